"""Two FSDP2 ranks (real Ray actors, real gloo) update the policy exactly as one plain process does."""

from __future__ import annotations

import pytest
import torch

from arpo.batch import DataBatch
from tests.trainer.workers_helpers import (add_training_columns, base_config, max_abs_diff,  # noqa: F401
                                           one_process_group, random_batch, ray_update, reference_update,
                                           small_model, tree_batch)

pytestmark = pytest.mark.slow


def _hf_log_probs(model_dir, batch, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits.float() / temperature
    r = batch["responses"].shape[1]
    logp = torch.log_softmax(logits[:, -r - 1:-1], dim=-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return logp * batch["attention_mask"][:, -r:]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient_checkpointing"])
def test_two_rank_update_equals_one_process(small_model, ray_cluster, checkpointing):
    from arpo.trainer.worker_group import RayWorkerGroup

    # 4 prompts x n=2 = 8 rows; mini-batches of 2 prompts (4 rows, 2 per rank); micro-batches of 1 row.
    # Gradient checkpointing recomputes each decoder layer in the backward pass (FSDP2 gathers its
    # parameters again): the gradients must still be those of one plain process.
    cfg = base_config(small_model, world=2)
    cfg["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] = checkpointing
    group = RayWorkerGroup(cfg, role="actor")
    try:
        batch = random_batch(8, seed=1)
        # Old log-probs from the 2-rank worker equal a plain HF forward.
        old = group.compute_log_prob(batch)
        assert old["log_probs"].shape == batch["responses"].shape
        assert torch.allclose(old["log_probs"], _hf_log_probs(small_model, batch), atol=1e-5)
        assert (old["entropy"][batch["attention_mask"][:, -batch["responses"].shape[1]:] == 1] > 0).all()

        train = add_training_columns(batch, old["log_probs"], seed=2)
        if not checkpointing:  # mini-batches of 2 of the 4 prompts: not on-policy, so old log-probs are required
            without_old = DataBatch({k: v for k, v in train.tensors.items() if k != "old_log_probs"},
                                    dict(train.non_tensors), dict(train.meta))
            with pytest.raises(Exception, match="only an on-policy update"):  # on every rank, before any collective
                group.update_policy(without_old)
        metrics = group.update_policy(train, keep_gradients=True)
        params, grads = group.full_parameters(), group.full_gradients()
    finally:
        group.shutdown()

    ref_params, ref_grads, ref_metrics = reference_update(small_model, train, cfg)
    assert max_abs_diff(grads, ref_grads) < 1e-6
    assert max_abs_diff(params, ref_params) < 1e-6
    n = len(ref_metrics)
    for key in ("pg_loss", "kl_loss", "grad_norm", "pg_clipfrac", "ppo_kl"):
        expected = sum(m[key] for m in ref_metrics) / n
        assert metrics[f"actor/{key}"] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
    assert metrics["actor/pg_clipfrac"] > 0  # the perturbed old log-probs make clipping happen
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert "actor/entropy" in metrics and metrics["actor/entropy"] > 0


@pytest.mark.parametrize("checkpointing,reshard", [(False, True), (True, True), (True, False)],
                         ids=["plain", "gradient_checkpointing", "gradient_checkpointing_layers_kept_gathered"])
def test_tree_packed_update_on_two_ranks_equals_the_padded_one_process_update(small_model, ray_cluster,
                                                                               checkpointing, reshard):
    """ARPO trees (5 prompts x 4 rows with forks), one forward per tree: mini-batches of 3 and 2 trees dealt
    whole to 2 ranks, so one rank has a tree fewer and joins the other's collectives with an empty micro-batch.
    Log-probs, entropy and gradients are the padded layout's to float rounding (2e-5 relative), also when the
    update keeps the gathered layers from forward to backward (``reshard_after_forward`` false, make run's)."""
    cfg = base_config(small_model, world=2, tree_packing=True, ppo_mini_batch_size=3)
    cfg["actor_rollout_ref"]["rollout"]["n"] = 4
    cfg["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] = checkpointing
    cfg["actor_rollout_ref"]["actor"]["fsdp_config"] = {"reshard_after_forward": reshard}
    batch = tree_batch(5, 4, seed=5)
    assert (batch.non_tensors["parent_index"] >= 0).sum() >= 10
    old, train, metrics, params, grads = ray_update(cfg, batch, seed=6)
    assert torch.allclose(old["log_probs"], _hf_log_probs(small_model, batch), atol=1e-5)
    attended = batch["attention_mask"][:, -batch["responses"].shape[1]:] == 1
    assert (old["entropy"][attended] > 0).all() and not old["entropy"][~attended].any()
    ref_params, ref_grads, ref_metrics = reference_update(small_model, train, cfg)
    for name, g in ref_grads.items():
        # 2e-5: attention segment by segment sums in another order than the padded rows (measured 1.4e-5)
        assert (grads[name] - g).abs().max() <= 2e-5 * g.abs().max() + 1e-9, name
    # Adam divides by the root of the squared gradients: rounding on a near-zero gradient moves a weight by up
    # to about lr (1e-3) times its relative error
    assert max_abs_diff(params, ref_params) < 1e-5
    for key in ("pg_loss", "kl_loss", "grad_norm", "pg_clipfrac", "ppo_kl"):
        expected = sum(m[key] for m in ref_metrics) / len(ref_metrics)
        assert metrics[f"actor/{key}"] == pytest.approx(expected, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept_gathered"])
def test_only_the_update_keeps_layers_gathered_after_their_forward(small_model, one_process_group, reshard):
    """``fsdp_config.reshard_after_forward`` false: in the update a decoder layer's parameters are still gathered
    (plain tensors, not DTensor shards) when its forward returns; log-prob passes before and after reshard."""
    from torch.distributed.tensor import DTensor

    from arpo.trainer.worker_group import LocalWorkerGroup

    cfg = base_config(small_model, world=1)
    cfg["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] = False  # one forward per layer and pass
    cfg["actor_rollout_ref"]["actor"]["fsdp_config"] = {"reshard_after_forward": reshard}
    group = LocalWorkerGroup(cfg, "actor")
    sharded_after: list[bool] = []
    try:
        layer = group.worker.model.model.layers[0]
        layer.register_forward_hook(  # runs after FSDP2's own post-forward hook
            lambda module, args, out: sharded_after.append(all(isinstance(p, DTensor) for p in module.parameters())))
        batch = random_batch(8, seed=1)
        old = group.compute_log_prob(batch)
        before = len(sharded_after)
        group.update_policy(add_training_columns(batch, old["log_probs"], seed=2))
        in_update = sharded_after[before:]
        after = len(sharded_after)
        group.compute_log_prob(batch)
    finally:
        group.shutdown()
    assert before > 0 and len(in_update) == 8 and len(sharded_after) - after == before  # 8 rows, micro-batch 1
    assert all(sharded_after[:before]) and all(sharded_after[after:])
    assert in_update == [reshard] * 8


def test_uneven_batch_is_padded_without_changing_the_update(small_model, ray_cluster):
    """7 rows over 2 ranks (mini-batches of 4 and 3 rows): pad rows carry no loss; seq-mean-token-sum
    counts only real rows; ppo_epochs=2 and micro-batches of 2."""
    cfg = base_config(small_model, world=2, loss_agg_mode="seq-mean-token-sum", ppo_epochs=2,
                      ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.0)
    old, train, metrics, params, grads = ray_update(cfg, random_batch(7, seed=3), seed=4, calc_entropy=False)
    assert len(old["log_probs"]) == 7 and "entropy" not in old
    ref_params, ref_grads, ref_metrics = reference_update(small_model, train, cfg)
    assert max_abs_diff(grads, ref_grads) < 1e-6
    assert max_abs_diff(params, ref_params) < 1e-6
    expected = sum(m["pg_loss"] for m in ref_metrics) / len(ref_metrics)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert "actor/entropy" not in metrics


def test_ref_role_gives_reference_log_probs(small_model, ray_cluster):
    from arpo.trainer.worker_group import RayWorkerGroup

    cfg = base_config(small_model, world=2)
    group = RayWorkerGroup(cfg, role="ref")
    try:
        batch = random_batch(5, seed=5)
        batch.meta["temperature"] = 0.7
        out = group.compute_log_prob(batch)
        with pytest.raises(Exception, match="role='actor'"):
            group.update_policy(add_training_columns(batch, out["log_probs"], seed=6))
    finally:
        group.shutdown()
    assert set(out) == {"log_probs"}
    assert torch.allclose(out["log_probs"], _hf_log_probs(small_model, batch, temperature=0.7), atol=1e-5)


def test_on_policy_update_without_old_log_probs_equals_update_with_them(small_model, ray_cluster):
    """One mini-batch and one epoch: the update may take its old log-probs from its own forward (verl's
    on-policy path) instead of a separate pass; parameters, losses and the entropy metric are the same."""
    from arpo.trainer.worker_group import RayWorkerGroup

    # data.train_batch_size 4 prompts = ppo_mini_batch_size: one mini-batch of 8 rows, 2 micro-batches of 2 per rank.
    cfg = base_config(small_model, world=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.0)
    # The two ways differ by rounding only (a ratio of 1 ± 1e-7 against exactly 1). Adam's first step is
    # lr·g/(|g| + eps): with eps 1e-8 it maps gradients that are 0 in exact arithmetic (rounding noise) to
    # ±lr; with eps 1e-4 it stays proportional to them, so the parameters compare the update itself.
    cfg["actor_rollout_ref"]["actor"]["optim"]["eps"] = 1e-4
    batch = random_batch(8, seed=7)
    runs = {}
    for name in ("two_passes", "on_policy"):
        group = RayWorkerGroup(cfg, role="actor")
        try:
            old = group.compute_log_prob(batch)  # the same for both: the first update has not happened yet
            train = add_training_columns(batch, old["log_probs"], seed=8)
            if name == "two_passes":
                train.tensors["old_log_probs"] = old["log_probs"]
            else:
                del train.tensors["old_log_probs"]
            runs[name] = (group.update_policy(train, keep_gradients=True), group.full_parameters(), group.full_gradients(), old)
        finally:
            group.shutdown()
    (m_two, p_two, g_two, old), (m_on, p_on, g_on, _) = runs["two_passes"], runs["on_policy"]
    assert max_abs_diff(g_two, g_on) < 1e-6
    assert max_abs_diff(p_two, p_on) < 1e-6
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert m_on[key] == pytest.approx(m_two[key], rel=1e-5, abs=1e-7), key
    # The ratio is exactly 1 on-policy: nothing is clipped and the approximate KL is 0.
    assert m_on["actor/pg_clipfrac"] == 0 and m_on["actor/ppo_kl"] == 0
    # The entropy metric moves from the old-log-prob pass (the trainer computed it there) into the update.
    assert "actor/entropy" not in m_two
    mask = batch["response_mask"].bool()
    assert m_on["actor/entropy"] == pytest.approx(float(old["entropy"][mask].mean()), rel=1e-5)


def test_bf16_ranks_autocast_and_agree_with_fp32(small_model, ray_cluster):
    """dtype=bfloat16 on CPU: the ranks run under autocast (fp32 master weights) and their log-probs stay
    within two bf16 roundings (u = 2^-8) of the largest logit of the fp32 model's; the update runs. The
    prompts share a 20-token system prompt, which the fast layout runs once per micro-batch (share_prefix)."""
    from transformers import AutoModelForCausalLM

    from arpo.trainer.worker_group import RayWorkerGroup

    cfg = base_config(small_model, world=2, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    cfg["actor_rollout_ref"]["model"]["dtype"] = "bfloat16"
    batch = random_batch(8, seed=11, system=20)
    group = RayWorkerGroup(cfg, role="actor")
    try:
        assert all(info["autocast"] and info["dtype"] == "torch.bfloat16" for info in group.init_info)
        out = group.compute_log_prob(batch)
        train = add_training_columns(batch, out["log_probs"], seed=12)
        del train.tensors["old_log_probs"]
        metrics = group.update_policy(train)
        params = group.full_parameters()
    finally:
        group.shutdown()
    model = AutoModelForCausalLM.from_pretrained(str(small_model), dtype=torch.float32)
    with torch.no_grad():
        max_logit = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                position_ids=batch["position_ids"]).logits.abs().max())
    valid = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    err = (out["log_probs"] - _hf_log_probs(small_model, batch))[valid].abs().max()
    assert 0 < float(err) <= 2 * 2.0 ** -8 * max_logit
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert all(p.dtype == torch.float32 for p in params.values())  # master weights stay fp32


def test_compiled_decoder_layers_give_the_eager_log_probs_gradients_and_update(small_model, one_process_group):
    """``actor.use_torch_compile``: with the decoder layers compiled (tree-packed ARPO groups, gradient
    checkpointing, float32, one FSDP2 process) the log-probs, entropy, gradients and weights are the eager ones to
    float rounding, and the per-segment attention stays out of the graphs."""
    from torch._dynamo.utils import counters

    from arpo.trainer.worker_group import LocalWorkerGroup

    cfg = base_config(small_model, world=1, tree_packing=True, ppo_mini_batch_size=3)
    cfg["actor_rollout_ref"]["rollout"]["n"] = 4
    batch = tree_batch(3, 4, seed=5)
    runs = {}
    for compiled in (False, True):
        cfg["actor_rollout_ref"]["actor"]["use_torch_compile"] = compiled
        counters.clear()
        group = LocalWorkerGroup(cfg, "actor")
        try:
            old = group.compute_log_prob(batch)
            metrics = group.update_policy(add_training_columns(batch, old["log_probs"], seed=6), keep_gradients=True)
            runs[compiled] = (old, metrics, group.full_parameters(), group.full_gradients())
        finally:
            group.shutdown()
        graphs = counters["stats"]["unique_graphs"]
        assert (graphs > 0) if compiled else graphs == 0
    (old_e, m_e, p_e, g_e), (old_c, m_c, p_c, g_c) = runs[False], runs[True]
    assert torch.allclose(old_c["log_probs"], old_e["log_probs"], atol=1e-5)
    assert torch.allclose(old_c["entropy"], old_e["entropy"], atol=1e-5)
    for name, g in g_e.items():
        assert (g_c[name] - g).abs().max() <= 2e-5 * g.abs().max() + 1e-9, name
    assert max_abs_diff(p_c, p_e) < 1e-5
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert m_c[key] == pytest.approx(m_e[key], rel=1e-5, abs=1e-6), key
