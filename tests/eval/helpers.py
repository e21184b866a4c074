"""Hand-made evaluation outputs (the layout ``python -m arpo.eval`` writes) for the tables and metrics tests."""

from __future__ import annotations

import json
from pathlib import Path


def record(benchmark: str, index: int, run: int, acc: float, tools: int = 0, f1: float | None = None,
           arpo_acc: float | None = None) -> dict:
    """A graded sample: ``acc`` under the strict profile, ``arpo_acc`` (default: the same) under the arpo one."""
    arpo_acc = acc if arpo_acc is None else arpo_acc
    return {
        "benchmark": benchmark, "index": index, "run": run, "seed": 1000 * run + index,
        "question": f"q{index}", "response": "", "answer": "",
        "metrics": {"acc": acc, "f1": acc if f1 is None else f1, "em": acc, "score": acc, "format_ok": 1.0},
        "metrics_arpo": {"acc": arpo_acc, "f1": arpo_acc, "em": arpo_acc, "substring_acc": arpo_acc,
                         "math_equal": arpo_acc},
        "tool_calls": {"total": tools, "search": tools, "python": 0, "refused": 0},
        "finish_reason": "stop", "response_tokens": 10,
    }


def write_run(root: Path, method: str, seed: int, per_bench: dict[str, list[list[float]]],
              tools: int = 0, num_runs: int | None = None) -> Path:
    """``per_bench[bench][run][question]`` = acc of that sample; returns the run directory."""
    run_dir = root / method / f"seed{seed}"
    (run_dir / "samples").mkdir(parents=True)
    runs = max((len(v) for v in per_bench.values()), default=1)
    (run_dir / "run.json").write_text(json.dumps({"method": method, "seed": seed, "num_runs": num_runs or runs,
                                                  "pass_threshold": 1.0, "model_path": "m"}))
    for bench, run_values in per_bench.items():
        with (run_dir / "samples" / f"{bench}.jsonl").open("w") as f:
            for run, values in enumerate(run_values):
                for index, acc in enumerate(values):
                    f.write(json.dumps(record(bench, index, run, acc, tools)) + "\n")
    return run_dir
