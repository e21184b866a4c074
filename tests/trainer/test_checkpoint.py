"""Checkpoints: save → load restores model, optimizer, scheduler, RNG and dataloader position exactly; an
interrupted save (leftover ``.tmp``, SIGKILL mid-write) never becomes the resume point; HF export loads."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from arpo.trainer.checkpoint import TRACKER_FILE, CheckpointManager, save_checkpoint
from tests.trainer.workers_helpers import (add_training_columns, base_config, max_abs_diff, random_batch,  # noqa: F401
                                           small_model)

REPO = Path(__file__).resolve().parents[2]


class _FakeActorGroup:
    """Writes what a real actor group writes first (contents.json), enough for the manager's bookkeeping."""

    def save_checkpoint(self, actor_dir: str, contents=None) -> None:
        Path(actor_dir).mkdir(parents=True)
        (Path(actor_dir) / "contents.json").write_text(json.dumps({"contents": contents}))


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
    mgr = CheckpointManager(tmp_path, max_to_keep=2)
    assert mgr.resolve_resume("auto") is None
    save_checkpoint(mgr, 1, _FakeActorGroup())
    # An interrupted save of step 2: only the .tmp directory exists.
    tmp = mgr.begin(2)
    (tmp / "actor").mkdir()
    assert mgr.latest() == tmp_path / "global_step_1"
    assert mgr.resolve_resume("auto") == tmp_path / "global_step_1"
    assert (tmp_path / TRACKER_FILE).read_text() == "1"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        mgr.resolve_resume(str(tmp))
    assert mgr.resolve_resume("disable") is None
    assert mgr.resolve_resume("resume_path", str(tmp_path / "global_step_1")) == tmp_path / "global_step_1"

    # The next save removes the leftover; retention keeps the newest two.
    for step in (3, 4):
        save_checkpoint(mgr, step, _FakeActorGroup())
    assert not list(tmp_path.glob("*.tmp"))
    assert mgr.complete_steps() == [3, 4]
    assert (tmp_path / TRACKER_FILE).read_text() == "4"
    # Crash after the rename but before the tracker update: the newer complete directory wins.
    (tmp_path / TRACKER_FILE).write_text("3")
    assert mgr.latest() == tmp_path / "global_step_4"
    # Saving a step again (a resumed run reaching it) replaces it.
    save_checkpoint(mgr, 4, _FakeActorGroup(), trainer_state={"note": "again"})
    assert torch.load(tmp_path / "global_step_4" / "trainer_state.pt", weights_only=False)["note"] == "again"


_SAVER = r"""
import sys, torch
from arpo.trainer.checkpoint import CheckpointManager, save_checkpoint
from arpo.trainer.fsdp_worker import ActorWorker
cfg = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"path": sys.argv[1]}}}
worker = ActorWorker(cfg, "actor", 0, 1)
worker.init_model()
mgr = CheckpointManager(sys.argv[2], max_to_keep=2)
step = 0
while True:
    step += 1
    with torch.no_grad():
        for p in worker.model.parameters():
            p.fill_(float(step))          # every parameter of step N equals N: a torn write would show
    save_checkpoint(mgr, step, worker, trainer_state={"marker": step})
"""


