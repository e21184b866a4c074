"""LoRA adapters on the FSDP2 policy (actor_rollout_ref.model.lora_rank): a fresh adapter is the base model, only
adapters train, the engine gets the merged weights under the base names, and 2 ranks update as one process."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.workers_helpers import (add_training_columns, base_config, max_abs_diff,  # noqa: F401
                                           one_process_group, random_batch, ray_update, small_model)


def _cfg(model_dir, world: int = 1, rank: int = 4) -> dict:
    cfg = base_config(model_dir, world=world)
    cfg["actor_rollout_ref"]["model"].update(dtype="float32", lora_rank=rank, lora_alpha=8)
    return cfg


def _worker(cfg: dict):
    from arpo.trainer.fsdp_worker import ActorWorker

    worker = ActorWorker(cfg, "actor", 0, 1)
    worker.init_model()
    return worker


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # in one process a gathered parameter may be the shard's own storage, which FSDP2 frees and reuses
    return {n: t.clone() for n, t in tensors.items()}


def _engine_state(worker) -> dict[str, torch.Tensor]:
    """What a weight sync sends, unpacked."""
    sizes = worker.plan_weight_sync("float32", 1 << 30)
    out = {}
    for i in range(len(sizes)):
        out.update((n, t.clone()) for n, t in worker.weight_bucket(i, fresh=True).tensors())
    worker.end_weight_sync()
    return out


def test_lora_trains_only_adapters_and_syncs_merged_base_weights(small_model, one_process_group, tmp_path):
    from transformers import AutoModelForCausalLM

    from arpo.trainer.logprobs import compute_logprobs_and_entropy

    batch = random_batch(8, seed=1)
    plain = _worker(_cfg(small_model, rank=0))
    base_lp = plain.compute_log_prob(batch)["log_probs"]
    base_engine = _engine_state(plain)

    worker = _worker(_cfg(small_model, rank=4))
    # B starts at zero: the wrapped model is the base model
    assert torch.allclose(worker.compute_log_prob(batch)["log_probs"], base_lp, atol=1e-6)
    trained = {n for n, p in worker.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in worker.optimizer.param_groups) == len(trained)
    before = _copy(worker.full_parameters())

    train = add_training_columns(batch, base_lp, seed=2)
    worker.update_policy(train)
    # the update frees its gradients: none stays allocated through the next generation and weight sync
    assert all(p.grad is None for p in worker.model.parameters()) and worker.full_gradients() == {}
    after = _copy(worker.full_parameters())
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trained)  # the base is frozen
    assert any(not torch.equal(after[n], before[n]) for n in trained)
    adapted = worker.compute_log_prob(batch)["log_probs"]
    assert not torch.allclose(adapted, base_lp, atol=1e-4)
    # adapters disabled: the base model again (the reference policy without a second copy)
    assert torch.allclose(worker.compute_log_prob(batch, base_model=True)["log_probs"], base_lp, atol=1e-6)

    # the engine gets the base model's names, merged weights: a plain HF model loaded with them gives the
    # adapted log-probs
    merged = _engine_state(worker)
    assert list(merged) == list(base_engine)
    hf = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
    missing, unexpected = hf.load_state_dict(merged, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        lp, _ = compute_logprobs_and_entropy(hf, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                             batch["responses"].shape[1], pack=False)
    assert torch.allclose(lp * batch["response_mask"], adapted * batch["response_mask"], atol=1e-5)

    # the HF export is the merged model too: transformers loads it as a plain checkpoint
    out = worker.export_hf(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        lp, _ = compute_logprobs_and_entropy(exported, batch["input_ids"], batch["attention_mask"],
                                             batch["position_ids"], batch["responses"].shape[1], pack=False)
    assert torch.allclose(lp * batch["response_mask"], adapted * batch["response_mask"], atol=1e-5)


def test_lora_keys_are_validated():
    from arpo.trainer.actor_config import ConfigError, validate_actor_config

    cfg = base_config("unused", world=1)
    cfg["actor_rollout_ref"]["model"]["lora_rank"] = -1
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_rank must be an integer >= 0"):
        validate_actor_config(cfg)
    cfg["actor_rollout_ref"]["model"].update(lora_rank=8, lora_alpha=0)
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.lora_alpha"):
        validate_actor_config(cfg)
    cfg["actor_rollout_ref"]["model"].update(lora_alpha=16, target_modules=[3])
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.target_modules"):
        validate_actor_config(cfg)


@pytest.mark.slow
def test_two_rank_lora_update_equals_one_process(small_model, ray_cluster, one_process_group):
    """The same LoRA update (rank 0's adapter init from trainer.seed, broadcast) on 2 gloo ranks and in one
    process: gradients and weights to 1e-6."""
    _, train, _, params2, grads2 = ray_update(_cfg(small_model, world=2), random_batch(8, seed=3), seed=4)
    worker = _worker(copy.deepcopy(_cfg(small_model, world=1)))
    worker.update_policy(train, keep_gradients=True)
    params1, grads1 = _copy(worker.full_parameters()), _copy(worker.full_gradients())
    assert set(grads1) == set(grads2) and all(".lora_" in n for n in grads1)
    assert max_abs_diff(grads2, grads1) < 1e-6
    assert max_abs_diff(params2, params1) < 1e-6


def test_lora_reference_is_the_actors_base_model(small_model, synthetic_dir, one_process_group, caplog):
    """With LoRA and a KL term no reference worker group starts: the trainer's reference log-probs are the actor's
    with the adapters disabled, which a plain HF load of the base model gives (after an update moved the adapters)."""
    import logging

    from transformers import AutoModelForCausalLM

    from arpo.config import load_config
    from arpo.main_arpo import worker_groups
    from arpo.trainer.actor_config import reference_policy
    from arpo.trainer.logprobs import compute_logprobs_and_entropy
    from arpo.trainer.ray_trainer import RayARPOTrainer
    from arpo.trainer.worker_group import LocalWorkerGroup

    common = [f"actor_rollout_ref.model.path={small_model}", f"synthetic.out_dir={synthetic_dir}",
              "trainer.device=cpu", "trainer.n_gpus_per_node=1", "data.train_batch_size=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.model.tree_packing=false"]
    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
    cfg = load_config("arpo_trainer", common + lora + ["actor_rollout_ref.actor.use_kl_loss=true"])
    assert reference_policy(cfg) == "actor" and worker_groups(cfg) == ["actor"]
    full = load_config("arpo_trainer", common + ["actor_rollout_ref.actor.use_kl_loss=true"])
    assert reference_policy(full) == "ref" and worker_groups(full) == ["actor", "ref"]
    in_reward = load_config("arpo_trainer", common + lora + ["algorithm.use_kl_in_reward=true"])
    assert reference_policy(in_reward) == "actor" and worker_groups(in_reward) == ["actor"]
    assert reference_policy(load_config("arpo_trainer", common + lora)) is None  # no KL term: no reference

    batch = random_batch(8, seed=5)
    actor = LocalWorkerGroup(cfg, "actor")
    try:
        actor.update_policy(add_training_columns(batch, actor.compute_log_prob(batch)["log_probs"], seed=6))
        with caplog.at_level(logging.INFO, logger="arpo.trainer.ray_trainer"):
            trainer = RayARPOTrainer(cfg, None, None, None, None, actor, None, [], None, None, None)
        assert "reference policy: the actor's base model" in caplog.text
        ref = trainer.reference_log_probs(batch)
        adapted = actor.compute_log_prob(batch)["log_probs"]
    finally:
        actor.shutdown()
    base = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
    with torch.no_grad():
        lp, _ = compute_logprobs_and_entropy(base, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                             batch["responses"].shape[1], pack=False)
    mask = batch["response_mask"]
    assert torch.allclose(ref * mask, lp * mask, atol=1e-5)
    assert not torch.allclose(adapted, ref, atol=1e-4)  # the adapters moved: the reference is not the policy


class AdapterEngine:
    """Records the adapter directories it is told to serve (and answers the weight-sync probe)."""

    def __init__(self):
        self.loaded: list[str] = []

    async def load_adapter(self, path: str | None) -> int:
        self.loaded.append(path)
        return len(self.loaded)

    async def generate(self, prompt_ids, sampling_params, request_id):
        from arpo.engine.base import GenerationOutput

        return GenerationOutput(token_ids=[1], text="", finish_reason="length", logprobs=[{1: -0.5, 2: -1.5}])


def test_adapter_sync_saves_the_adapter_and_every_engine_serves_it(small_model, synthetic_dir, one_process_group,
                                                                   tmp_path):
    """lora_serving: adapter (the default for vLLM on GPUs): each push saves the adapters alone (peft layout, the newest 3
    versions kept) and every replica is told to serve them; they are the trained policy, and far smaller than the
    merged weights the other path sends."""
    from types import SimpleNamespace

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from arpo.config import load_config
    from arpo.trainer.logprobs import compute_logprobs_and_entropy
    from arpo.trainer.ray_trainer import RayARPOTrainer
    from arpo.trainer.worker_group import LocalWorkerGroup

    cfg = load_config("arpo_trainer", [
        f"actor_rollout_ref.model.path={small_model}", f"synthetic.out_dir={synthetic_dir}", "trainer.device=cpu",
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.model.dtype=float32", "actor_rollout_ref.model.tree_packing=false",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8", f"trainer.output_dir={tmp_path}",
        "actor_rollout_ref.rollout.lora_serving=adapter"])
    batch = random_batch(8, seed=7)
    engines = [AdapterEngine(), AdapterEngine()]
    actor = LocalWorkerGroup(cfg, "actor")
    try:
        actor.update_policy(add_training_columns(batch, actor.compute_log_prob(batch)["log_probs"], seed=8))
        trainer = RayARPOTrainer(cfg, None, SimpleNamespace(dataset=[{"raw_prompt_ids": [1, 2, 3]}]), None, None,
                                 actor, None, engines, None, None, None)
        assert trainer.lora_serving == "adapter"  # logged at start-up validation (tests/engine/test_lora_serving.py)
        for step in range(5):
            trainer.global_step = step
            assert "rollout/weight_sync_probe" in trainer.push_weights()
        adapted = actor.compute_log_prob(batch)["log_probs"]
        merged_bytes = sum(b for b in actor.plan_weight_sync("float32", 1 << 30))
        actor.end_weight_sync()
    finally:
        actor.shutdown()
    root = tmp_path / "lora_adapters"
    assert sorted(d.name for d in root.iterdir()) == ["step_3", "step_4", "step_5"]
    assert all(e.loaded == [str(root / f"step_{s}") for s in range(1, 6)] for e in engines)
    size = sum(f.stat().st_size for f in (root / "step_5").iterdir())
    assert size < merged_bytes / 4

    served = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32),
                                       str(root / "step_5")).merge_and_unload()
    with torch.no_grad():
        lp, _ = compute_logprobs_and_entropy(served, batch["input_ids"], batch["attention_mask"],
                                             batch["position_ids"], batch["responses"].shape[1], pack=False)
    mask = batch["response_mask"]
    assert torch.allclose(lp * mask, adapted * mask, atol=1e-5)
