"""The results side of experiments/premise_holds.py: finished cells copied into ``--out/cells``, then the tables,
figures and README made from them and from the premise probes in ``--out/probe``.

- ``cells.csv``: method, level, seed, validation accuracy before and after RL, the gain with its 95% interval
  (paired by question), tool calls, generated tokens and forks per question per step, commit, machine;
- ``premise.csv``: per level the premise statistic after the search result (the decision) with its interval, and
  the same after the Python result and at the controls (a random point, ``</think>``), and whether it holds;
- ``pooled.csv``: per level each method against another (ARPO − GRPO, ARPO − random …), final accuracy paired by
  seed and question over all seeds;
- ``gain_vs_premise.png`` (ARPO − GRPO against ΔH, one point per level, the SmolLM2 hard benchmark's null result
  as another), ``cells.png`` (every cell's gain), ``README.md``.
"""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path
from typing import Any

from arpo.evaluation import stats
from arpo.runtime.machine import describe_machine
from experiments import REPO, repo_relative
from experiments.ablation_results import FINAL_CORRECTNESS, copy_run

CELL_COLUMNS = ("method", "level", "seed", "before", "after", "gain", "ci_low", "ci_high", "n", "tool_calls",
                "tokens", "forks", "fork_rate", "forks_after_search", "git_sha", "machine")
#: where a cell's forks went: per tool, the forks made right after its results and its decisions' ΔH
FORKS = "forks.json"
PREMISE_COLUMNS = ("level", "delta_h", "ci_low", "ci_high", "python_delta_h", "python_ci_low", "python_ci_high",
                   "random_delta_h", "random_ci_low", "random_ci_high", "think_delta_h", "think_ci_low",
                   "think_ci_high", "above_random", "above_random_ci_low", "above_random_ci_high", "above_think",
                   "above_think_ci_low", "above_think_ci_high", "trajectories", "holds")
POOLED_COLUMNS = ("level", "comparison", "diff", "ci_low", "ci_high", "n", "seeds")
#: (method, baseline) pairs of pooled.csv, where both ran
COMPARISONS = (("arpo", "grpo"), ("arpo", "random"), ("random", "grpo"), ("arpo_hard", "grpo"))
#: the SmolLM2 hard benchmark, where the premise fails: ΔH after search of make run's SFT model on gold
#: trajectories (the premise study) and the advantage suite's final answers (ARPO soft vs GRPO, 3 seeds)
NULL_PROBE = REPO / "experiments" / "results" / "premise" / "smollm2_sft_demos.json"
NULL_RUNS = REPO / "experiments" / "results" / "smollm2_advantage" / "runs"


def cell_dest(out: Path, level: int, method: str, seed: int) -> Path:
    return out / "cells" / f"level{level}" / method / f"seed{seed}"


def copy_cell(run_dir: Path, dest: Path) -> None:
    """A finished run's files as the ablation copies them, its summary cut to what a cell reports (gain, final
    validation, machine), and where its forks went."""
    copy_run(run_dir, dest)
    summary = json.loads((run_dir / "summary.json").read_text())
    kept = {k: summary.get(k) for k in ("validation_gain", "final_validation", "machine")}
    (dest / "summary.json").write_text(repo_relative(json.dumps(kept, indent=2)))
    (dest / FORKS).write_text(json.dumps(fork_placement(run_dir / "rollouts"), indent=1))


def fork_placement(rollouts: Path) -> dict[str, dict[str, float]]:
    """Per tool, over every training step's trajectories: forks started right after one of its results, its
    branching decisions, and the share of them whose ΔH was above zero (the paper rule's fork condition)."""
    out: dict[str, dict[str, float]] = {}
    for path in sorted(rollouts.glob("step_*.jsonl")):
        for row in (json.loads(line) for line in path.read_text().splitlines() if line.strip()):
            calls = row.get("tool_calls") or []
            if row.get("rollout_kind") == "branch":
                tool = next((c["tool"] for c in calls if c["end"] == row["branch_pos"]), "other")
                out.setdefault(tool, {"forks": 0, "decisions": 0, "rising": 0})["forks"] += 1
            for c in calls:  # the row's own decisions (a fork's inherited calls are its parent's)
                if c["end"] > int(row.get("branch_pos") or 0) and c.get("delta_entropy") is not None:
                    t = out.setdefault(c["tool"], {"forks": 0, "decisions": 0, "rising": 0})
                    t["decisions"] += 1
                    t["rising"] += int(c["delta_entropy"] > 0)
    return out


