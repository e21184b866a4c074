"""Entropy math (hand-checked), both branching rules, the look-ahead over future draws and the group budget
(the config's checks: tests/rollout/test_config.py)."""

from __future__ import annotations

import asyncio
import math
import random
import threading

import pytest

from arpo.rollout.branching import (GroupBudget, could_branch, max_window_entropy, should_branch, token_entropy,
                                    window_entropy)
from arpo.rollout.config import ARPORolloutConfig


def decision_cfg(policy: str = "arpo", penalty: float = 0.05, **branching) -> ARPORolloutConfig:
    """A rollout config with ``branching`` keys (the section the decision reads), the policy and AEPO's penalty."""
    return ARPORolloutConfig.from_dict({"policy": policy, "aepo": {"penalty": penalty}, "branching": branching})


class FixedRng(random.Random):
    """random() returns a fixed value; counts draws."""

    def __init__(self, value: float):
        super().__init__(0)
        self.value, self.draws = value, 0

    def random(self) -> float:
        self.draws += 1
        return self.value


def test_token_entropy_hand_checked():
    # two tokens at p = 1/2: H = log 2
    assert token_entropy({1: math.log(0.5), 2: math.log(0.5)}) == pytest.approx(math.log(2))
    # one certain token: H = 0
    assert token_entropy({7: 0.0}) == 0.0
    # top-k mass below 1 is not renormalised: p = (0.5, 0.25) -> 0.5 log 2 + 0.25 log 4 = log 2
    assert token_entropy({1: math.log(0.5), 2: math.log(0.25)}) == pytest.approx(math.log(2))
    # p = 0 entries contribute nothing
    assert token_entropy({1: 0.0, 2: -math.inf}) == 0.0


def test_window_entropy_mean_and_sum_normalised_by_log_vocab():
    flat = {1: math.log(0.5), 2: math.log(0.5)}  # H = log 2
    peaked = {1: 0.0}                             # H = 0
    steps = [flat, peaked, flat, flat]
    v = 16
    # window 3 covers flat, peaked, flat: mean = (2/3) log 2, sum = 2 log 2; both / log 16 = 4 log 2
    assert window_entropy(steps, 3, v, "mean") == pytest.approx((2 / 3) * math.log(2) / math.log(16))
    assert window_entropy(steps, 3, v, "sum") == pytest.approx(2 * math.log(2) / math.log(16))
    assert window_entropy(steps, 3, v) == window_entropy(steps, 3, v, "mean")  # mean is the default
    # a window longer than the segment uses what there is
    assert window_entropy(steps, 100, v, "mean") == pytest.approx(0.75 * math.log(2) / math.log(16))
    assert window_entropy([], 20, v) == 0.0
    with pytest.raises(ValueError, match="reduction"):
        window_entropy(steps, 3, v, "max")
    with pytest.raises(ValueError, match="window"):
        window_entropy(steps, 0, v)


def test_mean_does_not_depend_on_segment_length_but_sum_does():
    flat = {1: math.log(0.5), 2: math.log(0.5)}
    short, long = [flat] * 3, [flat] * 20
    assert window_entropy(short, 20, 100, "mean") == pytest.approx(window_entropy(long, 20, 100, "mean"))
    assert window_entropy(long, 20, 100, "sum") == pytest.approx(20 / 3 * window_entropy(short, 20, 100, "sum"))


def test_code_rule_boundaries():
    cfg = decision_cfg(rule="code", branch_probability=0.5, entropy_weight=0.2)
    # prob = clip(U - w dH): U=0.55, dH=0 -> 0.55 > 0.5: no branch; dH=0.5 -> 0.45 <= 0.5: branch
    assert not should_branch(cfg, 0.0, FixedRng(0.55))
    assert should_branch(cfg, 0.5, FixedRng(0.55))
    # negative dH lowers the chance: U=0.45, dH=-1 -> 0.65 > 0.5
    assert not should_branch(cfg, -1.0, FixedRng(0.45))
    # clip to [0, 1]: prob below 0 clips to 0 <= p; with p = 0 only a clipped (or zero) prob branches
    assert should_branch(decision_cfg(branch_probability=0.0, entropy_weight=1.0), 5.0, FixedRng(0.9))
    assert not should_branch(decision_cfg(branch_probability=0.0, entropy_weight=1.0), 0.0, FixedRng(0.9))
    # equality branches ("prob <= branch_probability")
    assert should_branch(cfg, 0.0, FixedRng(0.5))


