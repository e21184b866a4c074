"""The results side of experiments/ablation.py: finished runs copied into ``--out`` (metrics, summary, driver record,
per-question final correctness), then the table, figures and README made from them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from arpo import analysis
from arpo.evaluation import stats
from arpo.evaluation.training_tables import write_training_tables
from experiments import repo_path, repo_relative

if TYPE_CHECKING:
    from experiments.ablation import Run, Suite

#: a finished run's files copied into the results besides its metrics
RUN_FILES = ("summary.json", analysis.RUN_RECORD)


def copy_run(run_dir: Path, dest: Path) -> None:
    """A finished run's committed files (metrics, summary, driver record, final per-question correctness), the
    paths in them repo-relative."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(analysis.metrics_path(run_dir), dest / "metrics.jsonl")
    for name in RUN_FILES:
        (dest / name).write_text(repo_relative((run_dir / name).read_text()))
    _write_final_correctness(run_dir / "validation", dest / FINAL_CORRECTNESS)


def import_runs(suite: Suite, seeds: Sequence[int], source: Path, out: Path) -> list[str]:
    """Copy the suite's finished runs of ``seeds`` from another runs folder (``source/<variant>/seed<K>``, e.g.
    made by another checkout or machine) into ``out/runs``; returns what was imported."""
    imported = []
    for variant in suite.variants:
        for seed in seeds:
            run_dir = source / variant.name / f"seed{seed}"
            if (run_dir / "summary.json").is_file():
                copy_run(run_dir, out / "runs" / variant.name / f"seed{seed}")
                imported.append(f"{variant.name}/seed{seed}")
    return imported


def collect(suite: Suite, runs: list[Run], out: Path, header: str, smoke: bool, dump_prompts: int) -> None:
    """Copy the finished runs' metrics into ``out`` and write the table, figures and README."""
    for run in runs:
        if run.finished:
            copy_run(run.dir, out / "runs" / run.variant.name / f"seed{run.seed}")
    names = [v.name for v in suite.variants]
    all_summaries = analysis.seed_summaries(out / "runs")
    summaries = {n: all_summaries[n] for n in names if n in all_summaries}
    note = ("Val acc / reward: final validation (sampled as `actor_rollout_ref.rollout.val_kwargs` says; greedy by default) "
            "`val-core/all/acc/mean` / `val-core/all/reward/mean` (\"–\": not logged); train score: "
            "`critic/score/mean` at the last step; tool calls / traj: tool calls executed in training per "
            "trajectory, over all steps (an ARPO fork re-uses its parent's calls and results, so it runs fewer than "
            "its trajectories contain); tokens generated: `rollout/tokens/generated` summed over steps; wall: every "
            "attempt of the run, start-up and validation included (with --jobs > 1, under each other's load). Mean ± std "
            f"over seeds (ddof 1); p: Welch's t-test against `{suite.baseline}` over seeds (\"–\": < 2 seeds).")
    write_training_tables(summaries, out, suite.baseline, header=header, note=note)
    figures = [_save(_curves(out, names), out / "reward_curves.png", header)]
    dumps = {n: out / "rollouts" / f"{n}.jsonl" for n in names if (out / "rollouts" / f"{n}.jsonl").is_file()}
    branching = ""
    if dumps:
        rows = {n: analysis.load_rows(p) for n, p in dumps.items()}
        figures.append(_save(_entropy(rows), out / "entropy_around_tools.png", header))
        branching = _branching_section(rows, dump_prompts)
    variants = "\n".join(f"- `{v.name}`{' (baseline)' if v.name == suite.baseline else ''}: "
                         f"`{' '.join(v.overrides)}`" for v in suite.variants)
    readme = [f"# Ablation `{suite.name}`: {suite.title}", "", header, "",
              "**Smoke run (2 steps, one seed): checks the pipeline, not a result.**\n" if smoke else "",
              "Variants (same data, steps, seeds and budget M = `actor_rollout_ref.rollout.n`):", "", variants, "",
              "## Results", "", (out / "table.md").read_text().split("\n\n", 1)[-1], "",
              _gain_section(out / "runs", names), _vs_baseline_section(out / "runs", names, suite.baseline),
              *[f"![{p.stem}]({p.name})\n" for p in figures], branching,
              "Per-run metrics: `runs/<variant>/seed<K>/metrics.jsonl`; every number of the table: `runs.csv`. "
              f"Regenerate the table: `python -m arpo.tables --training-runs {repo_path(out)}/runs --out {repo_path(out)} "
              f"--baseline {suite.baseline}`; explore: `notebooks/arpo_analysis.ipynb`.", ""]
    (out / "README.md").write_text(repo_relative("\n".join(readme)))


