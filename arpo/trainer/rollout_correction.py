"""Rollout correction: the engine that sampled and the trainer give a token slightly different log-probs.

vLLM computes with its own kernels (and on GPU in bf16), the FSDP actor with another; so the rollout's samples are
a little off the policy the trainer differentiates. verl 0.9 (``algorithm.rollout_correction``) weights each
token's policy loss by the truncated importance ratio of the trainer's old log-prob over the rollout's
(TIS: ``min(exp(old - rollout), threshold)``, detached), per token or per sequence, and logs how far apart the
two are (``rollout_corr/*``). Log-ratios are clamped to ±20 before ``exp`` as verl does. Differs from verl:
``rollout_corr/k3_kl`` clamps its log-ratio too (verl's overflows to ~1e11 on a ±30 gap), ``rollout_corr/ratio_max``
is the untruncated maximum ratio, logged whenever rollout log-probs exist (verl has only the truncated
``rollout_is_max``), and the means are over each mini-batch, averaged over mini-batches (verl: over the batch).
"""

from __future__ import annotations

import torch

ROLLOUT_IS_LEVELS = ("token", "sequence")
#: bound of the log-ratios before exp (verl's SAFETY_BOUND)
SAFETY_BOUND = 20.0


def rollout_is_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                       level: str, threshold: float) -> torch.Tensor:
    """Truncated importance weights (B, T), 0 where ``response_mask`` is 0: per token, or the row's product of
    token ratios (the sum of log-ratios over its model tokens) on every token of the row."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: choose one of {list(ROLLOUT_IS_LEVELS)}")
    mask = response_mask.float()
    # where, not a product: a non-finite value off the mask must not reach the row (verl's masked_sum does the same)
    log_ratio = torch.where(response_mask.bool(), (old_log_prob - rollout_log_prob).detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    weights = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=threshold)
    return weights * mask


def mismatch_sums(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                  response_mask: torch.Tensor) -> tuple[list[float], list[float]]:
    """Token sums and maxima of the rollout-vs-trainer gap over the masked tokens, for all-reduces across ranks:
    sums ``[Σ (rollout - old) (k1 KL), Σ k3 KL, Σ |p_rollout - p_old|]``, maxima ``[max ratio exp(old - rollout),
    max |p_rollout - p_old|]``."""
    mask = response_mask.bool()
    if not mask.any():
        return [0.0, 0.0, 0.0], [0.0, 0.0]
    old, rollout = old_log_prob.detach()[mask].double(), rollout_log_prob.detach()[mask].double()
    log_ratio = (old - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k3 = torch.exp(log_ratio) - log_ratio - 1
    probs_diff = (torch.exp(rollout) - torch.exp(old)).abs()
    return ([float((rollout - old).sum()), float(k3.sum()), float(probs_diff.sum())],
            [float(torch.exp(log_ratio).max()), float(probs_diff.max())])
