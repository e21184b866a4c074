"""Token-budget micro-batches (actor.use_dynamic_bsz, rollout/ref log_prob_use_dynamic_bsz): how rows are packed,
how the budget composes with tree packing, and that the update and the log-probs equal row batching's."""

from __future__ import annotations

import copy

import pytest
import torch

from arpo.trainer.micro_batches import pack_by_tokens
from tests.trainer.workers_helpers import (add_training_columns, base_config, max_abs_diff, random_batch,  # noqa: F401
                                           ray_update, reference_update, small_model, tree_batch)


def test_rows_are_packed_longest_first_up_to_the_budget_and_a_longer_row_runs_alone():
    rows = torch.arange(6)
    lengths = torch.tensor([5, 30, 9, 10, 4, 12])
    micros = pack_by_tokens(rows, lengths, max_tokens=25)
    # 30 > 25 alone; then 12+10 padded to 2 x 12 = 24; 9+5 (+4 would be 3 x 9 = 27); 4
    assert [m.tolist() for m in micros] == [[1], [5, 3], [2, 0], [4]]
    assert sorted(torch.cat(micros).tolist()) == rows.tolist()
    for m in micros:
        width = int(lengths[m].max())
        assert len(m) == 1 or len(m) * width <= 25
    assert pack_by_tokens(rows[:0], lengths[:0], 10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        pack_by_tokens(rows, lengths, 0)


def test_tree_stays_whole_within_the_budget_and_bigger_trees_and_lone_rows_pack_by_tokens():
    from arpo.trainer.fsdp_worker import ActorWorker
    from arpo.trainer.tree_packing import unique_token_count

    cfg = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"dtype": "float32", "tree_packing": True}}}
    worker = ActorWorker(cfg)
    from arpo.batch import concat_padded
    from arpo.trainer.tree_packing import tree_columns

    batch = concat_padded([tree_batch(3, 4, seed=7), tree_batch(4, 1, seed=8)], pad_token_id=0)
    batch.tensors.update(tree_columns(batch))
    lengths = batch["attention_mask"].sum(1)
    packed = [unique_token_count(batch, list(range(g * 4, g * 4 + 4))) for g in range(3)]
    budget = sorted(packed)[1]  # one tree over the budget at least, one within it
    micros = worker.micro_batches(batch, micro_size=2, max_tokens=budget)
    assert sorted(torch.cat(micros).tolist()) == list(range(len(batch)))
    for g, size in enumerate(packed):
        rows = set(range(g * 4, g * 4 + 4))
        parts = [m.tolist() for m in micros if set(m.tolist()) & rows]
        if size <= budget:
            assert parts == [sorted(rows)]  # whole, one packed forward
        else:
            assert len(parts) > 1 and all(set(p) <= rows for p in parts)
            assert all(len(p) == 1 or len(p) * int(lengths[p].max()) <= budget for p in parts)
    lone_parts = [m.tolist() for m in micros if min(m.tolist()) >= 12]
    assert sorted(sum(lone_parts, [])) == list(range(12, 16))
    assert all(len(p) == 1 or len(p) * int(lengths[p].max()) <= budget for p in lone_parts)



def test_update_padding_counts_the_token_positions_each_micro_batch_runs():
    """The update's micro-batches on two ranks' shares (no model): the exact layout (float32) runs every row at the
    batch's width, the fast one (bf16) each micro-batch at its longest row; padding is what no real row fills."""
    from arpo.trainer.dynamic_batching import update_padding
    from arpo.trainer.fsdp_worker import ActorWorker
    from arpo.trainer.worker_group import split_for_ranks

    batch = random_batch(8, seed=3)
    width, real = batch["attention_mask"].shape[1], int(batch["attention_mask"].sum())

    def padding(dtype: str, dynamic: bool, budget: int = 40) -> dict:
        cfg = {"trainer": {"device": "cpu"}, "data": {"train_batch_size": 4},
               "actor_rollout_ref": {"model": {"dtype": dtype, "tree_packing": False}, "rollout": {"n": 2},
                                     "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
                                               "use_dynamic_bsz": dynamic, "ppo_max_token_len_per_gpu": budget}}}
        shares, per_rank = split_for_ranks(batch, 2, 8, balance=dtype != "float32")
        for s in shares:
            s.meta["mini_batch_rows_per_rank"] = per_rank
        stats = update_padding([ActorWorker(cfg, "actor", r, 2) for r in range(2)], shares)
        assert stats["padding_tokens"] == stats["tokens_run"] - real
        assert stats["padding_fraction"] == round(stats["padding_tokens"] / stats["tokens_run"], 4)
        return stats, shares

    stats, _ = padding("float32", False)  # 2 micro-batches of 2 rows per rank, all at the full width
    assert stats["micro_batches_per_rank"] == [2, 2] and stats["tokens_run"] == 8 * width
    stats, _ = padding("float32", True, budget=1)  # each row alone, still at the full width
    assert stats["micro_batches_per_rank"] == [4, 4] and stats["tokens_run"] == 8 * width
    stats, shares = padding("bfloat16", False)  # rows sorted longest first, pairs at their longer row's width
    pairs = [sorted(s["attention_mask"].sum(1).tolist(), reverse=True) for s in shares]
    assert stats["tokens_run"] == sum(2 * lengths[i] for lengths in pairs for i in (0, 2))
    stats, shares = padding("bfloat16", True, budget=10**6)  # one micro-batch per rank, at its longest row
    assert stats["micro_batches_per_rank"] == [1, 1]
    assert stats["tokens_run"] == sum(4 * int(s["attention_mask"].sum(1).max()) for s in shares)


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(cfg: dict):
    from arpo.trainer.fsdp_worker import ActorWorker

    worker = ActorWorker(cfg, "actor", 0, 1)
    worker.init_model()
    return worker