def _gain_section(runs_dir: Path, names: list[str]) -> str:
    """Each run's validation accuracy before and after RL, paired by question, with the gain's bootstrap
    interval (the run's ``summary.json``), and the git SHA of the attempt that finished it."""
    lines = ["### Gain over the starting model, per run (paired by validation question)", "",
             "| Variant | Seed | Val acc before → after | Gain [95% CI] | n | git SHA |",
             "|---|---:|---:|---:|---:|---|"]
    for name in names:
        for seed_dir in sorted((runs_dir / name).glob("seed*"), key=lambda p: int(p.name[4:])):
            gain = json.loads((seed_dir / "summary.json").read_text()).get("validation_gain", {}).get("acc")
            if not gain:
                continue
            record = seed_dir / analysis.RUN_RECORD
            attempts = json.loads(record.read_text())["attempts"] if record.is_file() else []
            sha = attempts[-1].get("git_sha", "–")[:12] if attempts else "–"
            lines.append(f"| {name} | {seed_dir.name[4:]} | {gain['before']:.3f} → {gain['after']:.3f} | "
                         f"{gain['gain']:+.3f} [{gain['low']:+.3f}, {gain['high']:+.3f}] | {gain['n']} | `{sha}` |")
    return "\n".join(lines + [""]) if len(lines) > 3 else ""


#: per run in the results: each validation question's accuracy at the last validation ({prompt_index: acc})
FINAL_CORRECTNESS = "final_validation_acc.json"


def _write_final_correctness(validation_dir: Path, dest: Path) -> None:
    files = sorted(validation_dir.glob("step_*.jsonl"), key=lambda p: int(p.stem[5:]))
    if not files:
        return
    acc = {}
    with files[-1].open() as fh:
        for line in fh:
            row = json.loads(line)
            acc[str(row["prompt_index"])] = float(row["acc"])
    dest.write_text(json.dumps(acc))


def _vs_baseline_section(runs_dir: Path, names: list[str], baseline: str) -> str:
    """Each variant against the baseline at the same seed, paired by validation question (the two final
    models answer the same questions), and over all seeds' question pairs together. The pooled interval
    counts questions, not seeds: seed-to-seed variation of training is in the per-seed rows and the p-values
    of the table above."""
    def load(name: str) -> dict[int, dict[str, float]]:
        found = {}
        for seed_dir in (runs_dir / name).glob("seed*"):
            path = seed_dir / FINAL_CORRECTNESS
            if path.is_file():
                found[int(seed_dir.name[4:])] = json.loads(path.read_text())
        return found

    base = load(baseline)
    lines = [f"### Against `{baseline}` at the same seed (final validation, paired by question)", "",
             f"| Variant | Seed | Val acc `{baseline}` → variant | Difference [95% CI] | n |",
             "|---|---:|---:|---:|---:|"]
    for name in names:
        if name == baseline:
            continue
        runs, pooled_b, pooled_v = load(name), [], []
        for seed in sorted(set(runs) & set(base)):
            keys = sorted(set(runs[seed]) & set(base[seed]))
            b, v = [base[seed][k] for k in keys], [runs[seed][k] for k in keys]
            pooled_b += b
            pooled_v += v
            g = stats.paired_gain(b, v)
            lines.append(f"| {name} | {seed} | {g.before:.3f} → {g.after:.3f} | {g.gain:+.3f} "
                         f"[{g.low:+.3f}, {g.high:+.3f}] | {g.n} |")
        if len(runs.keys() & base.keys()) > 1:
            g = stats.paired_gain(pooled_b, pooled_v)
            lines.append(f"| {name} | all | {g.before:.3f} → {g.after:.3f} | {g.gain:+.3f} "
                         f"[{g.low:+.3f}, {g.high:+.3f}] | {g.n} |")
    return "\n".join(lines + [""]) if len(lines) > 4 else ""


def _curves(out: Path, names: list[str]):
    runs = analysis.load_runs(out / "runs", names)
    metrics = [analysis.TRAIN_SCORE, analysis.VAL_REWARD, analysis.TOOL_CALLS_PER_TRAJ]
    axes = analysis.new_axes(ncols=len(metrics), figsize=(5 * len(metrics), 3.5))
    for ax, metric in zip(axes, metrics):
        analysis.plot_curves(runs, metric, ax=ax)
    return axes[0].figure


def _entropy(rows: dict[str, list[dict]]):
    axes = analysis.new_axes(ncols=len(rows), figsize=(5 * len(rows), 3.5), sharey=True)
    for a, (name, variant_rows) in zip(axes, rows.items()):
        analysis.plot_entropy_around_tools(analysis.entropy_around_tool_calls(variant_rows), ax=a, title=name)
    return axes[0].figure


def _branching_section(rows: dict[str, list[dict]], prompts: int) -> str:
    lines = [f"## Branching (rollouts of each variant's final model, first seed, first {prompts} test prompts)",
             "", "| Variant | trajectories / group | forks / group | mean depth | max depth | mean branch pos |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, variant_rows in rows.items():
        s = analysis.branch_summary(variant_rows)
        pos = "–" if math.isnan(s["branch_pos_mean"]) else f"{s['branch_pos_mean']:.0f}"
        lines.append(f"| {name} | {s['trajectories_per_group']:.1f} | {s['forks_per_group']:.2f} | "
                     f"{s['mean_depth']:.2f} | {s['max_depth']:.0f} | {pos} |")
    return "\n".join(lines + [""])


def _save(fig, path: Path, header: str) -> Path:
    fig.savefig(path, dpi=100, metadata={"Description": repo_relative(header)})
    return path
