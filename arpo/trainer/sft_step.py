"""The SFT step on the trainer's FSDP2 ranks: masked LM loss, backward, grad clip, AdamW, the SFT schedule.

:class:`SFTWorker` is the actor worker (:class:`~arpo.trainer.fsdp_worker.ActorWorker`: the same model loading,
sharding, checkpoints and HF export) with the SFT optimizer and one more collective, :meth:`SFTWorker.sft_step`.
The driver (:mod:`arpo.sft`) cuts each global batch into one contiguous share of rows per rank
(:meth:`arpo.trainer.worker_group.WorkerGroup.sft_step`). Each rank's loss is the mean over its own trained tokens
times ``local tokens x world size / global tokens``, and FSDP2 averages the gradients over the ranks, so every
step's gradient is that of the global batch's mean loss whatever the number of ranks (exactly the one-process
loss on one rank, where the factor is 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from arpo.trainer.fsdp_worker import ActorWorker
from arpo.trainer.logprobs import head_swapped, shared_prefix_cache

#: AdamW betas of the cold-start SFT (as ARPO's SFT recipe)
SFT_BETAS = (0.9, 0.95)


def sft_lr_lambda(step: int, warmup: int, total: int) -> float:
    """LR multiplier at scheduler step ``step``: linear warm-up times a cosine over all ``total`` steps."""
    return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total)))


def sft_warmup_steps(total: int, warmup_ratio: float) -> int:
    return max(1, int(total * warmup_ratio))


class _TrainedPositionsHead(torch.nn.Module):
    """Stands in for the output head during one forward: logits only at the positions that predict a trained
    token (most positions are prompt or tool output), so the (B, T, V) logits never exist. Running inside the
    model's own forward keeps FSDP2's root hooks (which gather the head and the embedding) in charge."""

    def __init__(self, head: torch.nn.Module, keep: torch.Tensor):
        super().__init__()
        self.head, self.keep = head, keep

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.head(hidden_states[:, :-1][self.keep])


def masked_lm_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                     shared_prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logits (K, V), targets (K,), anchor)`` of the K trained positions (labels != -100) of a right-padded
    batch; ``anchor`` is a zero to add to the loss when a shared prefix ran (else None).

    ``shared_prefix`` > 0: the first ``shared_prefix`` tokens are the same in every row (the system prompt) and
    untrained; they run once and every row reads their keys and values (the RL log-probs'
    :func:`~arpo.trainer.logprobs.shared_prefix_cache`)."""
    if shared_prefix:
        if not bool((labels[:, : shared_prefix + 1] == -100).all()):
            raise ValueError("shared_prefix covers trained tokens; it must end inside the masked prompt")
        if not bool((input_ids[:, :shared_prefix] == input_ids[:1, :shared_prefix]).all()):
            raise ValueError("shared_prefix covers tokens that differ between rows")
    positions = torch.arange(shared_prefix, device=input_ids.device).unsqueeze(0)
    with shared_prefix_cache(model, input_ids[:1, :shared_prefix], positions) as (cache, anchor):
        input_ids, labels = input_ids[:, shared_prefix:], labels[:, shared_prefix:]
        targets = labels[:, 1:]
        keep = targets != -100
        with head_swapped(model, _TrainedPositionsHead(model.lm_head, keep)):
            out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=False)
    return out.logits, targets[keep], anchor


def trained_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of :func:`masked_lm_logits`'s positions; a zero joined to the graph when there
    are none (a micro-batch that trains no token still runs its backward: FSDP2's reduce-scatters are collective)."""
    return F.cross_entropy(logits.float(), targets) if targets.numel() else logits.float().sum() * 0.0


def trained_tokens(labels: torch.Tensor) -> int:
    """How many next-token targets of right-padded ``labels`` are trained (the first column predicts nothing):
    the driver's global count and each micro-batch's share of it must count alike."""
    return int((labels[:, 1:] != -100).sum())


def masked_lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                   shared_prefix: int = 0) -> torch.Tensor:
    """Next-token cross-entropy (mean) over the trained positions only; see :func:`masked_lm_logits`. Same loss
    and gradients with or without ``shared_prefix``, about half the tokens with it."""
    logits, targets, anchor = masked_lm_logits(model, input_ids, attention_mask, labels, shared_prefix)
    loss = trained_token_loss(logits, targets)
    return loss if anchor is None else loss + anchor


class SFTWorker(ActorWorker):
    """One FSDP2 rank of the SFT model (``role="sft"``): full fine-tuning (no LoRA), AdamW (fused, betas
    :data:`SFT_BETAS`) with ``sft.lr`` / ``sft.weight_decay`` and the warm-up + cosine schedule of
    :func:`sft_lr_lambda` over ``trainer.total_training_steps`` (the driver plans them)."""

    ROLES = ("sft",)
    OPTIM_KEY = "sft"

    def _build_optimizer(self) -> None:
        s = self.config["sft"]
        total = max(1, self.cfg.total_training_steps)
        warmup = sft_warmup_steps(total, float(s["warmup_ratio"]))
        # fused: one kernel for all parameters; the per-parameter loop costs ~5% of a tiny-model step
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=float(s["lr"]), betas=SFT_BETAS,
                                           weight_decay=float(s["weight_decay"]), fused=True)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: sft_lr_lambda(step, warmup, total))

    def sft_step(self, share: dict[str, torch.Tensor], shared_prefix: int, global_tokens: int) -> dict[str, float]:
        """One optimizer step on this rank's rows of a global batch (``input_ids``, ``attention_mask``,
        ``labels``, right-padded; ``global_tokens`` trained tokens in the whole batch), in micro-batches of
        ``sft.micro_batch_size_per_gpu`` rows (null: the whole share in one forward). Collective. Returns the
        global batch's mean loss, the gradient norm before clipping and the LR the step used (equal on every
        rank)."""
        dev = self.device
        ids, attn, labels = (share[k].to(dev) for k in ("input_ids", "attention_mask", "labels"))
        micro = int(self.config["sft"].get("micro_batch_size_per_gpu") or len(ids))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for rows in range(0, len(ids), micro):
            sl = slice(rows, rows + micro)
            with self.settings.autocast_context():
                loss = masked_lm_loss(self.model, ids[sl], attn[sl], labels[sl], shared_prefix)
            # the shared prefix's tokens are untrained (masked_lm_logits checks), so counting from column 1 counts
            # exactly the positions the loss averages over
            scaled = loss * (trained_tokens(labels[sl]) * self.world_size / max(1, global_tokens))
            scaled.backward()
            total += float(scaled.detach())
        lr = float(self.lr_scheduler.get_last_lr()[0])
        grad_norm = self.clip_and_step(float(self.config["sft"]["grad_clip"]))
        self.lr_scheduler.step()
        return {"loss": float(self.all_reduce_sum([total])[0]) / self.world_size, "grad_norm": grad_norm, "lr": lr}