def import_cells(source: Path, out: Path) -> list[str]:
    """Copy the finished cells of another runs folder (``source/level<K>/<method>/seed<S>``) into ``out/cells``."""
    imported = []
    for run in sorted(source.glob("level*/*/seed*")):
        if (run / "summary.json").is_file():
            level, method, seed = int(run.parents[1].name[5:]), run.parent.name, int(run.name[4:])
            copy_cell(run, cell_dest(out, level, method, seed))
            imported.append(f"level{level}/{method}/seed{seed}")
    return imported


def _metrics(cell: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _train_rows(cell: Path) -> list[dict[str, Any]]:
    return [r for r in _metrics(cell) if "rollout/trajectories" in r]


def fork_rate(out: Path, level: int) -> float | None:
    """ARPO's fork rate at ``level``: fork candidates its rule said yes to over decisions taken, summed over every
    step of the level's finished ``arpo`` cells (None: none finished; 0 when they took no decision, so the control
    forks as little as ARPO did)."""
    wants = points = 0.0
    cells = sorted((out / "cells" / f"level{level}" / "arpo").glob("seed*/summary.json"))
    for summary in cells:
        for row in _train_rows(summary.parent):
            wants += row.get("rollout/branch_wants", 0.0)
            points += row.get("rollout/branch_points", 0.0)
    if not cells:
        return None
    return round(wants / points, 4) if points else 0.0


def _cells(out: Path) -> list[tuple[int, str, int, Path]]:
    found = []
    for cell in (out / "cells").glob("level*/*/seed*"):
        if (cell / "summary.json").is_file():
            found.append((int(cell.parents[1].name[5:]), cell.parent.name, int(cell.name[4:]), cell))
    return sorted(found)


def cell_row(level: int, method: str, seed: int, cell: Path) -> dict[str, Any]:
    summary = json.loads((cell / "summary.json").read_text())
    gain = (summary.get("validation_gain") or {}).get("acc") or {}
    rows = _train_rows(cell)
    record = json.loads((cell / "ablation_run.json").read_text())
    keys = dict(o.split("=", 1) for o in record.get("overrides", []) if "=" in o)
    n = float(keys.get("actor_rollout_ref.rollout.n", 1))  # the budget M: trajectories / M = questions

    def per_question(metric: str) -> float:
        vals = [r.get(metric, math.nan) * n / r["rollout/trajectories"] for r in rows if r["rollout/trajectories"]]
        return float(sum(vals) / len(vals)) if vals else math.nan

    placement = json.loads((cell / FORKS).read_text()) if (cell / FORKS).is_file() else {}
    forks = sum(t["forks"] for t in placement.values())
    wants = sum(r.get("rollout/branch_wants", 0.0) for r in rows)
    points = sum(r.get("rollout/branch_points", 0.0) for r in rows)
    attempts = record.get("attempts") or [{}]
    return {"method": method, "level": level, "seed": seed, "before": gain.get("before"), "after": gain.get("after"),
            "gain": gain.get("gain"), "ci_low": gain.get("low"), "ci_high": gain.get("high"), "n": gain.get("n"),
            "tool_calls": per_question("rollout/tool_calls/total"), "tokens": per_question("rollout/tokens/generated"),
            "forks": per_question("rollout/branches"), "fork_rate": wants / points if points else math.nan,
            "forks_after_search": placement.get("search", {}).get("forks", 0) / forks if forks else math.nan,
            "git_sha": str(attempts[-1].get("git_sha", ""))[:12],
            "machine": describe_machine(summary["machine"]) if summary.get("machine") else ""}


def premise_row(level: int, probe: dict[str, Any]) -> dict[str, Any]:
    p = probe["premise"]["topk"]
    row: dict[str, Any] = {"level": level, "trajectories": probe.get("trajectories")}
    for label, prefix, value in (("search", "", "delta_h"), ("python", "python_", "delta_h"),
                                 ("random", "random_", "delta_h"), ("think", "think_", "delta_h"),
                                 ("search - random", "above_random_", ""), ("search - think", "above_think_", "")):
        s = p.get(label, {})
        row[f"{prefix}{value}".rstrip("_")], row[f"{prefix}ci_low"], row[f"{prefix}ci_high"] = \
            s.get("mean", math.nan), s.get("lo", math.nan), s.get("hi", math.nan)
    # holds: the window after the search result (the decision) rises, and more than around both controls in the
    # same trajectories (the paired differences' intervals above zero)
    row["holds"] = bool(row["ci_low"] > 0 and row["above_random_ci_low"] > 0 and row["above_think_ci_low"] > 0)
    return row


def _final(cell: Path) -> dict[str, float]:
    path = cell / FINAL_CORRECTNESS
    return json.loads(path.read_text()) if path.is_file() else {}


def pooled(cells: list[tuple[int, str, int, Path]], level: int, method: str, base: str) -> dict[str, Any] | None:
    """``method`` − ``base`` in final accuracy, paired by seed and question over every seed both finished."""
    by = {(m, s): c for lv, m, s, c in cells if lv == level}
    seeds = sorted(s for (m, s) in by if m == method and (base, s) in by)
    a, b = [], []
    for s in seeds:
        fa, fb = _final(by[(method, s)]), _final(by[(base, s)])
        for q in sorted(set(fa) & set(fb)):
            a.append(fa[q])
            b.append(fb[q])
    if not a:
        return None
    g = stats.paired_gain(b, a)
    return {"level": level, "comparison": f"{method} - {base}", "diff": g.gain, "ci_low": g.low, "ci_high": g.high,
            "n": g.n, "seeds": len(seeds)}


def null_point() -> dict[str, float] | None:
    """The SmolLM2 hard benchmark: (ΔH after search, its interval, ARPO − GRPO pooled, its interval)."""
    if not NULL_PROBE.is_file() or not NULL_RUNS.is_dir():
        return None
    s = json.loads(NULL_PROBE.read_text())["premise"]["topk"]["search"]
    cells = [(0, m, int(c.name[4:]), c) for m in ("arpo_soft", "grpo") for c in (NULL_RUNS / m).glob("seed*")]
    g = pooled(cells, 0, "arpo_soft", "grpo")
    return None if g is None else {"dh": s["mean"], "dh_lo": s["lo"], "dh_hi": s["hi"], "diff": g["diff"],
                                   "lo": g["ci_low"], "hi": g["ci_high"], "seeds": g["seeds"]}


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in rows)


