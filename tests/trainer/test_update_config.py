"""Config side of the faster update: when the old-log-prob pass can be skipped, the checkpointing key, the
CPU autocast settings, and the micro-batch ordering."""

from __future__ import annotations

import pytest
import torch

from arpo.config import ConfigError
from arpo.trainer.actor_config import needs_old_log_prob_pass, validate_actor_config
from arpo.trainer.micro_batches import micro_batch_order
from arpo.trainer.device import device_settings


def _cfg(train_batch_size=4, mini=4, epochs=1, kl_in_reward=False, checkpointing=True) -> dict:
    return {
        "trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": 2},
        "algorithm": {"use_kl_in_reward": kl_in_reward},
        "data": {"train_batch_size": train_batch_size},
        "actor_rollout_ref": {
            "model": {"dtype": "bfloat16", "enable_gradient_checkpointing": checkpointing},
            "actor": {"ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": epochs},
            "rollout": {"n": 4},
        },
    }


@pytest.mark.parametrize("kwargs,needed", [
    ({}, False),                                   # one mini-batch, one epoch: on-policy
    ({"mini": 2}, True),                           # two optimizer steps: the second is off-policy
    ({"epochs": 2}, True),                         # the second epoch is off-policy
    ({"kl_in_reward": True}, True),                # the reward's KL reads old log-probs before the update
])
def test_old_log_prob_pass_only_when_the_update_is_not_on_policy(kwargs, needed):
    assert needs_old_log_prob_pass(_cfg(**kwargs)) is needed


def test_gradient_checkpointing_key_must_be_a_boolean():
    validate_actor_config(_cfg(checkpointing=False))
    with pytest.raises(ConfigError, match="enable_gradient_checkpointing must be true or false") as err:
        validate_actor_config(_cfg(checkpointing="yes"))
    assert "\n" not in str(err.value)


def test_share_prefix_key_must_be_a_boolean():
    cfg = _cfg()
    cfg["actor_rollout_ref"]["model"]["share_prefix"] = False
    validate_actor_config(cfg)
    cfg["actor_rollout_ref"]["model"]["share_prefix"] = "on"
    with pytest.raises(ConfigError, match="share_prefix must be true or false") as err:
        validate_actor_config(cfg)
    assert "\n" not in str(err.value)


def test_use_torch_compile_key_must_be_a_boolean_and_reaches_the_actor_only():
    from arpo.trainer.worker_config import WorkerConfig

    cfg = _cfg()
    cfg["actor_rollout_ref"]["actor"]["use_torch_compile"] = True
    validate_actor_config(cfg)
    assert WorkerConfig.from_config(cfg, "actor").use_torch_compile
    assert not WorkerConfig.from_config(cfg, "ref").use_torch_compile  # the key is the actor's
    cfg["actor_rollout_ref"]["actor"]["use_torch_compile"] = "yes"
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.use_torch_compile must be true or false") as err:
        validate_actor_config(cfg)
    assert "\n" not in str(err.value)


def test_tree_packing_needs_a_boolean_and_a_kernel_that_takes_a_tree_mask():
    cfg = _cfg()
    cfg["actor_rollout_ref"]["model"]["tree_packing"] = "yes"
    with pytest.raises(ConfigError, match="tree_packing must be true, false or auto"):
        validate_actor_config(cfg)
    cfg["actor_rollout_ref"]["model"].update(tree_packing=True, attn_implementation="flash_attention_2")
    with pytest.raises(ConfigError, match="attn_implementation=sdpa") as err:
        validate_actor_config(cfg)
    assert "\n" not in str(err.value)
    cfg["actor_rollout_ref"]["model"]["tree_packing"] = "auto"  # on for CPU (this test's trainer.device)
    with pytest.raises(ConfigError, match="attn_implementation=sdpa"):
        validate_actor_config(cfg)
    cfg["actor_rollout_ref"]["model"]["tree_packing"] = False
    validate_actor_config(cfg)


def test_cpu_low_precision_is_autocast_and_gpu_is_fsdp_mixed_precision():
    cpu = device_settings("cpu", "bfloat16")
    assert cpu.autocast and not cpu.fsdp_mixed_precision
    with cpu.autocast_context():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    exact = device_settings("cpu", "float32")
    assert not exact.autocast and not exact.fsdp_mixed_precision
    with exact.autocast_context():
        assert not torch.is_autocast_enabled("cpu")
    if torch.cuda.is_available():
        gpu = device_settings("cuda", "bfloat16")
        assert gpu.fsdp_mixed_precision and not gpu.autocast


