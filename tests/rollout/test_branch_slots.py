"""GroupSlots and ForkLookahead on their own: the fixed grant order, the look-ahead's counts, spare slots."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from arpo.rollout.branch_slots import ForkLookahead, GroupSlots, canonical
from arpo.rollout.branching import BranchingConfig, GroupBudget, should_branch


@dataclass
class Member:
    key: tuple
    next_depth: int | None = 1
    h_initial: float | None = 0.1


def slots_for(members, total, cfg=None, call_limit=3, grant_order="ordered"):
    cfg = cfg or BranchingConfig(branch_probability=1.0, entropy_weight=0.0)
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
    cfg = BranchingConfig(branch_probability=1.0, entropy_weight=0.0)
    assert ForkLookahead(cfg, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 2 ** limit - 1
    assert ForkLookahead(cfg, 0, 5, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == min(5, 2 ** limit - 1)
    assert ForkLookahead(cfg, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, limit + 1) == 0
    never = BranchingConfig(branch_probability=0.0, entropy_weight=0.0)
    assert ForkLookahead(never, 0, 100, limit, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 0
    assert ForkLookahead(cfg, 0, 7, None, 1000).tree_forks(0, ("initial", 0), 0.1, 1) == 7  # no call limit


def test_lookahead_uses_the_decisions_own_draws():
    # code rule p 0.5, w 0.2: a candidate can fork iff U - 0.2 * max ΔH <= 0.5; a known h0 narrows ΔH
    cfg = BranchingConfig(branch_probability=0.5, entropy_weight=0.2)
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
