"""The worked examples under examples/ (docs/extending.md), each run through the real code path it extends."""

from __future__ import annotations

import pytest

from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.policies import POLICY_REGISTRY, Arpo, get_policy_class, make_policy
from examples.margin_policy import MarginArpo, top_margin
from tests.rollout.rollout_helpers import rows, rollout

MARGIN = "examples.margin_policy:MarginArpo"
# rule and timing paper: fork iff the uncertainty after a tool result exceeds the root's (deterministic)
CFG = {"n": 6, "initial_rollouts": 2, "branching.rule": "paper", "branching.timing": "paper",
       "sampling.max_response_length": 256}


def test_builtin_policies_are_registered_and_config_strings_select_classes():
    assert {"arpo", "aepo", "tree_grpo"} <= set(POLICY_REGISTRY)
    cfg = ARPORolloutConfig.from_dict({"policy": MARGIN})
    assert type(make_policy(cfg)) is MarginArpo and issubclass(MarginArpo, Arpo)
    assert get_policy_class("arpo") is Arpo
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.arpo\.policy='nope': use one of \('arpo', 'aepo', 'tree_grpo'\)"):
        ARPORolloutConfig.from_dict({"policy": "nope"})
    with pytest.raises(ValueError, match=r"policy='examples.margin_policy:Missing': cannot import"):
        ARPORolloutConfig.from_dict({"policy": "examples.margin_policy:Missing"})


def test_margin_policy_forks_in_a_real_rollout():
    assert top_margin({1: -0.1, 2: -3.0}) == pytest.approx(0.9048 - 0.0498, abs=1e-3)
    calls = []
    original = MarginArpo.window_uncertainty

    def counted(self, tree, lps):
        calls.append(len(lps))
        return original(self, tree, lps)

    MarginArpo.window_uncertainty = counted
    try:
        batch, _, _ = rollout({**CFG, "policy": MARGIN}, n_prompts=2, seed=1)
    finally:
        MarginArpo.window_uncertainty = original
    rs = rows(batch)
    assert calls, "the rollout never asked the example policy for its measure"
    assert sum(r["kind"] == "branch" for r in rs) > 0
    deltas = [c["delta_entropy"] for r in rs for c in r["calls"] if c["delta_entropy"] is not None]
    assert deltas and max(deltas) > 0
    # the same rollout with ARPO's entropy measure records other ΔH values: the example changed the measure
    arpo_batch, _, _ = rollout({**CFG, "policy": "arpo"}, n_prompts=2, seed=1)
    arpo_deltas = [c["delta_entropy"] for r in rows(arpo_batch) for c in r["calls"] if c["delta_entropy"] is not None]
    assert arpo_deltas[:1] != deltas[:1]

