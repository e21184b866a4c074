"""Statistics for research claims: paired bootstrap intervals for before/after gains, Welch's t-test over seeds.

Thin on purpose: scipy does the work (``scipy.stats.bootstrap``, ``scipy.stats.ttest_ind``); this module only
fixes the choices (paired resampling over questions, BCa, a seeded generator) so every table and summary in the
project makes the same ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class GainInterval:
    """Mean of ``after − before`` over paired items, with a bootstrap confidence interval."""

    before: float
    after: float
    gain: float
    low: float
    high: float
    confidence: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def as_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "excludes_zero": self.excludes_zero}

    def describe(self, name: str) -> str:
        pct = round(self.confidence * 100)
        return (f"{name}: {self.before:.3f} -> {self.after:.3f}, gain {self.gain:+.3f} "
                f"({pct}% CI [{self.low:+.3f}, {self.high:+.3f}], n={self.n})")


def paired_gain(before: Sequence[float], after: Sequence[float], confidence: float = 0.95,
                n_resamples: int = 10_000, seed: int = 0) -> GainInterval:
    """Bootstrap CI of the mean paired difference (resampling items, so per-question difficulty cancels).

    BCa needs variation; when every difference is equal the interval is that single value."""
    from scipy.stats import bootstrap

    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if b.shape != a.shape or b.ndim != 1 or len(b) == 0:
        raise ValueError(f"paired_gain needs two equal-length non-empty 1-D sequences, got {b.shape} and {a.shape}")
    diff = a - b
    gain = float(diff.mean())
    if np.all(diff == diff[0]) or len(diff) < 2:
        low = high = gain
    else:
        res = bootstrap((diff,), np.mean, confidence_level=confidence, n_resamples=n_resamples, method="BCa",
                        random_state=np.random.default_rng(seed))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return GainInterval(float(b.mean()), float(a.mean()), gain, low, high, confidence, len(diff))


def welch_t_test(sample: Sequence[float], baseline: Sequence[float]) -> float:
    """Two-sided p-value of Welch's t-test (unequal variances); NaN with fewer than two values on a side."""
    from scipy.stats import ttest_ind

    s, b = np.asarray(sample, dtype=float), np.asarray(baseline, dtype=float)
    if len(s) < 2 or len(b) < 2:
        return float("nan")
    return float(ttest_ind(s, b, equal_var=False).pvalue)
