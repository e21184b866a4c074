"""A training run killed with SIGKILL resumes from its last checkpoint (real vLLM in a Ray actor, real FSDP2
workers, real tools). Its own module: the suite's test workers take whole modules, and this run alone takes
minutes."""

from __future__ import annotations

import math
import subprocess
import time

import pytest

from arpo.config import REPO_ROOT
from tests.test_main_arpo import check_training_run, kill_session, read_metrics, run_env, trainer_cmd


@pytest.mark.slow
def test_sigkill_mid_training_resumes_from_the_last_checkpoint(sft_model_dir, tmp_path):
    """A 2-rank PPO run (preset=ppo: actor, critic and GAE) on the agent-loop rollout path (the batch path trains
    GRPO in the ablation smoke), killed after its first checkpoint and resumed to the end. Step 1 is the critic's
    warm-up (trainer.critic_warmup=2: no actor update, the engine keeps its weights); the critic's shards are
    saved with the actor's and restored on resume."""
    import torch

    out = tmp_path / "resume"
    data = sft_model_dir.parents[1] / "data" / "synthetic"
    args = trainer_cmd("preset=ppo", f"actor_rollout_ref.model.path={sft_model_dir}", f"synthetic.out_dir={data}",
                f"trainer.output_dir={out}", "trainer.logger=[console,jsonl]", "trainer.total_training_steps=2",
                "trainer.save_freq=1", "trainer.test_freq=2", "trainer.val_before_train=false",
                "data.val_max_samples=8", "trainer.critic_warmup=2",
                "actor_rollout_ref.rollout.mode=agent_loop",
                # rewards scored in the driver: each of the two runs would otherwise start a pool of 4 spawned
                # processes for 16 rows a step (its start-up was the step's `timing_s/reward`, 14 s of ~31-50 s)
                "reward.num_workers=1")
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=run_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    ckpt1 = out / "checkpoints" / "global_step_1"
    deadline = time.time() + 900
    while not ckpt1.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(1)
    assert ckpt1.exists(), "no checkpoint at step 1 before the deadline"
    # The killed driver cannot stop its private Ray cluster; its raylets and workers (in their own process
    # groups, in the driver's session) would hold its CPUs. Kill that session only: `ray stop --force` would
    # also kill this pytest's own Ray (the trainer tests' cluster), and a user's other Ray jobs.
    kill_session(proc.pid)
    proc.wait()
    killed_at = max(int(p.name.split("_")[-1]) for p in (out / "checkpoints").glob("global_step_[0-9]*")
                    if not p.name.endswith(".tmp"))
    assert killed_at < 2
    data = torch.load(out / "checkpoints" / f"global_step_{killed_at}" / "data.pt", weights_only=False)
    assert data["batch_index"] == killed_at  # one batch of prompts per step so far

    # the resumed run joins this pytest worker's cluster (the killed one had its own, killed with its session)
    r = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=run_env(join_ray=True))
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"global step {killed_at})" in r.stderr + r.stdout
    final = torch.load(out / "checkpoints" / "global_step_2" / "trainer_state.pt", weights_only=False)
    assert final["global_step"] == 2
    assert torch.load(out / "checkpoints" / "global_step_2" / "data.pt", weights_only=False)["batch_index"] == 2
    logged = [m["step"] for m in read_metrics(out) if m["step"] > 0]
    # every step is logged, the steps after the checkpoint once more by the resumed run, none skipped
    assert set(logged) == {1, 2}
    assert logged[-(2 - killed_at):] == list(range(killed_at + 1, 3))
    check_training_run(out, steps=2, trajectories=4 * 4, first_actor_step=2)
    assert (out / "checkpoints" / "global_step_2" / "critic" / "contents.json").exists()
    for m in read_metrics(out):
        if m["step"] > 0:  # the critic learns every step, warm-up included; GAE's advantages are whitened
            assert math.isfinite(m["critic/vf_loss"]) and m["critic/vf_loss"] > 0 and "critic/vf_explained_var" in m
            assert abs(m["critic/advantages/mean"]) < 1e-4 and m["critic/values/min"] < m["critic/values/max"]
    # train_batch_size x rollout.n through the agent loops: the batch rollout's layout
    assert all(m["agent_loop/num_trajectories"] == 4 * 4 for m in read_metrics(out) if m["step"] > 0)
