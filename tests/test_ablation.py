"""experiments/ablation.py: how each suite's runs are built (fast: composed against the real configs), and the
`advantage` suite end to end in smoke mode (slow: real training runs, rollout dumps, results, rerun skips)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arpo.config import REPO_ROOT, load_config
from experiments import ablation
from experiments.ablation_results import FINAL_CORRECTNESS
from tests.conftest import worker_ray_env
from tests.test_main_arpo import check_training_run

#: the smoke ablation's results, shared with tests/test_notebook.py (each module gets its own fixture, one run)
_SMOKE: dict[str, Path] = {}


def run_smoke_ablation(sft_model_dir: Path, root: Path) -> dict[str, Path]:
    """Run the advantage suite in smoke mode once per session; returns its results and runs folders."""
    if not _SMOKE:
        out, runs = root / "results" / "advantage", root / "runs"
        start = time.perf_counter()
        r = _ablation(sft_model_dir, out, runs)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        _SMOKE.update(out=out, runs=runs, seconds=time.perf_counter() - start)
    return _SMOKE


def _ablation(sft_model_dir: Path, out: Path, runs: Path, *extra: str) -> subprocess.CompletedProcess:
    data = sft_model_dir.parents[1] / "data" / "synthetic"
    # two of the three variants (CI time): the baseline and ARPO with hard advantage (ARPO's rollout and the hard
    # advantage both exercised; soft vs hard differ in the trainer's advantage step, tested in tests/trainer);
    # --jobs 2: their start-ups overlap (most of a 2-step run)
    cmd = [sys.executable, str(REPO_ROOT / "experiments" / "ablation.py"), "--suite", "advantage", "--smoke",
           "--variants", "grpo", "arpo_hard", "--jobs", "2", "--seeds", "3", "4", "--model-dir", str(sft_model_dir), "--data-dir", str(data),
           "--out", str(out), "--runs-dir", str(runs), *extra]
    # the runs join this pytest worker's Ray cluster instead of starting one each, one at a time
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                          env={**worker_ray_env(), "TQDM_DISABLE": "1"})


@pytest.fixture(scope="session")
def smoke_ablation(sft_model_dir, tmp_path_factory) -> dict[str, Path]:
    return run_smoke_ablation(sft_model_dir, tmp_path_factory.mktemp("ablation"))


# ---- argument building (fast) ------------------------------------------------------------------------------
def test_seeds_and_overrides_are_separated_by_double_dash():
    # the shell script this replaced passed the seeds to every run as overrides too
    args, extra = ablation.parse_args(["--suite", "advantage", "--seeds", "0", "5", "--",
                                       "trainer.total_training_steps=3", "actor_rollout_ref.rollout.n=8"])
    assert args.seeds == [0, 5] and extra == ["trainer.total_training_steps=3", "actor_rollout_ref.rollout.n=8"]
    # the default results folder is beside the runs, never a committed one
    assert args.out == REPO_ROOT / "outputs/ablation/tiny/advantage/results" and args.dump_prompts == 16
    smoke, _ = ablation.parse_args(["--suite", "advantage", "--seeds", "2", "3", "--smoke"])
    assert smoke.seeds == [2] and smoke.dump_prompts == ablation.SMOKE_DUMP_PROMPTS
    with pytest.raises(SystemExit):
        ablation.parse_args(["--suite", "advantage", "--", "not-an-override"])


def test_variants_pick_part_of_a_suite_and_keep_its_baseline(capsys):
    args, _ = ablation.parse_args(["--suite", "policy", "--variants", "grpo", "tree_grpo"])
    assert args.variants == ["grpo", "tree_grpo"]
    assert ablation.parse_args(["--suite", "policy"])[0].variants is None  # default: every variant
    for bad, why in ((["arpo_soft"], "--variants arpo_soft: not in suite policy; choose from grpo arpo aepo"),
                     (["aepo"], "include the baseline grpo")):
        with pytest.raises(SystemExit):
            ablation.parse_args(["--suite", "policy", "--variants", *bad])
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("suite, expect", [
    ("advantage", {"grpo": ("single", "soft", 0.2, "code"), "arpo_soft": ("arpo", "soft", 0.2, "code"),
                   "arpo_hard": ("arpo", "hard", 0.2, "code")}),
    ("entropy_weight", {"ew_0": ("arpo", "soft", 0.0, "code"), "ew_0.2": ("arpo", "soft", 0.2, "code"),
                        "ew_0.4": ("arpo", "soft", 0.4, "code")}),
    ("branching_rule", {"rule_code": ("arpo", "soft", 0.2, "code"), "rule_paper": ("arpo", "soft", 0.2, "paper")}),
    ("policy", {"grpo": ("single", "soft", 0.2, "code"), "arpo": ("arpo", "soft", 0.2, "code"),
                "aepo": ("arpo", "soft", 0.2, "code"), "aepo_pre_monitoring": ("arpo", "soft", 0.2, "code"),
                "tree_grpo": ("arpo", "soft", 0.2, "code")}),
    ("baselines", {"grpo": ("single", "soft", 0.2, "code"), "dapo": ("single", "soft", 0.2, "code"),
                   "reinforce_plus_plus": ("single", "soft", 0.2, "code"), "ppo": ("single", "soft", 0.2, "code"),
                   "arpo": ("arpo", "soft", 0.2, "code")}),
    ("lora", {"arpo": ("arpo", "soft", 0.2, "code"), "arpo_lora16": ("arpo", "soft", 0.2, "code")}),
])
def test_every_variant_composes_to_the_intended_config(suite, expect, tmp_path):
    s = ablation.SUITES[suite]
    assert s.baseline in expect
    runs = ablation.plan_runs(s, [0, 7], tmp_path / "model", tmp_path / "data", tmp_path / "runs", smoke=False,
                              extra=["actor_rollout_ref.rollout.n=6"])
    assert [(r.variant.name, r.seed) for r in runs] == [(v, seed) for seed in (0, 7) for v in expect]
    budgets = set()
    for run in runs:
        cfg = load_config("arpo_trainer", list(run.overrides))  # unknown keys would fail here
        r = cfg.actor_rollout_ref.rollout
        assert (r.mode, cfg.algorithm.advantage_mode, r.arpo.branching.entropy_weight, r.arpo.branching.rule) == expect[run.variant.name]
        assert r.arpo.policy == {"aepo_pre_monitoring": "aepo"}.get(
            run.variant.name, run.variant.name if run.variant.name in ("aepo", "tree_grpo") else "arpo")
        assert r.arpo.aepo.pre_monitoring == (run.variant.name == "aepo_pre_monitoring")
        assert cfg.algorithm.adv_estimator == {"tree_grpo": "tree_grpo", "reinforce_plus_plus": "reinforce_plus_plus",
                                               "ppo": "gae"}.get(run.variant.name, "grpo")
        assert cfg.algorithm.filter_groups.enable == cfg.reward.overlong_buffer.enable == (run.variant.name == "dapo")
        m = cfg.actor_rollout_ref.model
        # LoRA only in the lora variant: rank 16, alpha 2 x rank, 10x the configs' learning rate
        assert (m.lora_rank, m.lora_alpha, cfg.actor_rollout_ref.actor.optim.lr) == (
            (16, 32, 1e-4) if run.variant.name == "arpo_lora16" else (0, 16, 1e-5))
        assert cfg.trainer.seed == run.seed
        assert Path(cfg.trainer.output_dir) == tmp_path / "runs" / suite / run.variant.name / f"seed{run.seed}"
        assert cfg.trainer.default_local_dir == f"{cfg.trainer.output_dir}/checkpoints"  # resumes from there
        assert cfg.synthetic.out_dir == str(tmp_path / "data")
        budgets.add((r.n, r.arpo.n, cfg.data.train_batch_size, cfg.trainer.total_training_steps))
    assert budgets == {(6, 6, 4, 6)}  # equal budget M (the override after -- wins), data and steps


def test_smoke_overrides_shrink_the_run(tmp_path):
    (run,) = ablation.plan_runs(ablation.SUITES["branching_rule"], [0], tmp_path, tmp_path, tmp_path, smoke=True,
                                extra=["data.val_max_samples=4"])[:1]
    cfg = load_config("arpo_trainer", list(run.overrides))
    assert cfg.trainer.total_training_steps == 2 and cfg.trainer.n_gpus_per_node == 1
    assert cfg.data.val_max_samples == 4  # the caller's override comes after the smoke ones


def test_a_preset_sizes_every_run_and_names_its_model_and_data(tmp_path):
    args, extra = ablation.parse_args(["--suite", "advantage", "--preset", "smollm2", "--",
                                       "trainer.total_training_steps=3"])
    assert args.model_dir == REPO_ROOT / "outputs/smollm2_arpo/models/smollm2-sft"
    assert args.data_dir == REPO_ROOT / "outputs/smollm2_arpo/data/synthetic"
    assert "synthetic=hard" in args.preset_overrides
    assert not any(o.startswith("sft.") for o in args.preset_overrides)  # only the RL stage's keys
    grpo, soft, _ = ablation.plan_runs(ablation.SUITES["advantage"], [5], args.model_dir, args.data_dir, tmp_path,
                                       smoke=False, extra=extra, preset=args.preset_overrides)
    for run in (grpo, soft):
        cfg = load_config("arpo_trainer", list(run.overrides))
        assert cfg.actor_rollout_ref.rollout.max_model_len == 768  # the preset's sizing
        assert cfg.trainer.total_training_steps == 3               # the key after -- wins over the preset's 14
        assert cfg.trainer.experiment_name == f"advantage-{run.variant.name}-seed5"  # the run's name, not the preset's
    assert load_config("arpo_trainer", list(grpo.overrides)).actor_rollout_ref.rollout.mode == "single"
    # each preset's runs and results in their own folders: a tiny suite never picks up SmolLM2 runs
    assert args.runs_dir == REPO_ROOT / "outputs/ablation/smollm2"
    assert args.out == REPO_ROOT / "outputs/ablation/smollm2/advantage/results"
    tiny, _ = ablation.parse_args(["--suite", "advantage"])
    assert tiny.runs_dir == REPO_ROOT / "outputs/ablation/tiny"
    assert tiny.out == REPO_ROOT / "outputs/ablation/tiny/advantage/results"
    assert not any(a.out.is_relative_to(REPO_ROOT / "experiments") for a in (args, tiny))
    with pytest.raises(SystemExit):
        ablation.parse_args(["--suite", "advantage", "--preset", "nope"])


def test_lora_suite_on_the_smollm2_preset_passes_the_start_up_checks_of_the_trainer(tmp_path):
    """The preset's learning rate (before the variant) gives way to the LoRA variant's; its keys pass the actor's
    start-up validation."""
    from arpo.trainer.actor_config import validate_actor_config

    args, extra = ablation.parse_args(["--suite", "lora", "--preset", "smollm2"])
    full, lora = ablation.plan_runs(ablation.SUITES["lora"], [0], args.model_dir, args.data_dir, tmp_path,
                                    smoke=False, extra=extra, preset=args.preset_overrides)
    for run, (rank, lr) in ((full, (0, 1e-5)), (lora, (16, 1e-4))):
        cfg = load_config("arpo_trainer", list(run.overrides))
        validate_actor_config(cfg)
        assert (cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.actor.optim.lr) == (rank, lr)


# ---- the advantage suite end to end (slow) -------------------------------------------------------------------
@pytest.mark.slow
def test_smoke_advantage_suite_writes_results_and_skips_finished_runs(smoke_ablation, sft_model_dir):
    out, runs = smoke_ablation["out"], smoke_ablation["runs"]
    variants = ["grpo", "arpo_hard"]
    readme = (out / "README.md").read_text()
    table = (out / "table.md").read_text()
    for text in (readme, table):
        assert ("python experiments/ablation.py --suite advantage --smoke --variants grpo arpo_hard --jobs 2 "
                "--seeds 3 4") in text
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
        assert f"git SHA: `{sha.strip()}" in text
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| Variant")]
    assert [r.split("|")[1].strip() for r in rows] == ["grpo (baseline)", "arpo_hard"]
    assert not (out / "runs" / "arpo_soft").exists() and not (runs / "advantage" / "arpo_soft").exists()
    for variant in variants:  # smoke: only the first seed given
        run = out / "runs" / variant / "seed3"
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [0, 1, 2]
        assert json.loads((run / "summary.json").read_text())["final_validation"]
        assert not (out / "runs" / variant / "seed4").exists() and not (runs / "advantage" / variant / "seed4").exists()
        # a finished run's checkpoints (only its resume needed them) are gone; its HF export stays, out of --out
        check_training_run(runs / "advantage" / variant / "seed3", steps=2, trajectories=4 * 4, checkpoint=False)
        dump = [json.loads(line) for line in (out / "rollouts" / f"{variant}.jsonl").read_text().splitlines()]
        assert len(dump) == ablation.SMOKE_DUMP_PROMPTS * 4 and all("token_entropy" in r for r in dump)
    # the dump's engine is shut down explicitly: no AsyncLLM.__del__ traceback at interpreter exit
    dump_log = (runs / "advantage" / "logs" / "dump_rollouts.log").read_text()
    assert '"rows": ' in dump_log and "Traceback" not in dump_log
    for png in ("reward_curves.png", "entropy_around_tools.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in readme
    assert "forks / group" in readme
    assert "Gain over the starting model" in readme and "| grpo | 3 |" in readme  # paired gain per run
    # each variant against the baseline at the same seed, paired by validation question
    assert "Against `grpo` at the same seed" in readme and "| arpo_hard | 3 |" in readme
    correct = json.loads((out / "runs" / "grpo" / "seed3" / FINAL_CORRECTNESS).read_text())
    assert len(correct) == 8 and set(correct.values()) <= {0.0, 1.0}  # smoke: 8 validation questions

    # a second invocation finds every run finished: nothing is trained or dumped again
    records = {v: (runs / "advantage" / v / "seed3" / "ablation_run.json").read_text() for v in variants}
    dumps = {v: (out / "rollouts" / f"{v}.jsonl").stat().st_mtime_ns for v in variants}
    start = time.perf_counter()
    again = _ablation(sft_model_dir, out, runs)
    assert again.returncode == 0, again.stderr[-4000:]
    assert time.perf_counter() - start < 0.25 * smoke_ablation["seconds"]
    assert again.stderr.count("finished earlier, skipped") == 2
    assert {v: (runs / "advantage" / v / "seed3" / "ablation_run.json").read_text() for v in variants} == records
    assert {v: (out / "rollouts" / f"{v}.jsonl").stat().st_mtime_ns for v in variants} == dumps
    assert (out / "table.md").read_text().split("\n\n", 1)[1] == table.split("\n\n", 1)[1]

    # the same runs asked for with another setting: an error, not old results under a new label
    changed = _ablation(sft_model_dir, out, runs, "--", "actor_rollout_ref.actor.optim.lr=3e-6")
    assert changed.returncode == 2 and "finished with other overrides" in changed.stderr
    assert "actor_rollout_ref.actor.optim.lr=3e-6" in changed.stderr


SIGTERM_SCRIPT = r"""
import subprocess, sys
from experiments import ablation
from experiments.ablation_results import FINAL_CORRECTNESS
from tests.test_main_arpo import check_training_run

def train(run, keep_checkpoints=False):  # a training run that would take a minute
    proc = subprocess.Popen(["sleep", "60"])
    ablation._RUNNING.add(proc)  # before the pid is announced: the test's SIGTERM must find the run registered
    print(proc.pid, flush=True)
    try:
        return proc.wait() == 0
    finally:
        ablation._RUNNING.discard(proc)

ablation.train = train
sys.exit(ablation.main(sys.argv[1:]))
"""


def test_sigterm_stops_the_runs_in_flight_instead_of_orphaning_them(tmp_path):
    # `kill <ablation pid>` (or a scheduler's SIGTERM) must not leave a training run running on its own
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(), data.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, "--suite", "advantage", "--smoke", "--seeds", "0",
                             "--model-dir", str(model), "--data-dir", str(data), "--out", str(tmp_path / "out"),
                             "--runs-dir", str(tmp_path / "runs")], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TQDM_DISABLE": "1",
                                                                    "PYTHONPATH": str(REPO_ROOT)})
    child = int(proc.stdout.readline())
    proc.terminate()
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        time.sleep(0.05)
    state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}").exists() else "gone"
    assert state in ("gone", "Z")


def test_collect_only_imports_runs_from_another_checkout_and_rebuilds_the_results(tmp_path):
    """Seeds made elsewhere (another checkout or machine) join a results folder without retraining: the committed
    SmolLM2 seed-1 runs, laid out as a runs folder, are imported next to the seed-0 ones and the table is rebuilt."""
    committed = REPO_ROOT / "experiments" / "results" / "smollm2_advantage" / "runs"
    out, source = tmp_path / "out", tmp_path / "other_checkout"
    for variant in ("grpo", "arpo_soft", "arpo_hard"):
        (out / "runs" / variant).mkdir(parents=True)
        shutil.copytree(committed / variant / "seed0", out / "runs" / variant / "seed0")
        run = source / variant / "seed1"
        (run / "logs").mkdir(parents=True)
        (run / "validation").mkdir()
        shutil.copyfile(committed / variant / "seed1" / "metrics.jsonl", run / "logs" / "metrics.jsonl")
        for name in ("summary.json", "ablation_run.json"):
            shutil.copyfile(committed / variant / "seed1" / name, run / name)
        acc = json.loads((committed / variant / "seed1" / FINAL_CORRECTNESS).read_text())
        (run / "validation" / "step_8.jsonl").write_text(
            "".join(json.dumps({"prompt_index": int(i), "acc": a}) + "\n" for i, a in acc.items()))
    args = ["--preset", "smollm2", "--suite", "advantage", "--seeds", "1", "--out", str(out),
            "--runs-dir", str(tmp_path / "runs"), "--dump-prompts", "0", "--collect-only"]
    assert ablation.main(args + ["--import-runs", str(tmp_path / "missing")]) == 2
    assert ablation.main(args + ["--import-runs", str(source)]) == 0
    table = (out / "table.md").read_text()
    assert "| grpo (baseline) | 2 | 76.8 ± 6.9 |" in table and "| arpo_soft | 2 | 78.7 ± 7.5 |" in table
    for variant in ("grpo", "arpo_soft", "arpo_hard"):
        assert json.loads((out / "runs" / variant / "seed1" / FINAL_CORRECTNESS).read_text()) == \
            json.loads((committed / variant / "seed1" / FINAL_CORRECTNESS).read_text())
    readme = (out / "README.md").read_text()
    assert "--collect-only" in readme and "| arpo_soft | all | 0.768 → 0.787 | +0.020 [-0.004, +0.045] | 512 |" in readme
    assert (out / "reward_curves.png").read_bytes()[:4] == b"\x89PNG"
