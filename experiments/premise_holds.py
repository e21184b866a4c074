"""ARPO where its premise holds: GRPO vs ARPO vs random branching on the namesake-town task, per ambiguity level.

The task (``synthetic=premise``, :mod:`arpo.data.synthetic_namesakes`) puts the decision right after a tool
result: K towns share a name, the search page lists them all, and the agent must compute with the one in the
question's country. K (``synthetic.candidates``) grades how uncertain that decision is. The study:

1. **SFT** once, on demonstrations mixing the levels (``configs/pipeline/premise.yaml``: SmolLM2-135M-Instruct,
   ``python -m arpo.pipeline --preset premise --skip-rl``), unless ``--model-dir`` names a model to start from;
2. **data** per level: the same world and seed with ``synthetic.candidates=K``;
3. **the premise measured** per level at that model: its own samples on the level's test questions
   (``experiments/dump_rollout_entropy.py``, plain sampling), re-scored teacher-forced by
   ``python -m arpo.entropy_probe``: entropy after the search result (the decision) and after the Python result
   (a copy) against a random point and ``</think>``;
4. **RL cells** at equal budget (the preset's M, N, prompts, steps, learning rate), per level, method and seed:

   - ``grpo``: plain sampling of M trajectories (``preset=grpo``);
   - ``arpo``: ARPO with soft advantage forking where entropy rose, as the paper writes the rule: the window of k
     tokens after the result against the root's first one, fork iff ΔH > 0 (``branching.rule=paper``,
     ``branching.timing=paper``; the released code's rule forks with probability 0.5 + 0.2·ΔH, which ΔH of a
     few hundredths barely moves);
   - ``random``: the same rollout and forking positions, but a coin decides each fork, independent of entropy
     (``branching.rule=code``, ``entropy_weight=0``), its probability ARPO's own fork rate at that level
     (``rollout/branch_wants`` / ``rollout/branch_points`` over the level's finished ARPO cells), so both make
     the same number of forks in expectation and differ only in where they spend them;
   - ``arpo_hard`` (``--methods``): ARPO with hard advantage.

   A level's ``random`` cells therefore run after its ARPO cells.
5. **collect** (:mod:`experiments.premise_holds_results`): ``cells.csv``, ``premise.csv``, ``pooled.csv``, figures
   and ``README.md`` under ``--out``.

Every finished cell's files are copied into ``--out/cells/level<K>/<method>/seed<S>/`` and the tables are made
from there, so cells run on other machines gather into one table (``--collect-only --import-runs DIR``; an
imported cell replaces one of the same name). A cell already in ``--out/cells`` is not run again (so a sweep
continues on another machine from the committed results), and a killed cell resumes from its checkpoint.

    python experiments/ablation.py --suite premise_holds [--levels 1 2 4] [--seeds 0 1 2] [--methods ...] \\
        [--model-dir DIR] [--out DIR] [--runs-dir DIR] [--jobs N] [--smoke] [--collect-only] [-- key=value ...]

The committed results were made with ``--out experiments/results/premise_holds`` (the default ``--out`` is under
``--runs-dir``, so a rerun never overwrites them unasked).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from experiments import git_sha, repo_path  # noqa: E402
from experiments.ablation import ROLLOUT_KEY, SMOKE_OVERRIDES, Run, Variant, train  # noqa: E402
from experiments.premise_holds_results import cell_dest, collect, copy_cell, fork_rate, import_cells  # noqa: E402

logger = logging.getLogger("arpo.premise_holds")

PRESET = "premise"
SUITE = "premise_holds"
LEVELS = (1, 2, 4)
#: the methods at equal budget; ``random`` gets its fork probability from the level's ARPO cells
METHODS = {
    "grpo": ("preset=grpo",),
    "arpo": ("preset=arpo_soft", f"{ROLLOUT_KEY}.branching.rule=paper", f"{ROLLOUT_KEY}.branching.timing=paper"),
    "random": ("preset=arpo_soft", f"{ROLLOUT_KEY}.branching.rule=code", f"{ROLLOUT_KEY}.branching.timing=paper",
               f"{ROLLOUT_KEY}.branching.entropy_weight=0"),
    "arpo_hard": ("preset=arpo_hard", f"{ROLLOUT_KEY}.branching.rule=paper",
                  f"{ROLLOUT_KEY}.branching.timing=paper"),
}
DEFAULT_METHODS = ("grpo", "arpo", "random")
#: smoke (CI): small data, 2 SFT steps, the smoke runs of experiments/ablation.py, a few probe prompts
SMOKE_DATA = ("synthetic.sizes.train=64", "synthetic.sizes.val=8", "synthetic.sizes.test=8",
              "synthetic.world.namesake_groups=40")
SMOKE_PROBE_PROMPTS = 4
#: smoke RL cells: 2 prompts a step (the budget M and N stay the preset's) and short responses
SMOKE_RL = ("data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=96")
#: the preset's keys the probe's sampling run takes (engine and lengths)
PROBE_KEYS = ("actor_rollout_ref.rollout.max_model_len=", "actor_rollout_ref.rollout.dtype=", "data.max_")


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python experiments/ablation.py --suite premise_holds",
                                description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Keys after -- go to every RL cell (python -m arpo.main_arpo).")
    p.add_argument("--suite", default=SUITE, choices=[SUITE])
    p.add_argument("--levels", type=int, nargs="+", default=list(LEVELS),
                   help="ambiguity levels: towns sharing a name (synthetic.candidates)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--model-dir", type=Path, help="the SFT model every cell starts from (default: the premise "
                                                   "preset's, built by its pipeline when missing)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results (default <runs-dir>/results; the committed ones: experiments/results/{SUITE})")
    p.add_argument("--runs-dir", type=Path, default=None,
                   help=f"run folders with checkpoints, data and probes (default outputs/ablation/{PRESET}/{SUITE})")
    p.add_argument("--probe-prompts", type=int, default=None,
                   help="test questions per level sampled for the premise probe (default 128, --smoke 4)")
    p.add_argument("--jobs", type=int, default=1, help="cells at once")
    p.add_argument("--smoke", action="store_true", help="CI: small data, first seed, 2 steps, 8 validation prompts")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep a finished cell's checkpoints (default: removed once it finishes; hf_model/ stays)")
    p.add_argument("--collect-only", action="store_true", help="run nothing: rebuild the results from --out/cells")
    p.add_argument("--import-runs", type=Path, default=None,
                   help="with --collect-only: first copy the finished cells of another runs folder (another "
                        "machine's --runs-dir) into --out/cells")
    args = p.parse_args(own)
    bad = [k for k in extra if "=" not in k]
    if bad:
        p.error(f"after -- give key=value overrides, got {bad}")
    if "random" in args.methods and "arpo" not in args.methods:
        p.error("--methods: random takes its fork rate from the arpo cells; include arpo")
    if args.smoke:
        args.seeds = args.seeds[:1]
    if args.probe_prompts is None:
        args.probe_prompts = SMOKE_PROBE_PROMPTS if args.smoke else 128
    args.runs_dir = (args.runs_dir or REPO / "outputs" / "ablation" / PRESET / SUITE).resolve()
    # never the committed results by default: a rerun must not overwrite them unasked
    args.out = (args.out or args.runs_dir / "results").resolve()
    return args, extra


def preset_overrides() -> tuple[list[str], list[str], list[str]]:
    """The premise preset's overrides: (synthetic data, SFT, RL)."""
    from arpo.pipeline import Preset, overrides_for_stage

    preset = Preset.load(PRESET)
    keys = list(preset.overrides)
    return (overrides_for_stage("synthetic_data", keys), overrides_for_stage("sft", keys),
            overrides_for_stage("arpo_trainer", keys))


