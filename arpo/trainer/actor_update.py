"""verl's dp_actor.update_policy for one FSDP2 rank: PPO epochs over mini-batches over micro-batches.

Data parallelism is exact and scaled as verl 0.9.1's FSDP actor scales it (``FSDPEngine.forward_backward_batch``
with ``ppo_loss``): for each PPO mini-batch the loss tokens and the rows are all-reduced over ranks first and
passed to every loss as verl's ``global_batch_info`` (``batch_num_tokens``, ``global_batch_size`` = all real rows
of the mini-batch, ``dp_size``, ``loss_scale_factor``); each micro-batch's loss is its local numerator over
those *global* counts times the world size, and FSDP2 averages the gradients over ranks. The gradient of
every mini-batch is then the gradient of the loss of the whole mini-batch computed in one process with the
same counts, whatever the number of ranks or micro-batches (tests/trainer/test_fsdp_update.py checks it to
1e-6). seq-mean-token-sum-norm divides by ``actor.loss_scale_factor``, or when that is null by
``data.max_response_length`` (verl pads every response to ``rollout.response_length`` and divides by that
width), so its scale does not follow the longest response of the step.

On-policy updates (one mini-batch per step and ``ppo_epochs`` = 1, ARPO's setting) need no old log-probs:
the policy that sampled is the one being updated, so ``old_log_probs`` is the detached log-prob of the
update's own forward and the PPO ratio is exactly 1. verl's dp_actor does the same (``on_policy = len(
mini_batches) == 1 and ppo_epochs == 1``); the released ARPO code (an older verl) always runs a separate
old-log-prob pass first, which gives the same update up to float rounding at the cost of one more forward
over the batch. A batch without ``old_log_probs`` takes this path, and the entropy metric then comes from
the same forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from arpo.batch import DataBatch
from arpo.trainer import core_algos
from arpo.trainer.micro_batches import dummy_micro_batch, mini_batch_indices
from arpo.trainer.rollout_correction import mismatch_sums, rollout_is_weights

if TYPE_CHECKING:
    from arpo.trainer.fsdp_worker import ActorWorker


#: Metrics returned by the update (verl's names).
METRIC_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy",
               "actor/kl_loss", "actor/grad_norm", "actor/lr")
#: With the rollout's log-probs in the batch: the rollout-vs-trainer gap (verl's rollout correction names), token
#: means over each mini-batch averaged like the others, and maxima over the step.
MISMATCH_MEAN_KEYS = ("rollout_corr/kl", "rollout_corr/k3_kl", "training/rollout_probs_diff_mean",
                      "rollout_corr/rollout_is_mean")
MISMATCH_MAX_KEYS = ("rollout_corr/ratio_max", "training/rollout_probs_diff_max")


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def global_batch_info(worker: "ActorWorker", loss_mask: torch.Tensor, real_rows: torch.Tensor,
                      loss_scale_factor: float | None = None) -> dict[str, float | int | None]:
    """verl's ``global_batch_info`` for one mini-batch: :func:`core_algos.agg_loss`'s keywords, with this rank's
    loss tokens and real rows (pad rows excluded) summed over all ranks (one all-reduce)."""
    tokens, rows = worker.all_reduce_sum([float(loss_mask.sum()), float(real_rows.sum())]).tolist()
    return {"dp_size": worker.world_size, "batch_num_tokens": tokens, "global_batch_size": rows,
            "loss_scale_factor": None if loss_scale_factor is None else float(loss_scale_factor)}


def ppo_update(worker: "ActorWorker", batch: DataBatch, keep_gradients: bool = False) -> dict[str, float]:
    """The body of :meth:`ActorWorker.update_policy` (see there for the batch contract)."""
    p = worker.cfg.policy
    mini_rows = int(batch.meta.get("mini_batch_rows_per_rank", max(1, worker.cfg.mini_batch_rows // worker.world_size)))
    epochs = int(p.ppo_epochs)
    minis = mini_batch_indices(batch, mini_rows)
    on_policy = epochs == 1 and len(minis) == 1
    has_old = "old_log_probs" in batch.tensors
    needed = ["responses", "input_ids", "attention_mask", "position_ids", "response_mask", "advantages"]
    use_kl = bool(p.use_kl_loss)
    if use_kl:
        needed.append("ref_log_prob")
    missing = [k for k in needed if k not in batch.tensors]
    if missing:
        raise ValueError(f"update_policy: batch lacks {missing} (compute ref log-probs and advantages first)")
    if not has_old and not on_policy:
        raise ValueError("update_policy: batch lacks old_log_probs, which only an on-policy update (one "
                         "mini-batch per step, ppo_epochs=1) can do without; compute them first")

    mode, clip = p.loss_agg_mode, p.clip_ratio
    clip_low = p.clip_ratio_low if p.clip_ratio_low is not None else clip
    clip_high = p.clip_ratio_high if p.clip_ratio_high is not None else clip
    clip_c = float(p.clip_ratio_c)
    balanced_clip = bool(p.enable_entropy_balanced_clipping)
    entropy_coeff = float(p.entropy_coeff)
    kl_coef, kl_type = float(p.kl_loss_coef), p.kl_loss_type
    micro_size = int(p.ppo_micro_batch_size_per_gpu)
    max_tokens = int(p.ppo_max_token_len_per_gpu) if p.use_dynamic_bsz else None  # packed by tokens instead
    scale_factor = p.loss_scale_factor if p.loss_scale_factor is not None else batch.meta.get("max_response_length")
    grad_clip = float(p.grad_clip)
    has_rollout = "rollout_log_probs" in batch.tensors
    is_level = p.rollout_is if has_rollout else None
    is_threshold = float(p.rollout_is_threshold)
    # Without a separate old-log-prob pass the entropy metric (verl's actor/entropy) comes from here; as a
    # metric only it is computed without autograd.
    calc_entropy = entropy_coeff != 0 or not has_old
    temperature = worker.temperature(batch)
    lr = float(worker.lr_scheduler.get_last_lr()[0])
    dev = worker.device

    worker.model.train()
    sums: dict[str, float] = {k: 0.0 for k in METRIC_KEYS + MISMATCH_MEAN_KEYS}
    maxima = [0.0, 0.0]
    n_updates = 0
    for _ in range(epochs):
        for mb_rows in minis:
            mb = batch.index(mb_rows)
            resp_mask = mb["response_mask"].float()
            if "is_pad" in mb.tensors:
                resp_mask = resp_mask * (1 - mb["is_pad"].float()).unsqueeze(-1)
            real_rows = (1 - mb["is_pad"].float()) if "is_pad" in mb.tensors else torch.ones(len(mb))
            agg = global_batch_info(worker, resp_mask, real_rows, scale_factor)
            g_tokens = agg["batch_num_tokens"]

            worker.optimizer.zero_grad(set_to_none=True)
            # [pg_loss, kl_loss, clipfrac·tok, ppo_kl·tok, clipfrac_lower·tok, entropy·tok,
            #  then with rollout log-probs: k1 KL·tok, k3 KL·tok, probs diff·tok, IS weight·tok]
            local = torch.zeros(10, dtype=torch.float64)
            local_max = [0.0, 0.0]
            micros = worker.micro_batches(mb, micro_size, max_tokens)
            for i in range(worker.micro_batch_count(micros)):
                if i >= len(micros):  # this rank has fewer trees than another: join its collectives
                    lp, _ = worker.forward(dummy_micro_batch(mb), temperature, False)
                    (lp.sum() * 0.0).backward()
                    continue
                sl = micros[i]
                micro = mb.index(sl)
                mask = resp_mask[sl].to(dev)
                n_tok = float(mask.sum())
                # Only loss positions reach the vocabulary projection: tool results and pad rows carry none.
                log_prob, entropy = worker.forward(micro, temperature, calc_entropy=calc_entropy,
                                                   entropy_grad=entropy_coeff != 0, head_mask=mask)
                old_log_prob = micro["old_log_probs"].to(dev) if has_old else log_prob.detach()
                weights = None
                if has_rollout:
                    rollout_lp = micro["rollout_log_probs"].to(dev)
                    gap_sums, gap_max = mismatch_sums(old_log_prob, rollout_lp, mask)
                    local[6:9] += torch.tensor(gap_sums, dtype=torch.float64)
                    local_max = [max(a, b) for a, b in zip(local_max, gap_max)]
                    if is_level is not None:
                        weights = rollout_is_weights(old_log_prob, rollout_lp, mask, is_level, is_threshold)
                        local[9] += float(weights.sum())
                pg_loss, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
                    old_log_prob=old_log_prob, log_prob=log_prob,
                    advantages=micro["advantages"].to(dev), response_mask=mask,
                    cliprange=clip, cliprange_low=clip_low, cliprange_high=clip_high, clip_ratio_c=clip_c,
                    loss_agg_mode=mode, rollout_is_weights=weights, entropy_balanced_clipping=balanced_clip, **agg)
                loss = pg_loss
                if entropy_coeff != 0:
                    loss = loss - entropy_coeff * core_algos.agg_loss(entropy, mask, mode, **agg)
                if calc_entropy:
                    local[5] += float((entropy.detach() * mask).sum())
                if use_kl:
                    kl_loss = core_algos.compute_kl_loss(log_prob, micro["ref_log_prob"].to(dev), mask,
                                                         kl_type, mode, **agg)
                    loss = loss + kl_coef * kl_loss
                    local[1] += float(kl_loss.detach())
                loss.backward()
                local[0] += float(pg_loss.detach())
                local[2] += float(clipfrac.detach()) * n_tok
                local[3] += float(ppo_kl.detach()) * n_tok
                local[4] += float(clipfrac_lower.detach()) * n_tok
                del log_prob, entropy, loss  # the graph is gone; let the next micro-batch reuse its memory

            grad_norm = worker.clip_and_step(grad_clip)
            tot = worker.all_reduce_sum(local)
            # Each rank's losses are (local numerator / global count) · world size.
            sums["actor/pg_loss"] += float(tot[0]) / worker.world_size
            sums["actor/kl_loss"] += float(tot[1]) / worker.world_size
            per_tok = max(g_tokens, 1.0)
            sums["actor/pg_clipfrac"] += float(tot[2]) / per_tok
            sums["actor/ppo_kl"] += float(tot[3]) / per_tok
            sums["actor/pg_clipfrac_lower"] += float(tot[4]) / per_tok
            sums["actor/entropy"] += float(tot[5]) / per_tok
            for key, value in zip(MISMATCH_MEAN_KEYS, tot[6:10].tolist()):
                sums[key] += value / per_tok
            if has_rollout:
                maxima = [max(a, b) for a, b in zip(maxima, worker.all_reduce_max(local_max).tolist())]
            sums["actor/grad_norm"] += float(grad_norm)
            n_updates += 1
    if not keep_gradients:
        # The last mini-batch's gradients would otherwise stay allocated (a full fp32 shard) through the next
        # generation, log-prob pass and weight sync, where the memory plan counts none.
        worker.optimizer.zero_grad(set_to_none=True)
    worker.lr_scheduler.step()
    metrics = {k: v / max(1, n_updates) for k, v in sums.items()}
    metrics["actor/lr"] = lr
    if not calc_entropy:
        metrics.pop("actor/entropy")  # the trainer logs it from the old-log-prob pass
    if not use_kl:
        metrics.pop("actor/kl_loss")
    if has_rollout:
        metrics.update(zip(MISMATCH_MAX_KEYS, maxima))
        if is_level is None:
            metrics.pop("rollout_corr/rollout_is_mean")
    else:
        for key in MISMATCH_MEAN_KEYS:
            metrics.pop(key)
    return metrics
