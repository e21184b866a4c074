"""Entropy aligned around tool results and around control points, with bootstrap intervals over trajectories.

Offsets count model-written tokens only (tool results and the prompt are skipped): offset 0 is the first token
the model writes after a result, −1 the last one before it (the call's close tag). A curve stops at the
neighbouring result, so no token is counted on the far side of another result.

Two controls, the same offsets around a point with no result: a random model-written position more than ``W``
model tokens from every result (seeded per trajectory), and the first token after ``</think>`` when there is one.

The premise statistic of one event is ``mean(first W tokens after it) − mean(W tokens before the call)`` (the
window the rollout measures after a result minus the one before the call; with ``reduction: sum`` the sums).
Per tool, each trajectory contributes the mean over its events of that tool, and the interval resamples
trajectories (``scipy.stats.bootstrap``, percentile, seeded), never tokens: tokens of one trajectory are not
independent.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure
from scipy import stats

from arpo.entropy_probe.scoring import Scores
from arpo.entropy_probe.trajectories import Trajectory
from arpo.rollout.branching import derive_seed, window_entropy

MEASURES = ("topk", "full")


@dataclass
class Event:
    """One aligned point of one trajectory, in model-token indices: ``at`` (offset 0), ``call_at`` (where the
    before-window ends: the call's first token; the point itself for a control), and ``[lo, hi)``, the span
    between the neighbouring results that its curve and windows stay in."""

    kind: str  # a tool name, "random" or "think"
    at: int
    call_at: int
    lo: int
    hi: int


@dataclass
class Measured:
    """One trajectory's model-written tokens in order: their normalised entropies per measure and, when the
    probe scored them, the top-k logprob dicts (for the rollout's own window function)."""

    name: str
    values: dict[str, np.ndarray]
    topk_logprobs: list[dict[int, float]] | None
    events: list[Event]


def measure(traj: Trajectory, scores: Scores | None, window: int, seed: int) -> Measured:
    """Compress ``traj`` to its model-written tokens and place its events (results and controls)."""
    positions = [t for t, m in enumerate(traj.model_mask) if m]
    if scores is None:
        if traj.recorded is None:
            raise ValueError(f"{traj.name}: neither scores nor recorded entropy")
        values = {"topk": np.array([traj.recorded[t] for t in positions], dtype=float)}
        dicts = None
    else:
        positions = [t for t in positions if t in scores.topk_logprobs]
        values = {"full": np.array([scores.full[t] for t in positions], dtype=float),
                  "topk": np.array([scores.topk[t] for t in positions], dtype=float)}
        dicts = [scores.topk_logprobs[t] for t in positions]
    index = np.asarray(positions)

    def model_index(pos: int) -> int:  # model tokens before sequence position ``pos``
        return int(np.searchsorted(index, pos))

    n = len(positions)
    own = model_index(traj.own_from)
    anchors = [(r.tool, model_index(r.end), model_index(r.call_start), r.end >= traj.own_from) for r in traj.results]
    events = []
    for k, (tool, at, call_at, counted) in enumerate(anchors):
        lo = anchors[k - 1][1] if k > 0 else 0
        hi = anchors[k + 1][1] if k + 1 < len(anchors) else n
        if counted and at < n:
            events.append(Event(tool, at, call_at, lo, hi))
    ats = [a[1] for a in anchors]
    far = [j for j in range(max(window, own), n - 1) if all(abs(j - a) > window for a in ats)]
    if far:
        j = random.Random(derive_seed(seed, "control", traj.name)).choice(far)
        events.append(Event("random", j, j, *_bounds(j, ats, n)))
    if traj.think_end is not None and own <= model_index(traj.think_end) < n:
        j = model_index(traj.think_end)
        events.append(Event("think", j, j, *_bounds(j, ats, n)))
    return Measured(traj.name, values, dicts, events)


def _bounds(j: int, ats: list[int], n: int) -> tuple[int, int]:
    return max([a for a in ats if a <= j], default=0), min([a for a in ats if a > j], default=n)


def window_value(m: Measured, measure_name: str, start: int, stop: int, window: int, vocab_size: int | None,
                 reduction: str) -> float:
    """The window entropy of model tokens ``[start, stop)`` (at most ``window`` of them), as the rollout reduces
    it: top-k windows through :func:`window_entropy` itself when the logprobs are at hand."""
    if stop <= start:
        return math.nan
    if measure_name == "topk" and m.topk_logprobs is not None:
        return window_entropy(m.topk_logprobs[start:stop], window, vocab_size, reduction)
    vals = m.values[measure_name][start:min(stop, start + window)]
    vals = vals[~np.isnan(vals)]
    if not len(vals):
        return math.nan
    return float(vals.mean() if reduction == "mean" else vals.sum())


def premise_deltas(m: Measured, measure_name: str, window: int, vocab_size: int | None, reduction: str) -> dict[str, float]:
    """Per event kind, this trajectory's mean of ``after − before`` over its events of that kind."""
    by_kind: dict[str, list[float]] = {}
    for e in m.events:
        after = window_value(m, measure_name, e.at, e.hi, window, vocab_size, reduction)
        before = window_value(m, measure_name, max(e.lo, e.call_at - window), e.call_at, window, vocab_size,
                              reduction)
        if not (math.isnan(after) or math.isnan(before)):
            by_kind.setdefault(e.kind, []).append(after - before)
    return {k: float(np.mean(v)) for k, v in by_kind.items()}


def offset_matrix(measured: Sequence[Measured], measure_name: str, kinds: Sequence[str],
                  offsets: Sequence[int]) -> np.ndarray:
    """``[trajectory, offset]``: the mean entropy at each offset over the trajectory's events of ``kinds``."""
    out = np.full((len(measured), len(offsets)), np.nan)
    for r, m in enumerate(measured):
        vals = m.values[measure_name]
        sums, counts = np.zeros(len(offsets)), np.zeros(len(offsets))
        for e in m.events:
            if e.kind not in kinds:
                continue
            for c, off in enumerate(offsets):
                j = e.at + off
                if e.lo <= j < e.hi and not math.isnan(vals[j]):
                    sums[c] += vals[j]
                    counts[c] += 1
        out[r] = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return out


def bootstrap_mean(values: Sequence[float], seed: int, resamples: int = 2000) -> dict[str, Any]:
    """Mean and percentile-bootstrap 95% interval of per-trajectory values (NaN interval under two values)."""
    x = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    out = {"mean": float(x.mean()) if len(x) else math.nan, "lo": math.nan, "hi": math.nan, "n": int(len(x))}
    if len(x) >= 2 and np.ptp(x) > 0:
        ci = stats.bootstrap((x,), np.mean, n_resamples=resamples, confidence_level=0.95, method="percentile",
                             rng=np.random.default_rng(seed)).confidence_interval
        out["lo"], out["hi"] = float(ci.low), float(ci.high)
    elif len(x) >= 2:
        out["lo"] = out["hi"] = float(x[0])
    return out


def summarise(measured: Sequence[Measured], window: int, vocab_size: int | None, reduction: str,
              offsets: Sequence[int], seed: int, resamples: int = 2000) -> dict[str, Any]:
    """The curves (per measure and event kind: mean and interval per offset), the premise statistic per kind, and
    per tool its paired difference from each control (``"search - random"``: per trajectory, the tool's statistic
    minus the control's)."""
    measures = [k for k in MEASURES if all(k in m.values for m in measured)]
    kinds = sorted({e.kind for m in measured for e in m.events}, key=lambda k: (k in ("random", "think"), k))
    tools = [k for k in kinds if k not in ("random", "think")]
    groups = {**{k: [k] for k in kinds}, **({"all tools": tools} if len(tools) > 1 else {})}
    curves: dict[str, Any] = {}
    premise: dict[str, Any] = {}
    for name in measures:
        curves[name], premise[name] = {}, {}
        for label, members in groups.items():
            mat = offset_matrix(measured, name, members, offsets)
            points = [bootstrap_mean(mat[:, c], derive_seed(seed, name, label, off), resamples)
                      for c, off in enumerate(offsets)]
            curves[name][label] = {k: [p[k] for p in points] for k in ("mean", "lo", "hi", "n")}
        deltas = [premise_deltas(m, name, window, vocab_size, reduction) for m in measured]
        for label in kinds:
            premise[name][label] = bootstrap_mean([d.get(label, math.nan) for d in deltas],
                                                  derive_seed(seed, "premise", name, label), resamples)
        if len(tools) > 1:
            pooled = [np.mean([d[t] for t in tools if t in d]) if any(t in d for t in tools) else math.nan
                      for d in deltas]
            premise[name]["all tools"] = bootstrap_mean(pooled, derive_seed(seed, "premise", name, "all"), resamples)
        # above a control in the same trajectories: the paired difference, whose interval is the test
        for tool in tools:
            for control in ("random", "think"):
                if control in kinds:
                    label = f"{tool} - {control}"
                    premise[name][label] = bootstrap_mean([d.get(tool, math.nan) - d.get(control, math.nan)
                                                           for d in deltas],
                                                          derive_seed(seed, "premise", name, label), resamples)
    events = {k: sum(e.kind == k for m in measured for e in m.events) for k in kinds}
    return {"offsets": list(offsets), "curves": curves, "premise": premise, "events": events,
            "trajectories": len(measured), "model_tokens": int(sum(len(m.values["topk"]) for m in measured))}


def plot(summary: dict[str, Any], title: str, path: str | None = None) -> Figure:
    """One panel per measure: entropy against the offset, a line per tool and control with its 95% band; saved to
    ``path`` when given."""
    from arpo.analysis import new_axes

    measures = list(summary["curves"])
    axes = new_axes(ncols=len(measures), figsize=(6 * len(measures), 3.8))
    offsets = summary["offsets"]
    for ax, name in zip(axes, measures):
        for label, curve in summary["curves"][name].items():
            if label == "all tools":
                continue
            style = {"linestyle": ":"} if label in ("random", "think") else {}
            mean = np.asarray(curve["mean"], dtype=float)
            ax.plot(offsets, mean, label=f"{label} ({summary['events'].get(label, 0)})", **style)
            ax.fill_between(offsets, np.asarray(curve["lo"], dtype=float), np.asarray(curve["hi"], dtype=float),
                            alpha=0.2)
        ax.axvline(0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("model tokens from the end of the result (controls: from the point)")
        ax.set_ylabel(f"{'top-k' if name == 'topk' else 'full-vocabulary'} entropy / log|V|")
        ax.set_title(f"{title}: {name}", fontsize="medium")
        ax.legend(fontsize="small")
    if path is not None:
        axes[0].figure.savefig(path, dpi=100)
    return axes[0].figure
