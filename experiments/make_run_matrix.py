"""`make run` over seeds and kernel/dtype settings: does the RL gain hold wherever it runs?

One cell is ``python -m arpo.pipeline --preset smollm2`` with one setting and one seed. A setting is a set of
environment variables (kernel choice: ``MKL_CBWR``, ``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA`` …) and config
overrides (``sft.dtype=bfloat16``); each setting trains its own SFT model once (in its first seed's cell, which
is exactly ``make run`` under that setting) and every other seed's cell reuses it (its ``data`` and ``models``
folders link to the first cell's). Seed K sets ``trainer.seed=K`` (rollout and validation sampling) and
``data.seed=K+1`` (prompt order; seed 0 keeps the preset's order). Cells run one at a time, each in a fresh
process; a finished cell (its ``summary.json`` holds a gain) is not run again, so a killed sweep resumes.
``--sft-of NAME=OTHER`` makes setting NAME reuse OTHER's SFT model in every seed (an RL-only change such as LoRA,
compared with OTHER on the same cold start); OTHER's first seed must have trained it.

Writes under ``--results``: ``matrix.csv`` (seed, setting, before, after, gain, ci_low, ci_high, per cell),
``per_kind.csv`` (the same per question kind, from the validation records and the validation parquet's
``ability``), ``cells.json`` (each cell's command, environment, git SHA, machine, SFT summary and timings) and
``matrix.png``. Prints the matrix's summary as JSON. Cells already in ``--results`` that this ``--out`` has no
finished cell for are kept, so cells run on different machines gather into one matrix.

    python experiments/make_run_matrix.py --out outputs/matrix --seeds 0 1 2 \\
        --settings default= mkl_compatible=MKL_CBWR=COMPATIBLE aten_default=ATEN_CPU_CAPABILITY=default
    python experiments/make_run_matrix.py --out outputs/matrix --collect-only    # tables from finished cells
    python experiments/make_run_matrix.py --out outputs/matrix --seeds 0 --sft-of lora=default --settings default= \
        lora=actor_rollout_ref.model.lora_rank=16,actor_rollout_ref.model.lora_alpha=32,actor_rollout_ref.actor.optim.lr=1e-4
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import REPO, environ_with, git_sha  # noqa: E402

MATRIX_COLUMNS = ("seed", "setting", "before", "after", "gain", "ci_low", "ci_high")
KIND_COLUMNS = ("seed", "setting", "kind", "n", "before", "after", "gain", "ci_low", "ci_high")


@dataclass(frozen=True)
class Setting:
    """A named kernel/dtype setting: environment for the cell's process and config overrides for its stages."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "Setting":
        """``name=KEY=VALUE,...``: a KEY with a dot is a config override, any other an environment variable (an
        empty VALUE unsets it)."""
        name, _, rest = text.partition("=")
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise SystemExit(f"--settings {text!r}: start with a name (letters, digits, _ or -), e.g. "
                             f"mkl_compatible=MKL_CBWR=COMPATIBLE")
        env, overrides = {}, []
        for item in filter(None, rest.split(",")):
            key, eq, value = item.partition("=")
            if not eq:
                raise SystemExit(f"--settings {text!r}: {item!r} is not KEY=VALUE")
            if "." in key:
                overrides.append(item)
            else:
                env[key] = value
        return cls(name, env, tuple(overrides))


def cell_dir(out: Path, setting: Setting, seed: int) -> Path:
    return out / setting.name / f"seed{seed}"


def finished(cell: Path) -> dict | None:
    """The cell's pipeline summary when it measured a gain, else None."""
    path = cell / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("validation_gain") else None


def link_sft(cell: Path, first: Path) -> None:
    """Point a later seed's cell at the first seed's data and models (its SFT model), so the pipeline skips them."""
    cell.mkdir(parents=True, exist_ok=True)
    for name in ("data", "models"):
        target, link = (first / name).resolve(), cell / name
        if not target.is_dir():
            raise SystemExit(f"{first}: no {name}/ (the setting's first seed must finish its SFT first)")
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)


