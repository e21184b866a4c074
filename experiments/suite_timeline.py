"""Where the test suite's wall time goes, from the timeline ``ARPO_TEST_TIMELINE=<file> make test`` writes.

Per pytest-xdist worker: busy seconds, when it started and finished, the idle tail while the other worker still
ran. Per module: its wall seconds on its worker (first test's start to last test's end, fixtures included) and
its slowest test. Prints JSON.

    ARPO_TEST_TIMELINE=/tmp/timeline.jsonl make test
    python experiments/suite_timeline.py /tmp/timeline.jsonl --top 25
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def summarize(records: list[dict], top: int = 20) -> dict:
    """Workers' spans and the modules' wall seconds from per-test records (test, worker, start, end)."""
    if not records:
        raise SystemExit("the timeline is empty: run the suite with ARPO_TEST_TIMELINE=<file> first")
    t0 = min(r["start"] for r in records)
    t_end = max(r["end"] for r in records)
    workers: dict[str, dict] = {}
    modules: dict[str, dict] = defaultdict(lambda: {"start": float("inf"), "end": 0.0, "tests": 0,
                                                    "slowest": ("", 0.0)})
    for r in records:
        w = workers.setdefault(r["worker"], {"busy_s": 0.0, "first_start_s": float("inf"), "last_end_s": 0.0,
                                             "tests": 0})
        w["busy_s"] += r["end"] - r["start"]
        w["first_start_s"] = min(w["first_start_s"], r["start"] - t0)
        w["last_end_s"] = max(w["last_end_s"], r["end"] - t0)
        w["tests"] += 1
        module = modules[r["test"].split("::", 1)[0]]
        module["worker"] = r["worker"]
        module["start"], module["end"] = min(module["start"], r["start"]), max(module["end"], r["end"])
        module["tests"] += 1
        if r["end"] - r["start"] > module["slowest"][1]:
            module["slowest"] = (r["test"].split("::", 1)[1], r["end"] - r["start"])
    for w in workers.values():
        w["idle_tail_s"] = round(t_end - t0 - w["last_end_s"], 1)
        for key in ("busy_s", "first_start_s", "last_end_s"):
            w[key] = round(w[key], 1)
    by_wall = sorted(modules.items(), key=lambda kv: kv[1]["start"] - kv[1]["end"])
    return {
        "wall_s": round(t_end - t0, 1),
        "tests": len(records),
        "workers": dict(sorted(workers.items())),
        "modules": [{"module": name, "worker": m["worker"], "wall_s": round(m["end"] - m["start"], 1),
                     "starts_at_s": round(m["start"] - t0, 1), "tests": m["tests"],
                     "slowest_test": m["slowest"][0], "slowest_s": round(m["slowest"][1], 1)}
                    for name, m in by_wall[:top]],
    }


def read_timeline(path: Path) -> tuple[list[dict], int]:
    """The records of a timeline file and how many lines did not parse: a suite killed mid-write, or one that
    filled the disk, leaves a line cut short, and the rest of its timeline is still worth reading."""
    records, broken = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            broken += 1
    return records, broken


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/suite_timeline.py", description=__doc__.split("\n\n")[0])
    p.add_argument("timeline", type=Path, help="the JSONL file ARPO_TEST_TIMELINE named")
    p.add_argument("--top", type=int, default=20, help="modules listed, longest first")
    args = p.parse_args(argv)
    records, broken = read_timeline(args.timeline)
    print(json.dumps({**summarize(records, args.top), "unreadable_lines": broken}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