@pytest.mark.slow
def test_sigkill_during_saves_leaves_a_complete_latest_checkpoint(small_model, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpt_root = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(0)
    for attempt in range(2):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(small_model), str(ckpt_root)], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 180
        while not (ckpt_root / TRACKER_FILE).exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(rng.uniform(0.2, 1.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

        latest = CheckpointManager(ckpt_root).resolve_resume("auto")
        assert latest is not None
        step = int(latest.name.split("_")[-1])
        state = torch.load(latest / "trainer_state.pt", weights_only=False)
        assert state["global_step"] == state["marker"] == step
        model = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=str(latest / "actor"))
        assert all(bool((t == float(step)).all()) for t in sd["model"].values() if t.is_floating_point())
        # The manager may have been killed at any instant: nothing but complete steps, tmp dirs and the tracker.
        for p in ckpt_root.iterdir():
            assert p.name.startswith((TRACKER_FILE, "global_step_")), p


@pytest.mark.slow
def test_save_load_restores_training_state_exactly(small_model, synthetic_dir, ray_cluster, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arpo.chat_templates import resolve_chat_template
    from arpo.data.rl_dataset import create_rl_dataloaders
    from arpo.trainer.checkpoint import load_checkpoint
    from arpo.trainer.worker_group import RayWorkerGroup

    cfg = base_config(small_model, world=2)
    cfg["actor_rollout_ref"]["actor"]["optim"].update(warmup_style="cosine", lr_warmup_steps=2, total_training_steps=5)
    cfg["actor_rollout_ref"]["actor"]["checkpoint"] = {"save_contents": ["model", "optimizer", "extra", "hf_model"]}
    cfg["actor_rollout_ref"]["model"]["custom_chat_template"] = "llama3"  # the export must prompt as training did
    cfg["data"].update(train_files=[str(synthetic_dir / "train.parquet")], max_prompt_length=4096, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(str(small_model))
    mgr = CheckpointManager(tmp_path / "ckpt")
    batch1 = random_batch(8, seed=11)
    batch2 = random_batch(8, seed=12)

    group = RayWorkerGroup(cfg, role="actor")
    try:
        loader, _ = create_rl_dataloaders(cfg, tokenizer)
        first = loader.next_batch()
        train1 = add_training_columns(batch1, group.compute_log_prob(batch1)["log_probs"], seed=13)
        m1 = group.update_policy(train1)
        saved_params = group.full_parameters()
        # save_contents (with hf_model) comes from the config
        ckpt = save_checkpoint(mgr, 1, group, dataloader=loader, trainer_state={"epoch": loader.epoch})
        after_save_random = random.random()
        next_prompts = loader.next_batch()
        train2 = add_training_columns(batch2, group.compute_log_prob(batch2)["log_probs"], seed=14)
        m2 = group.update_policy(train2)
        params2 = group.full_parameters()
    finally:
        group.shutdown()

    random.random()  # move the driver RNG on; the load must put it back
    group = RayWorkerGroup(cfg, role="actor")
    try:
        loader, _ = create_rl_dataloaders(cfg, tokenizer)
        resume = mgr.resolve_resume("auto")
        assert resume == ckpt
        state = load_checkpoint(resume, group, dataloader=loader)
        assert state["global_step"] == 1
        assert random.random() == after_save_random
        assert max_abs_diff(group.full_parameters(), saved_params) == 0.0
        resumed_prompts = loader.next_batch()
        assert resumed_prompts == next_prompts
        assert [r["index"] for r in resumed_prompts] != [r["index"] for r in first]
        m2_resumed = group.update_policy(train2)  # same old log-probs: only the restored state differs
        # Optimizer moments and scheduler position restored: the next update is the same to the bit.
        assert max_abs_diff(group.full_parameters(), params2) == 0.0
        assert m2_resumed["actor/lr"] == m2["actor/lr"] != m1["actor/lr"]
        assert m2_resumed["actor/pg_loss"] == m2["actor/pg_loss"]
    finally:
        group.shutdown()

    # The HF export inside the checkpoint loads with transformers and holds the step-1 weights.
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt / "actor" / "huggingface"), dtype=torch.float32)
    hf_params = dict(hf.named_parameters())
    assert max(float((hf_params[k].detach() - v).abs().max()) for k, v in saved_params.items()) == 0.0
    exported = AutoTokenizer.from_pretrained(str(ckpt / "actor" / "huggingface"))
    assert exported.encode("hello world") == tokenizer.encode("hello world")
    assert exported.chat_template == resolve_chat_template("llama3") != tokenizer.chat_template
