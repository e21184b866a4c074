"""GroupSlots and ForkLookahead on their own: the fixed grant order, the look-ahead's counts, spare slots, and
the fill prediction (the distribution of the forks still to come, the chance that each fill is needed)."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest

from arpo.rollout.branch_slots import CallRates, ForkLookahead, GroupSlots, PendingDecision, canonical
from arpo.rollout.branching import GroupBudget, should_branch
from tests.rollout.test_branching import decision_cfg


@dataclass
class Member:
    key: tuple
    next_depth: int | None = 1
    h_initial: float | None = 0.1
    speculative: bool = False


def slots_for(members, total, cfg=None, call_limit=3, grant_order="ordered"):
    cfg = cfg or decision_cfg(branch_probability=1.0, entropy_weight=0.0)
    lookahead = ForkLookahead(cfg, seed=0, budget=total, call_limit=call_limit, vocab_size=1000)
    budget = GroupBudget(total)
    budget.reserve(len(members))
    return GroupSlots(lookahead, budget, 0, members, lambda m: m.next_depth, grant_order), budget


def test_canonical_order_puts_forks_after_their_parent_and_fills_last():
    keys = [("fill", 0), ("initial", 1), ("initial", 0, 2, 0), ("initial", 0), ("initial", 0, 1, 0),
            ("initial", 0, 1, 0, 2, 0), ("initial", 0, 1, 1)]
    assert sorted(keys, key=canonical) == [
        ("initial", 0), ("initial", 0, 1, 0), ("initial", 0, 1, 0, 2, 0), ("initial", 0, 1, 1),
        ("initial", 0, 2, 0), ("initial", 1), ("fill", 0)]
    existing = [("initial", 0), ("initial", 0, 1, 0), ("initial", 0, 1, 0, 2, 0), ("initial", 1, 1, 0)]
    assert GroupSlots.fork_key(("initial", 0), 1, existing) == ("initial", 0, 1, 1)
    assert GroupSlots.fork_key(("initial", 0), 2, existing) == ("initial", 0, 2, 0)


@pytest.mark.parametrize("limit", [1, 2, 3, 4])
def test_lookahead_counts_the_whole_tree_when_every_draw_can_fork(limit):
    # beam 2, every candidate forks: each decision adds a fork that inherits the decisions after it, so a
    # root with `limit` decisions to come spawns 2^limit - 1 forks (capped at M)
    cfg = decision_cfg(branch_probability=1.0, entropy_weight=0.0)
    assert ForkLookahead(cfg, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 2 ** limit - 1
    assert ForkLookahead(cfg, 0, 5, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == min(5, 2 ** limit - 1)
    assert ForkLookahead(cfg, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, limit + 1) == 0
    never = decision_cfg(branch_probability=0.0, entropy_weight=0.0)
    assert ForkLookahead(never, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 0
    assert ForkLookahead(cfg, 0, 7, None, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 7  # no call limit


def test_lookahead_uses_the_decisions_own_draws():
    # code rule p 0.5, w 0.2: a candidate can fork iff U - 0.2 * max ΔH <= 0.5; a known h0 narrows ΔH
    cfg = decision_cfg(branch_probability=0.5, entropy_weight=0.2)
    look = ForkLookahead(cfg, seed=3, budget=50, call_limit=6, vocab_size=1000)
    h_max = look.h_max  # log(11) / log(1000): 11 entries (top 10 + the sampled token)
    assert h_max == pytest.approx(math.log(11) / math.log(1000))
    h0 = h_max - 0.1
    for depth in range(1, 7):
        u = look.rng(0, ("initial", 0), depth).random()
        assert look.may_want(0, ("initial", 0), h0, depth) == int(u - 0.2 * 0.1 <= 0.5)
        assert look.may_want(0, ("initial", 0), None, depth) == int(u - 0.2 * h_max <= 0.5)
        # the draw is the one the decision makes
        assert should_branch(cfg, 0.1, look.rng(0, ("initial", 0), depth)) == bool(
            look.may_want(0, ("initial", 0), h0, depth))


def test_a_contended_decision_waits_for_the_ones_before_it_in_the_order():
    a, b = Member(("initial", 0)), Member(("initial", 1))
    slots, budget = slots_for([a, b], total=3)  # one slot left, both roots may still fork at depth 1
    granted = []
    b.next_depth = 2  # b decided at depth 1 and wants a fork, but a (before it) may still want one at depth 1
    assert not slots.offer(b, 1, 1, granted.append)
    assert slots.waited == 1 and slots.spare() == 0
    slots.resolve()
    assert granted == []
    a.next_depth = 2  # a decided at depth 1 and wants a fork too: a comes first, and takes the last slot
    assert slots.offer(a, 1, 1, lambda n: granted.append(("a", n))) is False  # b's waiting fork contends
    a_pending = slots.pending[-1]
    slots.resolve()
    assert granted == [("a", 1), 0] and not slots.pending and budget.remaining == 0
    assert a_pending.member is a


def test_a_speculative_forks_decision_waits_behind_its_parents_and_is_bounded_by_it():
    a, b = Member(("initial", 0)), Member(("initial", 1), next_depth=None)
    slots, budget = slots_for([a, b], total=6)  # four slots left
    b_fork = Member(("initial", 1, 1, 0), next_depth=None, speculative=True)  # started while b's decision waits
    slots.members.append(b_fork)
    slots.pending.append(PendingDecision(b, 1, 1, lambda n: None))
    bound = slots.forks_bound()  # b's waiting fork and everything it may fork later: 1 + its tree
    assert bound == slots.forks_bound(exclude=b_fork)
    # the fork's own decision, uncontended or not, waits: it holds no slot, and its parent's decision comes first
    assert not slots.offer(b_fork, 2, 1, lambda n: None)
    assert slots.forks_bound() == bound  # its parent's term already bounds it
    slots.forget([b_fork])
    assert [d.member for d in slots.pending] == [b] and budget.remaining == 4


def test_a_decision_is_granted_at_once_when_no_one_else_can_compete():
    a, b = Member(("initial", 0)), Member(("initial", 1), next_depth=None)  # b is finished
    slots, budget = slots_for([a, b], total=4)
    granted = []
    a.next_depth = 2
    assert slots.offer(a, 1, 1, granted.append) and granted == [1]
    # a's own later decisions (depths 2, 3) and its fork's can take every slot left: nothing is spare
    a_fork = Member(("initial", 0, 1, 0), next_depth=2)
    slots.members.append(a_fork)
    assert slots.spare() == 0
    a.next_depth = a_fork.next_depth = None  # both finished: the last slot goes to a fill
    assert slots.spare() == budget.remaining == 1


def test_first_come_grants_in_arrival_order():
    a, b = Member(("initial", 0)), Member(("initial", 1))
    slots, budget = slots_for([a, b], total=3, grant_order="first_come")
    granted = []
    b.next_depth = 2
    assert slots.offer(b, 1, 1, lambda n: granted.append(("b", n)))
    a.next_depth = 2
    assert slots.offer(a, 1, 1, lambda n: granted.append(("a", n)))
    assert granted == [("b", 1)] and budget.remaining == 0  # a came second: nothing left to grant
    with pytest.raises(ValueError, match="branch_grant"):
        slots_for([a], total=2, grant_order="random")


def simulate_forks(look: ForkLookahead, key: tuple, h0: float, first_depth: int, reach, made: bool,
                   rng: random.Random) -> int:
    """One run of the process fork_distribution describes: each trajectory makes its next call with chance
    reach(depth) (the first one for sure when made), each decision takes the forks its draws allow."""
    total, stack = 0, [(key, first_depth, made)]
    while stack:
        k, depth, sure = stack.pop()
        if depth > look.call_limit or (not sure and rng.random() >= reach(depth)):
            continue
        wants = look.may_want(0, k, h0, depth)
        total += wants
        stack.append((k, depth + 1, False))
        stack.extend((k + (depth, j), depth + 1, False) for j in range(wants))
    return total


@pytest.mark.parametrize("beam, made", [(2, False), (2, True), (3, False)])
def test_fork_distribution_matches_simulating_who_calls_again(beam, made):
    cfg = decision_cfg(beam_size=beam, branch_probability=0.5, entropy_weight=0.2)
    look = ForkLookahead(cfg, seed=5, budget=50, call_limit=4, vocab_size=1000)
    reach = {1: 0.8, 2: 0.6, 3: 0.5, 4: 0.3}.get
    cap = 6
    dist = look.fork_distribution(0, ("initial", 0), 0.05, 1, reach, cap, call_made=made)
    assert len(dist) == cap + 1 and sum(dist) == pytest.approx(1) and max(dist) < 0.9
    rng, runs = random.Random(0), 20000
    counts = Counter(min(simulate_forks(look, ("initial", 0), 0.05, 1, reach, made, rng), cap) for _ in range(runs))
    assert dist == pytest.approx([counts[i] / runs for i in range(cap + 1)], abs=0.015)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_fork_distribution_at_the_extremes(limit):
    every = ForkLookahead(decision_cfg(branch_probability=1.0, entropy_weight=0.0), 0, 100, limit, 1000)
    # every trajectory calls again and every draw forks: the whole tree, for sure (capped)
    for cap in (3, 10):
        dist = every.fork_distribution(0, ("initial", 0), 0.1, 1, lambda d: 1.0, cap)
        assert dist.index(1.0) == min(cap, 2 ** limit - 1) == min(cap, every.tree_forks(0, ("initial", 0), 0.1, 1))
    # nobody calls again: no fork, unless the first call is already made
    assert every.fork_distribution(0, ("initial", 0), 0.1, 1, lambda d: 0.0, 5)[0] == 1.0
    assert every.fork_distribution(0, ("initial", 0), 0.1, 1, lambda d: 0.0, 5, call_made=True)[1] == 1.0
    never = ForkLookahead(decision_cfg(branch_probability=0.0, entropy_weight=0.0), 0, 100, limit, 1000)
    assert never.fork_distribution(0, ("initial", 0), 0.1, 1, lambda d: 1.0, 5)[0] == 1.0
    # no call limit: no bound, so nothing is predicted spare
    unbounded = ForkLookahead(decision_cfg(branch_probability=1.0, entropy_weight=0.0), 0, 100, None, 1000)
    assert unbounded.fork_distribution(0, ("initial", 0), 0.1, 1, lambda d: 0.5, 5)[5] == 1.0


def test_fill_need_is_sure_for_spare_slots_and_falls_with_each_further_fill():
    cfg = decision_cfg(branch_probability=0.5, entropy_weight=0.2)
    members = [Member(("initial", 0)), Member(("initial", 1), next_depth=2), Member(("initial", 2), next_depth=None)]
    slots, budget = slots_for(members, total=8, cfg=cfg)  # 5 slots left
    need = slots.fill_need(lambda d: 0.5, lambda m: False)
    assert len(need) == budget.remaining == 5
    assert all(a >= b for a, b in zip(need, need[1:])) and 0 < need[-1] < 1
    assert need[: slots.spare()] == pytest.approx([1.0] * slots.spare())
    assert slots.fill_need(lambda d: 0.5, lambda m: False, first=2) == pytest.approx(need[2:])
    # a member whose call is made decides for sure: fills are less likely
    made = slots.fill_need(lambda d: 0.5, lambda m: m is members[0])
    assert all(a <= b + 1e-12 for a, b in zip(made, need)) and made != pytest.approx(need)
    # nobody calls again: every slot left is a fill's
    assert slots.fill_need(lambda d: 0.0, lambda m: False) == pytest.approx([1.0] * 5)
    # everyone calls again and every draw forks: branching takes every slot
    slots, _ = slots_for([Member(("initial", 0))], total=6)
    assert slots.fill_need(lambda d: 1.0, lambda m: False) == pytest.approx([0.0] * 5)


def test_fill_need_counts_waiting_decisions_as_sure_forks():
    never = decision_cfg(branch_probability=0.0, entropy_weight=0.0)
    a = Member(("initial", 0), next_depth=2)
    slots, budget = slots_for([a], total=6, cfg=never)  # 5 left; no draw of a or its forks can fork
    slots.pending.append(PendingDecision(a, 1, 2, lambda n: None))
    assert slots.fill_need(lambda d: 0.9, lambda m: False) == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0])
    assert slots.fill_need(lambda d: 0.9, lambda m: False, first=4) == pytest.approx([0.0])
    budget.reserve(5)
    assert slots.fill_need(lambda d: 0.9, lambda m: False) == []


def test_call_rates_lean_on_the_batch_until_a_group_has_its_own_calls():
    rates = CallRates(2, prior={1: 0.9})
    assert rates.reach(0)(1) == pytest.approx(0.9) and rates.reach(0)(2) == pytest.approx(0.5)
    for _ in range(20):
        rates.record(1, 1, made=False)
    # group 1 has stopped calling; group 0, with no segment of its own, follows the batch, which has moved
    r0, r1 = rates.reach(0)(1), rates.reach(1)(1)
    assert r1 < 0.05 and r1 < r0 < 0.9
    assert r0 == pytest.approx(rates.batch_rate(1)) == pytest.approx(4 * 0.9 / 24)
    rates.record(0, 2, made=True)
    assert rates.reach(0)(2) > rates.reach(1)(2) > 0.5
    assert rates.rates() == pytest.approx({1: rates.batch_rate(1), 2: rates.batch_rate(2)})


def test_plan_fills_confirms_the_oldest_speculative_fills_and_drops_the_newest():
    never = decision_cfg(branch_probability=0.0, entropy_weight=0.0)
    # no draw can fork: every slot left is a fill's, the 3 speculative ones first
    slots, budget = slots_for([Member(("initial", 0))], total=6, cfg=never)
    plan = slots.plan_fills(3)
    assert (plan.confirm, plan.start, plan.drop, plan.predict) == (3, 2, 0, 0) and budget.remaining == 0
    # every draw forks: nothing is spare; forks took 4 of the 5 slots, so 1 of 3 speculative fills can stay
    slots, budget = slots_for([Member(("initial", 0))], total=6)
    budget.reserve(4)
    plan = slots.plan_fills(3)
    assert (plan.confirm, plan.start, plan.drop, plan.predict) == (0, 0, 2, 0) and budget.remaining == 1
    # prediction: a root that will surely not call again leaves its slot to a fill, one that will takes it
    assert slots.plan_fills(0, 0.5, lambda d: 0.0, lambda m: False).predict == 1
    assert slots.plan_fills(0, 0.5, lambda d: 1.0, lambda m: False).predict == 0
    assert slots.plan_fills(1, 0.5, lambda d: 0.0, lambda m: False).predict == 0  # already speculated
