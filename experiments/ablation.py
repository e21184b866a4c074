"""ARPO ablations on the synthetic tool-use setup: variants at equal rollout budget, over seeds, resumable.

Usage (repository root; `make run-tiny` / `make run` build the data and the SFT model the runs start from):

    python experiments/ablation.py --suite advantage --seeds 0 1 2 [--preset tiny|smollm2] \\
        [--model-dir DIR --data-dir DIR] --out experiments/results/advantage [-- key=value ...]

``--preset`` (default ``tiny``) gives each run the preset's RL overrides (``configs/pipeline/<name>.yaml``) and
defaults ``--model-dir``/``--data-dir`` to the preset's SFT model and data under its output folder.

Suites (every variant: same data, steps, seeds and budget M = ``actor_rollout_ref.rollout.n``):

- ``advantage``: ``grpo`` (plain sampling, ``rollout.mode=single``; the baseline) vs ARPO with
  ``algorithm.advantage_mode`` ``soft`` and ``hard``;
- ``entropy_weight``: ARPO (rule ``code``) with ``actor_rollout_ref.rollout.arpo.branching.entropy_weight`` 0 (the
  baseline: forks ignore entropy), 0.2 (the default), 0.4;
- ``branching_rule``: ARPO with ``actor_rollout_ref.rollout.arpo.branching.rule`` ``code`` (the baseline) vs ``paper``.
- ``policy``: the rollout policy at the same budget: GRPO sampling (the baseline), ARPO, AEPO (without and with
  its entropy pre-monitoring) and Tree-GRPO (``actor_rollout_ref.rollout.arpo.policy``; Tree-GRPO with its own
  advantage, ``adv_estimator=tree_grpo``).
- ``baselines``: the paper's RL baselines, each a preset (``configs/preset/``): GRPO (the baseline), DAPO,
  REINFORCE++, PPO with a critic and ARPO.
- ``premise_holds``: GRPO vs ARPO vs random branching on a task where ARPO's premise holds by construction, per
  ambiguity level, the premise probed at the SFT model (its own driver and options: ``experiments/premise_holds.py``).
- ``lora``: ARPO (soft advantage) training every weight (the baseline) vs LoRA adapters of rank 16 on every linear
  layer (``actor_rollout_ref.model.lora_rank=16``, ``lora_alpha=32``: the usual alpha = 2 x rank) at 10x the
  learning rate (1e-4 against the configs' 1e-5, the tiny and SmolLM2 presets' alike): adapters start at zero
  and move few weights, so the usual LoRA learning rates are about 10x full fine-tuning's.

Variants are presets (``preset=<name>``) where one exists, so a suite runs exactly what a user
running ``python -m arpo.main_arpo preset=<name>`` gets.

Each run is ``python -m arpo.main_arpo <variant keys> actor_rollout_ref.model.path=<model-dir>
synthetic.out_dir=<data-dir> trainer.seed=K trainer.output_dir=<runs-dir>/<suite>/<variant>/seed<K> [--smoke
keys] [keys after --]``; the keys after ``--`` come last, so they win. Rerunning the same command skips runs
that wrote ``summary.json`` and reruns the others, which resume from their last checkpoint
(``trainer.resume_mode=auto`` under ``<output_dir>/checkpoints``, every ``trainer.save_freq`` steps); Ctrl-C
stops the runs in flight. ``--jobs N`` runs N at once (their wall times then include each other's load).
``--variants A B`` trains only those variants (the baseline among them); the others' results already in ``--out``
stay in the table.

Written under ``--out`` (commit it): ``README.md`` (command, git SHA, table, figures, branching), ``table.md``
(mean ± std over seeds, Welch's t-test p-values against the baseline), ``runs.csv``, ``reward_curves.png``
(seed bands), ``runs/<variant>/seed<K>/`` (``metrics.jsonl``, ``summary.json``, ``ablation_run.json``), and
from each variant's final model of the first seed ``rollouts/<variant>.jsonl`` (per-token entropy, fork trees;
``experiments/dump_rollout_entropy.py``) and ``entropy_around_tools.png``. Run folders stay under ``--runs-dir``
(ignored by git); a finished run's checkpoints are removed (``--keep-checkpoints`` keeps them), its final model
stays in ``hf_model/``. ``notebooks/arpo_analysis.ipynb`` reads ``--out``.

``--collect-only`` trains nothing and rebuilds ``--out``'s table, figures and README from ``--out/runs``;
``--import-runs DIR`` first copies the suite's finished runs of ``--seeds`` from another runs folder (e.g. made
by another checkout or machine; each keeps its own git SHA and overrides in ``ablation_run.json``).

``--smoke`` (CI): 2 steps, the first seed only, 8 validation prompts, 1 FSDP rank, 4 rollout-dump prompts.
Time on a 2-core CPU: a smoke run ~50 s (~37 s of it start-up), a smoke suite of 3 variants ~4 min (the rollout
dumps ~1 min of it); a default run (6 steps, 32 validation prompts) ~1.5 min, so a suite of 3 variants x 3 seeds
~15 min. With ``--preset smollm2`` (SmolLM2-135M, 8 steps, 200 validation questions
(``synthetic.sizes.val`` in ``configs/pipeline/smollm2.yaml``; the committed SmolLM2 results used 256)) a run takes ~24 min, a
suite of 3 variants x 3 seeds ~3.5 h: run it over several sittings.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from arpo import analysis
from arpo.config import ConfigError
from arpo.pipeline import Preset, overrides_for_stage, stage_paths

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: its sibling module below
from experiments import git_sha  # noqa: E402
from experiments.ablation_results import collect, import_runs  # noqa: E402

logger = logging.getLogger("arpo.ablation")

ARPO = "actor_rollout_ref.rollout.mode=arpo"
ROLLOUT_KEY = "actor_rollout_ref.rollout.arpo"
SMOKE_OVERRIDES = ("trainer.total_training_steps=2", "trainer.test_freq=2", "data.val_max_samples=8",
                   "trainer.n_gpus_per_node=1", "trainer.logger=[console,jsonl]")
SMOKE_DUMP_PROMPTS = 4
#: the study of experiments/premise_holds.py (a task per ambiguity level, the premise probed, a calibrated
#: random-branching control), run through this entry point
PREMISE_HOLDS = "premise_holds"
#: training processes in flight (stopped on Ctrl-C)
_RUNNING: set[subprocess.Popen] = set()
#: set before stop_running looks at _RUNNING, so a run registered after that look stops itself
_STOPPING = threading.Event()
#: files of a finished run copied into the results


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    variants: tuple[Variant, ...]
    baseline: str


#: the baseline of the suites that compare against GRPO, and ARPO as the policy and baseline suites run it
GRPO = Variant("grpo", ("preset=grpo",))
ARPO_PRESET = Variant("arpo", ("preset=arpo_soft",))
#: LoRA as the lora suite trains it (see the module docstring for the learning rate)
LORA_RANK = 16
LORA = (f"actor_rollout_ref.model.lora_rank={LORA_RANK}", f"actor_rollout_ref.model.lora_alpha={2 * LORA_RANK}",
        "actor_rollout_ref.actor.optim.lr=1.0e-4")

SUITES = {s.name: s for s in (
    Suite("advantage", "GRPO with plain sampling vs ARPO with soft and hard advantage", (
        GRPO,
        Variant("arpo_soft", ("preset=arpo_soft",)),
        Variant("arpo_hard", ("preset=arpo_hard",)),
    ), baseline="grpo"),
    Suite("entropy_weight", "ARPO's entropy weight in the branching rule (rule code; 0: forks ignore entropy)",
          tuple(Variant(f"ew_{w}", (ARPO, f"{ROLLOUT_KEY}.branching.rule=code",
                                    f"{ROLLOUT_KEY}.branching.entropy_weight={w}"))
                for w in ("0", "0.2", "0.4")), baseline="ew_0"),
    Suite("branching_rule", "ARPO's branching rule: the released code's vs the paper's", (
        Variant("rule_code", (ARPO, f"{ROLLOUT_KEY}.branching.rule=code")),
        Variant("rule_paper", (ARPO, f"{ROLLOUT_KEY}.branching.rule=paper")),
    ), baseline="rule_code"),
    Suite("policy", "Rollout policy at the same budget: GRPO sampling, ARPO, AEPO (damped consecutive forks), "
                    "Tree-GRPO (tree search, intra + inter-tree advantage)", (
        GRPO,
        ARPO_PRESET,
        Variant("aepo", ("preset=aepo",)),
        Variant("aepo_pre_monitoring", ("preset=aepo", f"{ROLLOUT_KEY}.aepo.pre_monitoring=true")),
        Variant("tree_grpo", ("preset=tree_grpo",)),
    ), baseline="grpo"),
    Suite("baselines", "The paper's RL baselines at the same budget M: GRPO, DAPO (dynamic sampling generates more "
                       "rounds per step: train/num_gen_batches), REINFORCE++, PPO with a critic (GAE), ARPO", (
        GRPO,
        Variant("dapo", ("preset=dapo",)),
        Variant("reinforce_plus_plus", ("preset=reinforce_plus_plus",)),
        Variant("ppo", ("preset=ppo",)),
        ARPO_PRESET,
    ), baseline="grpo"),
    Suite("lora", f"ARPO training every weight vs LoRA adapters (rank {LORA_RANK}, alpha {2 * LORA_RANK}, 10x the "
                  f"learning rate)", (
        ARPO_PRESET,
        Variant(f"arpo_lora{LORA_RANK}", (*ARPO_PRESET.overrides, *LORA)),
    ), baseline="arpo"),
)}


@dataclass(frozen=True)
class Run:
    variant: Variant
    seed: int
    dir: Path
    overrides: tuple[str, ...]

    @property
    def finished(self) -> bool:
        return (self.dir / "summary.json").is_file()


def plan_runs(suite: Suite, seeds: Sequence[int], model_dir: Path, data_dir: Path, runs_dir: Path, smoke: bool,
              extra: Sequence[str], preset: Sequence[str] = ()) -> list[Run]:
    """Every (variant, seed) run of the suite with its full override list, seed-major so that a partial
    sweep already has every variant of the first seeds. Order: the preset's RL sizing, the variant, the run's
    own keys, smoke, then ``extra`` (later keys win)."""
    runs = []
    for seed in seeds:
        for v in suite.variants:
            out = runs_dir / suite.name / v.name / f"seed{seed}"
            overrides = (*preset, *v.overrides, f"actor_rollout_ref.model.path={model_dir}", f"synthetic.out_dir={data_dir}",
                         f"trainer.seed={seed}", f"trainer.experiment_name={suite.name}-{v.name}-seed{seed}",
                         f"trainer.output_dir={out}", *(SMOKE_OVERRIDES if smoke else ()), *extra)
            runs.append(Run(v, seed, out, overrides))
    return runs


def train(run: Run, keep_checkpoints: bool = False) -> bool:
    """Run (or resume) one training run; output goes to ``<run>/ablation.log``; attempts are recorded. A finished
    run's checkpoints are removed unless ``keep_checkpoints``: they only served its resume (its final weights stay
    in ``hf_model/``), and at 1.7 GB a step for a 135M model a sweep's cells would fill the disk."""
    run.dir.mkdir(parents=True, exist_ok=True)
    record_path = run.dir / analysis.RUN_RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {"attempts": []}
    cmd = [sys.executable, "-m", "arpo.main_arpo", *run.overrides]
    start = time.perf_counter()
    with (run.dir / "ablation.log").open("a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _RUNNING.add(proc)
        if _STOPPING.is_set():  # stopped between Popen and the line above: stop_running did not see this run
            proc.terminate()
        try:
            rc = proc.wait()
        finally:
            _RUNNING.discard(proc)
    wall = time.perf_counter() - start
    record["attempts"].append({"returncode": rc, "wall_s": round(wall, 1), "git_sha": git_sha(),
                               "ended": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    record.update(overrides=list(run.overrides), wall_s=round(sum(a["wall_s"] for a in record["attempts"]), 1))
    record_path.write_text(json.dumps(record, indent=2))
    if rc != 0 or not run.finished:
        tail = (run.dir / "ablation.log").read_text(errors="replace").splitlines()[-15:]
        logger.error("%s seed %d failed (exit %d); last lines of %s:\n%s", run.variant.name, run.seed, rc,
                     run.dir / "ablation.log", "\n".join(tail))
        return False
    if not keep_checkpoints:
        shutil.rmtree(run.dir / "checkpoints", ignore_errors=True)
    logger.info("%s seed %d finished in %.0f s", run.variant.name, run.seed, wall)
    return True


def stop_running(grace_s: float = 60.0) -> None:
    """Stop the training runs in flight with SIGTERM: Ctrl-C reaches them too, but not one whose SIGINT is
    ignored (started from a background job or nohup). A run stopped this way resumes from its last checkpoint."""
    _STOPPING.set()
    procs = list(_RUNNING)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()


def dump_rollouts(runs: list[Run], out: Path, data_dir: Path, prompts: int, extra: Sequence[str],
                  log: Path) -> None:
    """Per-token-entropy rollouts of the final model of each variant's first finished seed, all in one
    process (missing dumps only)."""
    jobs, first = [], {}
    for run in runs:
        if run.finished and run.variant.name not in first:
            first[run.variant.name] = run
    for name, run in first.items():
        path = out / "rollouts" / f"{name}.jsonl"
        if not path.is_file():
            # the trained model, whatever model path the extra keys gave the runs
            keys = [k for k in (*run.variant.overrides, *extra) if not k.startswith("actor_rollout_ref.model.path=")]
            jobs.append({"model": str(run.dir / "hf_model"), "out": str(path), "overrides": keys})
    if not jobs or prompts <= 0:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(jobs, f)
    cmd = [sys.executable, str(REPO / "experiments" / "dump_rollout_entropy.py"), "--jobs", f.name,
           "--data", str(data_dir), "--limit", str(prompts)]
    logger.info("dumping rollouts with per-token entropy of %s", ", ".join(first))
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT).returncode
    os.unlink(f.name)
    if rc != 0:
        logger.error("rollout dump failed (exit %d), see %s; the results go without entropy figures", rc, log)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options before ``--``; ``key=value`` overrides for every run after it."""
    argv = list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Keys after -- go to every run (python -m arpo.main_arpo).")
    parser.add_argument("--suite", required=True, choices=sorted(SUITES) + [PREMISE_HOLDS],
                        help=f"{PREMISE_HOLDS}: its own options, see --suite {PREMISE_HOLDS} --help")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=None,
                        help="train only these of the suite's variants (default: all; the baseline is always "
                             "among them, since the table compares against it); results already in --out stay")
    parser.add_argument("--preset", default="tiny",
                        help="pipeline preset (configs/pipeline/<name>.yaml) whose RL overrides every run starts "
                             "from and whose output folder holds the default model and data: tiny | smollm2")
    parser.add_argument("--model-dir", type=Path,
                        help="HF checkpoint the runs start from (default: the preset's cold-start SFT model)")
    parser.add_argument("--data-dir", type=Path,
                        help="synthetic data folder (default: the preset's train/val/test parquet + corpus.jsonl)")
    parser.add_argument("--out", type=Path, help="results folder (default <runs-dir>/<suite>/results, never the "
                                                  "committed ones; give experiments/results/<name> to update those)")
    parser.add_argument("--runs-dir", type=Path,
                        help="where run folders with checkpoints go (not committed; default outputs/ablation/<preset>)")
    parser.add_argument("--dump-prompts", type=int, default=None,
                        help=f"test prompts rolled out with entropy per variant (default 16, --smoke "
                             f"{SMOKE_DUMP_PROMPTS}; 0: none)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (each takes trainer.n_gpus_per_node "
                                                            "ranks + an engine; on a GPU node, one per GPU set)")
    parser.add_argument("--smoke", action="store_true", help="CI: 2 steps, first seed, tiny validation")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep a finished run's checkpoints (default: removed once it finishes; hf_model/ stays)")
    parser.add_argument("--collect-only", action="store_true",
                        help="train nothing: rebuild --out's table, figures and README from the runs in --out/runs")
    parser.add_argument("--import-runs", type=Path, default=None,
                        help="with --collect-only: first copy the suite's finished runs of --seeds from this folder "
                             "(<dir>/<variant>/seed<K>, e.g. another checkout's runs) into --out/runs; their own "
                             "git SHA and settings stay in their ablation_run.json")
    args = parser.parse_args(own)
    bad = [k for k in extra if "=" not in k]
    if bad:
        parser.error(f"after -- give key=value overrides, got {bad}")
    if args.smoke:
        args.seeds = args.seeds[:1]
    suite = SUITES[args.suite]
    names = [v.name for v in suite.variants]
    unknown = sorted(set(args.variants or ()) - set(names))
    if unknown:
        parser.error(f"--variants {' '.join(unknown)}: not in suite {suite.name}; choose from {' '.join(names)}")
    if args.variants is not None and suite.baseline not in args.variants:
        parser.error(f"--variants: include the baseline {suite.baseline} (the table compares every variant with it)")
    if args.dump_prompts is None:
        args.dump_prompts = SMOKE_DUMP_PROMPTS if args.smoke else 16
    try:
        preset = Preset.load(args.preset)
    except ConfigError as e:
        parser.error(str(e))
    paths = stage_paths(REPO / preset.output_dir, preset)
    args.model_dir = args.model_dir or paths["sft_model"]
    args.data_dir = args.data_dir or paths["data"]
    args.preset_overrides = overrides_for_stage("arpo_trainer", list(preset.overrides))
    args.runs_dir = args.runs_dir or REPO / "outputs" / "ablation" / args.preset
    args.out = (args.out or args.runs_dir / args.suite / "results").resolve()
    for key in ("model_dir", "data_dir", "runs_dir"):
        setattr(args, key, getattr(args, key).resolve())
    return args, extra


def collect_only(suite: Suite, args: argparse.Namespace, header: str) -> int:
    """``--collect-only``: import runs if asked, then rebuild the results from ``--out/runs``."""
    if args.import_runs is not None:
        if not args.import_runs.is_dir():
            print(f"error: --import-runs {args.import_runs}: no such directory", file=sys.stderr)
            return 2
        imported = import_runs(suite, args.seeds, args.import_runs.resolve(), args.out)
        logger.info("imported %d run(s): %s", len(imported), ", ".join(imported) or "none")
    if not (args.out / "runs").is_dir():
        print(f"error: {args.out / 'runs'}: no runs to collect (run the suite first, or give --import-runs)",
              file=sys.stderr)
        return 2
    collect(suite, [], args.out, header, args.smoke, args.dump_prompts)
    logger.info("results: %s", args.out / "README.md")
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, a job scheduler) stops cleanly as Ctrl-C does: no orphaned run


def requested_suite(argv: Sequence[str]) -> str | None:
    """The ``--suite`` named before ``--`` (None: none)."""
    own = list(argv)[: list(argv).index("--")] if "--" in argv else list(argv)
    for i, arg in enumerate(own):
        if arg == "--suite" and i + 1 < len(own):
            return own[i + 1]
        if arg.startswith("--suite="):
            return arg.split("=", 1)[1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if requested_suite(argv) == PREMISE_HOLDS:  # its own driver: levels, a probe per level, a calibrated control
        from experiments.premise_holds import main as premise_holds

        return premise_holds(argv)
    args, extra = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    _STOPPING.clear()
    from arpo.runtime.logging_utils import setup_logging

    setup_logging(args.runs_dir / args.suite / "logs", filename="ablation.log")
    suite = SUITES[args.suite]
    header = (f"Command: `python experiments/ablation.py {shlex.join(argv)}` — git SHA: `{git_sha()}` — "
              f"{datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}")
    if args.collect_only:
        return collect_only(suite, args, header)
    for path, what in ((args.model_dir, "--model-dir"), (args.data_dir, "--data-dir")):
        if not path.is_dir():
            raise SystemExit(f"{what} {path}: no such directory (`python -m arpo.pipeline --preset {args.preset} "
                             f"--skip-rl` builds the preset's SFT model and data)")
    runs = plan_runs(suite, args.seeds, args.model_dir, args.data_dir, args.runs_dir, args.smoke, extra,
                     args.preset_overrides)
    if args.variants is not None:
        runs = [r for r in runs if r.variant.name in args.variants]
    for run in runs:
        if run.finished:
            changed = _changed_overrides(run)
            if changed:
                # another setting's results would be mixed into this table
                print(f"error: {run.dir} finished with other overrides ({changed}); give --runs-dir another "
                      f"folder or delete that run to rerun it", file=sys.stderr)
                return 2
            logger.info("%s seed %d: finished earlier, skipped", run.variant.name, run.seed)
    pending = [r for r in runs if not r.finished]
    failed = []
    # Runs are independent processes (each with its own Ray cluster); on a small machine most of a short run is
    # start-up latency, so a few at once overlap it.
    pool = ThreadPoolExecutor(max_workers=args.jobs)
    try:
        with tqdm(total=len(runs), initial=len(runs) - len(pending), desc=f"ablation {suite.name}",
                  unit="run") as bar:
            futures = {pool.submit(train, run, args.keep_checkpoints): run for run in pending}
            for future in as_completed(futures):
                if not future.result():
                    failed.append(futures[future])
                bar.update(1)
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        stop_running()
        logger.error("interrupted; rerun the same command: finished runs are skipped, the others resume")
        return 130
    pool.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    dump_rollouts(runs, args.out, args.data_dir, args.dump_prompts, extra,
                  args.runs_dir / args.suite / "logs" / "dump_rollouts.log")
    if any(r.finished for r in runs):
        collect(suite, runs, args.out, header, args.smoke, args.dump_prompts)
        logger.info("results: %s", args.out / "README.md")
    if failed:
        logger.error("%d run(s) failed: %s; rerun the same command to resume them", len(failed),
                     ", ".join(f"{r.variant.name}/seed{r.seed}" for r in failed))
        return 1
    return 0


def _changed_overrides(run: Run) -> list[str]:
    """The keys in which a finished run's recorded overrides differ from this invocation's (none: same run)."""
    record = run.dir / analysis.RUN_RECORD
    before = json.loads(record.read_text()).get("overrides") if record.is_file() else None
    return [] if before is None else sorted(set(before) ^ set(run.overrides))


if __name__ == "__main__":
    sys.exit(main())
