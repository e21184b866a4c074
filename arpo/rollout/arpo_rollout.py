"""The ARPO generator: entropy-adaptive branching rollouts of a tool-calling policy on an async engine. This
module is the driver: it sends requests, runs tools and schedules branches; the tree's transitions are
:mod:`arpo.rollout.tree`.

Per prompt (a *group*, budget M = ``n``), one call of :meth:`ARPORollout.agenerate` does:

1. start ``initial_rollouts`` (N) root trajectories from the prompt;
2. send ALL active trajectories to the engine at once (the engine's continuous batching and prefix cache do
   the rest), each generating until a tool's close tag (a stop string), EOS, or the response length limit.
   ``schedule.mode: async`` (default) runs each trajectory as its own task — generate, tool, generate … — and a
   fork or fill starts the moment it exists; ``schedule.mode: rounds`` steps all active trajectories together
   (one round = one request each, then all tool calls), the released code's loop;
3. parse the trailing tool call (:mod:`arpo.rollout.call_format`: a tool's tag, or with ``tools.format: hermes`` a
   ``<tool_call>`` JSON call), run all calls of the round concurrently in the tool thread pool
   (:class:`~arpo.rollout.tool_executor.ToolExecutor`), and append `` <result>\\n…\\n</result>`` (hermes: the chat
   template's tool message) as tokens with ``response_mask`` 0. Token in, token out: the result text is
   tokenised on its own and appended; the history is never re-tokenised;
4. after each tool result, decide whether to fork: ΔH = H_now − H_initial (window entropies, see
   :mod:`arpo.rollout.branching`), one :func:`~arpo.rollout.branching.should_branch` per candidate fork
   (``beam_size − 1`` candidates, the parent itself being the ``beam_size``-th continuation), each granted a
   slot by the group's :class:`~arpo.rollout.branching.GroupBudget` — a group never exceeds M. A fork copies
   its parent's tokens, masks, tool-call records and H_initial, and records ``branch_pos`` (shared response
   tokens) and its parent, so the trainer sees the trajectory tree;
5. a group that ends short of M is filled: with fresh roots from the prompt (``schedule.fill: fresh``, default;
   they call tools like any root but never branch), or with copies of the group's last trajectory
   (``schedule.fill: duplicate``, released-code compatibility only — duplicates bias GRPO's group mean and std).
   Fresh fills start as soon as the budget left exceeds the most that branching could still take, instead
   of after the group finishes: the same decisions, fewer rounds. That most is a look-ahead, not a worst
   case: every future decision's draws are known in advance (see Determinism), and entropies lie in a known
   range, so a candidate whose draw no reachable ΔH would fork is not counted
   (:mod:`arpo.rollout.branch_slots`). ``schedule.speculative_fill: K`` goes further and starts up to K fills per
   group with the initial rollouts, outside the budget: each is confirmed when the group turns out to need
   it and dropped (its tokens wasted, counted in ``rollout/tokens/discarded``) when branching takes its slot.
   Which fills survive depends only on how many are needed, never on their content, so the kept ones are
   unbiased fresh samples; the trade is extra compute for less latency. ``schedule.fill_probability: p``
   (fill prediction) starts such a fill when it is needed with probability at least p, from the draws of
   the decisions still to come and how often trajectories have made their next tool call so far (this
   call's segments, the last call's rates as prior; :meth:`~arpo.rollout.branch_slots.GroupSlots.fill_need`):
   what the look-ahead cannot know is whether a trajectory will call a tool again, so without it the fills
   a group needs mostly start when its last branching trajectory ends, and run late, alone.

Logprobs. Entropy uses the top-k logprobs of a segment's first ``entropy.window`` tokens; each segment is one
request with logprobs on every token (:mod:`arpo.rollout.segments`).

Entropy timing. ``branching.timing: code`` takes H_now from the first ``entropy.window`` tokens of the segment that
ends with the tool call (the released code). ``branching.timing: paper`` appends the result, generates
``entropy.window`` tokens (a *probe* request), measures them, then decides; forks start from the end of the
result, and the probe tokens stay in the parent as the start of its continuation (nothing is thrown away).

Initial entropy is the window entropy of the first segment of each root (``initial_entropy_scope:
trajectory``) or the mean over the group's initial roots (``group``). It lives only inside one call: the
released code keeps it in an instance dict keyed by row index across training steps, so from the second
step it compares against stale entropies of other prompts — here it is call-local state, a fork inherits
its parent's value, and nothing survives the call.

Tool call limit. A call made when the trajectory has already run ``tools.call_limit`` calls is not executed:
the rollout appends EOS (``response_mask`` 0, since the policy did not sample it) and finishes the
trajectory with ``finish_reason`` ``tool_limit``. Malformed calls (a close tag without its open tag; with
hermes also bad JSON, an unknown tool or a missing argument) get an error text result and count toward the limit.

Determinism. Engine requests carry seeds derived from (call seed, group, trajectory, request number), and
each branching decision draws from its own generator seeded by (call seed, group, trajectory, call number),
so no draw depends on the order requests complete in. A trajectory's identity is its parent's plus (call
number, sibling number), so the draws of decisions of forks not yet made are known too. With
``schedule.branch_grant: ordered`` (default) budget slots also go to decisions in a fixed order (see
:class:`~arpo.rollout.branch_slots.GroupSlots`), so a deterministic engine gives the same batch for a seed
under either schedule, whatever order requests and tool calls complete in. A decision that waits for its turn
starts its forks at once, outside the budget (``schedule.speculative_forks``), and keeps those it is granted:
a fork's tokens depend on its identity, not on when it started, so the wait costs no latency.
``first_come`` grants slots as decisions arrive: replayable under ``schedule.mode: rounds`` (decisions are taken
in a fixed order there), timing-dependent under ``async``. A call without an explicit seed uses ``seed``
mixed with the call count, so a fresh generator replays the same sequence of batches.

``mode: single`` is plain GRPO sampling with the same tools and loop (``n`` independent roots, no
branching) for baselines and benchmarks; it requests logprobs only when ``return_entropy`` is set.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Sequence
from typing import Any, Iterable, Mapping

from arpo.batch import DataBatch, Trajectory, collate_trajectories
from arpo.engine.base import GenerationEngine, SamplingParams
from arpo.protocol import MalformedCall, ToolCall, ToolProtocol
from arpo.rollout.branch import Branch, Phase
from arpo.rollout.branching import derive_seed
from arpo.rollout.call_format import make_call_format
from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.rollout_metrics import RolloutMetrics, summarize
from arpo.rollout.segments import SegmentRequester
from arpo.rollout.tool_executor import ToolExecutor
from arpo.rollout.tree import RolloutTree
from tools.base import BaseTool

__all__ = ["ARPORollout", "ARPORolloutConfig", "RolloutCall", "derive_seed"]


class ARPORollout:
    """ARPO (or plain GRPO) rollouts of a tool-calling policy on an injected :class:`GenerationEngine`, or on
    several replicas of it: each prompt group then runs on one replica (the least busy when the group starts;
    sticky, so its branches share that replica's prefix cache). The trajectories do not depend on the split:
    every request's seed derives from the group and branch, not from where it runs."""

    def __init__(
        self,
        engine: GenerationEngine | Sequence[GenerationEngine],
        tokenizer: Any,
        config: ARPORolloutConfig | Mapping[str, Any] | None = None,
        tools: Mapping[str, BaseTool] | Iterable[BaseTool] | None = None,
        executor: ToolExecutor | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ):
        """``chat_template_kwargs``: those the prompts were rendered with (``tools.format: hermes`` renders tool
        messages with them)."""
        self.engines = list(engine) if isinstance(engine, Sequence) else [engine]
        if not self.engines:
            raise ValueError("ARPORollout needs at least one engine")
        self.router = None
        if len(self.engines) > 1:
            from arpo.agent_loop.server_manager import ServerManager

            self.router = ServerManager(self.engines)
        self.tokenizer = tokenizer
        self.config = config.validate() if isinstance(config, ARPORolloutConfig) else \
            ARPORolloutConfig.from_dict(config)
        if executor is not None and tools is not None:
            raise ValueError("pass either tools or an executor, not both")
        self._owns_executor = executor is None
        self.executor = executor or ToolExecutor(
            tools or [], max_workers=self.config.tools.workers, timeout_s=self.config.tools.timeout_s,
            retries=self.config.tools.retries, retry_on_empty=self.config.tools.retry_on_empty,
            max_result_chars=self.config.tools.max_result_chars,
        )
        #: how the model calls the tools (tools.format); built here so that a bad tag, or hermes without a chat
        #: template, fails at start-up, not in the first rollout
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.call_format = make_call_format(self.config, self.executor, tokenizer, self.chat_template_kwargs)
        self._calls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the last call's tool-call rates by depth: the prior of the next call's fill prediction (they decide
        #: only when fills start, never what any trajectory contains)
        self.call_rate_prior: dict[int, float] = {}

    @property
    def protocol(self) -> ToolProtocol:
        """The loaded tools in the run's call format: what the rewards' format gate reads."""
        return self.executor.protocol.with_format(self.config.tools.format)

    # ---- public entry points ------------------------------------------------------------------------
    async def agenerate(
        self,
        prompts: list[list[int]],
        group_uids: list[str] | None = None,
        group_fields: dict[str, list[Any]] | None = None,
        seed: int | None = None,
        config: ARPORolloutConfig | None = None,
    ) -> DataBatch:
        """Roll out every prompt into exactly ``n`` trajectories and collate them (verl row layout)."""
        cfg = config.validate() if config is not None else self.config
        if not prompts:
            raise ValueError("no prompts to roll out")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if seed is None:
            seed = derive_seed(cfg.seed, "call", self._calls)
        self._calls += 1
        if group_uids is None:
            uid_rng = random.Random(derive_seed(seed, "uid"))
            group_uids = [str(uuid.UUID(int=uid_rng.getrandbits(128), version=4)) for _ in prompts]
        if len(group_uids) != len(prompts):
            raise ValueError(f"{len(group_uids)} group uids for {len(prompts)} prompts")
        sessions = []
        if self.router is not None:
            from arpo.agent_loop.server_manager import SessionEngine

            nonce = uuid.uuid4().hex[:8]
            sessions = [SessionEngine(self.router, f"rollout-{nonce}-g{g}") for g in range(len(prompts))]
        call = RolloutCall(sessions or self.engines[0], self.tokenizer, self.executor, cfg,
                           [list(map(int, p)) for p in prompts], seed, self.call_rate_prior,
                           chat_template_kwargs=self.chat_template_kwargs)
        try:
            trajectories = await call.run()
        finally:
            for session in sessions:
                session.close()
        self.call_rate_prior = call.tree.call_rates.rates()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = collate_trajectories(trajectories, pad, group_uids, group_fields, cfg.sampling.max_response_length)
        batch.meta["metrics"] = call.metrics()
        batch.meta["seed"] = seed
        return batch

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> DataBatch:
        """Blocking :meth:`agenerate` for callers without a running event loop. Every call runs on the same
        private loop, because an in-process async engine (vLLM's AsyncLLM) stays bound to its first loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(self.agenerate(prompts, **kwargs))
        raise RuntimeError("ARPORollout.generate() called inside a running event loop; await agenerate() instead")

    def generate_sequences(self, prompts: DataBatch) -> DataBatch:
        """verl-style entry: prompts from ``raw_prompt_ids`` (or unpadded ``input_ids``); other columns are
        repeated onto each row of their group; ``meta['seed']`` and ``meta['rollout_overrides']`` (config keys
        for this call, e.g. greedy validation) are honoured."""
        if "raw_prompt_ids" in prompts.non_tensors:
            ids = [list(map(int, p)) for p in prompts.non_tensors["raw_prompt_ids"]]
        elif "input_ids" in prompts.tensors:
            mask = prompts.tensors.get("attention_mask")
            rows = prompts.tensors["input_ids"]
            ids = [row[m.bool()].tolist() if mask is not None else row.tolist()
                   for row, m in zip(rows, mask if mask is not None else rows)]
        else:
            raise ValueError("prompt batch needs a 'raw_prompt_ids' column or an 'input_ids' tensor")
        fields = {k: list(v) for k, v in prompts.non_tensors.items() if k not in ("raw_prompt_ids", "uid")}
        uids = list(prompts.non_tensors["uid"]) if "uid" in prompts.non_tensors else None
        overrides = prompts.meta.get("rollout_overrides") or {}
        cfg = self.config.updated(overrides) if overrides else None
        return self.generate(ids, group_uids=uids, group_fields=fields, seed=prompts.meta.get("seed"), config=cfg)

    def close(self) -> None:
        if self._owns_executor:
            self.executor.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


class RolloutCall:
    """One rollout call: its tree, and the engine requests and tool calls that move it, under a schedule
    (so nothing can leak into the next call). The batch rollout makes one per batch; the ARPO agent loop
    one per prompt group, with the group's row in ``group_ids`` so that it rolls out the same tree."""

    def __init__(self, engine: GenerationEngine | Sequence[GenerationEngine], tokenizer: Any, executor: ToolExecutor,
                 cfg: ARPORolloutConfig, prompts: list[list[int]], seed: int,
                 call_rate_prior: dict[int, float] | None = None, group_ids: list[int] | None = None,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        self.cfg, self.executor, self.n_groups = cfg, executor, len(prompts)
        group_ids = list(range(len(prompts))) if group_ids is None else list(group_ids)
        if len(group_ids) != len(prompts):
            raise ValueError(f"{len(group_ids)} group ids for {len(prompts)} prompts")
        self.m = RolloutMetrics()
        call_format = make_call_format(cfg, executor, tokenizer, chat_template_kwargs)
        want_logprobs = cfg.mode == "arpo" or cfg.return_entropy or cfg.calculate_log_probs
        params = SamplingParams(
            temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
            repetition_penalty=cfg.sampling.repetition_penalty,
            stop=tuple(call_format.stop_strings() + list(cfg.sampling.extra_stop)),
            stop_token_ids=tuple(cfg.sampling.stop_token_ids),
            logprobs=cfg.entropy.topk_logprobs if want_logprobs else None,
        )
        engines = list(engine) if isinstance(engine, Sequence) else [engine] * len(prompts)  # one per group
        if len(engines) != len(prompts):
            raise ValueError(f"{len(engines)} engines for {len(prompts)} prompt groups")
        self.segments = SegmentRequester(
            engines, tokenizer, params, seed=seed, nonce=uuid.uuid4().hex[:8],  # request ids only
            group_ids=group_ids, window=cfg.entropy.window, max_response_length=cfg.sampling.max_response_length,
            metrics=self.m)
        self.tree = RolloutTree(cfg, tokenizer, prompts, seed, call_format, call_rate_prior or {}, self.m,
                                self.segments.cut_at_stop, group_ids)
        #: set once the group's initial entropy is known (``entropy.initial_scope: group``)
        self.h0_settled = [asyncio.Event() for _ in prompts]
        #: schedule async: one task per branch that has started, by tid
        self.tasks: dict[int, asyncio.Task] = {}
        self.live: set[asyncio.Task] = set()
        self.task_errors: list[BaseException] = []
        self.task_event = asyncio.Event()

    async def run(self) -> list[Trajectory]:
        t_start = self.m.started_at = time.perf_counter()
        from tqdm.auto import tqdm

        progress = tqdm(total=self.n_groups * self.cfg.n, desc="rollout", unit="traj",
                        disable=not self.cfg.show_progress, leave=False)
        self.tree.progress = progress
        self.tree.start()
        try:
            if self.cfg.schedule.mode == "rounds":
                await self._run_rounds()
            else:
                await self._run_async()
        finally:
            progress.close()
        self.m.time["total"] = time.perf_counter() - t_start
        return self.tree.trajectories()

    def _settle(self, groups: Iterable[int]) -> None:
        for g in self.tree.h0.settle(groups, self.tree.by_group):
            self.h0_settled[g].set()

    async def _run_rounds(self) -> None:
        """``schedule.mode: rounds``: every round sends all active branches at once and waits for all of them,
        then runs all tool calls of the round at once. Decisions happen in a fixed order, so a deterministic
        engine gives identical batches whatever order requests complete in (exact replay)."""
        tree, active, rounds = self.tree, list(self.tree.branches), 0
        while active:
            rounds += 1
            tasks = [asyncio.ensure_future(self.segments.request(b)) for b in active]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # do not leave orphan requests running in the engine
                    task.cancel()
                raise
            finishes = [tree.absorb(b, out) for b, out in zip(active, outputs)]
            self._settle(range(self.n_groups))
            for b in active:
                if b.phase is Phase.PROBE:
                    tree.decide_after_probe(b)
            pending = []
            for b, out, (finish, stop_reason) in zip(active, outputs, finishes):
                call = tree.classify(b, out, finish, stop_reason)
                if call is not None:
                    pending.append((b, call))
            await self._run_tools(pending)
            tree.top_up(range(self.n_groups))
            active = [b for b in tree.branches if b.phase is not Phase.DONE]
        self.m.count["rounds"] = rounds

    async def _run_async(self) -> None:
        """``schedule.mode: async``: one task per branch (generate, tool, generate, ...); forks and fills start
        their own task the moment they exist. No branch waits for another's request or tool call (except
        for the group's initial entropy under ``entropy.initial_scope: group``), so there are no round
        barriers and a group's late fills overlap other groups' work."""
        for g in range(self.n_groups):
            self._start_tasks(g)
        try:
            while self.live:
                await self.task_event.wait()
                self.task_event.clear()
                if self.task_errors:
                    raise self.task_errors[0]
        except BaseException:
            for task in self.tasks.values():  # do not leave orphan requests running in the engine
                task.cancel()
            raise

    async def _drive(self, b: Branch) -> None:
        """One branch's life under ``schedule.mode: async``: the steps of one round, for one branch."""
        tree = self.tree
        while b.phase is not Phase.DONE:
            out = await self.segments.request(b)
            finish, stop_reason = tree.absorb(b, out)
            self._settle([b.group])
            if b.phase is Phase.PROBE:
                tree.decide_after_probe(b)
            call = tree.classify(b, out, finish, stop_reason)
            if call is not None:
                if b.may_fork and self.cfg.branching_enabled and tree.h0.pending(b):  # its decision needs H_initial
                    await self.h0_settled[b.group].wait()
                await self._run_tools([(b, call)])
            tree.top_up([b.group])
            self._start_tasks(b.group)

    def _start_tasks(self, group: int) -> None:
        """Start a task for each new branch of the group; cancel those of dropped speculative fills."""
        current = asyncio.current_task()
        for b in self.tree.by_group[group]:
            task = self.tasks.get(b.tid)
            if b.discarded:
                if task is not None and task is not current and not task.done():
                    task.cancel()  # its in-flight request is aborted; its tokens were counted as discarded
            elif task is None and b.phase is not Phase.DONE:
                task = asyncio.ensure_future(self._drive(b))
                self.tasks[b.tid] = task
                self.live.add(task)
                task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.live.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.task_errors.append(task.exception())
        self.task_event.set()

    async def _run_tools(self, pending: list[tuple[Branch, ToolCall | MalformedCall]]) -> None:
        """Run the calls at once in the tool pool (a malformed one gets its error text without running)."""
        if not pending:
            return
        real = [(b, c) for b, c in pending if isinstance(c, ToolCall)]
        with self.m.tools_clock:
            results = await self.executor.arun_many([(c.tool, c.content) for _, c in real])
        by_tid = {b.tid: r for (b, _), r in zip(real, results)}
        for b, call in pending:
            self.tree.append_tool_result(b, call, by_tid.get(b.tid))

    def metrics(self) -> dict[str, float]:
        return summarize(self.m, self.tree.branches, self.tree.slots, self.cfg.schedule.mode)
