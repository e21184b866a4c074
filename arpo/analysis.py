"""Analysis of ARPO runs, shared by ``notebooks/arpo_analysis.ipynb`` and ``experiments/ablation.py``.

Two inputs:

- training metrics: ``metrics.jsonl`` as the trainer writes it (verl names: ``critic/score/mean``,
  ``val-core/all/reward/mean``, ``rollout/tool_calls/total`` …) under ``<run>/logs/``, ``<run>/rl/logs/`` (a
  pipeline output folder) or ``<run>/`` (a copy in an ablation results folder). Ablation folders hold
  ``<variant>/seed<K>/`` runs, so curves get seed bands (mean ± std over seeds per step);
- rollout rows with per-token entropy (``experiments/dump_rollout_entropy.py``, the ARPO rollout with
  ``return_entropy: true``): ``token_entropy`` (NaN/None on tool tokens), ``tool_calls`` (``{"tool", "start",
  "end"}``: the response positions of each result), ``parent_index`` and ``branch_pos`` (the fork tree).
  They give the measurement behind ARPO's motivation (the paper reports entropy rising in the first 10–50 tokens
  after a tool result, more after search than after Python; whether a model shows it is measured, not assumed:
  docs/premise.md) and where the rollout forked.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from arpo.runtime.tracking import json_safe

#: metric names the trainer logs (arpo/trainer/ray_trainer.py, metrics.py and the rollout's metrics)
TRAIN_SCORE = "critic/score/mean"
VAL_REWARD = "val-core/all/reward/mean"
VAL_ACC = "val-core/all/acc/mean"
TRAIN_ACC = "reward/acc/mean"
TOOL_CALLS = "rollout/tool_calls/total"
TRAJECTORIES = "rollout/trajectories"
TOKENS_GENERATED = "rollout/tokens/generated"
STEP_TIME = "timing_s/step"
#: derived by load_metrics: tool calls per trajectory of each step
TOOL_CALLS_PER_TRAJ = "rollout/tool_calls_per_traj"
#: what experiments/ablation.py records next to a run (attempts, wall time)
RUN_RECORD = "ablation_run.json"

_SEED_DIR = re.compile(r"^seed(\d+)$")


# ---- training metrics -----------------------------------------------------------------------------------
def metrics_path(run_dir: str | Path) -> Path:
    """The metrics file of a trainer run, a pipeline output folder, or an ablation results copy."""
    run = Path(run_dir)
    for candidate in (run / "logs" / "metrics.jsonl", run / "rl" / "logs" / "metrics.jsonl",
                      run / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{run}: no logs/metrics.jsonl, rl/logs/metrics.jsonl or metrics.jsonl")


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """One row per step, sorted; a resumed run logs the steps after its checkpoint twice, the last one wins."""
    path = metrics_path(run_dir)
    with path.open() as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return pd.DataFrame({"step": pd.Series(dtype=int)})
    df = pd.DataFrame(records)
    df = df.drop_duplicates("step", keep="last").sort_values("step").reset_index(drop=True)
    if TOOL_CALLS in df and TRAJECTORIES in df:
        df[TOOL_CALLS_PER_TRAJ] = df[TOOL_CALLS] / df[TRAJECTORIES]
    return df


def find_seed_runs(root: str | Path) -> list[tuple[str, int, Path]]:
    """``(variant, seed, dir)`` of every ``<root>/<variant>/seed<K>/`` holding metrics, sorted."""
    found = []
    for seed_dir in sorted(Path(root).glob("*/seed*")):
        match = _SEED_DIR.match(seed_dir.name)
        if match and seed_dir.is_dir():
            try:
                metrics_path(seed_dir)
            except FileNotFoundError:
                continue
            found.append((seed_dir.parent.name, int(match.group(1)), seed_dir))
    return sorted(found, key=lambda r: (r[0], r[1]))


def load_runs(root: str | Path, variants: Sequence[str] | None = None) -> pd.DataFrame:
    """Metrics of every seed run under ``root`` in one long frame with ``variant`` and ``seed`` columns."""
    frames = [load_metrics(d).assign(variant=v, seed=s) for v, s, d in find_seed_runs(root)
              if variants is None or v in variants]
    if not frames:
        raise FileNotFoundError(f"{root}: no <variant>/seed<K>/ runs with metrics")
    return pd.concat(frames, ignore_index=True)


def load_experiment(path: str | Path) -> pd.DataFrame:
    """Metrics of whatever ``path`` is: an ablation results folder (``runs/<variant>/seed<K>/``), a folder of
    ``<variant>/seed<K>/`` runs, or one run (variant: the folder's name, seed 0)."""
    path = Path(path)
    for root in (path / "runs", path):
        if find_seed_runs(root):
            return load_runs(root)
    return load_metrics(path).assign(variant=path.name, seed=0)


def load_rollouts(path: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Rollout dumps by name: ``<path>/rollouts/<variant>.jsonl`` of an ablation results folder, the
    ``*.jsonl`` of a folder, or one file ({} when there are none)."""
    path = Path(path)
    if path.is_file():
        return {path.stem: load_rows(path)}
    folder = path / "rollouts" if (path / "rollouts").is_dir() else path
    return {f.stem: load_rows(f) for f in sorted(folder.glob("*.jsonl")) if f.name != "metrics.jsonl"}


def seed_band(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Mean, std (ddof 1; NaN with one seed) and seed count of ``metric`` per variant and step."""
    if metric not in runs:
        return pd.DataFrame(columns=["variant", "step", "mean", "std", "n"])
    rows = runs.dropna(subset=[metric])
    out = rows.groupby(["variant", "step"])[metric].agg(["mean", "std", "count"]).reset_index()
    return out.rename(columns={"count": "n"})


def plot_curves(runs: pd.DataFrame, metric: str, ax: Axes | None = None, title: str | None = None) -> Axes:
    """``metric`` against the step, one line per variant with a ± std band over seeds."""
    ax = ax if ax is not None else _axes()
    for variant, part in seed_band(runs, metric).groupby("variant"):
        ax.plot(part["step"], part["mean"], marker="o", label=f"{variant} (seeds: {int(part['n'].max())})")
        std = part["std"].fillna(0.0)
        ax.fill_between(part["step"], part["mean"] - std, part["mean"] + std, alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel(metric)
    ax.set_title(title or metric)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return ax


def run_summary(metrics: pd.DataFrame) -> dict[str, float]:
    """The numbers an ablation table compares, from one run's metrics (NaN where not logged)."""
    def last(key: str) -> float:
        vals = metrics[key].dropna() if key in metrics else pd.Series(dtype=float)
        return float(vals.iloc[-1]) if len(vals) else math.nan

    train = metrics[metrics["step"] > 0] if "step" in metrics else metrics
    per_traj = math.nan
    if TOOL_CALLS in train and TRAJECTORIES in train and train[TRAJECTORIES].sum() > 0:
        per_traj = float(train[TOOL_CALLS].sum() / train[TRAJECTORIES].sum())
    return {
        "val_acc": last(VAL_ACC),
        "val_reward": last(VAL_REWARD),
        "train_score": last(TRAIN_SCORE),
        "train_acc": last(TRAIN_ACC),
        "tool_calls_per_traj": per_traj,
        "tokens_generated": float(train[TOKENS_GENERATED].sum()) if TOKENS_GENERATED in train else math.nan,
        "step_time_s": float(train[STEP_TIME].sum()) if STEP_TIME in train else math.nan,
        "steps": float(train["step"].max()) if len(train) else 0.0,
    }


def summaries_by_variant(runs: pd.DataFrame) -> dict[str, list[dict[str, float]]]:
    """variant -> one :func:`run_summary` (with its ``seed``) per seed of a :func:`load_runs` frame."""
    return {str(v): [{"seed": float(seed), **run_summary(m)} for seed, m in part.groupby("seed")]
            for v, part in runs.groupby("variant", sort=False)}


def seed_summaries(root: str | Path) -> dict[str, list[dict[str, float]]]:
    """:func:`summaries_by_variant` of the runs under ``root``, with ``wall_s`` where the ablation driver
    recorded it (seconds of every attempt of the run, start-up and validation included)."""
    out = summaries_by_variant(load_runs(root))
    dirs = {(v, s): d for v, s, d in find_seed_runs(root)}
    for variant, summaries in out.items():
        for summary in summaries:
            record = dirs[(variant, int(summary["seed"]))] / RUN_RECORD
            wall = json.loads(record.read_text()).get("wall_s") if record.is_file() else None
            summary["wall_s"] = math.nan if wall is None else float(wall)
    return out


def compare_variants(summaries: dict[str, list[dict[str, float]]], variant: str, baseline: str,
                     keys: Sequence[str] = ("val_acc", "val_reward", "train_score", "tool_calls_per_traj",
                                            "tokens_generated")) -> pd.DataFrame:
    """Per summary key: the mean over seeds of ``variant`` and ``baseline`` and Welch's t-test p-value
    (NaN: fewer than two seeds with the value on a side)."""
    from arpo.evaluation.stats import welch_t_test

    def values(name: str, key: str) -> list[float]:
        return [s[key] for s in summaries[name] if math.isfinite(s.get(key, math.nan))]

    rows = [{"metric": k, variant: np.mean(values(variant, k)) if values(variant, k) else math.nan,
             baseline: np.mean(values(baseline, k)) if values(baseline, k) else math.nan,
             "welch_p": welch_t_test(values(variant, k), values(baseline, k))} for k in keys]
    return pd.DataFrame(rows).set_index("metric")


# ---- rollout rows: entropy around tool calls ------------------------------------------------------------
def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rollout rows of one dump (JSONL); ``parent_index`` refers to the line order within the file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _response_length(row: dict[str, Any]) -> int:
    return int(row.get("response_length") or len(row.get("token_entropy") or []))


def _entropies(row: dict[str, Any]) -> list[float]:
    return [math.nan if v is None else float(v) for v in row["token_entropy"]]


def entropy_around_tool_calls(rows: Iterable[dict[str, Any]], before: int = 10, after: int = 50) -> pd.DataFrame:
    """One record per (tool call, offset) with the token entropy there.

    ``offset`` >= 0: the model token ``offset`` positions after the call's result (0 = the first token the
    model writes after ``</result>``); ``offset`` < 0: model tokens before the result (−1 = the call's last
    token). A window stops at the neighbouring result, so tokens after the next call count for that call
    only. A fork's tokens before its ``branch_pos`` are its parent's, already counted with the parent."""
    records = []
    for r_idx, row in enumerate(rows):
        if row.get("token_entropy") is None:
            continue
        ent = _entropies(row)
        own_from = int(row.get("branch_pos") or 0) if int(row.get("parent_index", -1)) >= 0 else 0
        calls = sorted(row.get("tool_calls") or [], key=lambda c: int(c["start"]))
        for c_idx, call in enumerate(calls):
            start, end = int(call["start"]), int(call["end"])
            prev_end = int(calls[c_idx - 1]["end"]) if c_idx > 0 else 0
            next_start = int(calls[c_idx + 1]["start"]) if c_idx + 1 < len(calls) else len(ent)
            window = [(-off, start - off) for off in range(1, before + 1) if start - off >= prev_end]
            window += [(off, end + off) for off in range(after) if end + off < next_start]
            for off, pos in window:
                if pos < len(ent) and pos >= own_from and not math.isnan(ent[pos]):
                    records.append((r_idx, c_idx, call["tool"], off, ent[pos]))
    return pd.DataFrame(records, columns=["row", "call", "tool", "offset", "entropy"])


def entropy_by_variant(rollouts: dict[str, list[dict[str, Any]]], before: int = 10, after: int = 50) -> pd.DataFrame:
    """:func:`entropy_around_tool_calls` of each named set of rows, tools pooled, the set's name in the ``tool``
    column: :func:`plot_entropy_around_tools` then draws one line per set (e.g. soft vs hard)."""
    frames = [entropy_around_tool_calls(rows, before, after).assign(tool=name) for name, rows in rollouts.items()]
    return pd.concat(frames, ignore_index=True) if frames else entropy_around_tool_calls([])


def mean_curve(df: pd.DataFrame) -> pd.DataFrame:
    """Mean entropy per tool and offset with its std, standard error and 95% normal CI half-width."""
    out = df.groupby(["tool", "offset"])["entropy"].agg(["mean", "count", "std"]).reset_index()
    out["sem"] = out["std"] / np.sqrt(out["count"].clip(lower=1))
    out["ci95"] = 1.96 * out["sem"]
    return out


def plot_entropy_around_tools(df: pd.DataFrame, ax: Axes | None = None, band: str = "ci95",
                              title: str | None = None) -> Axes:
    """Entropy against the offset from the tool result, one line per tool with a ``band`` (ci95 | sem |
    std) band; returns the axes."""
    curve = mean_curve(df)
    ax = ax if ax is not None else _axes()
    for tool, part in curve.groupby("tool"):
        ax.plot(part["offset"], part["mean"], label=tool)
        width = part[band].fillna(0.0)
        ax.fill_between(part["offset"], part["mean"] - width, part["mean"] + width, alpha=0.2)
    ax.axvline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("model tokens from the end of the tool result")
    ax.set_ylabel("normalised token entropy")
    ax.set_title(title or f"token entropy around tool results (band: {band})")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return ax


# ---- rollout rows: written by the trainer (trainer.rollout_data_dir) and experiments/dump_rollout_entropy.py ----
ENTROPY_DIGITS = 5


def rollout_rows(batch: Any, data_sources: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """One JSON-ready row per trajectory of a rollout batch (``arpo.batch.DataBatch``): the fork tree, tool calls
    and, when the rollout ran with ``return_entropy``, per-token entropy; the score and accuracy once rewarded; the
    prompt's and response's token ids and the response's loss mask (1 = model-written).
    ``data_sources`` names each prompt group's source when the batch has no ``data_source`` column."""
    nt, t = batch.non_tensors, batch.tensors
    scores = t["token_level_scores"].sum(-1).tolist() if "token_level_scores" in t else None
    rows = []
    for i in range(len(batch)):
        group = int(nt["group_index"][i])
        ent = nt["token_entropy"][i] if "token_entropy" in nt else None
        length = len(ent) if ent is not None else int(t["attention_mask"][i, -t["responses"].shape[1]:].sum())
        # the tokens themselves, so that another model can re-score the trajectory teacher-forced (arpo.entropy_probe)
        ids = {} if "prompts" not in t else {
            "prompt_ids": t["prompts"][i][t["attention_mask"][i, :t["prompts"].shape[1]].bool()].tolist(),
            "response_ids": t["responses"][i, :length].tolist(),
            "response_mask": t["response_mask"][i, :length].tolist()}
        rows.append(json_safe({
            "row": i, "group": group,
            "parent_index": int(nt["parent_index"][i]), "branch_pos": int(nt["branch_pos"][i]),
            "tree_index": int(nt["tree_index"][i]) if "tree_index" in nt else None,  # Tree-GRPO's trees
            "rollout_kind": nt["rollout_kind"][i] if "rollout_kind" in nt else None,
            "finish_reason": nt["finish_reason"][i] if "finish_reason" in nt else None,
            "response_length": length,
            "model_tokens": int(t["response_mask"][i].sum()),
            "token_entropy": None if ent is None else [round(float(v), ENTROPY_DIGITS) if v == v else None
                                                       for v in ent],
            "tool_calls": list(nt["tool_calls"][i]) if "tool_calls" in nt else [],
            "data_source": data_sources[group] if data_sources is not None else str(nt["data_source"][i]),
            "score": scores[i] if scores is not None else None,
            "acc": float(nt["reward_acc"][i]) if "reward_acc" in nt else None,
            **ids,
        }))
    return rows


def write_run_plots(run_dir: str | Path, rollout_dir: str | Path | None = None) -> list[Path]:
    """The PNGs of a finished training run, under ``<run_dir>/plots``: reward, accuracy and tool-call curves
    (``curves.png``) and, when the step rollouts in ``rollout_dir`` carry per-token entropy, the entropy around
    tool results per tool over all steps (``entropy_around_tools.png``). Returns the files written."""
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    metrics = load_metrics(run_dir).assign(variant=Path(run_dir).name, seed=0)
    panels = [(m, t) for m, t in ((TRAIN_SCORE, "training reward"), (TRAIN_ACC, "training accuracy"),
                                  (VAL_ACC, "validation accuracy"), (TOOL_CALLS_PER_TRAJ, "tool calls / trajectory"))
              if m in metrics and metrics[m].notna().any()]
    written = []
    if panels:
        axes = new_axes(ncols=len(panels), figsize=(4.5 * len(panels), 3.5))
        for ax, (metric, title) in zip(axes, panels):
            plot_curves(metrics, metric, ax=ax, title=title)
            ax.get_legend() and ax.get_legend().remove()
        written.append(out / "curves.png")
        axes[0].figure.savefig(written[-1], dpi=100)
    rows = [r for f in sorted(Path(rollout_dir).glob("step_*.jsonl")) for r in load_rows(f)] \
        if rollout_dir and Path(rollout_dir).is_dir() else []
    around = entropy_around_tool_calls(rows)
    if len(around):
        ax = plot_entropy_around_tools(around, title=f"token entropy around tool results ({len(rows)} training "
                                                     f"trajectories)")
        written.append(out / "entropy_around_tools.png")
        ax.figure.savefig(written[-1], dpi=100)
    return written


# ---- rollout rows: the branch trees ---------------------------------------------------------------------
def tree_depths(rows: Sequence[dict[str, Any]]) -> list[int]:
    """Fork depth of every row: 0 for a root, its parent's depth + 1 for a fork (parents precede children)."""
    depths: list[int] = []
    for i, row in enumerate(rows):
        parent = int(row.get("parent_index", -1))
        if parent >= i:
            raise ValueError(f"row {i}: parent_index {parent} does not precede it; rows must be in batch order")
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return depths


def branch_stats(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One record per prompt group: trajectories, forks, tree depth, and where the forks branched off
    (mean ``branch_pos`` in response tokens, and as a fraction of the parent's response length)."""
    depths = tree_depths(rows)
    records: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        g = records.setdefault(int(row.get("group", 0)), {"trajectories": 0, "forks": 0, "depth": 0,
                                                          "positions": [], "fractions": []})
        g["trajectories"] += 1
        g["depth"] = max(g["depth"], depths[i])
        parent = int(row.get("parent_index", -1))
        if parent >= 0:
            pos = int(row.get("branch_pos") or 0)
            g["forks"] += 1
            g["positions"].append(pos)
            length = _response_length(rows[parent])
            if length:
                g["fractions"].append(pos / length)
    out = [{"group": k, "trajectories": v["trajectories"], "forks": v["forks"], "depth": v["depth"],
            "branch_pos_mean": float(np.mean(v["positions"])) if v["positions"] else math.nan,
            "branch_frac_mean": float(np.mean(v["fractions"])) if v["fractions"] else math.nan}
           for k, v in sorted(records.items())]
    return pd.DataFrame(out, columns=["group", "trajectories", "forks", "depth", "branch_pos_mean",
                                      "branch_frac_mean"])


def branch_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The fork trees of one dump in a few numbers: means over prompt groups, deepest tree, mean fork position."""
    stats, positions = branch_stats(rows), branch_positions(rows)
    return {"groups": float(len(stats)), "trajectories_per_group": float(stats["trajectories"].mean()),
            "forks_per_group": float(stats["forks"].mean()), "mean_depth": float(stats["depth"].mean()),
            "max_depth": float(stats["depth"].max()),
            "branch_pos_mean": float(positions["branch_pos"].mean()) if len(positions) else math.nan}


def branch_positions(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One record per fork: its group, depth and ``branch_pos`` (response tokens shared with the parent)."""
    depths = tree_depths(rows)
    return pd.DataFrame([{"group": int(r.get("group", 0)), "depth": depths[i], "branch_pos": int(r["branch_pos"])}
                         for i, r in enumerate(rows) if int(r.get("parent_index", -1)) >= 0],
                        columns=["group", "depth", "branch_pos"])


def tool_call_records(rows: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One record per tool call made (a fork's copies of its parent's calls left out): tool, window entropy
    before and after the result and their difference as the rollout measured them."""
    records = []
    for row in rows:
        own_from = int(row.get("branch_pos") or 0) if int(row.get("parent_index", -1)) >= 0 else 0
        for call in row.get("tool_calls") or []:
            if int(call["end"]) > own_from:
                records.append({k: call.get(k) for k in ("tool", "error", "entropy_before", "entropy_after",
                                                         "delta_entropy")})
    return pd.DataFrame(records, columns=["tool", "error", "entropy_before", "entropy_after", "delta_entropy"])


def plot_branch_positions(positions: dict[str, pd.DataFrame], ax: Axes | None = None, bins: int = 20) -> Axes:
    """Histogram of fork positions (response tokens) per labelled set of rollouts."""
    ax = ax if ax is not None else _axes()
    for label, df in positions.items():
        if len(df):
            ax.hist(df["branch_pos"], bins=bins, alpha=0.5, label=f"{label} ({len(df)} forks)")
    ax.set_xlabel("branch position (response tokens)")
    ax.set_ylabel("forks")
    ax.set_title("where the rollout forked")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return ax


# ---- figures --------------------------------------------------------------------------------------------
def new_axes(ncols: int = 1, figsize: tuple[float, float] = (7, 3.5), sharey: bool = False) -> list[Axes]:
    """A row of ``ncols`` axes on a new figure (``axes[0].figure``)."""
    # A bare Figure, not pyplot: no global figure registry to leak into in scripts, and no backend switch
    # that would stop a notebook's inline backend from showing it.
    fig = Figure(figsize=figsize, layout="constrained")
    return list(fig.subplots(1, ncols, sharey=sharey, squeeze=False)[0])


def _axes() -> Axes:
    return new_axes()[0]