def test_code_rule_rate_matches_branch_probability():
    rng = random.Random(3)
    for p in (0.2, 0.5, 0.8):
        cfg = decision_cfg(branch_probability=p, entropy_weight=0.2)
        rate = sum(should_branch(cfg, 0.0, rng) for _ in range(20000)) / 20000
        assert rate == pytest.approx(p, abs=0.015)
        # dH = 0.5 shifts U by w*dH = 0.1: rate p + 0.1
        rate_up = sum(should_branch(cfg, 0.5, rng) for _ in range(20000)) / 20000
        assert rate_up == pytest.approx(min(1.0, p + 0.1), abs=0.015)


def test_paper_rule_is_deterministic_threshold():
    cfg = decision_cfg(rule="paper", paper_alpha=0.5, paper_beta=0.2, paper_tau=0.5)
    rng = FixedRng(0.0)
    assert should_branch(cfg, 0.01, rng)       # 0.502 > 0.5
    assert not should_branch(cfg, 0.0, rng)    # 0.5 > 0.5 is false
    assert not should_branch(cfg, -0.3, rng)
    assert rng.draws == 0                      # no randomness consumed
    cfg2 = decision_cfg(rule="paper", paper_alpha=0.2, paper_beta=1.0, paper_tau=0.5)
    assert should_branch(cfg2, 0.31, rng) and not should_branch(cfg2, 0.29, rng)


def test_max_window_entropy_bounds_every_distribution_and_is_reached():
    rng = random.Random(0)
    for _ in range(300):
        vocab, k = rng.choice([5, 50, 1000]), rng.choice([1, 2, 3, 10])
        window, reduction = rng.choice([1, 4, 20]), rng.choice(["mean", "sum"])
        bound = max_window_entropy(window, k, vocab, reduction)
        steps = []
        for _ in range(rng.randint(1, 25)):
            # a distribution over the vocabulary (sometimes near-uniform); the engine returns its top k plus
            # the sampled token
            weights = [rng.random() ** rng.choice([0.01, 1, 8]) for _ in range(vocab)]
            total = sum(weights)
            probs = sorted(((w / total, i) for i, w in enumerate(weights)), reverse=True)
            sampled = rng.randrange(vocab)
            entries = {i: math.log(p) for p, i in probs[:k]}
            entries[sampled] = math.log(weights[sampled] / total)
            steps.append(entries)
        assert window_entropy(steps, window, vocab, reduction) <= bound + 1e-9
    # reached: k + 1 entries of probability 1/(k + 1) each
    uniform = {i: -math.log(11) for i in range(11)}
    assert window_entropy([uniform] * 20, 20, 1000, "mean") == pytest.approx(max_window_entropy(20, 10, 1000))
    assert window_entropy([uniform] * 20, 20, 1000, "sum") == pytest.approx(
        max_window_entropy(20, 10, 1000, "sum"))
    # fewer than e entries cannot reach log K: one entry gives at most 1/e nats
    assert max_window_entropy(1, 0, 1000) == pytest.approx(1 / math.e / math.log(1000))


@pytest.mark.parametrize("rule", ["code", "paper"])
def test_could_branch_replays_the_draws_and_covers_every_reachable_delta(rule):
    rng = random.Random(1)
    for _ in range(2000):
        cfg = decision_cfg(rule=rule, branch_probability=rng.random(), entropy_weight=rng.uniform(-1, 1),
                              paper_alpha=rng.random(), paper_beta=rng.uniform(-1, 1), paper_tau=rng.random())
        lo = rng.uniform(-1, 1)
        hi = lo + rng.uniform(0, 1)
        seed = rng.randrange(10**9)
        look, decide = random.Random(seed), random.Random(seed)
        possible = could_branch(cfg, lo, hi, look)
        deltas = [lo, hi] + [rng.uniform(lo, hi) for _ in range(5)]
        verdicts = [should_branch(cfg, d, random.Random(seed)) for d in deltas]
        assert possible == any(verdicts)  # the ends are among the deltas, and the rules are monotone
        # the same number of draws: the next decision from the same generator sees the same state
        should_branch(cfg, lo, decide)
        assert look.random() == decide.random()
    if rule == "code":
        # the default rule (p 0.5, w 0.2): U = 0.55 can fork when ΔH reaches 0.5 (0.55 - 0.1 <= 0.5), not when
        # ΔH stays at most 0.2 (0.51); U = 0.4 can whatever ΔH in [-0.1, 0]
        cfg = decision_cfg()
        assert could_branch(cfg, -0.1, 0.5, FixedRng(0.55)) and not could_branch(cfg, -0.1, 0.2, FixedRng(0.55))
        assert could_branch(cfg, -0.1, 0.0, FixedRng(0.4))


