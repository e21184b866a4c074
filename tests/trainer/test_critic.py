"""PPO's critic: two FSDP2 ranks (real Ray actors, real gloo) compute values and update the value model exactly as
one plain process does, and its checkpoint restores on a different number of ranks."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.trainer.workers_helpers import (base_config, max_abs_diff, random_batch,  # noqa: F401
                                           reference_mini_batches, small_model)

pytestmark = pytest.mark.slow

SEED = 3


def critic_config(model_dir, world: int = 2) -> dict:
    cfg = base_config(model_dir, world=world)
    cfg["trainer"]["seed"] = SEED
    cfg["critic"] = {
        "model": {"path": None, "enable_gradient_checkpointing": True},
        "optim": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "warmup_style": "constant",
                  "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "total_training_steps": 10},
        "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1, "forward_micro_batch_size_per_gpu": 3,
        "ppo_epochs": 2, "grad_clip": 1.0e6, "cliprange_value": 0.2, "loss_agg_mode": "token-mean",
    }
    return cfg


def reference_critic(model_dir):
    from transformers import AutoConfig, AutoModelForTokenClassification

    from arpo.trainer.critic_worker import init_value_head

    config = AutoConfig.from_pretrained(str(model_dir))
    config.num_labels, config.classifier_dropout = 1, 0.0
    model = AutoModelForTokenClassification.from_pretrained(str(model_dir), config=config, dtype=torch.float32)
    init_value_head(model.score, SEED, config.initializer_range)
    return model


def reference_values(model, batch) -> torch.Tensor:
    r = batch["responses"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    return logits[:, -r - 1:-1, 0] * batch["response_mask"]


def reference_update(model, batch, cfg: dict) -> list[float]:
    """verl's dp_critic in one process: whole mini-batches, plain AdamW; returns each mini-batch's vf_loss."""
    from arpo.trainer import core_algos

    c = cfg["critic"]
    losses = []
    for mb in reference_mini_batches(model, batch, c, cfg["actor_rollout_ref"]["rollout"]["n"]):
        mask = mb["response_mask"].float()
        vf_loss, _ = core_algos.compute_value_loss(reference_values(model, mb), mb["returns"], mb["values"], mask,
                                                   c["cliprange_value"], c["loss_agg_mode"], global_batch_size=len(mb))
        vf_loss.backward()
        losses.append(float(vf_loss.detach()))
    return losses


def test_two_rank_critic_equals_one_process_and_its_checkpoint_reshards(small_model, ray_cluster, tmp_path):
    from arpo.trainer import core_algos
    from arpo.trainer.worker_group import RayWorkerGroup

    cfg = critic_config(small_model)
    group = RayWorkerGroup(cfg, role="critic")
    fresh = None
    try:
        batch = random_batch(8, seed=4)
        mask = batch["response_mask"].float()
        values = group.compute_values(batch)["values"]
        ref_model = reference_critic(small_model)
        with torch.no_grad():
            expected = reference_values(ref_model, batch)
        torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
        assert (values[mask == 0] == 0).all() and (values[mask == 1] != 0).all()

        # an outcome reward on each row's last model token; GAE over the values (tool tokens skipped)
        g = torch.Generator().manual_seed(5)
        last = (mask * torch.arange(mask.shape[1])).argmax(-1)
        rewards = torch.zeros_like(mask)
        rewards[torch.arange(len(batch)), last] = (torch.rand(len(batch), generator=g) > 0.5).float()
        batch.tensors["token_level_rewards"] = rewards
        _, returns = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.95)
        batch.tensors["values"], batch.tensors["returns"] = values, returns

        def value_error(v: torch.Tensor) -> float:
            return float((((v - returns) ** 2) * mask).sum() / mask.sum())

        metrics = group.update_critic(batch)
        losses = reference_update(ref_model, copy.copy(batch), cfg)
        # 8 rows, mini-batches of 2 prompts x n=2 = 4 rows (2 per rank), 2 epochs: 4 optimizer steps
        assert len(losses) == 4
        assert metrics["critic/vf_loss"] == pytest.approx(sum(losses) / 4, abs=1e-6)
        assert 0 <= metrics["critic/vf_clipfrac"] <= 1 and metrics["critic/lr"] == pytest.approx(1e-3)
        params = group.full_parameters()
        assert max_abs_diff(params, {n: p.detach() for n, p in ref_model.named_parameters()}) < 1e-5
        after = group.compute_values(batch)["values"]
        assert value_error(after) < value_error(values)  # the values moved toward the returns

        # saved on 2 ranks, restored on 1: the same model, the same values
        group.save_checkpoint(str(tmp_path / "critic"))
        fresh = RayWorkerGroup(critic_config(small_model, world=1), role="critic")
        assert max_abs_diff(fresh.full_parameters(), params) > 1e-4  # a fresh critic differs from the trained one
        fresh.load_checkpoint(str(tmp_path / "critic"))
        assert max_abs_diff(fresh.full_parameters(), params) == 0
        torch.testing.assert_close(fresh.compute_values(batch)["values"], after, atol=1e-6, rtol=0)
    finally:
        group.shutdown()
        if fresh is not None:
            fresh.shutdown()


def test_a_model_without_a_token_classification_head_cannot_be_a_critic(tmp_path):
    from transformers import OPTConfig

    from arpo.trainer.critic_worker import CriticWorker

    OPTConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, ffn_dim=8, word_embed_proj_dim=8,
              vocab_size=10).save_pretrained(tmp_path)
    cfg = {"critic": {"model": {"path": str(tmp_path)}}, "trainer": {"seed": 0}}
    with pytest.raises(ValueError, match="critic.model.path"):
        CriticWorker(cfg).load_model()
