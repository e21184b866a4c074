"""Policy / value / KL / entropy losses, loss aggregation and KL controllers (verl's names and semantics).

Every function keeps the name, argument names and meaning of its counterpart in verl 0.9.1's
``verl/trainer/ppo/core_algos.py`` so results can be compared one to one;
``tests/trainer/test_verl_parity.py`` checks them against outputs of verl 0.9.1 itself to 1e-6.
The advantage estimators live in :mod:`arpo.trainer.advantages` and the masked statistics in
:mod:`arpo.trainer.masked_stats`; both are re-exported here under verl's names. Deliberate differences
are marked "Differs from verl" in the docstrings; none changes a result on finite inputs:

* a value outside the mask never reaches a loss (verl's seq modes multiply it by 0, so a NaN or inf
  there poisons the row; its token modes already drop it);
* bad names and arguments raise ``ValueError`` with the valid choices (verl: ``NotImplementedError`` or
  an assertion).

Shapes: ``B`` rows (trajectories), ``T`` response positions. ``response_mask`` is 1 on model-generated
response tokens and 0 on tool results and padding; it is the mask every loss here is taken over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from arpo.trainer.advantages import (  # noqa: F401  (verl's core_algos namespace)
    ADV_ESTIMATOR_REGISTRY,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    compute_tree_grpo_outcome_advantage,
    get_adv_estimator_fn,
    register_adv_est,
)
from arpo.trainer.logprobs import entropy_from_logits
from arpo.trainer.masked_stats import masked_mean, masked_sum, masked_var, masked_whiten  # noqa: F401

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
_BASE_KL = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: KL estimator names accepted by :func:`kl_penalty`: "k1"/"k2"/"k3" are verl's aliases of kl/mse/low_var_kl,
#: and a trailing "+" keeps the value but takes the gradient of k2 (straight-through, see kl_penalty).
KL_PENALTY_TYPES = _BASE_KL + tuple(f"{name}+" for name in _BASE_KL)
KL_CTRL_TYPES = ("fixed", "adaptive")


# --------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------

def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")


def agg_loss_count(loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """The local count behind a mode's global normaliser, as verl 0.9.1's actor counts it: loss tokens for
    the token modes (``batch_num_tokens``), rows for the seq modes (``global_batch_size``; every row,
    fully masked ones included, since verl passes ``ppo_mini_batch_size · rollout.n``).

    A data-parallel worker sums this over its share of the mini-batch and all-reduces it over ranks;
    pad rows added only to split a batch evenly must be left out of the row count (the caller knows them).
    """
    _check_agg_mode(loss_agg_mode)
    if loss_agg_mode.startswith("token-"):
        return loss_mask.to(torch.float32).sum()
    return torch.tensor(float(loss_mask.shape[0]), device=loss_mask.device)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a (B, T) loss matrix into a scalar, invariant to how the mini-batch is split over
    data-parallel ranks and micro-batches (verl 0.9.1's ``agg_loss``).

    With S_i = Σ_t mask·loss of row i and n_i its loss tokens; the sums run over this call's rows, the
    normalisers ``batch_num_tokens`` (loss tokens) and ``global_batch_size`` (rows) over the whole
    mini-batch on all ranks, ``dp_size`` the number of ranks:

    * ``token-mean``: Σ_i S_i / batch_num_tokens · dp_size.
    * ``token-sum``: Σ_i S_i · dp_size.
    * ``seq-mean-token-sum``: Σ_{i: n_i>0} S_i / global_batch_size · dp_size.
    * ``seq-mean-token-mean``: Σ_{i: n_i>0} (S_i / (n_i + 1e-8)) / global_batch_size · dp_size.
    * ``seq-mean-token-sum-norm``: seq-mean-token-sum / ``loss_scale_factor`` (default T =
      ``loss_mask.shape[-1]``; set it to a constant so the scale does not follow the padded length).

    A normaliser left as None is this call's own count (tokens; rows with at least one token), which needs
    ``dp_size`` 1; an empty mask then gives 0/0 = NaN, as in verl (the actor skips a non-finite step).
    Each rank backpropagates the sum of its micro-batch losses and FSDP *averages* gradients over ranks,
    hence the factor ``dp_size``: the update equals one process aggregating the whole mini-batch with the
    same normalisers. verl's actor passes ``global_batch_size`` = all rows of the mini-batch, so a fully
    masked row counts in the seq modes' denominator there but not in a call without it.
    """
    _check_agg_mode(loss_agg_mode)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            if dp_size > 1:
                raise ValueError(f"agg_loss('token-mean') with dp_size={dp_size} needs batch_num_tokens "
                                 "(loss tokens of the mini-batch over all ranks)")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size

    # Differs from verl: masked_sum per row, so a non-finite value off the mask is dropped, not multiplied by 0.
    row_sums = masked_sum(loss_mat, loss_mask, axis=-1)
    row_tokens = loss_mask.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        row_sums = row_sums / (row_tokens + 1e-8)
    non_empty = (row_tokens > 0).to(row_sums.dtype)
    if global_batch_size is None:
        if dp_size > 1:
            raise ValueError(f"agg_loss({loss_agg_mode!r}) with dp_size={dp_size} needs global_batch_size "
                             "(rows of the mini-batch over all ranks)")
        global_batch_size = non_empty.sum()
    loss = masked_sum(row_sums, non_empty) / global_batch_size * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return loss


