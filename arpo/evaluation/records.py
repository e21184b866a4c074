"""The per-sample JSONL store of an evaluation run: one file per benchmark, appended and flushed per sample.

A sample is identified by ``(benchmark, index, run)``. A killed run loses only the samples in flight:
every finished sample is one complete line, written with a single ``write`` and flushed. The line being
written when the process died may be cut short; :func:`load_samples` drops such a tail (and truncates the
file to the last complete line) so the rerun redoes exactly that sample.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

from arpo.data.jsonl import json_lines

logger = logging.getLogger(__name__)

SAMPLES_DIR = "samples"


def samples_path(run_dir: str | Path, benchmark: str) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"{benchmark}.jsonl"


def sample_key(record: dict[str, Any]) -> tuple[str, int, int]:
    return str(record["benchmark"]), int(record["index"]), int(record["run"])


def load_samples(path: str | Path, repair: bool = True) -> list[dict[str, Any]]:
    """Every complete record of a samples file (first occurrence of each key). An unterminated last line
    (a write cut by a kill) is dropped, and with ``repair`` cut off the file; a broken line elsewhere is
    an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        logger.warning("%s: dropping an unfinished last line (%d bytes) left by an interrupted run",
                       path, len(data) - end)
        if repair:
            with path.open("r+b") as f:
                f.truncate(end)
        data = data[:end]
    records: list[dict[str, Any]] = []
    seen: set[tuple[str, int, int]] = set()
    for line_no, record in json_lines(data.decode("utf-8").splitlines(), path, "remove or fix that line"):
        key = sample_key(record)
        if key in seen:
            logger.warning("%s:%d: duplicate sample %s ignored (the first one is kept)", path, line_no, key)
            continue
        seen.add(key)
        records.append(record)
    return records


def load_run_samples(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Benchmark -> records for every samples file of a run directory (read only; nothing repaired)."""
    folder = Path(run_dir) / SAMPLES_DIR
    return {p.stem: load_samples(p, repair=False) for p in sorted(folder.glob("*.jsonl"))}


class SampleWriter:
    """Appends records to the benchmark files of one run; each record is flushed as it is written."""

    def __init__(self, run_dir: str | Path, fsync: bool = False):
        self.run_dir = Path(run_dir)
        self.fsync = fsync
        self._files: dict[str, Any] = {}

    def write(self, record: dict[str, Any]) -> None:
        benchmark = str(record["benchmark"])
        f = self._files.get(benchmark)
        if f is None:
            path = samples_path(self.run_dir, benchmark)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = self._files[benchmark] = path.open("a", encoding="utf-8")
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            self.write(record)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