def test_aepo_rule_is_the_released_form_damped_after_consecutive_forks():
    cfg = decision_cfg(policy="aepo")  # p 0.5, w 0.2, penalty 0.05: fork iff clip((U + w·ΔH)·f) >= p
    assert should_branch(cfg, 0.0, FixedRng(0.5)) and not should_branch(cfg, 0.0, FixedRng(0.49))
    assert should_branch(cfg, 0.5, FixedRng(0.41))  # 0.41 + 0.1 >= 0.5: ΔH > 0 raises the chance
    assert should_branch(cfg, 0.0, FixedRng(0.6)) and not should_branch(cfg, 0.0, FixedRng(0.6), streak=4)  # 0.48
    assert not should_branch(cfg, 1.0, FixedRng(0.99), streak=20)  # f = 0
    assert should_branch(decision_cfg(), 0.0, FixedRng(0.4), streak=20)  # ARPO ignores the streak
    rng = random.Random(0)  # rates: clip(1 - p/f + w·ΔH): 0.5, 0.375, 0
    for streak, rate in ((0, 0.5), (4, 0.375), (10, 0.0)):
        assert sum(should_branch(cfg, 0.0, rng, streak) for _ in range(20000)) / 20000 == pytest.approx(rate, abs=0.015)
    paper = decision_cfg(policy="aepo", rule="paper", paper_alpha=0.6, paper_beta=0.0, paper_tau=0.5)
    assert should_branch(paper, 0.0, FixedRng(0.0)) and not should_branch(paper, 0.0, FixedRng(0.0), streak=4)


@pytest.mark.parametrize("rule", ["code", "paper"])
def test_aepo_look_ahead_covers_every_path_history(rule):
    # the look-ahead does not know a future decision's streak: it must say yes whenever some streak could fork
    rng = random.Random(2)
    for _ in range(2000):
        cfg = decision_cfg(policy="aepo", rule=rule, penalty=rng.choice([0.05, 0.3, 1.0]),
                              branch_probability=rng.random(), entropy_weight=rng.uniform(-1, 1),
                              paper_alpha=rng.uniform(-1, 1), paper_beta=rng.uniform(-1, 1),
                              paper_tau=rng.uniform(-0.5, 1))
        lo = rng.uniform(-1, 1)
        hi = lo + rng.uniform(0, 1)
        seed = rng.randrange(10**9)
        possible = could_branch(cfg, lo, hi, random.Random(seed))
        verdicts = [should_branch(cfg, d, random.Random(seed), streak)
                    for d in [lo, hi] + [rng.uniform(lo, hi) for _ in range(3)] for streak in (0, 1, 2, 5, 40)]
        assert possible or not any(verdicts)


def test_group_budget_never_exceeds_total():
    b = GroupBudget(5)
    assert b.reserve(3) == 3 and b.reserve(3) == 2 and b.reserve(1) == 0
    assert b.used == 5 and b.remaining == 0
    with pytest.raises(ValueError):
        b.reserve(-1)


def test_group_budget_threads_and_coroutines():
    b = GroupBudget(500)
    granted = []

    def worker():
        got = sum(b.reserve(1) for _ in range(200))
        granted.append(got)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 500 and b.used == 500

    b2 = GroupBudget(37)

    async def take():
        total = 0
        for _ in range(10):
            total += b2.reserve(1)
            await asyncio.sleep(0)
        return total

    async def main():
        return await asyncio.gather(*(take() for _ in range(10)))

    assert sum(asyncio.run(main())) == 37 and b2.remaining == 0
