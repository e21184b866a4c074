"""Who gets a prompt group's trajectory slots, and when: ordered grants to branching decisions, and the
look-ahead that tells when slots are spare for fresh fills.

Shared by the ARPO rollout tree (:mod:`arpo.rollout.tree`) and the ARPO agent loop
(:mod:`arpo.agent_loop.arpo_agent_loop`); the decision rule itself is :mod:`arpo.rollout.branching`.

**Identity.** A trajectory's *key* is ``("initial", i)``, ``("fill", i)``, or its parent's key plus
``(depth, j)`` for the parent's ``j``-th fork at the decision after its ``depth``-th tool call. Keys do not
depend on the order trajectories are created in, and each decision draws from its own generator seeded by
(seed, group, key, depth) (:func:`~arpo.rollout.branching.decision_rng`).

**Look-ahead** (:class:`ForkLookahead`). So the draws of every decision still to come — of trajectories that
exist and of forks not yet made — are known before it is taken. Window entropies lie in ``[0, h_max]``
(:func:`~arpo.rollout.branching.max_window_entropy`; decisions measure them with
:meth:`ForkLookahead.window_entropy`, which clips to that range), so a trajectory whose initial
entropy is known can only reach ΔH in ``[−h0, h_max − h0]``, and a fork candidate whose draw no reachable ΔH
would fork can never take a slot. The most forks a trajectory and its descendants can still take is the sum
over its remaining decisions' possible candidates, recursively (capped at M).

**Ordered grants** (:class:`GroupSlots`). Slots go to decisions in a fixed order — tool-call depth, then the
trajectory's place in the tree (:func:`canonical`) — each taking what it asks for while slots last,
whatever order decisions arrive in, so a deterministic engine gives the same batch under any schedule. A
decision takes its forks at once when the slots left cover the most every other decision could still ask
for; otherwise it waits until no decision before it in that order can still appear and ask for a fork
(meanwhile the tree may run its forks speculatively, ``schedule.speculative_forks``: their own decisions wait
behind it, and its term in :meth:`GroupSlots.forks_bound` already bounds them).
``first_come`` (the released code) grants as decisions arrive. Fresh fills take the slots left over once
that most is subtracted, at any time: fills never branch, so branching sees the same budget as if they came
last.

**Fill prediction** (:meth:`GroupSlots.fill_need`). What the look-ahead cannot know is whether a trajectory
will call a tool again, so fills that are in the end needed mostly wait until the group's last branching
trajectory finishes, and run late, alone. Given the chance that a trajectory makes its next call (estimated
by the caller from the calls made so far), the same draws give the *distribution* of the forks still to come,
and so the chance that the group will need its i-th fill; a rollout may start a fill early once that chance
is high enough (speculatively: outside the budget, dropped if branching takes its slot after all).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

from arpo.rollout.branching import GroupBudget, could_branch, decision_rng, max_window_entropy, window_entropy

if TYPE_CHECKING:  # config.py imports GRANTS from here
    from arpo.rollout.config import ARPORolloutConfig

GRANTS = ("ordered", "first_come")


def canonical(key: tuple) -> tuple:
    """A trajectory's place in its group's fixed order: initial roots, then fills, each followed by its forks
    (a key extends its parent's, so it sorts right after it)."""
    return (key[0] != "initial",) + tuple(key[1:])


class ForkLookahead:
    """The most forks future branching decisions can take, from their draws (known in advance) and the ΔH
    range their trajectories can reach. Results are memoised: they are pure functions of their arguments."""

    def __init__(self, cfg: ARPORolloutConfig, seed: int, budget: int, call_limit: int | None, vocab_size: int):
        self.cfg, self.seed, self.budget, self.call_limit, self.vocab_size = cfg, seed, budget, call_limit, vocab_size
        #: the largest window entropy a real distribution's top-k can give; every bound here assumes it
        self.h_max = max_window_entropy(cfg.entropy.window, cfg.entropy.topk_logprobs, vocab_size,
                                        cfg.entropy.reduction)
        self._wants: dict[tuple, int] = {}
        self._trees: dict[tuple, int] = {}

    def window_entropy(self, step_logprobs: list[dict[int, float]]) -> float:
        """The window entropy branching decisions use: clipped into ``[0, h_max]`` (only a broken engine's
        logprobs fall outside), so the look-ahead, which assumes that range, is never wrong."""
        h = window_entropy(step_logprobs, self.cfg.entropy.window, self.vocab_size, self.cfg.entropy.reduction)
        return min(max(h, 0.0), self.h_max)

    def rng(self, group: int, key: tuple, depth: int) -> random.Random:
        """The generator of the decision of trajectory ``key`` after its ``depth``-th tool call."""
        return decision_rng(self.seed, group, key, depth)

    def delta_range(self, h0: float | None) -> tuple[float, float]:
        """The ΔH a trajectory with initial entropy ``h0`` (None: not known yet) can reach."""
        if h0 is None:
            return -self.h_max, self.h_max
        return -h0, self.h_max - h0

    def may_want(self, group: int, key: tuple, h0: float | None, depth: int) -> int:
        """How many of the decision's ``beam_size − 1`` candidates could ask for a fork."""
        memo = (group, key, h0, depth)
        if memo not in self._wants:
            lo, hi = self.delta_range(h0)
            rng = self.rng(group, key, depth)
            candidates = self.cfg.branching.beam_size - 1
            self._wants[memo] = sum(could_branch(self.cfg, lo, hi, rng) for _ in range(candidates))
        return self._wants[memo]

    def tree_forks(self, group: int, key: tuple, h0: float | None, first_depth: int) -> int:
        """Most forks (capped at M) the decisions of trajectory ``key`` at depths ``first_depth`` … the call
        limit, and those of the forks they may make, can take. Without a call limit: M (no bound)."""
        if self.cfg.branching.beam_size <= 1:
            return 0
        if self.call_limit is None:
            return self.budget
        memo = (group, key, h0, first_depth)
        if memo in self._trees:
            return self._trees[memo]
        total = 0
        for depth in range(first_depth, self.call_limit + 1):
            for j in range(self.may_want(group, key, h0, depth)):
                total += 1 + self.tree_forks(group, key + (depth, j), h0, depth + 1)
                if total >= self.budget:
                    break
            if total >= self.budget:
                break
        self._trees[memo] = total = min(total, self.budget)
        return total

    def fork_distribution(self, group: int, key: tuple, h0: float | None, first_depth: int,
                          reach: Callable[[int], float], cap: int, call_made: bool = False) -> list[float]:
        """Distribution of the forks the decisions of trajectory ``key`` at depths ``first_depth`` … the call
        limit, and those of the forks they make, will take: entry i is P(i forks), the last entry P(≥ cap).
        ``reach(d)`` is the chance that a trajectory that has made d − 1 calls makes its d-th; ``call_made``:
        the call at ``first_depth`` is already made (its result pending or its decision in progress).
        A candidate counts as a fork when its draw could fork at some reachable ΔH (as :meth:`may_want`)."""
        if self.cfg.branching.beam_size <= 1 or cap <= 0:
            return _point(0, cap)
        if self.call_limit is None:  # unbounded calls: no bound on forks, as in tree_forks
            return _point(cap, cap)
        memo: dict[tuple, list[float]] = {}

        def dist(k: tuple, depth: int, made: bool) -> list[float]:
            if depth > self.call_limit:
                return _point(0, cap)
            if (k, depth, made) not in memo:
                taken = dist(k, depth + 1, False)
                for j in range(self.may_want(group, k, h0, depth)):
                    taken = _convolve(taken, _shift(dist(k + (depth, j), depth + 1, False), cap), cap)
                r = 1.0 if made else min(max(reach(depth), 0.0), 1.0)
                memo[k, depth, made] = [r * p + (1 - r) * (i == 0) for i, p in enumerate(taken)]
            return memo[k, depth, made]

        return dist(key, first_depth, call_made)

    def earliest_wanting_depth(self, group: int, key: tuple, h0: float | None, first_depth: int) -> int | None:
        """Depth of the first decision from ``first_depth`` on that could ask for a fork (None: none can).
        The trajectory's forks decide only after it."""
        if self.cfg.branching.beam_size <= 1:
            return None
        if self.call_limit is None:
            return first_depth
        return next((d for d in range(first_depth, self.call_limit + 1) if self.may_want(group, key, h0, d)), None)


class CallRates:
    """How often a trajectory that has made d − 1 tool calls goes on to make its d-th, counted over the
    segments that ended so far in one rollout call: the ``reach`` of fill prediction. A group's rate leans
    on the batch's until the group has its own evidence, the batch's on ``prior`` (the previous call's
    rates, say; 0.5 where none is given). Only when fills start depends on them, never what is generated."""

    #: pseudo-counts of the batch prior in the batch rate, and of the batch rate in a group's
    PRIOR_WEIGHT, BATCH_WEIGHT = 4.0, 2.0

    def __init__(self, groups: int, prior: dict[int, float] | None = None):
        self.prior = dict(prior or {})
        self.made = [Counter() for _ in range(groups)]
        self.seen = [Counter() for _ in range(groups)]
        self.batch_made: Counter = Counter()
        self.batch_seen: Counter = Counter()

    def record(self, group: int, depth: int, made: bool) -> None:
        """A segment of a trajectory that had made ``depth`` − 1 calls ended, with a call or not."""
        self.seen[group][depth] += 1
        self.batch_seen[depth] += 1
        if made:
            self.made[group][depth] += 1
            self.batch_made[depth] += 1

    def batch_rate(self, depth: int) -> float:
        w = self.PRIOR_WEIGHT
        return (self.batch_made[depth] + w * self.prior.get(depth, 0.5)) / (self.batch_seen[depth] + w)

    def reach(self, group: int) -> Callable[[int], float]:
        """``reach(d)`` for the group's trajectories."""
        made, seen, w = self.made[group], self.seen[group], self.BATCH_WEIGHT
        return lambda d: (made[d] + w * self.batch_rate(d)) / (seen[d] + w)

    def rates(self) -> dict[int, float]:
        """The batch's rates by depth (a prior for the next call)."""
        return {d: self.batch_rate(d) for d in set(self.batch_seen) | set(self.prior)}


@dataclass
class FillPlan:
    """See :meth:`GroupSlots.plan_fills`: speculative fills to confirm (the oldest) and to drop (the newest),
    fills to start inside the budget, and speculative fills to start."""

    confirm: int
    start: int
    drop: int
    predict: int


@dataclass
class PendingDecision:
    """A decision that asked for forks and waits for its turn in the grant order."""

    member: Any
    depth: int
    wants: int
    #: called with the number of slots granted; creates that many forks (siblings 0, 1, ...)
    grant: Callable[[int], None]
    #: time.perf_counter() when it was queued (the wait is a metric: it delays the forks, never changes them)
    since: float = 0.0


class GroupSlots:
    """One prompt group's budget M in one rollout call: ordered (or first-come) grants to branching decisions,
    and the slots spare for fills. ``members`` is the caller's list of the group's trajectories (it grows as
    they are created); each has ``key`` and ``h_initial``, and ``first_depth(member)`` gives the depth of the
    next decision it can still take (None: it takes no more: finished, a fill, out of calls)."""

    def __init__(self, lookahead: ForkLookahead, budget: GroupBudget, group: int, members: list,
                 first_depth: Callable[[Any], int | None], grant_order: str = "ordered"):
        if grant_order not in GRANTS:
            raise ValueError(f"branch_grant={grant_order!r} is invalid; use one of {GRANTS}")
        self.lookahead, self.budget, self.group = lookahead, budget, group
        self.members, self.first_depth, self.grant_order = members, first_depth, grant_order
        self.pending: list[PendingDecision] = []
        #: decisions that had to wait for their turn, and their seconds waited in all (metrics)
        self.waited = 0
        self.wait_s = 0.0

    def _future_forks(self, member: Any) -> int:
        first = self.first_depth(member)
        return 0 if first is None else self.lookahead.tree_forks(self.group, member.key, member.h_initial, first)

    def _counted(self) -> list[PendingDecision]:
        """The waiting decisions not already bounded by an ancestor's: a speculative fork's decisions are among
        the decisions its parent's waiting decision bounds (``tree_forks`` of the fork)."""
        return [d for d in self.pending if not _speculative(d.member)]

    def forks_bound(self, exclude: Any = None) -> int:
        """Most slots the decisions still to come (of every member but ``exclude``) and the waiting decisions
        (with the forks they would make) can take."""
        bound = sum(self._future_forks(m) for m in self.members if m is not exclude)
        for d in self._counted():
            m = d.member
            bound += sum(1 + self.lookahead.tree_forks(self.group, m.key + (d.depth, j), m.h_initial, d.depth + 1)
                         for j in range(d.wants))
        return bound

    def offer(self, member: Any, depth: int, wants: int, grant: Callable[[int], None]) -> bool:
        """A decision of ``member`` after its ``depth``-th call asks for ``wants`` forks: grant them now
        (``grant(n)`` with the slots reserved) or queue the decision; True if it was settled now. The member
        must already count as past this decision in ``first_depth``. A speculative member's decision always
        waits: the member holds no slot yet, and its parent's waiting decision comes first in the order."""
        if wants == 0 or self.budget.remaining == 0:  # slots are never given back: 0 now is 0 in any order
            return True
        uncontended = not _speculative(member) and self.budget.remaining - self.forks_bound(exclude=member) >= wants
        if self.grant_order == "first_come" or uncontended:
            grant(self.budget.reserve(wants))
            return True
        self.pending.append(PendingDecision(member, depth, wants, grant, time.perf_counter()))
        self.waited += 1
        return False

    def resolve(self) -> None:
        """Grant waiting decisions in the fixed order, each once no decision before it can still appear and
        ask for forks (every other member has passed its depth, finished, or has no draw left that could
        fork before it)."""
        while self.pending:
            first = min(self.pending, key=lambda d: (d.depth, canonical(d.member.key)))
            place = (first.depth, canonical(first.member.key))
            for m in self.members:
                start = self.first_depth(m)
                if start is None:
                    continue
                depth = self.lookahead.earliest_wanting_depth(self.group, m.key, m.h_initial, start)
                if depth is not None and (depth, canonical(m.key)) < place:
                    return
            assert not _speculative(first.member), "a speculative fork's decision came before its parent's"
            assert not getattr(first.member, "discarded", False), "a dropped fork's decision is still waiting"
            self.pending.remove(first)
            self.wait_s += time.perf_counter() - first.since
            first.grant(self.budget.reserve(first.wants))

    def forget(self, members: Iterable[Any]) -> None:
        """Drop the waiting decisions of ``members`` (speculative forks that did not get a slot)."""
        gone = {id(m) for m in members}
        self.pending = [d for d in self.pending if id(d.member) not in gone]

    def spare(self) -> int:
        """Slots no branching decision can take any more: the fills' (call :meth:`resolve` first, so that
        decisions whose turn has come hold their slots)."""
        return max(0, self.budget.remaining - self.forks_bound())

    def fill_need(self, reach: Callable[[int], float], call_made: Callable[[Any], bool], first: int = 0) -> list[float]:
        """The chances that the group will need at least i + 1 fills beyond those it has been granted, for
        i = ``first`` … remaining − 1 (``reach`` and ``call_made`` as in :meth:`ForkLookahead.fork_distribution`,
        the latter per member). Waiting decisions' forks are certain; the rest follows the members' draws."""
        remaining = self.budget.remaining
        # at least i + 1 fills iff fewer than remaining − i forks: counts from remaining − first on need no detail
        cap = remaining - first
        if cap <= 0:
            return []
        look, g = self.lookahead, self.group
        forks = _point(0, cap)
        for m in self.members:
            start = self.first_depth(m)
            if start is not None:
                forks = _convolve(forks, look.fork_distribution(g, m.key, m.h_initial, start, reach, cap,
                                                                call_made(m)), cap)
        for d in self._counted():
            for j in range(d.wants):
                child = look.fork_distribution(g, d.member.key + (d.depth, j), d.member.h_initial, d.depth + 1,
                                               reach, cap)
                forks = _convolve(forks, _shift(child, cap), cap)
        return [sum(forks[: remaining - i]) for i in range(first, remaining)]

    def plan_fills(self, speculative: int, probability: float | None = None,
                   reach: Callable[[int], float] | None = None, call_made: Callable[[Any], bool] | None = None
                   ) -> "FillPlan":
        """What to do with the group's fresh fills now (call :meth:`resolve` first), given its ``speculative``
        fills (started outside the budget, oldest first): the slots no decision can take any more are reserved
        for fills — confirmed speculative ones first, then new ones; speculative fills beyond the slots left
        are dropped, newest first (so the kept fills are always the lowest-numbered, whatever their content);
        and, with fill prediction (``probability``, ``reach``, ``call_made`` as in :meth:`fill_need`), further
        speculative fills start for each fill the group needs with at least that chance."""
        granted = self.budget.reserve(self.spare())
        confirm = min(granted, speculative)
        left = speculative - confirm
        drop = max(0, left - self.budget.remaining)
        predict = 0
        if probability is not None:
            for p in self.fill_need(reach, call_made, first=left - drop):
                if p < probability:
                    break
                predict += 1
        return FillPlan(confirm=confirm, start=granted - confirm, drop=drop, predict=predict)

    @staticmethod
    def fork_key(parent_key: tuple, depth: int, existing: Iterable[tuple]) -> tuple:
        """The key of the parent's next fork at ``depth``, given the keys of the group's trajectories."""
        n = len(parent_key)
        siblings = sum(1 for k in existing if len(k) == n + 2 and k[:n] == parent_key and k[n] == depth)
        return parent_key + (depth, siblings)


def _speculative(member: Any) -> bool:
    return getattr(member, "speculative", False)


def _point(n: int, cap: int) -> list[float]:
    """The distribution of a count that is ``n`` for sure (entries 0 … cap, the last one meaning ≥ cap)."""
    return [1.0 if i == min(n, cap) else 0.0 for i in range(cap + 1)]


def _shift(dist: list[float], cap: int) -> list[float]:
    """One more than a count distributed as ``dist``."""
    return [0.0] + dist[:-2] + [dist[-2] + dist[-1]] if cap > 0 else dist


def _convolve(a: list[float], b: list[float], cap: int) -> list[float]:
    """The distribution of the sum of two independent counts, everything from ``cap`` on lumped at ``cap``."""
    out = [0.0] * (cap + 1)
    for i, p in enumerate(a):
        if p:
            for j, q in enumerate(b):
                out[min(i + j, cap)] += p * q
    return out