def test_micro_batch_order_groups_rows_by_length():
    lengths = torch.tensor([3, 9, 5, 9, 1])
    mask = (torch.arange(10).expand(5, 10) < lengths.unsqueeze(1)).long()
    order = micro_batch_order(mask)
    assert order.tolist() == [1, 3, 2, 0, 4]  # longest first, ties in their original order


def test_balanced_split_evens_tokens_and_gathers_back_in_order():
    from arpo.trainer.worker_group import balanced_order, gather_rows, split_for_ranks
    from tests.trainer.workers_helpers import random_batch

    batch = random_batch(9, seed=3)
    lengths = batch["attention_mask"].sum(1)
    # Plain split: rows dealt by length, results come back in the batch's order (pad row dropped).
    shares, _ = split_for_ranks(batch, world_size=2, balance=True)
    assert [len(s) for s in shares] == [5, 5]
    results = [{"ids": s["input_ids"]} for s in shares]
    back = gather_rows(results, [s["is_pad"] for s in shares], [s["row_index"] for s in shares])
    assert torch.equal(back["ids"], batch["input_ids"])
    # Mini-batch split: every mini-batch's rows, each exactly once, over the ranks.
    shares, per_rank = split_for_ranks(batch, world_size=2, mini_batch_rows=4, balance=True)
    assert per_rank == 2 and [len(s) for s in shares] == [5, 5]
    for start, stop in ((0, 2), (2, 4)):
        got = torch.cat([s["input_ids"][start:stop] for s in shares])
        want = batch["input_ids"][2 * start: 2 * stop]
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))
    # Snake dealing: the token counts of the two shares differ by less than the longest row.
    order = balanced_order(batch["attention_mask"][:8], 2)
    halves = lengths[:8][order].split(4)
    assert abs(int(halves[0].sum()) - int(halves[1].sum())) < int(lengths.max())


def test_global_batch_info_is_verls_for_the_mini_batch():
    """What every loss of a mini-batch is normalised by: loss tokens and real rows summed over the ranks
    (pad rows left out; a real row without loss tokens counted, as verl's global_batch_size)."""
    from arpo.trainer.actor_update import global_batch_info

    class Rank:  # rank 0 of 2; the other rank holds 3 real rows with 7 loss tokens
        world_size = 2

        def all_reduce_sum(self, values):
            return torch.as_tensor(values, dtype=torch.float64) + torch.tensor([7.0, 3.0])

    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0]])  # a real row without tokens, then a pad row
    real_rows = torch.tensor([1.0, 1.0, 0.0])
    info = global_batch_info(Rank(), mask, real_rows, loss_scale_factor=None)
    assert info == {"dp_size": 2, "batch_num_tokens": 9.0, "global_batch_size": 5.0, "loss_scale_factor": None}
    assert global_batch_info(Rank(), mask, real_rows, 4096)["loss_scale_factor"] == 4096.0


def test_worker_config_takes_each_rank_key_from_the_composed_yaml():
    """The typed view a rank reads (WorkerConfig) holds the YAML's values, not its own defaults."""
    from arpo.config import load_config
    from arpo.trainer.worker_config import WorkerConfig

    cfg = load_config("arpo_trainer", ["actor_rollout_ref.actor.clip_ratio_high=0.28",
                                       "actor_rollout_ref.actor.optim.lr=3e-6", "critic.optim.lr=2e-5",
                                       "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=3"])
    actor, ref, critic = (WorkerConfig.from_config(cfg, role) for role in ("actor", "ref", "critic"))
    a = cfg.actor_rollout_ref
    assert actor.policy.clip_ratio_high == 0.28 and actor.policy.clip_ratio_low == a.actor.clip_ratio_low
    assert actor.optim.lr == 3e-6 and critic.optim.lr == 2e-5 and isinstance(actor.optim.betas, tuple)
    assert actor.model.path == a.model.path == critic.model.path  # critic.model.path null: the actor's
    assert actor.log_prob_micro_batch_size == a.rollout.log_prob_micro_batch_size_per_gpu
    assert ref.log_prob_micro_batch_size == 3
    assert actor.mini_batch_rows == a.actor.ppo_mini_batch_size * a.rollout.n
    assert critic.mini_batch_rows == cfg.critic.ppo_mini_batch_size * a.rollout.n
    assert actor.policy.logprob_chunk_size == a.actor.logprob_chunk_size
    assert actor.save_contents == tuple(a.actor.checkpoint.save_contents)
    assert actor.model.tree_packing == a.model.tree_packing and critic.model.tree_packing is False