@pytest.mark.parametrize("tree_packing", [False, True], ids=["padded", "tree_packed"])
def test_dynamic_batching_gives_row_batchings_log_probs_loss_and_gradients(small_model, one_process_group,
                                                                           tree_packing):
    """float32, one FSDP2 process: the same batch micro-batched by 2 rows and by a token budget that makes
    micro-batches of 1 to 3 rows (and splits trees) gives the same old log-probs, losses, gradients and weights."""
    rows_cfg = base_config(small_model, world=1, tree_packing=tree_packing, ppo_micro_batch_size_per_gpu=2)
    rows_cfg["actor_rollout_ref"]["model"]["dtype"] = "float32"
    batch = tree_batch(4, 2, seed=3) if tree_packing else random_batch(8, seed=3)
    if tree_packing:
        from arpo.trainer.tree_packing import tree_columns

        batch.tensors.update(tree_columns(batch))
    lengths = batch["attention_mask"].sum(1)
    budget = int(2 * lengths.float().median())
    dyn_cfg = copy.deepcopy(rows_cfg)
    dyn_cfg["actor_rollout_ref"]["actor"].update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
    dyn_cfg["actor_rollout_ref"]["rollout"].update(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=budget)

    results = []
    for cfg in (rows_cfg, dyn_cfg):
        worker = _worker(cfg)
        old = worker.compute_log_prob(batch)
        train = add_training_columns(batch, old["log_probs"], seed=4)
        if cfg is dyn_cfg:
            micros = worker.micro_batches(train.index(torch.arange(4)), 2, budget)
            assert sorted(len(m) for m in micros) != [2, 2]  # the budget really regroups the rows
        metrics = worker.update_policy(train, keep_gradients=True)
        results.append((old, metrics, worker.full_gradients(), worker.full_parameters()))
    (old_r, met_r, grads_r, params_r), (old_d, met_d, grads_d, params_d) = results
    assert torch.allclose(old_r["log_probs"], old_d["log_probs"], atol=1e-6)
    assert torch.allclose(old_r["entropy"], old_d["entropy"], atol=1e-6)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/entropy"):
        assert met_d[key] == pytest.approx(met_r[key], rel=1e-6, abs=1e-6), key
    assert max_abs_diff(grads_d, grads_r) < 1e-6
    # Adam divides by the root of the squared gradients: the rows summed in another order move a weight with a
    # near-zero gradient by up to about lr (1e-3) times its relative rounding error (measured 3e-6)
    assert max_abs_diff(params_d, params_r) < 1e-5


def test_dynamic_batching_keys_are_validated():
    from arpo.trainer.actor_config import ConfigError, validate_actor_config

    cfg = base_config("unused", world=1, use_dynamic_bsz="yes")
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.use_dynamic_bsz must be true or false"):
        validate_actor_config(cfg)
    cfg = base_config("unused", world=1, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=0)
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.ppo_max_token_len_per_gpu must be a positive"):
        validate_actor_config(cfg)
    cfg = base_config("unused", world=1)
    cfg["actor_rollout_ref"]["ref"]["log_prob_max_token_len_per_gpu"] = -3
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"):
        validate_actor_config(cfg)


@pytest.mark.slow
def test_two_rank_dynamic_batching_update_equals_one_process(small_model, ray_cluster):
    """2 gloo ranks with token-budget micro-batches of uneven counts per rank: one plain process's update."""
    cfg = base_config(small_model, world=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=20)
    cfg["actor_rollout_ref"]["rollout"].update(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=20)
    _, train, metrics, params, grads = ray_update(cfg, random_batch(8, seed=1), seed=2)
    ref_params, ref_grads, ref_metrics = reference_update(small_model, train, cfg)
    assert max_abs_diff(grads, ref_grads) < 1e-6
    assert max_abs_diff(params, ref_params) < 1e-6
    for key in ("pg_loss", "kl_loss", "grad_norm"):
        expected = sum(m[key] for m in ref_metrics) / len(ref_metrics)
        assert metrics[f"actor/{key}"] == pytest.approx(expected, rel=1e-5, abs=1e-6), key
