"""Masked sums, means and variances (verl's ``verl/utils/torch_functional.py`` helpers of the same names).

Every estimator and loss in :mod:`arpo.trainer.core_algos` reduces over ``response_mask`` through these, so
their numerics (the 1e-8 in the mean's denominator, the Bessel correction) are verl's exactly.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Σ values where ``mask`` is non-zero (weighted by the mask). A NaN or inf outside the mask is dropped
    rather than multiplied by 0, so padding can never poison a loss."""
    valid = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return (valid * mask).sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is 1; an all-zero mask gives 0 (the 1e-8 in the denominator)."""
    return masked_sum(values, mask, axis) / (mask.sum(dim=axis) + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the whole mask; ``unbiased`` applies Bessel's n/(n−1), which needs n ≥ 2."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 unmasked values, got {int(n)}; "
                "check response_mask (all-tool or empty responses?)"
            )
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values − masked mean) / sqrt(unbiased masked variance + 1e-8); ``shift_mean=False`` adds the mean
    back (scale only). Positions outside the mask are transformed too; callers multiply by the mask."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
