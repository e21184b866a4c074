"""The suite's timeline (tests/conftest.py writes it, experiments/suite_timeline.py reads it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from arpo.config import REPO_ROOT
from experiments.suite_timeline import read_timeline, summarize


def test_a_real_pytest_run_writes_one_line_per_test_and_the_summary_reads_it(tmp_path):
    timeline = tmp_path / "timeline.jsonl"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_make_run_matrix.py"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                       env={**{k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"},  # under make test
                            "ARPO_TEST_TIMELINE": str(timeline)})
    assert r.returncode == 0, r.stdout[-2000:]
    records = [json.loads(line) for line in timeline.read_text().splitlines()]
    passed = int(r.stdout.strip().splitlines()[-1].split(" passed")[0].split()[-1])
    assert len(records) == passed and all(rec["worker"] == "main" and rec["end"] >= rec["start"] for rec in records)
    summary = summarize(records)
    assert summary["tests"] == passed and summary["modules"][0]["module"] == "tests/test_make_run_matrix.py"
    assert summary["workers"]["main"]["idle_tail_s"] == 0.0


def test_summary_finds_the_idle_tail_and_the_longest_module():
    records = [{"test": "tests/a.py::t1", "worker": "gw0", "start": 100.0, "end": 130.0},
               {"test": "tests/a.py::t2", "worker": "gw0", "start": 130.0, "end": 190.0},
               {"test": "tests/b.py::t", "worker": "gw1", "start": 100.0, "end": 140.0}]
    s = summarize(records)
    assert s["wall_s"] == 90.0 and s["workers"]["gw1"]["idle_tail_s"] == 50.0 and s["workers"]["gw0"]["busy_s"] == 90.0
    assert [m["module"] for m in s["modules"]] == ["tests/a.py", "tests/b.py"]
    assert s["modules"][0]["slowest_test"] == "t2" and s["modules"][0]["slowest_s"] == 60.0


def test_a_line_cut_short_is_counted_and_the_rest_is_read(tmp_path):
    # a suite killed mid-write (or one that filled the disk) leaves a partial line between whole ones
    whole = {"test": "tests/a.py::t", "worker": "gw0", "start": 1.0, "end": 2.0}
    timeline = tmp_path / "timeline.jsonl"
    timeline.write_text(json.dumps(whole) + "\n" + json.dumps(whole)[:40] + json.dumps(whole) + "\n\n")
    assert read_timeline(timeline) == ([whole], 1)  # the cut line ran into the next one: both unreadable
    out = subprocess.run([sys.executable, "experiments/suite_timeline.py", str(timeline)], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["unreadable_lines"] == 1 and json.loads(out)["tests"] == 1
