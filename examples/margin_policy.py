"""A rollout policy that forks on the top-1/top-2 probability margin instead of entropy.

ARPO (:class:`arpo.rollout.policies.Arpo`) forks after a tool result when the model became more uncertain than
at the start: ``ΔH = U_now − U_initial`` goes through the branching rule (``branching.rule``), where ``U`` is a
window's uncertainty, measured by :meth:`~arpo.rollout.policies.Sampling.window_uncertainty`. This policy keeps
everything of ARPO (budget, fills, rule, timing) and only changes ``U``: the mean over the window of
``1 − (p_top1 − p_top2)`` — a small margin between the two likeliest tokens means the model hesitates.

Select it without registering, by import path::

    actor_rollout_ref.rollout.arpo.policy=examples.margin_policy:MarginArpo

or register it under a short name by decorating the class with
``@arpo.rollout.policies.register_policy("margin")`` and importing the module before the config is read.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from arpo.rollout.policies import Arpo

if TYPE_CHECKING:
    from arpo.rollout.tree import RolloutTree


def top_margin(top_logprobs: dict[int, float]) -> float:
    """``p_top1 − p_top2`` of one token's top-k logprobs (1 when only one entry came back)."""
    probs = sorted((math.exp(lp) for lp in top_logprobs.values() if lp == lp), reverse=True)
    if not probs:
        return 1.0
    return probs[0] - (probs[1] if len(probs) > 1 else 0.0)


class MarginArpo(Arpo):
    """ARPO whose uncertainty is the mean ``1 − margin`` of the first ``entropy.window`` tokens, scaled into
    ``[0, h_max]`` (the range the fork look-ahead assumes for every measure), so ``branching.*`` thresholds
    read on the same scale as entropy's."""

    def window_uncertainty(self, tree: "RolloutTree", step_logprobs: list[dict[int, float]]) -> float:
        window = step_logprobs[: self.cfg.entropy.window]
        if not window:
            return 0.0
        hesitation = sum(1.0 - top_margin(lps) for lps in window) / len(window)
        return min(max(hesitation, 0.0), 1.0) * tree.lookahead.h_max
