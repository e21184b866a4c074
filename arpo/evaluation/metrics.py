"""Per-benchmark summaries of per-sample records: mean and std over runs, pass@k, tool calls per question,
samples truncated at their response budget.

Each run (one sample per question) gives one value per metric: the mean over the questions it covers.
``mean``/``std`` are over those run values (``std``: sample standard deviation, ddof=1; ``None`` with
one run). pass@k uses the unbiased estimator of Chen et al. (2021), 1 − C(n−c, k)/C(n, k) per question
with n runs of which c are correct, averaged over the questions with at least k runs; a sample is
correct when its ``acc`` is at least ``pass_threshold`` (math: equivalence is 0/1; QA: ``acc`` is the
configured F1 or EM, so 1.0 means a full match).

Every record is graded under two metric profiles: ``strict`` (``record["metrics"]``: the reward's grading,
SQuAD F1 and math-verify equivalence) and ``arpo`` (``record["metrics_arpo"]``: the released ARPO evaluation's
metrics, :mod:`arpo.evaluation.released_metrics`). A summary is made under one of them; records written before
the ``arpo`` profile existed are graded from their response on the fly.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from functools import lru_cache
from typing import Any, Iterable, Sequence

#: metric profiles: ``arpo`` (the released evaluation's metrics, for tables beside the paper's) | ``strict`` (ours)
PROFILES = ("arpo", "strict")
#: per profile, the record field holding its per-sample metrics and the metrics summarised
PROFILE_FIELD = {"strict": "metrics", "arpo": "metrics_arpo"}
PROFILE_METRICS = {"strict": ("acc", "f1", "em", "score", "format_ok"),
                   "arpo": ("acc", "f1", "em", "substring_acc", "math_equal")}
PROFILE_NOTES = {
    "arpo": "metric profile arpo: the released ARPO evaluation's metrics (math: Hendrycks string equivalence; "
            "QA: token F1 with punctuation kept), arpo/evaluation/released_metrics.py",
    "strict": "metric profile strict: math-verify equivalence (math), SQuAD EM/F1 (QA), as the rewards grade",
}
#: tool-call counts per sample (``tool_calls`` of a record); ``total`` = calls that really ran
TOOL_COUNTS = ("total", "search", "python", "refused")


def mean_std(values: Sequence[float]) -> dict[str, Any]:
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "std": None, "n": 0}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "std": std, "n": len(vals)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one question with ``n`` samples, ``c`` of them correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ValueError(f"metric profile {profile!r}: choose one of {list(PROFILES)}")
    return profile


@lru_cache(maxsize=None)
def released_task(data_source: str) -> str:
    """The released evaluator's task type of a data source: ``math`` for the math rewards' sources, else ``qa``."""
    from reward_fns.registry import builtin_registry

    try:
        return "math" if builtin_registry().lookup(data_source).family == "math" else "qa"
    except KeyError:
        return "qa"


def arpo_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The ``arpo`` profile's metrics of a record (its response graded as the released evaluation does)."""
    from arpo.evaluation.released_metrics import sample_metrics

    task = record.get("task") or released_task(str(record.get("data_source") or record.get("benchmark", "")))
    return sample_metrics(str(record.get("response") or ""), record.get("ground_truth"), task,
                          str(record.get("benchmark", "")))


def profile_metrics(record: dict[str, Any], profile: str) -> dict[str, Any]:
    """A record's per-sample metrics under ``profile``."""
    metrics = record.get(PROFILE_FIELD[profile])
    if metrics is None and profile == "arpo":
        metrics = arpo_metrics(record)
    return metrics or {}


def summarise_benchmark(records: Iterable[dict[str, Any]], pass_threshold: float = 1.0,
                        expected_questions: int | None = None, expected_runs: int | None = None,
                        profile: str = "strict") -> dict[str, Any]:
    """Summary of one benchmark's records under one metric profile (see the module docstring)."""
    check_profile(profile)
    records = list(records)
    graded = {id(r): profile_metrics(r, profile) for r in records}
    by_run: dict[int, list[dict[str, Any]]] = defaultdict(list)
    by_question: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_run[int(r["run"])].append(r)
        by_question[int(r["index"])].append(r)
    runs = sorted(by_run)
    out: dict[str, Any] = {
        "metric_profile": profile,
        "num_questions": len(by_question),
        "num_runs": len(runs),
        "num_samples": len(records),
        "samples_per_run": {str(run): len(by_run[run]) for run in runs},
    }
    if expected_questions is not None and expected_runs is not None:
        out["expected_samples"] = expected_questions * expected_runs
        out["complete"] = len(records) >= expected_questions * expected_runs
    for metric in PROFILE_METRICS[profile]:
        per_run = [_mean(float(graded[id(r)].get(metric, 0.0)) for r in by_run[run]) for run in runs]
        out[metric] = {**mean_std(per_run), "per_run": per_run}
    for count in TOOL_COUNTS:
        per_run = [_mean(float(r["tool_calls"].get(count, 0)) for r in by_run[run]) for run in runs]
        out[f"tool_calls_{count}"] = {**mean_std(per_run), "per_run": per_run}
    correct = {q: sum(float(graded[id(r)].get("acc", 0.0)) >= pass_threshold for r in rs)
               for q, rs in by_question.items()}
    n_max = max((len(rs) for rs in by_question.values()), default=0)
    out["pass@k"] = {}
    for k in range(1, n_max + 1):
        vals = [pass_at_k(len(by_question[q]), correct[q], k) for q in by_question if len(by_question[q]) >= k]
        out["pass@k"][str(k)] = _mean(vals)
    out["finish_reasons"] = dict(Counter(str(r.get("finish_reason", "")) for r in records))
    # a sample that reached its response budget; records from before the field: finish_reason length
    cut = sum(bool(r.get("truncated", r.get("finish_reason") == "length")) for r in records)
    out["truncated"] = {"count": cut, "rate": cut / len(records) if records else None}
    out["response_tokens"] = mean_std([float(r.get("response_tokens", 0)) for r in records])
    return out


def summarise_profiles(records: Sequence[dict[str, Any]], pass_threshold: float, profile: str,
                       expected_questions: int | None = None, expected_runs: int | None = None) -> dict[str, Any]:
    """The summary under ``profile``, plus ``acc_by_profile``: the headline accuracy under every profile, so the
    metric's effect is visible next to the number (each profile summarised once)."""
    check_profile(profile)
    by_profile = {p: summarise_benchmark(records, pass_threshold, expected_questions, expected_runs, profile=p)
                  for p in PROFILES}
    return {**by_profile[profile], "acc_by_profile": {p: s["acc"] for p, s in by_profile.items()}}


def _mean(values: Iterable[float]) -> float | None:
    vals = list(values)
    return sum(vals) / len(vals) if vals else None
