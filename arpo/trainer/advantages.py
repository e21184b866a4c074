"""Advantage estimators and their registry (verl's ``core_algos`` names, signatures and numerics).

``algorithm.adv_estimator`` picks one by its registered name. Each takes ``token_level_rewards`` (B, T),
``response_mask`` (B, T: 1 on model tokens, 0 on tool results and padding) and, for the group baselines,
``index`` (one group label per row: rows sampled for the same prompt share it), and returns
``(advantages, returns)``, both (B, T). Every estimator ignores keywords it does not use, so a trainer can
call any of them with the same ones, except ``gae``, which also needs the critic's ``values`` and ``lam``.

Two forms of the group estimators exist, as in verl, because they differ in cost, not in meaning: the loop
forms (``grpo``, ``rloo``) walk the groups one at a time with a mean / std per group; the vectorized forms
(``grpo_vectorized``, ``rloo_vectorized``) do every group at once with scatter-adds
(``experiments/bench_algos.py`` times both). They agree except where verl's do: for a group of one row
``rloo`` keeps the raw score while ``rloo_vectorized`` gives 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from arpo.trainer.masked_stats import masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATOR_REGISTRY: dict[str, AdvantageFn] = {}


def register_adv_est(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering an advantage estimator under ``algorithm.adv_estimator: name``."""
    name = getattr(name, "value", name)

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATOR_REGISTRY and ADV_ESTIMATOR_REGISTRY[name] is not fn:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATOR_REGISTRY[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The estimator registered as ``name``. Every estimator accepts extra keyword arguments and ignores
    the ones it does not use, so a trainer can call any of them with the same keywords
    (``token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, gamma``); ``gae``
    also needs ``values`` and ``lam``."""
    name = getattr(name, "value", name)
    if name not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"unknown algorithm.adv_estimator {name!r}; valid: {', '.join(sorted(ADV_ESTIMATOR_REGISTRY))}"
        )
    return ADV_ESTIMATOR_REGISTRY[name]


# --------------------------------------------------------------------------------------------------
# Group bookkeeping
# --------------------------------------------------------------------------------------------------

def _group_rows(index: Any) -> list[list[int]]:
    """Row numbers of each group, groups in order of first appearance (the loop forms' walk)."""
    labels = index.tolist() if hasattr(index, "tolist") else list(index)
    groups: dict[Any, list[int]] = {}
    for row, label in enumerate(labels):
        groups.setdefault(label, []).append(row)
    return list(groups.values())


def _dense_group_ids(index: Any, device: torch.device) -> tuple[torch.Tensor, int]:
    """Group labels (uids: str / int, array / list / tensor) as ids 0..G-1, without a Python loop over rows."""
    if isinstance(index, torch.Tensor):
        _, inverse = torch.unique(index.reshape(-1), return_inverse=True)
        inverse = inverse.to(device=device, dtype=torch.long)
    else:
        labels = np.asarray(index).reshape(-1)
        try:
            _, inverse = np.unique(labels, return_inverse=True)
        except TypeError:  # labels of mixed types do not sort; their strings do
            _, inverse = np.unique(labels.astype(str), return_inverse=True)
        inverse = torch.from_numpy(inverse.astype(np.int64).reshape(-1)).to(device)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _scatter_sum(values: torch.Tensor, gid: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, gid, values)


def _group_mean_std(scores: torch.Tensor, gid: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, ...]:
    """Per-group mean, unbiased std and count in fp32 (verl's ``group_mean_std`` with eps 0: groups of one
    get mean 0 and std 1 so that their advantage is the raw score)."""
    scores = scores.to(torch.float32)
    count = _scatter_sum(torch.ones_like(scores), gid, n_groups)
    mean = _scatter_sum(scores, gid, n_groups) / count.clamp_min(1.0)
    var = _scatter_sum((scores - mean[gid]) ** 2, gid, n_groups) / (count - 1.0).clamp_min(1.0)
    std = torch.sqrt(var.clamp_min(0.0))
    single = count <= 1.0
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean, std, count


# --------------------------------------------------------------------------------------------------
# Outcome estimators (one scalar per trajectory, broadcast over its tokens)
# --------------------------------------------------------------------------------------------------

@register_adv_est("grpo")
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, one group at a time.

    score_i = Σ_t token_level_rewards[i, t]; within each group (rows with equal ``index``)
    A_i = (score_i − mean) / (std + epsilon) with the unbiased std, or score_i − mean when
    ``norm_adv_by_std_in_grpo`` is false (Dr. GRPO). A group of one row uses mean 0 and std 1.
    Returns ``(advantages, returns)``, both A_i broadcast over the row and multiplied by ``response_mask``.
    """
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = torch.empty_like(scores)
        for rows in _group_rows(index):
            idx = torch.tensor(rows, device=scores.device)
            group = scores[idx]
            if len(rows) == 1:
                mean, std = torch.zeros((), dtype=group.dtype), torch.ones((), dtype=group.dtype)
            else:
                mean, std = group.mean(), group.std()
            adv[idx] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("tree_grpo")
def compute_tree_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    tree_index: Any = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree-GRPO's advantage (arXiv 2509.21240; released code AMAP-ML/Tree-GRPO, ``adv_estimator=tree``):
    the GRPO advantage within the prompt's group (inter-tree) plus the GRPO advantage within the row's tree
    (intra-tree), unweighted. ``tree_index`` labels each row's tree within its group (the rollout's
    ``tree_index`` column, ``actor_rollout_ref.rollout.arpo.policy=tree_grpo``)."""
    if tree_index is None or any(t is None for t in tree_index):
        raise ValueError("algorithm.adv_estimator=tree_grpo needs every row's tree (the tree_index column); "
                         "roll out with actor_rollout_ref.rollout.arpo.policy=tree_grpo")
    kw = dict(token_level_rewards=token_level_rewards, response_mask=response_mask, epsilon=epsilon,
              norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)
    inter, _ = compute_grpo_outcome_advantage(index=index, **kw)
    trees = np.asarray([f"{u}\x1f{t}" for u, t in zip(np.asarray(index).tolist(), list(tree_index))], dtype=object)
    intra, _ = compute_grpo_outcome_advantage(index=trees, **kw)
    adv = inter + intra
    return adv, adv


@register_adv_est("grpo_vectorized")
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO with every group at once (scatter-adds, group statistics in fp32 as verl); the values of
    :func:`compute_grpo_outcome_advantage` up to rounding."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, n_groups = _dense_group_ids(index, scores.device)
        mean, std, _ = _group_mean_std(scores, gid, n_groups)
        centred = scores - mean[gid]
        adv = centred / (std[gid] + epsilon) if norm_adv_by_std_in_grpo else centred
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("rloo")
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (leave-one-out, arXiv 2402.14740), one group at a time: A_i = score_i − mean of the other rows
    of its group = (score_i − group mean)·n/(n−1). A group of one keeps its raw score."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        adv = scores.clone()
        for rows in _group_rows(index):
            n = len(rows)
            if n > 1:
                idx = torch.tensor(rows, device=scores.device)
                group = scores[idx]
                adv[idx] = group * n / (n - 1) - group.mean() * n / (n - 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("rloo_vectorized")
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO with every group at once: A_i = (n·score_i − group sum)/(n − 1). A group of one gets 0 (it has
    no other row to compare with), unlike :func:`compute_rloo_outcome_advantage`, as in verl."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, n_groups = _dense_group_ids(index, scores.device)
        count = _scatter_sum(torch.ones_like(scores), gid, n_groups)[gid]
        total = _scatter_sum(scores, gid, n_groups)[gid]
        adv = (count * scores - total) / (count - 1).clamp_min(1) * (count > 1)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@register_adv_est("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262): score − group mean (a group of one: the raw score), broadcast
    over the response and whitened over all masked tokens of the batch; ``(adv, adv)``, zero off the mask."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        centred = scores.clone()
        for rows in _group_rows(index):
            if len(rows) > 1:
                idx = torch.tensor(rows, device=scores.device)
                centred[idx] = scores[idx] - scores[idx].mean()
        adv = centred.unsqueeze(-1).expand_as(token_level_rewards) * response_mask
        adv = masked_whiten(adv, response_mask) * response_mask
    return adv, adv


# --------------------------------------------------------------------------------------------------
# Token-level estimator
# --------------------------------------------------------------------------------------------------

@register_adv_est("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: Any = None,
    gamma: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (arXiv 2501.03262): discounted return-to-go over the model's tokens, whitened over all
    masked tokens of the batch. Returns ``(advantages, returns)``, both zero where the mask is 0.

    G_t = r_t + γ·G_{t'} where t' is the next response-mask token: a tool result (mask 0) is skipped, the
    return passing through it undiscounted, so in a multi-turn response the final reward reaches the
    tokens before every tool call. A reward placed on a masked-out position is not counted (rewards sit on
    model tokens). ``gamma`` defaults to ``config.gamma`` (verl passes its AlgoConfig), else 1.
    """
    if gamma is None:
        gamma = float(getattr(config, "gamma", 1.0)) if config is not None else 1.0
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = torch.zeros_like(token_level_rewards)
        running = torch.zeros_like(token_level_rewards[:, 0])
        for t in reversed(range(token_level_rewards.shape[1])):
            candidate = token_level_rewards[:, t] + gamma * running
            returns[:, t] = candidate * mask[:, t]
            running = candidate * mask[:, t] + running * (1 - mask[:, t])
        adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns


# --------------------------------------------------------------------------------------------------
# Critic-based estimator
# --------------------------------------------------------------------------------------------------

@register_adv_est("gae")
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (arXiv 1506.02438) from the critic's ``values`` (B, T), as verl's.

    Backward over the response: δ_t = r_t + γ·V_{t'} − V_t and A_t = δ_t + γλ·A_{t'}, t' the next
    response-mask token. A position with mask 0 (a tool result, padding) has neither a value nor a TD error:
    V_{t'} and A_{t'} pass through it unchanged, so it holds the advantage of the model token after it.
    Returns ``(advantages, returns)`` with returns = A + V (the critic's target, before whitening) and the
    advantages whitened over every masked token of the batch; off the mask neither is zeroed, as in verl.
    The trainer calls this one with ``values`` and ``lam``, not with the group estimators' keywords.
    """
    with torch.no_grad():
        dtype = torch.promote_types(token_level_rewards.dtype, values.dtype)
        mask = response_mask.to(dtype)
        advantages = torch.empty(values.shape, dtype=dtype, device=values.device)
        next_value = torch.zeros(values.shape[0], dtype=dtype, device=values.device)
        running = torch.zeros_like(next_value)
        for t in reversed(range(token_level_rewards.shape[-1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            candidate = delta + gamma * lam * running
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            running = candidate * mask[:, t] + (1 - mask[:, t]) * running
            advantages[:, t] = running
        returns = advantages + values
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns
