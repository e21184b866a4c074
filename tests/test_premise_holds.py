"""experiments/premise_holds.py: the methods compose to the intended configs at equal budget, the random-branching
control forks where a coin says (not where entropy rose) at ARPO's own rate, and the suite's smoke runs end to end
(real SFT model cut, real vLLM, Ray and FSDP2, the real probe) into cells.csv, premise.csv and pooled.csv."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arpo.config import load_config
from arpo.testing.scripted_engine import ScriptPolicy
from experiments import premise_holds
from experiments.ablation import ROLLOUT_KEY
from tests.conftest import worker_ray_env
from tests.rollout.rollout_helpers import rollout, rows

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_methods_compose_at_equal_budget_and_differ_only_in_the_fork_decision(tmp_path):
    args, extra = premise_holds.parse_args(["--suite", "premise_holds", "--seeds", "0", "4"])
    _, _, rl = premise_holds.preset_overrides()
    seen = {}
    for method in ("grpo", "arpo", "random", "arpo_hard"):
        for run in premise_holds.plan_cells(args, 2, method, tmp_path / "sft", tmp_path / "data", rl, extra,
                                            0.62 if method == "random" else None):
            cfg = load_config("arpo_trainer", list(run.overrides))
            r, b = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.rollout.arpo.branching
            assert Path(cfg.trainer.output_dir) == args.runs_dir / "level2" / method / f"seed{run.seed}"
            assert cfg.synthetic.out_dir == str(tmp_path / "data") and cfg.trainer.seed == run.seed
            seen[method] = (r.mode, cfg.algorithm.advantage_mode, b.rule, b.timing, b.entropy_weight,
                            b.branch_probability)
            # equal budget: M, N, prompts, steps and learning rate are the preset's in every method
            assert (r.n, r.arpo.initial_rollouts, cfg.data.train_batch_size, cfg.trainer.total_training_steps,
                    cfg.actor_rollout_ref.actor.optim.lr) == (8, 4, 8, 8, 1e-5)
    assert seen["grpo"][:2] == ("single", "soft")
    assert seen["arpo"] == ("arpo", "soft", "paper", "paper", 0.2, 0.5)
    assert seen["random"] == ("arpo", "soft", "code", "paper", 0.0, 0.62)
    assert seen["arpo_hard"][:4] == ("arpo", "hard", "paper", "paper")


def test_random_needs_arpo_and_smoke_takes_one_seed():
    with pytest.raises(SystemExit):
        premise_holds.parse_args(["--methods", "grpo", "random"])
    args, _ = premise_holds.parse_args(["--smoke", "--seeds", "3", "4"])
    assert args.seeds == [3] and args.probe_prompts == premise_holds.SMOKE_PROBE_PROMPTS


def _rollout_cfg(method: str, **extra) -> dict:
    """A method's fork keys as the scripted rollout's config (the study's own definitions)."""
    prefix = f"{ROLLOUT_KEY}."
    keys = dict(k[len(prefix):].split("=", 1) for k in premise_holds.METHODS[method] if k.startswith(prefix))
    cfg = {"n": 8, "initial_rollouts": 4, "sampling.max_response_length": 300, "return_entropy": True,
           "entropy.window": 8, "tools.call_limit": 2, **extra}
    for key, value in keys.items():
        cfg[key] = float(value) if key.endswith(("weight", "probability")) else value
    return cfg


#: the same tokens under both (the scripted engine draws entropy gaps after the tokens): flat right after each
#: tool result, or no rise there at all
RISES, FLAT = (ScriptPolicy(call_prob=0.9, call_decay=0.0),
               ScriptPolicy(call_prob=0.9, call_decay=0.0, high_entropy_gap=(2.5, 7.0)))
#: a small rise after results: ARPO's rule forks at some of them (about 4 in 5)
MIXED = ScriptPolicy(call_prob=0.9, call_decay=0.0, high_entropy_gap=(2.3, 7.0))


def _forks(batch) -> list[tuple[int, int, int]]:
    return sorted((r["group"], r["parent"], r["bpos"]) for r in rows(batch) if r["kind"] == "branch")


def test_random_control_forks_where_a_coin_says_not_where_entropy_rose():
    control = _rollout_cfg("random", **{"branching.branch_probability": 0.5})
    for seed in range(3):
        a, _, _ = rollout(control, RISES, n_prompts=6, seed=seed)
        b, _, _ = rollout(control, FLAT, n_prompts=6, seed=seed)
        assert [r["ids"] for r in rows(a)] == [r["ids"] for r in rows(b)]  # same tokens, other entropies
        assert _forks(a) == _forks(b) and _forks(a)
    # ARPO's paper rule does follow the entropy: it forks after the rising results and not after the flat ones
    arpo = _rollout_cfg("arpo")
    rising, _, _ = rollout(arpo, RISES, n_prompts=6, seed=0)
    flat, _, _ = rollout(arpo, FLAT, n_prompts=6, seed=0)
    assert _forks(rising) != _forks(flat)
    assert rising.meta["metrics"]["rollout/branch_wants"] > flat.meta["metrics"]["rollout/branch_wants"]


def test_random_control_at_arpos_rate_makes_as_many_forks():
    wants = {"arpo": 0.0, "random": 0.0}
    points = {"arpo": 0.0, "random": 0.0}
    rate = None
    for method in ("arpo", "random"):
        cfg = _rollout_cfg(method, **({"branching.branch_probability": rate} if method == "random" else {}))
        for seed in range(4):
            batch, _, _ = rollout(cfg, MIXED, n_prompts=8, seed=seed)
            m = batch.meta["metrics"]
            wants[method] += m["rollout/branch_wants"]
            points[method] += m["rollout/branch_points"]
        rate = wants["arpo"] / points["arpo"]
    assert 0.2 < rate < 1.0 and points["random"] > 100
    q = wants["random"] / points["random"]
    sd = (rate * (1 - rate) / points["random"]) ** 0.5
    assert abs(q - rate) < 4 * sd


def _write_cell(out: Path, level: int, method: str, seed: int, final: dict, wants: float, points: float) -> None:
    cell = premise_holds.cell_dest(out, level, method, seed)
    cell.mkdir(parents=True)
    gain = {"before": 0.5, "after": sum(final.values()) / len(final), "gain": 0.1, "low": 0.0, "high": 0.2,
            "n": len(final)}
    (cell / "summary.json").write_text(json.dumps({"validation_gain": {"acc": gain}}))
    (cell / "ablation_run.json").write_text(json.dumps({"overrides": ["actor_rollout_ref.rollout.n=8"],
                                                        "attempts": [{"git_sha": "abc"}]}))
    (cell / "final_validation_acc.json").write_text(json.dumps({str(k): v for k, v in final.items()}))
    step = {"step": 1, "rollout/trajectories": 64.0, "rollout/branch_wants": wants, "rollout/branch_points": points,
            "rollout/tool_calls/total": 128.0, "rollout/tokens/generated": 6400.0, "rollout/branches": 16.0}
    (cell / "metrics.jsonl").write_text(json.dumps(step) + "\n")


def test_collect_pools_paired_answers_and_takes_arpos_fork_rate(tmp_path):
    from experiments.premise_holds_results import collect, fork_rate

    out = tmp_path / "results"
    assert fork_rate(out, 2) is None
    for seed in (0, 1):
        _write_cell(out, 2, "grpo", seed, {q: float(q % 2) for q in range(10)}, 0, 0)
        _write_cell(out, 2, "arpo", seed, {q: 1.0 for q in range(10)}, 30.0, 40.0)
    assert fork_rate(out, 2) == 0.75
    _write_cell(out, 3, "arpo", 0, {0: 1.0}, 0.0, 0.0)
    assert fork_rate(out, 3) == 0.0  # no decision taken: the control forks as little
    collect(out, "header", smoke=False)
    cells = list(csv.DictReader((out / "cells.csv").open()))
    assert {(c["method"], c["level"], c["seed"]) for c in cells} == \
        {(m, "2", s) for m in ("grpo", "arpo") for s in ("0", "1")} | {("arpo", "3", "0")}
    # per question per step: 64 trajectories / M 8 = 8 questions
    assert {float(c["tool_calls"]) for c in cells} == {16.0} and {float(c["tokens"]) for c in cells} == {800.0}
    assert {float(c["forks"]) for c in cells} == {2.0}
    (pooled,) = list(csv.DictReader((out / "pooled.csv").open()))
    assert pooled["comparison"] == "arpo - grpo" and float(pooled["diff"]) == 0.5 and pooled["n"] == "20"
    readme = (out / "README.md").read_text()
    assert "arpo - grpo +0.500" in readme  # the verdict line
    # one format per column: accuracies unsigned, gains and their bounds signed, whatever their size
    row = next(line for line in readme.splitlines() if line.startswith("| grpo | 2 | 0 |")).split(" | ")
    assert all(re.fullmatch(r"\d\.\d{3}", v) for v in row[3:5]), row  # before, after
    assert all(re.fullmatch(r"[+-]\d\.\d{3}", v) for v in row[5:8]), row  # gain and its interval


@pytest.mark.slow
def test_smoke_suite_runs_every_method_into_the_tables_and_skips_finished_cells(smollm2_truncated_dir, tmp_path):
    out, runs = tmp_path / "results", tmp_path / "runs"
    # GRPO's cell is the ablation smoke's code path (tests/test_ablation.py): the two branching methods only here
    cmd = [sys.executable, str(REPO_ROOT / "experiments" / "ablation.py"), "--suite", "premise_holds", "--smoke",
           "--levels", "2", "--methods", "arpo", "random", "--jobs", "2", "--model-dir", str(smollm2_truncated_dir),
           "--out", str(out), "--runs-dir", str(runs)]
    env = {**worker_ray_env(), "TQDM_DISABLE": "1"}  # the cells join this pytest worker's Ray cluster
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    cells = list(csv.DictReader((out / "cells.csv").open()))
    assert sorted(c["method"] for c in cells) == ["arpo", "random"]
    assert all(c["level"] == "2" and c["seed"] == "0" and c["n"] == "8" for c in cells)
    by = {c["method"]: c for c in cells}
    assert float(by["arpo"]["tool_calls"]) >= 0 and float(by["random"]["tool_calls"]) >= 0
    pooled = {r["comparison"] for r in csv.DictReader((out / "pooled.csv").open())}
    assert pooled == {"arpo - random"}
    # the control ran at ARPO's measured rate
    record = json.loads((premise_holds.cell_dest(out, 2, "random", 0) / "ablation_run.json").read_text())
    rate = premise_holds.fork_rate(out, 2)
    assert f"{ROLLOUT_KEY}.branching.branch_probability={rate}" in record["overrides"]
    (premise,) = list(csv.DictReader((out / "premise.csv").open()))
    assert premise["level"] == "2" and int(premise["trajectories"]) == premise_holds.SMOKE_PROBE_PROMPTS
    assert (out / "probe" / "level2.png").is_file() and (out / "cells.png").is_file()
    assert str(REPO_ROOT) not in (out / "README.md").read_text()
    # a rerun finds every cell finished and the probe done: it only collects
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and "main_arpo" not in again.stderr
    # another machine continuing from the results alone (no run folders): the cells there are not run again
    shutil.rmtree(runs / "level2")
    again = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0 and not (runs / "level2").exists()
    assert len(list(csv.DictReader((out / "cells.csv").open()))) == 2


def test_fork_placement_counts_forks_by_the_result_they_follow(tmp_path):
    from experiments.premise_holds_results import fork_placement

    search = {"tool": "search", "start": 5, "end": 10, "delta_entropy": 0.01}
    python = {"tool": "python", "start": 20, "end": 24, "delta_entropy": -0.002}
    rows = [{"rollout_kind": "initial", "branch_pos": 0, "tool_calls": [search, python]},
            # a fork after the search result: its own decision is the one after its python result
            {"rollout_kind": "branch", "branch_pos": 10, "tool_calls": [search, {**python, "delta_entropy": 0.003}]}]
    (tmp_path / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert fork_placement(tmp_path) == {"search": {"forks": 1, "decisions": 1, "rising": 1},
                                        "python": {"forks": 0, "decisions": 2, "rising": 1}}