def sft_sources(pairs: list[str], names: set[str]) -> dict[str, str]:
    """``--sft-of NAME=OTHER`` pairs as {NAME: OTHER}; both must be settings of this sweep, OTHER trains its own."""
    out = {}
    for pair in pairs:
        name, eq, other = pair.partition("=")
        if not eq or name not in names or other not in names or name == other:
            raise SystemExit(f"--sft-of {pair!r}: give NAME=OTHER, two different settings of --settings "
                             f"({', '.join(sorted(names))})")
        out[name] = other
    if set(out) & set(out.values()):
        raise SystemExit(f"--sft-of {' '.join(pairs)}: a setting that reuses another's SFT cannot lend its own")
    return out


def cell_command(args: argparse.Namespace, setting: Setting, seed: int, cell: Path) -> list[str]:
    return [sys.executable, "-m", "arpo.pipeline", "--preset", args.preset, "--output-dir", str(cell),
            *setting.overrides, *args.overrides, f"trainer.seed={seed}", f"data.seed={seed + 1}"]


def run_cell(args: argparse.Namespace, setting: Setting, seed: int, cell: Path) -> None:
    cmd = cell_command(args, setting, seed, cell)
    cell.mkdir(parents=True, exist_ok=True)
    record = {"setting": setting.name, "seed": seed, "command": cmd[1:], "env": setting.env, "git_sha": git_sha(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"[matrix] {setting.name} seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.time()
    with open(cell / "matrix_cell.log", "a") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=environ_with(setting.env), stdout=log, stderr=subprocess.STDOUT).returncode
    record.update(returncode=rc, wall_s=round(time.time() - start, 1))
    (cell / "matrix_cell.json").write_text(json.dumps(record, indent=2))
    if rc:
        print(f"[matrix] {setting.name} seed {seed} failed (exit {rc}); see {cell / 'matrix_cell.log'}",
              file=sys.stderr, flush=True)


def validation_by_kind(cell: Path, summary: dict) -> dict[str, dict]:
    """Per question kind: the paired gain over that kind's questions (kinds from the validation parquet)."""
    import numpy as np
    import pandas as pd

    from arpo.main_arpo import validation_records
    from arpo.evaluation.stats import paired_gain

    gain = summary["validation_gain"]
    val = pd.read_parquet(cell / "data" / "synthetic" / "val.parquet")
    steps = [cell / "rl" / "validation" / f"step_{gain[k]}.jsonl" for k in ("before_step", "after_step")]
    per_step = [validation_records(path) for path in steps]
    common = sorted(set(per_step[0]) & set(per_step[1]))
    kinds: dict[str, list[int]] = {}
    for i in common:
        row = val.iloc[i]
        truth = str(row["reward_model"]["ground_truth"])
        if per_step[0][i][0]["ground_truth"] != truth:  # the records' order must be the parquet's
            raise SystemExit(f"{steps[0]}: prompt {i}'s ground truth is not val.parquet row {i}'s")
        kinds.setdefault(str(row["ability"]), []).append(i)
    out = {}
    for kind, idx in sorted(kinds.items()):
        before, after = ([float(np.mean([r["acc"] for r in p[i]])) for i in idx] for p in per_step)
        out[kind] = paired_gain(before, after).as_dict()
    return out


def collect(out: Path, results: Path, settings: list[Setting], seeds: list[int]) -> dict:
    """matrix.csv, per_kind.csv, cells.json and matrix.png from every finished cell and the results' other cells."""
    rows, kind_rows, cells = [], [], []
    for setting in settings:
        for seed in seeds:
            cell = cell_dir(out, setting, seed)
            summary = finished(cell)
            if summary is None:
                continue
            acc = summary["validation_gain"]["acc"]
            rows.append({"seed": seed, "setting": setting.name, "before": acc["before"], "after": acc["after"],
                         "gain": acc["gain"], "ci_low": acc["low"], "ci_high": acc["high"]})
            for kind, g in validation_by_kind(cell, summary).items():
                kind_rows.append({"seed": seed, "setting": setting.name, "kind": kind, "n": g["n"],
                                  "before": g["before"], "after": g["after"], "gain": g["gain"],
                                  "ci_low": g["low"], "ci_high": g["high"]})
            meta = cell / "matrix_cell.json"
            cells.append({**(json.loads(meta.read_text()) if meta.is_file() else {}), "setting": setting.name,
                          "seed": seed, "machine": summary.get("machine"), "sft": summary.get("sft"),
                          "stage_timings_s": summary.get("stage_timings_s"), "wall_s": summary.get("wall_s"),
                          "reward": summary["validation_gain"]["score"]})
    here = {(r["setting"], r["seed"]) for r in rows}
    rows, kind_rows, cells = (kept_from(results, name, here) + table for name, table in
                              (("matrix.csv", rows), ("per_kind.csv", kind_rows), ("cells.json", cells)))
    results.mkdir(parents=True, exist_ok=True)
    for name, columns, table in (("matrix.csv", MATRIX_COLUMNS, rows), ("per_kind.csv", KIND_COLUMNS, kind_rows)):
        with open(results / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in table)
    (results / "cells.json").write_text(json.dumps(cells, indent=2))
    if rows:
        plot_matrix(rows, results / "matrix.png")
    return summarize(rows, kind_rows)


def kept_from(results: Path, name: str, here: set[tuple[str, int]]) -> list[dict]:
    """The rows of an earlier ``results/name`` whose cell (setting, seed) this collection has no finished cell for:
    a matrix gathers cells run on several machines, each machine's outputs holding only its own."""
    path = results / name
    if not path.is_file():
        return []
    if name.endswith(".json"):
        old = json.loads(path.read_text())
    else:
        with open(path, newline="") as f:
            old = [{k: v if k in ("setting", "kind") else (int(v) if k in ("seed", "n") else float(v))
                    for k, v in r.items()} for r in csv.DictReader(f)]
    return [r for r in old if (r["setting"], int(r["seed"])) not in here]


def summarize(rows: list[dict], kind_rows: list[dict]) -> dict:
    import numpy as np

    if not rows:
        return {"cells": 0}
    gains = np.array([r["gain"] for r in rows])
    worst = min(rows, key=lambda r: r["ci_low"])
    # a kind "loses more than its own CI": its upper bound is below zero
    losing = [f"{r['setting']}/seed{r['seed']}/{r['kind']}" for r in kind_rows if r["ci_high"] < 0]
    return {"cells": len(rows), "gain_mean": round(float(gains.mean()), 4),
            "gain_std": round(float(gains.std(ddof=1)), 4) if len(rows) > 1 else 0.0,
            "every_ci_above_zero": all(r["ci_low"] > 0 for r in rows),
            "worst_cell": {k: worst[k] for k in MATRIX_COLUMNS},
            "before_by_setting": {s: sorted({round(r["before"], 3) for r in rows if r["setting"] == s})
                                  for s in dict.fromkeys(r["setting"] for r in rows)},
            "kinds_significantly_worse": losing}


def plot_matrix(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(rows) + 2), 3.6))
    labels = [f"{r['setting']}\nseed {r['seed']}" for r in rows]
    gains = [r["gain"] for r in rows]
    err = [[r["gain"] - r["ci_low"] for r in rows], [r["ci_high"] - r["gain"] for r in rows]]
    ax.errorbar(range(len(rows)), gains, yerr=err, fmt="o", capsize=4)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("validation accuracy gain (95% CI)")
    ax.set_title("make run: RL gain per setting and seed")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/make_run_matrix.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="cells go to OUT/<setting>/seed<K>/")
    p.add_argument("--results", type=Path, default=None, help="tables and figure (default: OUT)")
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--settings", nargs="+", default=["default="],
                   help="name=KEY=VALUE,... (KEY with a dot: config override; else environment variable)")
    p.add_argument("--sft-of", nargs="+", default=[], metavar="NAME=OTHER",
                   help="setting NAME trains no SFT: every seed reuses setting OTHER's (OTHER's first seed's cell)")
    p.add_argument("--collect-only", action="store_true", help="only rebuild the tables from finished cells")
    args, args.overrides = p.parse_known_args(argv)
    settings = [Setting.parse(s) for s in args.settings]
    if len({s.name for s in settings}) != len(settings):
        p.error("--settings: names must differ")
    sft_of = sft_sources(args.sft_of, {s.name for s in settings})
    if not args.collect_only:
        for setting in settings:
            source = sft_of.get(setting.name)
            first = cell_dir(args.out, Setting(source) if source else setting, args.seeds[0])
            for seed in args.seeds:
                cell = cell_dir(args.out, setting, seed)
                if finished(cell):
                    continue
                if source or seed != args.seeds[0]:
                    link_sft(cell, first)
                run_cell(args, setting, seed, cell)
    print(json.dumps(collect(args.out, args.results or args.out, settings, args.seeds), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