def _plot_gain_vs_premise(premise: list[dict], pooled_rows: list[dict], null: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    diffs = {r["level"]: r for r in pooled_rows if r["comparison"] == "arpo - grpo"}
    for p in premise:
        d = diffs.get(p["level"])
        if d is None:
            continue
        ax.errorbar(p["delta_h"], d["diff"], xerr=[[p["delta_h"] - p["ci_low"]], [p["ci_high"] - p["delta_h"]]],
                    yerr=[[d["diff"] - d["ci_low"]], [d["ci_high"] - d["diff"]]], fmt="o", capsize=3, color="C0")
        seeds = f"{d['seeds']} seed{'s' if d['seeds'] > 1 else ''}"
        ax.annotate(f"K = {p['level']} ({seeds})", (p["delta_h"], d["diff"]), textcoords="offset points",
                    xytext=(6, 6))
    if null is not None:
        ax.errorbar(null["dh"], null["diff"], xerr=[[null["dh"] - null["dh_lo"]], [null["dh_hi"] - null["dh"]]],
                    yerr=[[null["diff"] - null["lo"]], [null["hi"] - null["diff"]]], fmt="s", capsize=3, color="C3")
        ax.annotate(f"SmolLM2 hard benchmark ({null['seeds']} seeds)", (null["dh"], null["diff"]),
                    textcoords="offset points", xytext=(6, -12))
    ax.axhline(0, color="grey", lw=0.8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("premise ΔH after the tool result (window mean, ÷ log|V|), 95% CI")
    ax.set_ylabel("ARPO − GRPO final accuracy, 95% CI")
    ax.set_title("ARPO's gain over GRPO against its premise's strength")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_cells(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["level"] for r in rows})
    methods = [m for m in ("grpo", "arpo", "random", "arpo_hard") if any(r["method"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        for j, level in enumerate(levels):
            cell = [r for r in rows if r["method"] == m and r["level"] == level and r["gain"] is not None]
            for k, r in enumerate(cell):
                x = j + (i - (len(methods) - 1) / 2) * width + (k - 1) * width / 6
                ax.errorbar(x, r["gain"], yerr=[[r["gain"] - r["ci_low"]], [r["ci_high"] - r["gain"]]], fmt="o",
                            color=f"C{i}", capsize=2, label=m if j == 0 and k == 0 else None)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(levels)), [f"K = {lv}" for lv in levels])
    ax.set_xlim(-0.6, len(levels) - 0.4)
    ax.set_ylabel("validation accuracy gain, 95% CI")
    ax.set_title("RL gain per cell (one point per seed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _table(columns: tuple[str, ...], rows: list[dict[str, Any]], digits: int, signed: tuple[str, ...] = ()) -> str:
    """A markdown table, every number of a column in one format: ``signed`` columns (differences) with their sign."""
    def fmt(column: str, v: Any) -> str:
        if isinstance(v, float):
            return "–" if math.isnan(v) else f"{v:+.{digits}f}" if column in signed else f"{v:.{digits}f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(c, r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def verdict(premise: list[dict], pooled_rows: list[dict]) -> list[str]:
    """One plain line per level: does the premise hold, and does ARPO beat GRPO and the random control."""
    lines = []
    probes = {p["level"]: p for p in premise}
    for level in sorted(set(probes) | {r["level"] for r in pooled_rows}):
        p = probes.get(level)
        words = [f"K = {level}: " + ("the premise was not probed" if p is None else
                                     f"the premise {'holds' if p['holds'] else 'does not hold'} "
                                     f"(ΔH after the search result {p['delta_h']:+.4f} "
                                     f"[{p['ci_low']:+.4f}, {p['ci_high']:+.4f}]; above a random point "
                                     f"{p['above_random']:+.4f} [{p['above_random_ci_low']:+.4f}, "
                                     f"{p['above_random_ci_high']:+.4f}], above </think> {p['above_think']:+.4f} "
                                     f"[{p['above_think_ci_low']:+.4f}, {p['above_think_ci_high']:+.4f}])")]
        for r in pooled_rows:
            if r["level"] != level or not r["comparison"].startswith("arpo -"):
                continue
            side = "above" if r["ci_low"] > 0 else "below" if r["ci_high"] < 0 else "not distinguishable from"
            words.append(f"{r['comparison']} {r['diff']:+.3f} [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}], {side} zero")
        lines.append("- " + "; ".join(words) + ".")
    return lines


def collect(out: Path, header: str, smoke: bool) -> None:
    """Write cells.csv, premise.csv, pooled.csv, the figures and README.md under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cells = _cells(out)
    rows = [cell_row(*c) for c in cells]
    probes = sorted((out / "probe").glob("level*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem)))
    for probe in probes:  # a probe given absolute paths records them: keep the committed ones repo-relative
        probe.write_text(repo_relative(probe.read_text()))
    premise = [premise_row(int(p.stem[5:]), json.loads(p.read_text())) for p in probes]
    levels = sorted({lv for lv, *_ in cells})
    pooled_rows = [r for lv in levels for m, b in COMPARISONS if (r := pooled(cells, lv, m, b))]
    _write_csv(out / "cells.csv", CELL_COLUMNS, rows)
    _write_csv(out / "premise.csv", PREMISE_COLUMNS, premise)
    _write_csv(out / "pooled.csv", POOLED_COLUMNS, pooled_rows)
    figures = []
    if rows:
        _plot_cells(rows, out / "cells.png")
        figures.append("cells.png")
    if premise and pooled_rows:
        _plot_gain_vs_premise(premise, pooled_rows, None if smoke else null_point(), out / "gain_vs_premise.png")
        figures.append("gain_vs_premise.png")
    readme = ["# ARPO where its premise holds: GRPO vs ARPO vs random branching, per ambiguity level", "", header, "",
              "**Smoke run: checks the machinery, not a result.**\n" if smoke else "",
              "Task: `synthetic=premise` (K towns share a name; the search result lists them all; the agent computes "
              "with the one in the question's country). Methods, cells and files: `experiments/premise_holds.py`; "
              "design, machine and what it took: `docs/results/premise-holds.md`. The premise: the SFT model's own "
              "samples on the level's test questions, re-scored teacher-forced (`probe/level<K>.json`, `.png`; "
              "`probe_window5/`: the same with a 5-token window). The machine of each cell: `cells.csv`.",
              "", "## Verdict", "", *verdict(premise, pooled_rows), "",
              "## The premise at the SFT model (`premise.csv`)", "",
              _table(PREMISE_COLUMNS, premise, 4, signed=PREMISE_COLUMNS), "",
              "## Methods against each other (`pooled.csv`; final accuracy paired by seed and question)", "",
              _table(POOLED_COLUMNS, pooled_rows, 4, signed=("diff", "ci_low", "ci_high")), "",
              "## Cells (`cells.csv`; tool calls, tokens and forks per question per training step)", "",
              _table(CELL_COLUMNS[:-1], rows, 3, signed=("gain", "ci_low", "ci_high")), "",
              *[f"![{f}]({f})\n" for f in figures]]
    (out / "README.md").write_text(repo_relative("\n".join(readme)))
