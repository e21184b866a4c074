"""Shared pieces of the worker / checkpoint tests: a very small model, random verl-layout batches, configs,
a private Ray cluster, and the single-process reference update the FSDP2 workers must reproduce."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Iterator

import pytest
import torch

from arpo.batch import DataBatch, Trajectory, collate_trajectories

# Small enough that a Ray actor loads and updates it in well under a second.
SMALL_MODEL = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def build_small_model(out_dir: Path, synthetic_dir: Path) -> Path:
    from arpo.models.tiny import build_tiny_model

    return build_tiny_model(out_dir, [synthetic_dir / "train.parquet", synthetic_dir / "corpus.jsonl"], seed=0,
                            **SMALL_MODEL)


@pytest.fixture(scope="session")
def small_model(synthetic_dir, tmp_path_factory) -> Path:
    return build_small_model(tmp_path_factory.mktemp("small-model"), synthetic_dir)


@pytest.fixture
def one_process_group():
    """Leave the in-process group after a test that ran workers in this process (world size 1)."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def base_config(model_dir: Path, world: int = 2, tree_packing: bool = False, **actor_overrides) -> dict:
    """Padded layout by default (``tree_packing`` off): the tests of data-parallel exactness compare it with the
    padded one-process reference; the tree-packed update has its own tests."""
    actor = {
        "strategy": "fsdp2", "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 1,
        "grad_clip": 1.0e6, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
        "clip_ratio_c": 3.0, "loss_agg_mode": "token-mean", "entropy_coeff": 0.01, "use_kl_loss": True,
        "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "logprob_chunk_size": 7,
        "optim": {"lr": 1e-3, "weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "warmup_style": "constant",
                  "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "total_training_steps": 10},
    }
    for k, v in actor_overrides.items():
        actor[k] = v
    return {
        "trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": world, "cpus_per_worker": 1},
        "data": {"train_batch_size": 4},
        "actor_rollout_ref": {
            "model": {"path": str(model_dir), "dtype": "auto", "tree_packing": tree_packing},
            "actor": actor,
            "ref": {"log_prob_micro_batch_size_per_gpu": 3},
            "rollout": {"n": 2, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 3},
        },
        "ray_init": {"num_cpus": 4, "object_store_memory": 100 * 1024 * 1024},
    }


def random_batch(n_rows: int, seed: int, vocab: int = 400, n_per_group: int = 2, system: int = 0) -> DataBatch:
    """Rows of random prompts and responses (model tokens, then tool tokens, then model tokens); every
    prompt begins with the same ``system`` tokens (a system prompt)."""
    rng = random.Random(seed)
    system_ids = [rng.randrange(5, vocab) for _ in range(system)]
    trajs = []
    for i in range(n_rows):
        prompt = system_ids + [rng.randrange(5, vocab) for _ in range(rng.randint(3, 9))]
        t = Trajectory(group=i // n_per_group, prompt_ids=prompt)
        t.append([rng.randrange(5, vocab) for _ in range(rng.randint(1, 5))], True)
        t.append([rng.randrange(5, vocab) for _ in range(rng.randint(0, 3))], False)
        t.append([rng.randrange(5, vocab) for _ in range(rng.randint(1, 4))], True)
        trajs.append(t)
    n_groups = (n_rows + n_per_group - 1) // n_per_group
    return collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{g}" for g in range(n_groups)])


def tree_batch(groups: int, rows: int, seed: int, vocab: int = 400) -> DataBatch:
    """ARPO-shaped groups: ``rows`` trajectories per prompt, each after the first forked from an earlier one at
    a random point of its response (model tokens, a tool result, model tokens), so rows share their prompt and
    their parent's first ``branch_pos`` tokens."""
    rng = random.Random(seed)
    trajs: list[Trajectory] = []
    for g in range(groups):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(4, 10))]
        first = len(trajs)
        for r in range(rows):
            t = Trajectory(group=g, prompt_ids=prompt)
            if r and rng.random() < 0.8:
                t.parent = first + rng.randrange(r)
                parent = trajs[t.parent]
                t.branch_pos = rng.randint(0, len(parent.response_ids))
                t.response_ids = parent.response_ids[: t.branch_pos]
                t.response_mask = parent.response_mask[: t.branch_pos]
            t.append([rng.randrange(5, vocab) for _ in range(rng.randint(1, 5))], True)
            t.append([rng.randrange(5, vocab) for _ in range(rng.randint(0, 3))], False)
            t.append([rng.randrange(5, vocab) for _ in range(rng.randint(1, 4))], True)
            trajs.append(t)
    return collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{g}" for g in range(groups)])