def sft_model(args: argparse.Namespace, extra_data: Sequence[str]) -> Path:
    """``--model-dir``, or the premise pipeline's SFT model (built now when missing: data, base model, SFT)."""
    if args.model_dir is not None:
        if not (args.model_dir / "config.json").is_file():
            raise SystemExit(f"--model-dir {args.model_dir}: no HF checkpoint there (config.json)")
        return args.model_dir.resolve()
    from arpo.pipeline import Preset, stage_paths

    root = REPO / Preset.load(PRESET).output_dir
    model = stage_paths(root, Preset.load(PRESET))["sft_model"]
    if not (model / "config.json").is_file():
        cmd = [sys.executable, "-m", "arpo.pipeline", "--preset", PRESET, "--skip-rl", *extra_data]
        logger.info("building the SFT model: %s", shlex.join(cmd))
        subprocess.run(cmd, cwd=REPO, check=True)
    return model


def level_data(level: int, runs_dir: Path, data_overrides: Sequence[str]) -> Path:
    """The level's train/val/test parquet and corpus (the preset's world and seed, ``synthetic.candidates=K``)."""
    from arpo.config import load_config
    from arpo.data.synthetic import generate_from_config

    out = runs_dir / "data" / f"level{level}"
    if not (out / "test.parquet").is_file():
        cfg = load_config("synthetic_data", [*data_overrides, f"synthetic.candidates={level}",
                                             f"synthetic.out_dir={out}"])
        generate_from_config(cfg.synthetic)
    return out


def probe_level(level: int, model: Path, data: Path, runs_dir: Path, out: Path, prompts: int,
                rl_overrides: Sequence[str]) -> None:
    """The premise at ``model`` on the level's test questions: its own samples (one per question, training
    sampling), re-scored teacher-forced; the probe's JSON and PNG go to ``out/probe``."""
    dump = runs_dir / "probe" / f"level{level}.jsonl"
    name = f"level{level}"
    if (out / "probe" / f"{name}.json").is_file():
        return
    if not dump.is_file():
        # the engine's and the lengths' settings of the cells; the sampling is training's (one per question)
        keys = [k for k in rl_overrides if k.startswith(PROBE_KEYS)]
        cmd = [sys.executable, str(REPO / "experiments" / "dump_rollout_entropy.py"), "--model", str(model),
               "--out", str(dump), "--data", str(data), "--split", "test", "--limit", str(prompts), "--n", "1",
               "--initial", "1", *keys, "actor_rollout_ref.rollout.mode=single"]
        _logged(cmd, runs_dir / "logs" / f"probe_{name}.log")
    # repo-relative where they can be: the probe's JSON records its sources
    cmd = [sys.executable, "-m", "arpo.entropy_probe", "--model", repo_path(model), "--trajectories", repo_path(dump),
           "--out", repo_path(out / "probe"), "--name", name]
    _logged(cmd, runs_dir / "logs" / f"probe_{name}.log")


