"""python -m arpo.eval end to end in real subprocesses: the tiny model on the real vLLM engine with the real
tools over two real benchmark files and the synthetic test split, then a table; and a run killed with
SIGKILL midway that a rerun completes without redoing finished samples.

The tiny model is random, so scores near zero are expected: what is tested is the pipeline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arpo.evaluation.records import load_samples, samples_path, sample_key
from arpo.evaluation.tables import make_tables

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RECORD_FIELDS = {"benchmark", "index", "run", "seed", "method", "question", "ground_truth", "prompt", "response",
                 "answer", "metrics", "metrics_arpo", "task", "tool_calls", "finish_reason", "session"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}


def _eval_cmd(model: Path, run_dir: Path, *overrides: str, response_tokens: int = 48) -> list[str]:
    return [sys.executable, "-m", "arpo.eval", f"actor_rollout_ref.model.path={model}", f"eval.run_dir={run_dir}",
            f"actor_rollout_ref.rollout.arpo.sampling.max_response_length={response_tokens}", "eval.num_runs=2", *overrides]


@pytest.mark.shared_data
def test_vllm_eval_over_real_benchmarks_and_synthetic_yields_tables(tiny_model_dir, synthetic_dir, shared_data,
                                                                     tmp_path):
    run_dir = tmp_path / "eval" / "tiny" / "seed0"
    cmd = _eval_cmd(
        tiny_model_dir, run_dir,
        "actor_rollout_ref.rollout.name=vllm", "eval.method=tiny", "eval.seed=0",
        f"eval.data_dir={shared_data / 'eval'}", "eval.benchmarks=[bamboogle,math500]", "eval.max_samples=3",
        f"eval.parquet_files=[{{path: {synthetic_dir / 'test.parquet'}, name: synthetic}}]",
        "eval.prompt_type=synthetic",
        # tools: arpo_cache (the default): ARPO's recorded searches + the python sandbox
        f"tools.0.config.backend.cache_path={shared_data / 'search_cache' / 'search_cache.json'}",
    )
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "vLLM engine ready" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["method"] == "tiny" and summary["seed"] == 0
    for bench in ("bamboogle", "math500", "synthetic"):
        records = load_samples(samples_path(run_dir, bench))
        assert {(r["index"], r["run"]) for r in records} == {(i, r) for i in range(3) for r in range(2)}
        for r in records:
            assert RECORD_FIELDS <= set(r)
            assert 0.0 <= r["metrics"]["acc"] <= 1.0 and r["response_tokens"] <= 48
            assert r["prompt"].startswith("<|im_start|>system\n")
        s = summary["benchmarks"][bench]
        assert s["complete"] and s["num_samples"] == 6 and s["num_runs"] == 2
        assert set(s["pass@k"]) == {"1", "2"} and s["acc"]["mean"] is not None
    assert {r["data_source"] for r in load_samples(samples_path(run_dir, "synthetic"))} <= \
        {"synthetic/search", "synthetic/python", "synthetic/both"}
    assert "bamboogle" in proc.stdout and "pass@2" in proc.stdout

    written = make_tables([str(tmp_path / "eval")], tmp_path / "tables")
    md = written["table1.md"].read_text()
    row = next(line for line in md.splitlines() if line.startswith("| tiny"))
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    cells = dict(zip(header, [c.strip() for c in row.strip("|").split("|")]))
    assert cells["MATH500"] != "–" and cells["Bamboogle"] != "–" and cells["AIME24"] == "–"
    assert float(cells["MATH500"]) == pytest.approx(100 * summary["benchmarks"]["math500"]["acc"]["mean"])
    assert "Synthetic" in written["other.md"].read_text()


def _complete_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_killed_eval_resumes_without_redoing_finished_samples(tiny_model_dir, synthetic_dir, tmp_path):
    run_dir = tmp_path / "run"
    questions = 8
    total = questions * 2
    cmd = _eval_cmd(
        tiny_model_dir, run_dir,
        # the HF backend starts in seconds; resuming does not depend on the backend
        "actor_rollout_ref.rollout.name=hf", "tools=synthetic", f"synthetic.out_dir={synthetic_dir}",
        "eval.benchmarks=[]", f"eval.parquet_files=[{{path: {synthetic_dir / 'test.parquet'}, name: synthetic}}]",
        "eval.prompt_type=synthetic", f"eval.max_samples={questions}", "eval.method=tiny", response_tokens=24,
    )
    path = samples_path(run_dir, "synthetic")
    log = (tmp_path / "first.log").open("w")
    # own session: the kill takes the whole process group (engine and tool children included)
    proc = subprocess.Popen(cmd + ["eval.concurrency=1"], cwd=REPO, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while _complete_lines(path) < 3:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no samples written in 300 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    assert proc.returncode == -signal.SIGKILL
    first = load_samples(path, repair=False)
    done = len(first)
    assert 3 <= done < total, f"the first run was not stopped midway ({done} of {total} samples)"

    proc = subprocess.run(cmd + ["eval.concurrency=8"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{done} already in" in proc.stderr and f"{total - done} to run" in proc.stderr
    final = load_samples(path)
    keys = [sample_key(r) for r in final]
    assert len(keys) == total == len(set(keys))
    assert set(keys) == {("synthetic", i, r) for i in range(questions) for r in range(2)}
    assert final[:done] == first  # finished samples are neither redone nor rewritten
    old_session = {r["session"] for r in first}
    new = [r for r in final if r["session"] not in old_session]
    assert len(old_session) == 1 and len(new) == total - done and len({r["session"] for r in new}) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["benchmarks"]["synthetic"]["complete"]
