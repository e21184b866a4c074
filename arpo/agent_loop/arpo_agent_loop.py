"""ARPO's entropy-adaptive branching inside the asynchronous agent loop.

One ``run`` call drives one prompt's whole group of M (= ``n``) trajectories. ``initial_rollouts`` (N)
root conversations start at once, each as its own coroutine. After a tool result, a coroutine may fork
copies of itself — the same rule, timing, entropy and budget code as the ARPO rollout
(:mod:`arpo.rollout.branching` for the rule, :mod:`arpo.rollout.branch_slots` for who gets the slots and
when) — and each copy continues as a new coroutine at once, without waiting for a round boundary:

* ``timing: code`` — ΔH from the first ``window`` tokens of the segment that ended with the tool call;
  the decision is taken as soon as the result is appended.
* ``timing: paper`` — ΔH from the first ``window`` tokens generated after the result; the parent
  generates its next segment, measures it, and forks copies of its state at the end of the result.

Every decision draws from its own generator, seeded by the loop's seed, the request seed, the prompt, the
trajectory's identity and its tool-turn count, so no draw depends on completion order. Slots of the group's budget go to
decisions in a fixed order (``branch_grant: ordered``, default: tool-turn depth, then place in the tree) or
as they come (``first_come``, the released code). Slots that no decision can reach any more — known early,
because future decisions' draws are known in advance — go at once to fresh roots, which fill the group to
exactly M. So with a deterministic engine and a fixed request seed, the group is the same whatever order
requests complete in. Outputs are in tree order (initial roots, then fills, each followed by its forks);
``parent``/``branch_pos`` describe the tree exactly as the rollout does, and a fork goes to its parent's
server (sticky session) so it hits the prefix cache.

Fill prediction (``speculative_fill_probability``, as in the rollout): a fresh root the group will need with
at least that chance — from the known draws and how often the group's trajectories have made their next tool
call so far (:meth:`~arpo.rollout.branch_slots.GroupSlots.fill_need`) — starts early, outside the budget, and
is dropped (its coroutine cancelled) if a fork takes its slot after all; which ones are kept depends only on
how many are needed, so the group is the same as without it.

Without ``multi_turn.max_user_turns`` a trajectory's future forks are unbounded, so fresh roots wait until
every branch has finished.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from dataclasses import dataclass, fields
from typing import Any

from arpo.agent_loop.base import AgentLoopContext, AgentLoopOutput, register
from arpo.agent_loop.tool_agent_loop import Conversation, ToolAgentLoop
from arpo.engine.base import GenerationOutput, SamplingParams
from arpo.rollout.branch_slots import GRANTS, CallRates, ForkLookahead, GroupSlots, canonical
from arpo.rollout.branching import BranchingConfig, GroupBudget, derive_seed, should_branch, token_entropy


@dataclass
class _Branch:
    """One trajectory of the group: its conversation and its place in the tree."""

    index: int
    conv: Conversation
    kind: str  # initial | branch | fill
    #: identity in the group, independent of creation order (see arpo.rollout.branch_slots)
    key: tuple
    parent: int = -1
    branch_pos: int = 0
    h_initial: float | None = None
    requests: int = 0
    #: the decision at the last tool result is still to be taken (paper timing: after the next segment).
    pending_decision: bool = False
    #: its tool calls are running: the decision after them is sure to come
    awaiting_result: bool = False
    done: bool = False
    #: a fill started before the group knows it needs it (outside the budget), or one dropped after all
    speculative: bool = False
    discarded: bool = False
    task: asyncio.Task | None = None


@register("arpo_agent")
class ARPOAgentLoop(ToolAgentLoop):
    """Returns the prompt's whole group: exactly ``n`` outputs forming ARPO's trajectory tree."""

    returns_group = True

    def __init__(self, context: AgentLoopContext, branching: BranchingConfig | dict[str, Any] | None = None,
                 initial_rollouts: int | None = None, seed: int | None = None, format: str | None = "arpo_tags",
                 vocab_size: int | None = None, return_entropy: bool = False, branch_grant: str = "ordered",
                 speculative_fill_probability: float | None = 0.35, **kwargs: Any):
        super().__init__(context, format=format, **kwargs)
        if isinstance(branching, BranchingConfig):
            self.bcfg = branching.validate()
        else:
            values = dict(branching or {})
            known = {f.name for f in fields(BranchingConfig)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"arpo_agent branching: unknown key(s) {unknown}; known: {sorted(known)}")
            self.bcfg = BranchingConfig(**values).validate()
        if initial_rollouts is not None and initial_rollouts < 1:
            raise ValueError(f"arpo_agent initial_rollouts={initial_rollouts}: must be >= 1 (or null for M/2)")
        self.initial_rollouts = initial_rollouts
        if branch_grant not in GRANTS:
            raise ValueError(f"arpo_agent branch_grant={branch_grant!r}: use one of {GRANTS}")
        self.branch_grant = branch_grant
        p = speculative_fill_probability
        if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ValueError(f"arpo_agent speculative_fill_probability={p!r}: give a probability in (0, 1], "
                             f"or null (off)")
        self.fill_probability = p
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        self.vocab_size = vocab_size or len(context.tokenizer)
        #: record every response token's normalised entropy (``token_entropy``; NaN on tool tokens).
        self.return_entropy = return_entropy
        self.log_v = math.log(self.vocab_size)

    # ------------------------------------------------------------------------------------- run

    async def run(self, messages: list[dict[str, Any]], sampling_params: SamplingParams, *, n: int = 1,
                  **dataset_fields: Any) -> list[AgentLoopOutput]:
        if n < 1:
            raise ValueError(f"n={n}: the group budget M must be >= 1")
        initial = self.initial_rollouts if self.initial_rollouts is not None else max(1, n // 2)
        if initial > n:
            raise ValueError(f"arpo_agent initial_rollouts ({initial}) > n ({n}): the initial rollouts N cannot "
                             f"exceed the budget M; lower initial_rollouts or raise rollout.n")
        self.budget = GroupBudget(n)
        self.branches: list[_Branch] = []
        self.tasks: set[asyncio.Task] = set()
        self.params = self.sampling_params(sampling_params).with_(logprobs=self.bcfg.topk_logprobs)
        self.prompt_ids = self.ctx.templater.prompt_ids(messages, with_tools=self.format == "hermes")
        # the prompt in the seed: groups of one batch (one loop seed) must not share their draws
        self.lookahead = ForkLookahead(self.bcfg, derive_seed(self.seed, self.params.seed, self.prompt_ids), n,
                                       self.ctx.multi_turn.max_user_turns or None, self.vocab_size)
        self.slots = GroupSlots(self.lookahead, self.budget, 0, self.branches, self._first_depth, self.branch_grant)
        self.call_rates = CallRates(1)
        # Group scope: H_initial is the mean of the initial roots' first windows, known once all have one.
        self.root_h0: list[float | None] = []
        self.group_h0: asyncio.Future = asyncio.get_running_loop().create_future()
        self.initial_count = self.budget.reserve(initial)
        for i in range(self.initial_count):
            self._spawn(_Branch(len(self.branches), self._new_conversation(), "initial", ("initial", i)))
        self._fill()
        try:
            while self.tasks:
                done, _ = await asyncio.wait(list(self.tasks), return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    self._check(task)
                self._fill()  # every branch is done: waiting decisions are granted, the rest goes to fresh roots
        except BaseException:
            for task in self.tasks:
                task.cancel()
            raise
        # tree order by identity, which does not depend on the order branches were created in
        ordered = sorted((b for b in self.branches if not b.discarded), key=lambda b: canonical(b.key))
        assert not any(b.speculative for b in ordered), "a speculative fill was neither confirmed nor dropped"
        position = {b.index: i for i, b in enumerate(ordered)}
        return [self._output(b, position) for b in ordered]

    def _new_conversation(self) -> Conversation:
        return Conversation(uuid.uuid4().hex, self.prompt_ids, token_entropy=[] if self.return_entropy else None)

    def _check(self, task: asyncio.Task) -> None:
        """Re-raise a branch's failure. A dropped speculative fill may end cancelled (cancelled before it
        started, or by its own :meth:`_fill`); that is its normal end, never the group's."""
        if task.cancelled():
            if not any(b.task is task and b.discarded for b in self.branches):
                raise asyncio.CancelledError("an ARPO branch was cancelled from outside its group")
        elif task.exception() is not None:
            raise task.exception()

    def _spawn(self, branch: _Branch) -> None:
        self.branches.append(branch)
        task = branch.task = asyncio.ensure_future(self._drive(branch))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def _fill(self) -> None:
        """Grant the waiting decisions whose turn has come, then give fresh roots the slots no branch can
        still take by forking (:meth:`GroupSlots.spare`): speculative fills first (confirmed), then new ones.
        Fill roots never fork, so the forks that do happen are exactly the ones the budget would have allowed
        anyway. Speculative fills beyond the slots left are dropped (newest first), and, with fill
        prediction, new ones start for the fills the group will probably need."""
        self.slots.resolve()
        spec = [b for b in self.branches if b.speculative]
        plan = self.slots.plan_fills(len(spec), self.fill_probability, self.call_rates.reach(0),
                                     lambda b: b.awaiting_result or b.pending_decision)
        for b in spec[: plan.confirm]:
            b.speculative = False
        for _ in range(plan.start):
            self._spawn_fill()
        current = asyncio.current_task()
        for b in spec[len(spec) - plan.drop:]:
            b.speculative, b.discarded = False, True
            # a branch dropped from its own task stops at its next check instead (_drive)
            if b.task is not None and b.task is not current and not b.task.done():
                b.task.cancel()
        for _ in range(plan.predict):
            self._spawn_fill(speculative=True)

    def _spawn_fill(self, speculative: bool = False) -> None:
        fills = sum(1 for b in self.branches if b.kind == "fill")
        self._spawn(_Branch(len(self.branches), self._new_conversation(), "fill", ("fill", fills),
                            speculative=speculative))

    def _first_depth(self, b: _Branch) -> int | None:
        """Tool-turn depth of the next decision ``b`` can still take (None: none)."""
        if b.kind == "fill" or b.done or self.bcfg.beam_size <= 1:
            return None
        turns = b.conv.user_turns
        if b.pending_decision:
            return turns
        limit = self.ctx.multi_turn.max_user_turns
        return None if limit and turns >= limit else turns + 1

    def _output(self, b: _Branch, position: dict[int, int]) -> AgentLoopOutput:
        out = b.conv.to_output(self.ctx.response_length)
        out.parent, out.branch_pos = (position[b.parent] if b.parent >= 0 else -1), b.branch_pos
        out.extra = {"rollout_kind": b.kind, "num_tool_calls": len(b.conv.tool_calls),
                     "initial_entropy": math.nan if b.h_initial is None else b.h_initial}
        return out

    # ------------------------------------------------------------------------- one trajectory

    async def _drive(self, b: _Branch) -> None:
        conv = b.conv
        timing = self.bcfg.timing
        paper_point: Conversation | None = None  # state at the end of the last result (paper timing)
        try:
            while not conv.finish_reason:
                self._fill()
                if b.discarded:
                    return
                seg_start = len(conv.response_ids)
                out = await self.generate_turn(conv, self._request_params(b))
                h = self._window(out)
                if b.requests == 1 and b.kind in ("initial", "fill"):
                    await self._record_initial(b, h)
                record = conv.tool_calls[-1] if conv.tool_calls else None
                if record is not None and record["end"] == seg_start and record["end"] > b.branch_pos:
                    record["entropy_after"] = h
                if paper_point is not None:
                    await self._maybe_fork(b, h, paper_point, record)
                    paper_point, b.pending_decision = None, False
                calls = self.after_generation(conv, out)
                self.call_rates.record(0, conv.user_turns + 1, made=bool(calls))
                if not calls:
                    break
                b.awaiting_result = True
                await self.run_tools(conv, calls)
                b.awaiting_result = False
                if conv.finish_reason:
                    break
                record = conv.tool_calls[-1]
                record.update(entropy_before=h, entropy_after=None, delta_entropy=None)
                if timing == "code":
                    b.pending_decision = True  # counted as pending while the decision may await
                    await self._maybe_fork(b, h, conv, record)
                    b.pending_decision = False
                else:
                    paper_point, b.pending_decision = conv.fork(conv.session_id), True
        except asyncio.CancelledError:
            if not b.discarded:  # a dropped speculative fill just stops; anything else is a real cancellation
                raise
        finally:
            b.done = True
            self.ctx.server_manager.end_session(conv.session_id)
            if not conv.finish_reason:
                conv.finish_reason = "abort"
            elif not b.discarded:
                self._fill()

    def _request_params(self, b: _Branch) -> SamplingParams:
        b.requests += 1
        if self.params.seed is None:
            return self.params
        # A fixed seed on every request would make every fork resample its parent's continuation; the
        # identity (not the creation index) keeps the seed independent of completion order.
        return self.params.with_(seed=derive_seed(self.params.seed, b.key, b.requests))

    def token_entropies(self, out: GenerationOutput) -> list[float] | None:
        if not self.return_entropy or out.logprobs is None or len(out.logprobs) != len(out.token_ids):
            return None
        return [token_entropy(lp) / self.log_v for lp in out.logprobs]

    def _window(self, out: GenerationOutput) -> float | None:
        if not out.logprobs or len(out.logprobs) != len(out.token_ids):
            return None
        return self.lookahead.window_entropy(out.logprobs)

    async def _record_initial(self, b: _Branch, h: float | None) -> None:
        if self.bcfg.initial_entropy_scope == "trajectory":
            b.h_initial = h
            return
        if b.kind == "initial":
            self.root_h0.append(h)
            if len(self.root_h0) == self.initial_count and not self.group_h0.done():
                known = [x for x in self.root_h0 if x is not None]
                self.group_h0.set_result(sum(known) / len(known) if known else None)
        b.h_initial = await asyncio.shield(self.group_h0)  # a dropped fill must not cancel the shared future

    async def _maybe_fork(self, b: _Branch, h_now: float | None, state: Conversation,
                          record: dict[str, Any] | None) -> None:
        """Decide the ``beam_size − 1`` fork candidates at ``state`` (the end of a tool result) and offer the
        forks asked for to the group's slots; they copy ``state`` whenever they are granted."""
        try:
            if self.bcfg.beam_size <= 1 or self.budget.remaining == 0 or h_now is None or b.kind == "fill":
                return
            if b.h_initial is None and self.bcfg.initial_entropy_scope == "group":
                b.h_initial = await asyncio.shield(self.group_h0)
            if b.h_initial is None:
                return
            delta_h = h_now - b.h_initial
            if record is not None:
                record["delta_entropy"] = delta_h
            if state.tool_calls and state is not b.conv:  # the paper-timing snapshot holds its own copy
                state.tool_calls[-1]["delta_entropy"] = delta_h
            depth = state.user_turns
            rng = self.lookahead.rng(0, b.key, depth)
            wants = sum(should_branch(self.bcfg, delta_h, rng) for _ in range(self.bcfg.beam_size - 1))
        finally:
            b.pending_decision = False  # past this decision before its forks are offered (GroupSlots.offer)
        if wants == 0 or self.budget.remaining == 0:
            return
        # the parent goes on; a grant that comes later copies the state as it was at the decision
        snapshot = state if state is not b.conv else state.fork(state.session_id)
        pos, parent_session = len(snapshot.response_ids), b.conv.session_id

        def grant(granted: int) -> None:
            for _ in range(granted):
                key = GroupSlots.fork_key(b.key, depth, (x.key for x in self.branches))
                child = snapshot.fork(uuid.uuid4().hex)
                child.metrics = {"generate_sequences": 0.0, "tool_calls": 0.0}
                self.ctx.server_manager.fork_session(parent_session, child.session_id)
                self._spawn(_Branch(len(self.branches), child, "branch", key, parent=b.index, branch_pos=pos,
                                    h_initial=b.h_initial))

        self.slots.offer(b, depth, wants, grant)
