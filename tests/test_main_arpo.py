"""The trainer entry point: start-up validation and the REINFORCE++ and Tree-GRPO presets on the trainer's
rollout and advantage path (fast, in process), and real end-to-end runs (slow: real vLLM in a Ray actor, real
FSDP2 workers on gloo, real tools, real rewards): the DAPO preset on a Ray cluster started beforehand
(``ray_init.address``) and AEPO. The SIGKILL-and-resume run (PPO) is tests/test_main_arpo_resume.py; soft and
hard advantage train end to end in the ablation smoke (tests/test_ablation.py); both check their runs with
``check_training_run``."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from arpo.config import REPO_ROOT
from arpo.reference.metrics_glossary import unknown_metrics
from tests.conftest import worker_ray_env


def trainer_cmd(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "arpo.main_arpo", *overrides]


def run_env(join_ray: bool = False) -> dict[str, str]:
    """A training subprocess's environment; ``join_ray``: the run joins this pytest worker's Ray cluster
    (``RAY_ADDRESS``) instead of starting its own (10-40 s on 2 busy cores)."""
    return {**(worker_ray_env() if join_ray else os.environ), "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}


def _bad(model: Path, data: Path, *overrides: str) -> str:
    r = subprocess.run(trainer_cmd(f"actor_rollout_ref.model.path={model}", f"synthetic.out_dir={data}", *overrides),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=run_env())
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def start_up_config_error(model: Path, data: Path, *overrides: str) -> str:
    """The one-line ConfigError of the training config with ``overrides`` (start-up validation, in-process; the
    CLI's form is test_missing_model_path_names_the_key)."""
    from arpo.config import ConfigError, load_config
    from arpo.main_arpo import validate_config

    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={model}", f"synthetic.out_dir={data}",
                                       *overrides])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("overrides, expect", [
    (["actor_rollout_ref.rollout.arpo.initial_rollouts=8"], "initial_rollouts"),
    (["algorithm.adv_estimator=ppo_magic"], "adv_estimator"),
    (["data.train_batch_size=3"], "ppo_mini_batch_size"),
    (["actor_rollout_ref.rollout.mode=beam"], "actor_rollout_ref.rollout.mode"),
    (["algorithm.advantage_mode=medium"], "advantage_mode"),
    (["ray_init.num_cpus=1"], "ray_init.num_cpus"),
    (["actor_rollout_ref.rollout.arpo.mode=single"], "set actor_rollout_ref.rollout.mode=single instead"),
    (["preset=ppo", "critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size=3 must divide data.train_batch_size"),
    (["preset=ppo", "critic.cliprange_value=0"], "critic.cliprange_value must be a number in (0.0"),
    (["preset=ppo", "critic.optim.lr=0"], "critic.optim.lr must be a number in (0.0, 1.0]"),
    (["preset=ppo", "trainer.critic_warmup=-1"], "trainer.critic_warmup must be an integer >= 0"),
    (["preset=ppo", "critic.model.path=/nonexistent"], "critic.model.path=/nonexistent is not an HF model directory"),
    (["preset=ppo", "ray_init.num_cpus=4"], "actor + critic, + 1 per engine replica"),
    (["actor_rollout_ref.rollout.arpo.aepo.pre_monitoring=true"],
     "aepo.pre_monitoring=True: true only with actor_rollout_ref.rollout.arpo.policy=aepo"),
    (["preset=aepo", "actor_rollout_ref.rollout.arpo.aepo.beta=0"], "aepo.beta=0: use a number > 0"),
    (["actor_rollout_ref.rollout.val_kwargs.temperature=0.6"], "actor_rollout_ref.rollout.val_kwargs.temperature=0.6 "
     "is ignored with actor_rollout_ref.rollout.val_kwargs.do_sample=false (greedy): set actor_rollout_ref.rollout."
     "val_kwargs.do_sample=true"),
    (["data.val_max_samples=0"], "data.val_max_samples must be -1 (all) or an integer >= 1, got 0"),
    (["actor_rollout_ref.rollout.mode=agent_loop", "actor_rollout_ref.rollout.multi_turn.format=xml"],
     "actor_rollout_ref.rollout.multi_turn.format='xml': use one of"),
    (["actor_rollout_ref.rollout.mode=agent_loop", "actor_rollout_ref.rollout.agent.max_concurrency=0"],
     "actor_rollout_ref.rollout.agent.max_concurrency=0: must be >= 1"),
    (["actor_rollout_ref.rollout.arpo.sampling.temperature=0.5"], "actor_rollout_ref.rollout.arpo.sampling.temperature"
     "=0.5 differs from actor_rollout_ref.rollout.temperature=1.0: one setting, one value; set only "
     "actor_rollout_ref.rollout.temperature"),
    (["actor_rollout_ref.rollout.num_replicas=0"], "actor_rollout_ref.rollout.num_replicas=0: must be >= 1"),
    (["actor_rollout_ref.rollout.num_replicas=2", "actor_rollout_ref.rollout.ray_actor=false"],
     "num_replicas=2 needs actor_rollout_ref.rollout.ray_actor=true"),
    (["actor_rollout_ref.rollout.ray_actor=false"], "actor_rollout_ref.rollout.ray_actor=false with actor_rollout_ref."
     "rollout.name=vllm: the trainer's weight push cannot reach a vLLM engine bound to the rollout's event loop in "
     "this process (it would hang); set actor_rollout_ref.rollout.ray_actor=true"),
    (["actor_rollout_ref.rollout.num_replicas=5"], "fewer than the 7 the actors ask for"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=1"], "trainer.nnodes=2 needs a Ray cluster of that many nodes"),
    (["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.rollout.name=hf",
      "actor_rollout_ref.rollout.lora_serving=adapter"],
     "actor_rollout_ref.rollout.lora_serving=adapter needs actor_rollout_ref.rollout.name=vllm"),
])
def test_bad_config_fails_at_start_up_naming_the_key(tiny_model_dir, synthetic_dir, overrides, expect):
    assert expect in start_up_config_error(tiny_model_dir, synthetic_dir, *overrides)


def test_validation_is_greedy_unless_do_sample():
    # verl's val_kwargs: do_sample false samples greedily whatever the other keys hold (start-up forbids that)
    from omegaconf import OmegaConf

    from arpo.trainer.actor_config import validation_sampling

    kwargs = OmegaConf.create({"n": 2, "do_sample": False, "temperature": 0.0, "top_p": 1.0, "top_k": -1})
    assert validation_sampling(kwargs) == {"n": 2, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
    kwargs.update(do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    assert validation_sampling(kwargs) == {"n": 2, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


def test_missing_model_path_names_the_key(synthetic_dir, tmp_path):
    line = _bad(tmp_path / "no-model", synthetic_dir)
    assert "actor_rollout_ref.model.path" in line and "arpo.pipeline" in line


def kill_session(sid: int, timeout: float = 30.0) -> None:
    """SIGKILL every process of session ``sid`` and wait until none is left."""
    import psutil

    deadline = time.time() + timeout
    while True:
        left = []
        for pid in psutil.pids():
            try:  # a zombie is dead already (its parent reaps it, or init does)
                if os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    os.kill(pid, signal.SIGKILL)
                    left.append(pid)
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                continue
        if not left:
            return
        assert time.time() < deadline, f"processes of the killed run still alive: {left}"
        time.sleep(0.2)


def multi_node_env(multi_node: bool) -> dict[str, str]:
    """Ray's switch for clusters of several nodes: init_ray sets it to 0, which keeps a one-node cluster on
    127.0.0.1; a node joining another refuses to start with it, so a cluster of several nodes (and every process
    that joins it: the nodes and the driver) runs with 1, on the machine's routable address."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if multi_node else "0"}


def raylet_crash(temp_dir: str, known: set[Path]) -> tuple[Path, str] | None:
    """The log and fatal message of a raylet of a Ray session under ``temp_dir`` that died, other than the
    ``known`` ones (None while none has)."""
    for log in Path(temp_dir).glob("session_*/logs/raylet*.*"):
        if log in known:
            continue
        text = log.read_text(errors="replace")
        fatal = re.search(r"Check failed|\*\*\* SIG|Failed to bind", text)
        if fatal:
            return log, f"{log.name}:\n{text[max(0, fatal.start() - 1500):fatal.start() + 1500]}"
    return None


def ray_start(args: list[str], env: dict[str, str], temp_dir: str, started: list[subprocess.Popen]) -> str:
    """``ray start *args`` in a session of its own (appended to ``started``), once more if its raylet dies while
    starting; returns the command's output. On 2 busy cores a raylet has died at start-up (its agents missed a
    hard-coded 15 s to report their ports, ray-project/ray#65983), after which ``ray start`` waited ~360 s for a
    node that was gone; the raylet's log shows the death at once. The test is about the trainer on a joined
    cluster, not about Ray starting on a loaded machine."""
    for attempt in (1, 2):
        # the logs already there are another node's (up) or a dead try's (its raylet.out and .err both say so)
        known = set(Path(temp_dir).glob("session_*/logs/raylet*.*"))
        proc = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        started.append(proc)
        began, crash = time.monotonic(), None
        while proc.poll() is None and crash is None and time.monotonic() - began < 360:
            crash = raylet_crash(temp_dir, known)
            time.sleep(1)
        with proc.stdout:  # closed once read
            out = proc.stdout.read() if proc.returncode is not None else ""
        took = time.monotonic() - began
        if proc.returncode == 0:
            if took > 120:  # 10-40 s is usual: say so where the suite's time went
                warnings.warn(f"ray start {args[0]} took {took:.0f} s")
            return out
        kill_session(proc.pid)
        crash = crash or raylet_crash(temp_dir, known)
        failure = (f"ray start {args[0]} failed after {took:.0f} s (exit code {proc.returncode}):\n"
                   f"{crash[1] if crash else out[-3000:]}")
        assert attempt == 1, failure
        warnings.warn(failure)  # retried, and shown in the run's warnings summary
    raise AssertionError("unreachable")


@contextmanager
def ray_head(num_cpus: int, worker_cpus: tuple[int, ...] = (), gpus: int = 0) -> Iterator[str]:
    """A Ray head node started as a user starts one (``ray start --head``) on 127.0.0.1, and a worker node of
    ``worker_cpus[i]`` CPUs joined to it for each entry (``ray start --address``: several nodes, simulated on this
    machine), each node with ``gpus`` logical GPUs (Ray counts them; nothing computes on them); yields the head's
    address. Their processes live in their own sessions, which are killed afterwards
    (never ``ray stop``: that would also stop this pytest's own Ray)."""
    env = {**run_env(), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": multi_node_env(bool(worker_cpus))["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"],
           # longer than init_ray's 120 s: on 2 cores the head starts while the other test worker starts a whole
           # training run, and its raylet twice took over 120 s to register there
           "RAY_raylet_start_wait_time_s": "300"}
    temp_dir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # Ray's socket paths must stay short
    started: list[subprocess.Popen] = []
    try:
        out = ray_start(["--head", "--port=0", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                         f"--num-gpus={gpus}", "--include-dashboard=false", f"--temp-dir={temp_dir}",
                         "--object-store-memory=209715200"], env, temp_dir, started)
        # the address the head serves on (port 0: Ray picks a free one): 127.0.0.1 alone, the routable one for
        # several nodes
        address = re.search(r"ray start --address='([^']+)'", re.sub(r"\x1b\[[0-9;]*m", "", out))[1]
        for cpus in worker_cpus:  # a worker node's logs go to the head's session folder
            ray_start([f"--address={address}", "--node-ip-address=127.0.0.1", f"--num-cpus={cpus}",
                       f"--num-gpus={gpus}", "--object-store-memory=209715200"], env, temp_dir, started)
        yield address
    finally:
        for proc in reversed(started):  # worker nodes first
            kill_session(proc.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


def check_training_run(out: Path, steps: int, trajectories: int, model_type: str = "qwen2",
                       first_actor_step: int = 1, checkpoint: bool = True) -> None:
    """What every finished training run must leave: per-step metrics under verl's names, engine outputs that
    move with the weights after every actor update (from ``first_actor_step`` on), a final validation, the last
    checkpoint (none when ``checkpoint`` is False: the ablation runner removes a finished run's) and an HF
    export. Used by the resume test (2 ranks, PPO with a critic, agent loops) and by the ablation smoke (1 rank,
    grpo/soft/hard), which are the suite's longest end-to-end trainings."""
    from transformers import AutoConfig

    metrics = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {m["step"]: m for m in metrics if m["step"] > 0}  # a resumed run logs some steps twice: last wins
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, m in by_step.items():
        for key in ("critic/score/mean", "critic/advantages/mean", "rollout/trajectories", "rollout/tool_calls/total",
                    "timing_s/gen", "response_length/mean"):
            assert key in m, key
        actor_keys = ("actor/pg_loss", "actor/grad_norm", "timing_s/update_actor", "rollout/weight_sync_probe")
        assert all((key in m) == (step >= first_actor_step) for key in actor_keys), (step, sorted(m))
        assert m["rollout/trajectories"] == trajectories  # every prompt yields exactly M trajectories
    missing = unknown_metrics(k for m in metrics for k in m)
    assert not missing, f"metrics without an entry in arpo/reference/metrics_glossary.py: {missing}"
    probes = [by_step[s]["rollout/weight_sync_probe"] for s in sorted(by_step) if s >= first_actor_step]
    assert all(a != b for a, b in zip(probes, probes[1:])), probes
    assert "val-core/all/reward/mean" in json.loads((out / "summary.json").read_text())["final_validation"]
    assert (out / "checkpoints" / f"global_step_{steps}" / "trainer_state.pt").exists() == checkpoint
    assert AutoConfig.from_pretrained(out / "hf_model").model_type == model_type


@pytest.mark.slow
def test_dapo_preset_trains_on_informative_groups_of_several_rounds_on_a_joined_cluster(sft_model_dir, tmp_path):
    """preset=dapo end to end (one step): groups filtered over generation rounds, rounds joined (re-padded,
    trees kept) and cut to train_batch_size, the overlong penalty in the reward, rollout correction (TIS) on the
    engine's recorded log-probs. The tiny model almost never
    answers correctly, so groups are told apart by their summed reward (format, overlong) instead of accuracy.
    The run joins a Ray cluster of two nodes started beforehand (``ray_init.address``), as on several machines,
    with two training ranks (trainer.nnodes=2) and two engine replicas, one of each per node: the prompt groups
    are spread over the replicas and every weight push reaches both; the run leaves the cluster running; a cluster
    too small for the config is one clear error. Each node has one logical GPU, so the placement groups of the
    GPU path hold them (arpo/runtime/placement.py, colocated: each replica shares its node's GPU with that node's rank),
    while everything computes on CPU."""
    out = tmp_path / "dapo"
    data = sft_model_dir.parents[1] / "data" / "synthetic"
    common = (f"actor_rollout_ref.model.path={sft_model_dir}", f"synthetic.out_dir={data}",
              f"trainer.output_dir={out}", "trainer.logger=[console,jsonl]")
    env = {**run_env(), **multi_node_env(True)}
    with ray_head(num_cpus=2, worker_cpus=(2,), gpus=1) as address:
        too_big = subprocess.run(trainer_cmd(*common, f"ray_init.address={address}", "trainer.n_gpus_per_node=2",
                                      "trainer.cpus_per_worker=2"),
                                 cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert too_big.returncode == 2, too_big.stderr[-3000:]
        assert too_big.stderr.strip().splitlines()[-1].startswith(
            f"config error: the Ray cluster at ray_init.address={address} has 4 CPUs"), too_big.stderr[-3000:]
        too_many_nodes = subprocess.run(trainer_cmd(*common, f"ray_init.address={address}", "trainer.nnodes=4",
                                             "trainer.n_gpus_per_node=1",
                                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"),
                                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert too_many_nodes.returncode == 2 and too_many_nodes.stderr.strip().splitlines()[-1].startswith(
            "config error: trainer.nnodes=4: the Ray cluster has 2 node(s)"), too_many_nodes.stderr[-3000:]

        r = subprocess.run(trainer_cmd("preset=dapo", *common, f"ray_init.address={address}", "trainer.nnodes=2",
                                "trainer.n_gpus_per_node=1",
                                "trainer.total_training_steps=1", "trainer.test_freq=-1",
                                "trainer.val_before_train=false", "data.gen_batch_size=4",
                                "algorithm.filter_groups.metric=seq_reward",
                                "algorithm.filter_groups.max_num_gen_batches=3",
                                "actor_rollout_ref.rollout.calculate_log_probs=true",
                                "algorithm.rollout_correction.rollout_is=token",
                                "actor_rollout_ref.rollout.num_replicas=2",
                                # fp32 like the engine, on every CPU (dtype fast is bf16 where avx512_bf16 exists):
                                # the rollout-correction checks below compare the two
                                "actor_rollout_ref.model.dtype=float32"),
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)
        assert r.returncode == 0, r.stderr[-4000:]
        log = (out / "logs" / "arpo.log").read_text()
        assert f"joined ray cluster at {address}" in log
        assert ("GPU placement: 2 node(s) x 1 training GPU(s), actor ranks 0.5 GPU each; colocated (hybrid engine): "
                "2 engine replica(s) in the training GPUs' bundles; 2 GPU(s) in all") in log, log[-3000:]
        nodes = re.search(r"2 engine replicas on Ray nodes \['(\w+)', '(\w+)'\]", log)
        assert nodes and nodes[1] != nodes[2], log[-3000:]  # one replica per node
        ranks = re.search(r"actor worker group: 2 ranks on Ray nodes \['(\w+)', '(\w+)'\]", log)
        assert ranks and ranks[1] != ranks[2], log[-3000:]  # trainer.nnodes=2: one rank per node
        host, port = address.split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # the run left the cluster running
    steps = [m for m in read_metrics(out) if m["step"] > 0]
    missing = unknown_metrics(k for m in steps for k in m)
    assert not missing, f"metrics without an entry in arpo/reference/metrics_glossary.py: {missing}"
    assert [m["step"] for m in steps] == [1]
    for m in steps:
        rounds, kept, dropped = m["train/num_gen_batches"], m["train/num_groups_kept"], m["train/num_groups_dropped"]
        assert 1 <= rounds <= 3 and kept <= 4 and kept + dropped + m["train/num_groups_surplus"] == 4 * rounds
        assert (kept == 4) or rounds == 3  # stops as soon as the batch is full, else at the cap
        assert "reward/overlong/fraction" in m
        if kept:  # rollout correction: vLLM's and the FSDP trainer's log-probs (both fp32 here) nearly agree
            assert m["rollout/weight_sync_replica_gap"] < 1e-4  # the update reached both replicas
            assert abs(m["rollout_corr/kl"]) < 1e-2 and m["rollout_corr/k3_kl"] < 1e-2
            assert 0.99 < m["rollout_corr/ratio_max"] < 2.0 and 0.9 < m["rollout_corr/rollout_is_mean"] < 1.1
            assert 0 <= m["training/rollout_probs_diff_mean"] <= m["training/rollout_probs_diff_max"] < 0.5
        if kept:  # the update's batch: the kept groups, whole, each with rewards that differ
            rows = [json.loads(line) for line in
                    (out / "rollouts" / f"step_{m['step']}.jsonl").read_text().splitlines()]
            groups = {}
            for row in rows:
                groups.setdefault(row["group"], []).append(row["score"])
            assert len(rows) == 4 * kept and len(groups) == kept
            assert all(len(set(scores)) > 1 for scores in groups.values())
            assert "actor/pg_loss" in m
    assert any(m["train/num_gen_batches"] > 1 for m in steps) or all(m["train/num_groups_kept"] == 4 for m in steps)
    assert (out / "checkpoints" / "global_step_1" / "trainer_state.pt").exists()


@pytest.mark.slow
def test_aepo_preset_with_sequence_level_rollout_correction_trains(sft_model_dir, tmp_path):
    """preset=aepo end to end: AEPO's damped branching, its entropy-balanced clip and advantage (which makes the
    old-log-prob pass run for its entropies), its entropy pre-monitoring (a probe per prompt sets the roots),
    tree-packed actor passes, and sequence-level TIS on vLLM's recorded log-probs."""
    out = tmp_path / "aepo"
    data = sft_model_dir.parents[1] / "data" / "synthetic"
    r = subprocess.run(trainer_cmd("preset=aepo", f"actor_rollout_ref.model.path={sft_model_dir}", f"synthetic.out_dir={data}",
                            f"trainer.output_dir={out}", "trainer.logger=[console,jsonl]",
                            "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
                            "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.calculate_log_probs=true",
                            "algorithm.rollout_correction.rollout_is=sequence",
                            "actor_rollout_ref.rollout.arpo.aepo.pre_monitoring=true",
                            "actor_rollout_ref.model.dtype=float32"),  # as the engine computes (TIS checks below)
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=run_env(join_ray=True))
    assert r.returncode == 0, r.stderr[-4000:]
    (m,) = [m for m in read_metrics(out) if m["step"] > 0]
    assert not (missing := unknown_metrics(m)), f"metrics without an entry in arpo/reference/metrics_glossary.py: {missing}"
    assert "timing_s/old_log_prob" in m and m["actor/entropy"] > 0  # the pass AEPO's advantage needs
    assert abs(m["rollout_corr/kl"]) < 1e-3 and 0.9 < m["rollout_corr/rollout_is_mean"] <= 1.0 + 1e-3
    assert 0 < m["perf/packed_token_ratio"] < 1 and m["rollout/branches"] >= 0
    assert math.isfinite(m["actor/pg_loss"]) and m["rollout/trajectories"] == 4 * 4
    assert m["rollout/tokens/monitor"] > 0 and 1 <= m["rollout/aepo/initial_rollouts_mean"] <= 4


@pytest.mark.parametrize("preset", ["reinforce_plus_plus", "tree_grpo"])
def test_preset_from_config_alone_on_the_trainers_rollout_and_advantage_path(preset, tiny_model_dir, synthetic_dir):
    """The presets without a training process of their own (grpo, arpo_soft and arpo_hard train in the ablation
    smoke; dapo, aepo and ppo above), in process: ``preset=<name>`` alone validates at start-up, its rollout
    config builds the rollout (scripted engine), and the trainer's advantage step gives the preset's estimator:
    REINFORCE++ whitens the discounted returns over the batch's model tokens; Tree-GRPO grows initial_rollouts
    trees per prompt and adds GRPO within each tree (the trainer passes the tree column). Their training step is
    grpo's with another estimator (checked against verl in tests/trainer); processes of their own cost the suite
    ~100 s each under load."""
    import numpy as np
    import torch

    from arpo.config import load_config
    from arpo.main_arpo import validate_config
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.testing.scripted_engine import ScriptedEngine
    from arpo.trainer import core_algos
    from arpo.trainer.ray_trainer import compute_advantage
    from tests.rollout.fake_tools import FakePython, FakeSearch

    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={tiny_model_dir}",
                                       f"synthetic.out_dir={synthetic_dir}", f"preset={preset}"])
    validate_config(cfg)
    r = cfg.actor_rollout_ref.rollout
    assert cfg.algorithm.adv_estimator == preset
    engine = ScriptedEngine()
    gen = ARPORollout(engine, engine.tokenizer, {**dict(r.arpo), "mode": r.mode, "sampling.max_response_length": 200},
                      tools=[FakeSearch(), FakePython()])
    try:
        batch = gen.generate([engine.tokenizer.encode(f"Question {i}?") for i in range(4)], seed=0)
    finally:
        gen.close()
    mask = batch.tensors["response_mask"]
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    last = mask.shape[1] - 1 - torch.argmax(mask.flip(1), dim=1)  # each row's last model token
    rewards[torch.arange(len(mask)), last] = torch.rand(len(mask), generator=torch.Generator().manual_seed(0))
    batch.tensors["token_level_rewards"] = rewards
    adv = compute_advantage(batch, cfg).tensors["advantages"]
    on = mask.bool()
    assert len(batch) == 4 * r.n
    if preset == "reinforce_plus_plus":
        assert r.mode == "single"
        assert abs(float(adv[on].mean())) < 1e-5 and float(adv[on].std()) == pytest.approx(1, abs=0.05)
        assert torch.equal(batch.tensors["returns"][~on], torch.zeros_like(batch.tensors["returns"][~on]))
    else:
        trees = batch.non_tensors["tree_index"]
        groups = batch.non_tensors["group_index"]
        assert r.arpo.policy == "tree_grpo"
        assert all(len({t for t, gg in zip(trees, groups) if gg == g}) == r.arpo.initial_rollouts for g in range(4))
        expected, _ = core_algos.compute_tree_grpo_outcome_advantage(
            rewards, mask, np.asarray(batch.non_tensors["uid"]), tree_index=trees)
        assert torch.allclose(adv, expected)