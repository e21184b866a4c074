"""Experiment scripts (ablations, benchmarks) and what they share."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from arpo.runtime.machine import git_sha  # noqa: F401 - the commit every result JSON records

REPO = Path(__file__).resolve().parents[1]


def environ_with(changes: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``changes`` applied, an empty value unsetting its key (a child's settings)."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it (committed files hold no absolute paths)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def repo_relative(text: str) -> str:
    """``text`` with this checkout's absolute path taken out, so committed results hold repo-relative paths."""
    return text.replace(str(REPO) + "/", "").replace(str(REPO), ".")


class PeakSampler:
    """Per value, the peak over time of what ``measure()`` returns, sampled every ``interval`` seconds in a thread
    while the ``with`` block runs (the benchmarks' memory peaks of process trees). ``cpu_seconds``: the CPU time
    the sampling took, which the measured processes did not get on a small machine."""

    def __init__(self, measure: Callable[[], Sequence[float]], interval: float) -> None:
        self.measure, self.interval = measure, interval
        self.peaks: list[float] = []
        self.cpu_seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            start = time.thread_time()
            values = self.measure()
            self.cpu_seconds += time.thread_time() - start
            self.peaks = [max(p, v) for p, v in zip(self.peaks, values)] if self.peaks else list(values)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