# --------------------------------------------------------------------------------------------------
# Policy, value, KL and entropy losses
# --------------------------------------------------------------------------------------------------

def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    entropy_balanced_clipping: bool = False,
    **agg_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with asymmetric clipping and dual clip (verl's vanilla policy loss).

    ratio = exp(clamp(logp − old_logp, −20, 20));
    L1 = −A·ratio; L2 = −A·clip(ratio, 1 − cliprange_low, 1 + cliprange_high); L = max(L1, L2);
    for A < 0 the loss is further capped: L = min(L, −A·clip_ratio_c) (dual clip).
    ``cliprange_low``/``cliprange_high`` default to ``cliprange`` (config: ``clip_ratio_low/high``,
    ``clip_ratio``). ``agg_kwargs`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
    ``loss_scale_factor``: verl's ``config.global_batch_info``) go to :func:`agg_loss`; the metrics are
    local masked means. ``rollout_is_weights`` (rollout correction, :mod:`arpo.trainer.rollout_correction`)
    multiply each token's loss before aggregation, as in verl. ``entropy_balanced_clipping`` (AEPO, arXiv
    2510.14545, and its released code): the upper bound becomes (1 + cliprange_high)·ratio/sg(ratio), the same
    value, but a token clipped there keeps the gradient (1 + cliprange_high)·∇log p instead of none — the
    high-entropy tokens that PPO's clip silences.

    Returns ``(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the fraction of tokens where the clipped
    term is active, the masked mean of old_logp − logp, and the fraction where the dual clip is active.
    """
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    if cliprange_low is None or cliprange_high is None:
        raise ValueError("compute_policy_loss needs cliprange or both cliprange_low and cliprange_high")
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")

    neg_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(neg_kl)
    ppo_kl = masked_mean(-neg_kl, response_mask)

    loss_unclipped = -advantages * ratio
    if entropy_balanced_clipping:
        upper = (1 + cliprange_high) * ratio / ratio.detach()
        loss_clipped = -advantages * torch.clamp(ratio, torch.full_like(ratio, 1 - cliprange_low), upper)
    else:
        loss_clipped = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_loss = torch.maximum(loss_unclipped, loss_clipped)
    pg_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)

    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_clipfrac_lower = masked_mean((torch.gt(clip_loss, dual_cap) & negative).float(), response_mask)
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights

    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    return pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: float | torch.Tensor | None = None,
    global_batch_size: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss for the critic (verl's ``compute_value_loss``).

    V_clip = clip(vpreds, values − cliprange_value, values + cliprange_value), ``values`` the critic's
    predictions at rollout time; L = max((vpreds − R)², (V_clip − R)²) with R = ``returns``, so the update
    cannot move a prediction far from its old value to lower the loss. vf_loss = ½·agg_loss(L), the global
    normalisers going to :func:`agg_loss` as in :func:`compute_policy_loss`. Returns ``(vf_loss,
    vf_clipfrac)``, the latter the masked fraction of tokens where the clipped term is the larger.
    """
    # verl's clip_by_value (min then max, not clamp): the same values, and the same gradient at a bound too.
    vpredclipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss_unclipped = (vpreds - returns) ** 2
    loss_clipped = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(loss_unclipped, loss_clipped), response_mask, loss_agg_mode,
                             dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                             global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor)
    vf_clipfrac = masked_mean(torch.gt(loss_clipped, loss_unclipped).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_balanced_advantage(advantages: torch.Tensor, entropy: torch.Tensor, response_mask: torch.Tensor,
                                       alpha: float = 0.2) -> torch.Tensor:
    """AEPO's entropy-aware advantage: A·(1 + alpha·z), z the token entropy standardised (mean, unbiased std;
    std 0 counts as 1) over the masked tokens, so uncertain tokens weigh more. Here the entropy is the sampling
    policy's (the old-log-prob pass) over the whole batch; the released code standardises the update's own
    entropy within each micro-batch, which makes the update depend on the micro-batch size and rank count."""
    mask = response_mask.bool()
    values = entropy.detach()[mask].double()
    if values.numel() < 2:
        return advantages
    std = float(values.std()) or 1.0
    z = (entropy.detach() - float(values.mean())) / std
    return advantages * (1 + alpha * z) * response_mask


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (Schulman's k1/k2/k3, joschu.net/blog/kl-approx).

    kl / k1: logp − ref; abs: |logp − ref|; mse / k2: ½(logp − ref)²;
    low_var_kl / k3: e^d − d − 1 with d = clamp(ref − logp, −20, 20), the result clamped to [−10, 10].
    """
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        d = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(d) - d - 1, min=-10, max=10)
    # Differs from verl (NotImplementedError, also for "full"): one line naming the valid estimators.
    raise ValueError(f"unknown kl penalty {kl_penalty!r}; valid: {', '.join(KL_PENALTY_TYPES)}")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """:func:`kl_penalty_forward`, or for a name ending in "+" (``k1+``, ``k3+``, ``low_var_kl+`` ...) its
    value with the gradient of k2.

    k1 and k3 estimate the KL without bias but their gradients do not estimate its gradient (k1's
    expected gradient is 0); k2's gradient does. The straight-through form
    k2 − stop_grad(k2) + stop_grad(estimate) reports the chosen estimator and trains with k2's gradient.
    For k2 itself the "+" changes nothing.
    """
    straight_through = kl_penalty.endswith("+")
    value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1] if straight_through else kl_penalty)
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: Any,
) -> torch.Tensor:
    """The actor's KL loss (``actor.use_kl_loss``): ``agg_loss(kl_penalty(logp, ref, kl_loss_type))``;
    the caller multiplies it by ``kl_loss_coef``."""
    kld = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(kld, response_mask, loss_agg_mode, **agg_kwargs)


def compute_entropy_loss(
    logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", **agg_kwargs: Any
) -> torch.Tensor:
    """Aggregated categorical entropy of ``logits`` (B, T, V) over the response mask. The actor subtracts
    ``entropy_coeff`` times it from the policy loss. (When entropies already come from
    :func:`arpo.trainer.logprobs.compute_logprobs_and_entropy`, call :func:`agg_loss` on them directly.)
    ``agg_kwargs`` are :func:`agg_loss`'s global normalisers (verl's version takes none and so is only
    right in one process); the entropy is computed in fp32."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode, **agg_kwargs)


# --------------------------------------------------------------------------------------------------
# KL in the reward
# --------------------------------------------------------------------------------------------------

class FixedKLController:
    """KL coefficient that never changes (``algorithm.kl_ctrl.type: fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv 1909.08593), as in verl:
    value ← value · (1 + clip(current_kl / target_kl − 1, −0.2, 0.2) · n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL controller needs target_kl > 0 and horizon > 0, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: Mapping[str, Any]) -> FixedKLController | AdaptiveKLController:
    """Controller from ``algorithm.kl_ctrl`` (type, kl_coef, target_kl, horizon)."""
    kind = kl_ctrl.get("type", "fixed")
    if kind == "fixed":
        return FixedKLController(kl_coef=kl_ctrl["kl_coef"])
    if kind == "adaptive":
        return AdaptiveKLController(kl_ctrl["kl_coef"], kl_ctrl["target_kl"], kl_ctrl["horizon"])
    raise ValueError(f"unknown algorithm.kl_ctrl.type {kind!r}; valid: {', '.join(KL_CTRL_TYPES)}")


def apply_kl_penalty(data: Any, kl_ctrl: FixedKLController | AdaptiveKLController,
                     kl_penalty: str = "kl") -> tuple[Any, dict[str, float]]:
    """KL in the reward (``algorithm.use_kl_in_reward``), as verl's ``apply_kl_penalty``.

    Reads ``token_level_scores``, ``old_log_probs``, ``ref_log_prob`` and ``response_mask`` from ``data``
    (a :class:`arpo.batch.DataBatch`), writes ``token_level_rewards = scores − β·kl·mask`` with
    β = ``kl_ctrl.value``, then updates the controller with the batch KL (mean over rows of the per-row
    masked-mean KL) and ``n_steps`` = number of rows. Returns ``(data, metrics)`` with verl's metric names
    ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``.
    """
    mask = data["response_mask"].to(data["token_level_scores"].dtype)
    kld = kl_penalty_fn(data["old_log_probs"], data["ref_log_prob"], kl_penalty) * mask
    beta = kl_ctrl.value
    data.tensors["token_level_rewards"] = data["token_level_scores"] - beta * kld
    current_kl = masked_mean(kld, mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=mask.shape[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": float(beta)}


# apply_kl_penalty's keyword shadows the function name inside it, as in verl's signature.
kl_penalty_fn = kl_penalty
