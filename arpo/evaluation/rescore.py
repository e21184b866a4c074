"""Re-grade saved evaluation samples under both metric profiles, without generating anything.

    python -m arpo.evaluation.rescore --runs outputs/eval/arpo/seed0 [more dirs or globs] [--profile arpo|strict]

For every sample of every run directory (``python -m arpo.eval`` layout), recomputes ``metrics`` (the
``strict`` profile: the run's own reward settings from ``run.json``, re-run on the saved response and tool-call
record) and ``metrics_arpo`` (the released ARPO evaluation's metrics, :mod:`arpo.evaluation.released_metrics`),
rewrites the samples files (each replaced whole, atomically) and ``summary.json`` (under ``--profile``, default
the run's ``eval.metric_profile``). Use it after a grading fix, or to add the ``arpo`` profile to runs made
before it existed. Prints, per benchmark, the accuracy under each profile and how many samples changed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Sequence

from arpo.evaluation.metrics import PROFILES, arpo_metrics, released_task
from arpo.evaluation.records import load_run_samples, samples_path
from arpo.evaluation.tables import find_run_dirs

STRICT_KEYS = ("score", "acc", "em", "f1", "format_ok")


def grader_for(meta: dict[str, Any]):
    """The Grader of the run's recorded reward settings (custom function or the configured registry) and tools
    (their tags, for the format gate)."""
    from arpo.evaluation.runner import Grader
    from reward_fns.registry import build_compute_score

    reward = dict(meta.get("reward") or {})
    config = {"custom_reward_function": reward.pop("custom_reward_function", None) or {}, "reward": reward,
              "tools": meta.get("tools")}
    return Grader(build_compute_score(config), require_format=bool(meta.get("require_format", False)))


def regrade(record: dict[str, Any], grader: Any) -> dict[str, Any]:
    """The record with both profiles' metrics recomputed from its response."""
    extra_info = {"question": record.get("question"), "tool_calls": record.get("tool_call_records") or []}
    graded = grader.grade(record["data_source"], record["response"], record["ground_truth"], extra_info)
    out = {**record, "task": released_task(str(record["data_source"])),
           "metrics": {k: graded[k] for k in STRICT_KEYS if k in graded},
           "answer": graded.get("answer", record.get("answer", "")), "format_reason": graded.get("format_reason")}
    out["metrics_arpo"] = arpo_metrics(out)
    if "error" in graded:
        out["reward_error"] = graded["error"]
    else:
        out.pop("reward_error", None)
    return out


def _rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".rescore.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, path)  # a kill leaves the old file or the new one, never half of each


def rescore_run(run_dir: Path, profile: str | None = None) -> dict[str, Any]:
    """Re-grade one run directory; return its new summary plus ``changed``: benchmark -> samples whose strict
    ``acc`` changed."""
    from arpo.evaluation.evaluate import RUN_FILE, write_summary

    meta = json.loads((run_dir / RUN_FILE).read_text())
    if profile is not None:
        meta["metric_profile"] = profile
        (run_dir / RUN_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    grader = grader_for(meta)
    changed = {}
    for bench, records in load_run_samples(run_dir).items():
        new = [regrade(r, grader) for r in records]
        changed[bench] = sum(r.get("metrics", {}).get("acc") != n["metrics"].get("acc") for r, n in zip(records, new))
        _rewrite(samples_path(run_dir, bench), new)
    summary = write_summary(run_dir, meta)
    return {**summary, "changed": changed}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m arpo.evaluation.rescore", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="evaluation run dirs, globs, or folders above them")
    parser.add_argument("--profile", choices=PROFILES, default=None,
                        help="metric profile of summary.json (default: the run's eval.metric_profile)")
    args = parser.parse_args(argv)
    try:
        run_dirs = find_run_dirs(args.runs)
    except FileNotFoundError as err:
        raise SystemExit(f"arpo.evaluation.rescore: {err}") from None
    summaries = []
    for run_dir in run_dirs:
        summary = rescore_run(run_dir, args.profile)
        summaries.append(summary)
        print(f"{run_dir}: summary under profile {summary['metric_profile']}")
        for bench, s in summary["benchmarks"].items():
            accs = "  ".join(f"{p} {100 * s['acc_by_profile'][p]['mean']:.1f}" for p in PROFILES)
            print(f"  {bench:<12} acc {accs}  ({s['num_samples']} samples, strict acc changed on "
                  f"{summary['changed'].get(bench, 0)})")
    return summaries


if __name__ == "__main__":
    main()