def _logged(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"failed (exit {rc}): {shlex.join(cmd)}; see {log}")


def plan_cells(args: argparse.Namespace, level: int, method: str, model: Path, data: Path,
               rl_overrides: Sequence[str], extra: Sequence[str], fork_probability: float | None = None) -> list[Run]:
    """The level's cells of ``method`` (one per seed), with their full override lists (later keys win)."""
    keys = METHODS[method] + ((f"{ROLLOUT_KEY}.branching.branch_probability={fork_probability}",)
                              if fork_probability is not None else ())
    runs = []
    for seed in args.seeds:
        out = args.runs_dir / f"level{level}" / method / f"seed{seed}"
        overrides = (*rl_overrides, *keys, f"actor_rollout_ref.model.path={model}", f"synthetic.out_dir={data}",
                     f"trainer.seed={seed}", f"trainer.experiment_name={SUITE}-k{level}-{method}-seed{seed}",
                     f"trainer.output_dir={out}", *((*SMOKE_OVERRIDES, *SMOKE_RL) if args.smoke else ()), *extra)
        runs.append(Run(Variant(method, keys), seed, out, overrides))
    return runs


def run_cells(runs: list[Run], jobs: int, out: Path, level: int, bar=None, keep_checkpoints: bool = False) -> list[Run]:
    """Train the unfinished ``runs`` (``jobs`` at once), each copied into the results as soon as it finishes (and
    counted on ``bar``); returns the failed ones."""
    from concurrent.futures import ThreadPoolExecutor

    def cell(run: Run) -> bool:
        ok = train(run, keep_checkpoints)
        if run.finished:
            copy_cell(run.dir, cell_dest(out, level, run.variant.name, run.seed))
        if bar is not None:
            bar.update(1)
        return ok

    # seed-major: a partial sweep already has every method of the first seeds
    pending = sorted((r for r in runs if not r.finished), key=lambda r: r.seed)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ok = list(pool.map(cell, pending))
    return [r for r, good in zip(pending, ok) if not good]


def main(argv: Sequence[str] | None = None) -> int:
    from tqdm import tqdm

    from arpo.runtime.logging_utils import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parse_args(argv)
    setup_logging(args.runs_dir / "logs", filename="premise_holds.log")
    header = (f"Command: `python experiments/ablation.py {shlex.join(argv)}` — git SHA: `{git_sha()}` — "
              f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    if args.collect_only:
        if args.import_runs is not None:
            logger.info("imported %d cell(s)", len(import_cells(args.import_runs.resolve(), args.out)))
        collect(args.out, header, args.smoke)
        return 0
    data_keys, _, rl_keys = preset_overrides()
    if args.smoke:
        data_keys = [*data_keys, *SMOKE_DATA]
    model = sft_model(args, [*data_keys] if args.smoke else [])
    failed: list[Run] = []
    total = len(args.levels) * len(args.methods) * len(args.seeds)
    with tqdm(total=total, desc=SUITE, unit="cell") as bar:
        for level in args.levels:
            data = level_data(level, args.runs_dir, data_keys)
            probe_level(level, model, data, args.runs_dir, args.out, args.probe_prompts, rl_keys)
            # the control last: it takes its fork rate from the level's finished arpo cells
            for batch in ([m for m in args.methods if m != "random"], [m for m in args.methods if m == "random"]):
                runs = []
                for method in batch:
                    rate = fork_rate(args.out, level) if method == "random" else None
                    if method == "random" and rate is None:
                        logger.error("level %d: no finished arpo cell to take the fork rate from; random skipped", level)
                        bar.update(len(args.seeds))
                        continue
                    runs += plan_cells(args, level, method, model, data, rl_keys, extra, rate)
                # a cell already in the results (finished here earlier, or on another machine and imported) is done
                done = [r for r in runs if (cell_dest(args.out, level, r.variant.name, r.seed) / "summary.json").is_file()
                        and not r.finished]
                bar.update(len(done))
                runs = [r for r in runs if r not in done]
                already = [r for r in runs if r.finished]  # finished in an earlier call: copied again, counted
                for run in already:
                    copy_cell(run.dir, cell_dest(args.out, level, run.variant.name, run.seed))
                bar.update(len(already))
                failed += run_cells(runs, args.jobs, args.out, level, bar, args.keep_checkpoints)
    collect(args.out, header, args.smoke)
    if failed:
        logger.error("%d cell(s) failed: %s; rerun the same command to resume them", len(failed),
                     ", ".join(f"{r.dir.relative_to(args.runs_dir)}" for r in failed))
        return 1
    logger.info("results: %s", args.out / "README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