def add_training_columns(batch: DataBatch, old_log_probs: torch.Tensor, seed: int) -> DataBatch:
    """Old log-probs perturbed (so ratios leave 1 and clipping happens), a reference, and advantages."""
    g = torch.Generator().manual_seed(seed)
    out = copy.copy(batch)
    out.tensors = dict(batch.tensors)
    noise = 0.3 * torch.randn(old_log_probs.shape, generator=g)
    out.tensors["old_log_probs"] = old_log_probs + noise
    out.tensors["ref_log_prob"] = old_log_probs - 0.2 * torch.randn(old_log_probs.shape, generator=g)
    adv = torch.randn(len(batch), 1, generator=g).expand_as(old_log_probs).clone()
    out.tensors["advantages"] = adv * batch["response_mask"]
    return out


def ray_update(cfg: dict, batch: DataBatch, seed: int, **log_prob_kwargs
               ) -> tuple[dict[str, torch.Tensor], DataBatch, dict[str, float], dict, dict]:
    """What the data-parallel tests compare with :func:`reference_update`: an actor RayWorkerGroup's old log-probs of
    ``batch``, one update on them (:func:`add_training_columns` with ``seed``), then its full parameters and
    gradients; the group is shut down even when a call fails, so the next test gets the cluster's CPUs.
    Returns ``(old, train, metrics, params, grads)``."""
    from arpo.trainer.worker_group import RayWorkerGroup

    group = RayWorkerGroup(cfg, role="actor")
    try:
        old = group.compute_log_prob(batch, **log_prob_kwargs)
        train = add_training_columns(batch, old["log_probs"], seed=seed)
        metrics = group.update_policy(train, keep_gradients=True)
        return old, train, metrics, group.full_parameters(), group.full_gradients()
    finally:
        group.shutdown()


def reference_mini_batches(model: torch.nn.Module, batch: DataBatch, section: dict, rollout_n: int
                           ) -> Iterator[DataBatch]:
    """One process's PPO schedule with plain AdamW over ``section`` (the actor's or the critic's config): every
    mini-batch of ``ppo_mini_batch_size * rollout.n`` rows, every epoch. The caller backpropagates each mini-batch's
    loss; the optimizer step follows when it asks for the next one (the last one's gradients stay)."""
    o = section["optim"]
    opt = torch.optim.AdamW(model.parameters(), lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"],
                            eps=o["eps"])
    rows = section["ppo_mini_batch_size"] * rollout_n
    for _ in range(section["ppo_epochs"]):
        for start in range(0, len(batch), rows):
            opt.zero_grad(set_to_none=True)
            yield batch.index(slice(start, start + rows))
            opt.step()


def reference_update(model_dir: Path, batch: DataBatch, cfg: dict) -> tuple[dict, dict, list[dict]]:
    """What one process does: whole mini-batches at once, plain HF model, plain AdamW.
    Returns (final params, gradients of the last mini-batch, per-mini-batch metrics)."""
    from transformers import AutoModelForCausalLM

    from arpo.trainer import core_algos
    from arpo.trainer.logprobs import compute_logprobs_and_entropy

    a = cfg["actor_rollout_ref"]["actor"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    metrics = []
    for mb in reference_mini_batches(model, batch, a, cfg["actor_rollout_ref"]["rollout"]["n"]):
        # The plain padded layout with masked attention (fp32 ranks use it too: DeviceSettings.fast_layout).
        logp, ent = compute_logprobs_and_entropy(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                                 mb["responses"].shape[1], calc_entropy=True, pack=False)
        mask = mb["response_mask"].float()
        mode = a["loss_agg_mode"]
        # verl's actor divides the seq modes by all rows of the mini-batch (global_batch_size), even in one process.
        agg = {"global_batch_size": len(mb), "loss_scale_factor": a.get("loss_scale_factor")}
        pg_loss, clipfrac, ppo_kl, lower = core_algos.compute_policy_loss(
            mb["old_log_probs"], logp, mb["advantages"], mask, cliprange=a["clip_ratio"],
            cliprange_low=a["clip_ratio_low"], cliprange_high=a["clip_ratio_high"],
            clip_ratio_c=a["clip_ratio_c"], loss_agg_mode=mode, **agg)
        loss = pg_loss - a["entropy_coeff"] * core_algos.agg_loss(ent, mask, mode, **agg)
        kl = core_algos.compute_kl_loss(logp, mb["ref_log_prob"], mask, a["kl_loss_type"], mode, **agg)
        loss = loss + a["kl_loss_coef"] * kl
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a["grad_clip"])
        metrics.append({"pg_loss": float(pg_loss.detach()), "kl_loss": float(kl.detach()), "grad_norm": float(norm),
                        "pg_clipfrac": float(clipfrac.detach()), "ppo_kl": float(ppo_kl.detach())})
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, grads, metrics


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
