"""The ARPO generator: entropy-adaptive branching rollouts of a tool-calling policy on an async engine.

Per prompt (a *group*, budget M = ``n``), one call of :meth:`ARPORollout.agenerate` does:

1. start ``initial_rollouts`` (N) root trajectories from the prompt;
2. send ALL active trajectories to the engine at once (the engine's continuous batching and prefix cache do
   the rest), each generating until a tool's close tag (a stop string), EOS, or the response length limit.
   ``schedule: async`` (default) runs each trajectory as its own task — generate, tool, generate … — and a
   fork or fill starts the moment it exists; ``schedule: rounds`` steps all active trajectories together
   (one round = one request each, then all tool calls), the released code's loop;
3. parse the trailing tool call (:func:`arpo.protocol.parse_trailing_tool_call`), run all calls of the round
   concurrently in the tool thread pool (:class:`~arpo.rollout.tool_executor.ToolExecutor`), and append
   `` <result>\\n…\\n</result>`` as tokens with ``response_mask`` 0. Token in, token out: the result text is
   tokenised on its own and appended; the history is never re-tokenised;
4. after each tool result, decide whether to fork: ΔH = H_now − H_initial (window entropies, see
   :mod:`arpo.rollout.branching`), one :func:`~arpo.rollout.branching.should_branch` per candidate fork
   (``beam_size − 1`` candidates, the parent itself being the ``beam_size``-th continuation), each granted a
   slot by the group's :class:`~arpo.rollout.branching.GroupBudget` — a group never exceeds M. A fork copies
   its parent's tokens, masks, tool-call records and H_initial, and records ``branch_pos`` (shared response
   tokens) and its parent, so the trainer sees the trajectory tree;
5. a group that ends short of M is filled: with fresh roots from the prompt (``fill: fresh``, default;
   they call tools like any root but never branch), or with copies of the group's last trajectory
   (``fill: duplicate``, released-code compatibility only — duplicates bias GRPO's group mean and std).
   Fresh fills start as soon as the budget left exceeds the most that branching could still take, instead
   of after the group finishes: the same decisions, fewer rounds. That most is a look-ahead, not a worst
   case: every future decision's draws are known in advance (see Determinism), and entropies lie in a known
   range, so a candidate whose draw no reachable ΔH would fork is not counted
   (:mod:`arpo.rollout.branch_slots`). ``speculative_fill: K`` goes further and starts up to K fills per
   group with the initial rollouts, outside the budget: each is confirmed when the group turns out to need
   it and dropped (its tokens wasted, counted in ``rollout/tokens/discarded``) when branching takes its slot.
   Which fills survive depends only on how many are needed, never on their content, so the kept ones are
   unbiased fresh samples; the trade is extra compute for less latency. ``speculative_fill_probability: p``
   (fill prediction) starts such a fill when it is needed with probability at least p, from the draws of
   the decisions still to come and how often trajectories have made their next tool call so far (this
   call's segments, the last call's rates as prior; :meth:`~arpo.rollout.branch_slots.GroupSlots.fill_need`):
   what the look-ahead cannot know is whether a trajectory will call a tool again, so without it the fills
   a group needs mostly start when its last branching trajectory ends, and run late, alone.

Logprobs. Entropy uses the top-k logprobs of a segment's first ``entropy_window`` tokens. What they cost
vLLM is mostly detokenising the k candidates of every token, so requests carrying them run without
detokenisation (see ``_RolloutCall._request``): when every stop string is a single token (the tiny model's
tags) a segment is one request stopping on the tags' token ids, with logprobs on every token; otherwise it
is a window request with logprobs, then at once (same coroutine, no extra round) a continuation without
them, and a stop string split between the two is found and cut like the probe's below.

Entropy timing. ``timing: code`` takes H_now from the first ``entropy_window`` tokens of the segment that
ends with the tool call (the released code). ``timing: paper`` appends the result, generates
``entropy_window`` tokens (a *probe* request), measures them, then decides; forks start from the end of the
result, and the probe tokens stay in the parent as the start of its continuation (nothing is thrown away).

Initial entropy is the window entropy of the first segment of each root (``initial_entropy_scope:
trajectory``) or the mean over the group's initial roots (``group``). It lives only inside one call: the
released code keeps it in an instance dict keyed by row index across training steps, so from the second
step it compares against stale entropies of other prompts — here it is call-local state, a fork inherits
its parent's value, and nothing survives the call.

Tool call limit. A call made when the trajectory has already run ``tool_call_limit`` calls is not executed:
the rollout appends EOS (``response_mask`` 0, since the policy did not sample it) and finishes the
trajectory with ``finish_reason`` ``tool_limit``. Malformed calls (a close tag without its open tag) get an
error text result and count toward the limit.

Determinism. Engine requests carry seeds derived from (call seed, group, trajectory, request number), and
each branching decision draws from its own generator seeded by (call seed, group, trajectory, call number),
so no draw depends on the order requests complete in. A trajectory's identity is its parent's plus (call
number, sibling number), so the draws of decisions of forks not yet made are known too. With
``branch_grant: ordered`` (default) budget slots also go to decisions in a fixed order (see
:class:`~arpo.rollout.branch_slots.GroupSlots`), so a deterministic engine gives the same batch for a seed
under either schedule, whatever order requests and tool calls complete in.
``first_come`` grants slots as decisions arrive: replayable under ``schedule: rounds`` (decisions are taken
in a fixed order there), timing-dependent under ``async``. A call without an explicit seed uses ``seed``
mixed with the call count, so a fresh generator replays the same sequence of batches.

``mode: single`` is plain GRPO sampling with the same tools and loop (``n`` independent roots, no
branching) for baselines and benchmarks; it requests logprobs only when ``return_entropy`` is set.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import random
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from arpo.batch import DataBatch, Trajectory, collate_trajectories
from arpo.engine.base import GenerationEngine, GenerationOutput, SamplingParams
from arpo.protocol import TOOL_TAGS, format_tool_result, parse_trailing_tool_call, stop_strings
from arpo.rollout.branch_slots import GRANTS, CallRates, ForkLookahead, GroupSlots, canonical
from arpo.rollout.branching import BranchingConfig, GroupBudget, derive_seed, should_branch, token_entropy
from arpo.rollout.tool_executor import ToolExecutor
from tools.base import BaseTool

logger = logging.getLogger(__name__)

CONFIG_PREFIX = "actor_rollout_ref.rollout.arpo"
MODES = ("arpo", "single")
FILLS = ("fresh", "duplicate")
SCHEDULES = ("async", "rounds")


@dataclass
class ARPORolloutConfig:
    """``actor_rollout_ref.rollout.arpo.*`` (every key is documented in ``configs/rollout/arpo.yaml``)."""

    mode: str = "arpo"
    schedule: str = "async"
    branch_grant: str = "ordered"
    n: int = 16
    initial_rollouts: int = 8
    beam_size: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    rule: str = "code"
    timing: str = "code"
    paper_alpha: float = 0.5
    paper_beta: float = 0.2
    paper_tau: float = 0.5
    entropy_window: int = 20
    topk_logprobs: int = 10
    entropy_reduction: str = "mean"
    initial_entropy_scope: str = "trajectory"
    vocab_size: int | None = None
    tool_call_limit: int = 3
    max_response_length: int = 4096
    fill: str = "fresh"
    speculative_fill: int = 0
    speculative_fill_probability: float | None = 0.35
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    extra_stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    return_entropy: bool = False
    tool_workers: int = 64
    tool_timeout_s: float = 120.0
    tool_retries: int = 3
    retry_on_empty: bool = True
    max_result_chars: int | None = None
    show_progress: bool = False

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any] | None) -> "ARPORolloutConfig":
        """Build from a dict or OmegaConf node; an unknown key is an error naming it."""
        if cfg is None:
            return cls().validate()
        if hasattr(cfg, "items") and not isinstance(cfg, dict):
            try:
                from omegaconf import OmegaConf

                cfg = OmegaConf.to_container(cfg, resolve=True)
            except (ImportError, ValueError):
                cfg = dict(cfg)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"{CONFIG_PREFIX}: unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**cfg).validate()

    def validate(self) -> "ARPORolloutConfig":
        p = CONFIG_PREFIX

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.mode in MODES, f"{p}.mode={self.mode!r}: use one of {MODES}")
        need(self.schedule in SCHEDULES, f"{p}.schedule={self.schedule!r}: use one of {SCHEDULES}")
        need(self.branch_grant in GRANTS, f"{p}.branch_grant={self.branch_grant!r}: use one of {GRANTS}")
        need(isinstance(self.n, int) and self.n >= 1, f"{p}.n={self.n!r}: the per-prompt budget M must be >= 1")
        need(isinstance(self.initial_rollouts, int) and self.initial_rollouts >= 1,
             f"{p}.initial_rollouts={self.initial_rollouts!r}: must be >= 1")
        need(self.mode == "single" or self.initial_rollouts <= self.n,
             f"{p}.initial_rollouts ({self.initial_rollouts}) > {p}.n ({self.n}): the initial rollouts N cannot "
             f"exceed the budget M; lower initial_rollouts or raise n (ARPO uses N = M/2)")
        need(self.fill in FILLS, f"{p}.fill={self.fill!r}: use one of {FILLS}")
        need(isinstance(self.speculative_fill, int) and self.speculative_fill >= 0,
             f"{p}.speculative_fill={self.speculative_fill!r}: must be an integer >= 0 (0: off)")
        need(self.speculative_fill == 0 or self.fill == "fresh",
             f"{p}.speculative_fill={self.speculative_fill} needs {p}.fill=fresh (duplicates cannot be speculated)")
        sfp = self.speculative_fill_probability
        need(sfp is None or (isinstance(sfp, (int, float)) and 0 < sfp <= 1),
             f"{p}.speculative_fill_probability={sfp!r}: give a probability in (0, 1], or null (off)")
        need(isinstance(self.tool_call_limit, int) and self.tool_call_limit >= 0,
             f"{p}.tool_call_limit={self.tool_call_limit!r}: must be an integer >= 0")
        need(isinstance(self.max_response_length, int) and self.max_response_length >= 1,
             f"{p}.max_response_length={self.max_response_length!r}: must be an integer >= 1")
        need(self.vocab_size is None or self.vocab_size >= 2,
             f"{p}.vocab_size={self.vocab_size!r}: leave null (tokenizer length) or give an integer >= 2")
        need(self.temperature >= 0, f"{p}.temperature={self.temperature!r}: must be >= 0")
        need(0 < self.top_p <= 1, f"{p}.top_p={self.top_p!r}: must be in (0, 1]")
        need(self.tool_workers >= 1, f"{p}.tool_workers={self.tool_workers!r}: must be >= 1")
        need(self.tool_timeout_s > 0, f"{p}.tool_timeout_s={self.tool_timeout_s!r}: must be > 0")
        need(self.tool_retries >= 0, f"{p}.tool_retries={self.tool_retries!r}: must be >= 0")
        need(self.max_result_chars is None or self.max_result_chars >= 1,
             f"{p}.max_result_chars={self.max_result_chars!r}: leave null (no limit) or give an integer >= 1")
        try:
            self.branching()
        except ValueError as exc:
            raise ValueError(str(exc).replace("branching config: ", f"{p}.").replace("window=", "entropy_window="))
        return self

    def branching(self) -> BranchingConfig:
        """The branching decision's parameters (validated)."""
        return BranchingConfig(
            rule=self.rule, timing=self.timing, beam_size=self.beam_size,
            branch_probability=self.branch_probability, entropy_weight=self.entropy_weight,
            paper_alpha=self.paper_alpha, paper_beta=self.paper_beta, paper_tau=self.paper_tau,
            window=self.entropy_window, topk_logprobs=self.topk_logprobs,
            entropy_reduction=self.entropy_reduction, initial_entropy_scope=self.initial_entropy_scope,
        ).validate()

    @property
    def num_initial(self) -> int:
        return self.n if self.mode == "single" else self.initial_rollouts

    @property
    def branching_enabled(self) -> bool:
        return self.mode == "arpo" and self.beam_size > 1


@dataclass
class _Traj:
    """Mutable state of one trajectory inside one rollout call."""

    tid: int
    group: int
    local: int
    kind: str  # initial | branch | fill | duplicate
    #: identity within the group that does not depend on creation order (seeds derive from it):
    #: ("initial", i), ("fill", i), or the parent's key + (decision depth, j) for its j-th fork at the decision
    #: after its depth-th tool call (a duplicate: depth ``tool_call_limit + 1``).
    key: tuple
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    token_entropy: list[float] = field(default_factory=list)
    parent: int = -1  # tid of the parent
    branch_pos: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    n_calls: int = 0
    h_initial: float | None = None
    own_h0: float | None = None
    seg_start: int = 0
    seg_logprobs: list[dict[int, float]] = field(default_factory=list)
    seg_after_tool: bool = False
    phase: str = "generate"  # generate | probe | done
    branch_point: int = 0
    n_requests: int = 0
    finish_reason: str = ""
    #: a fill started before the group knows it needs it: not in the budget, dropped if not needed.
    speculative: bool = False
    discarded: bool = False
    #: its first request has come back (group-scope initial entropy waits for every initial root's)
    started: bool = False
    #: it made a tool call whose result is not appended yet (the decision after it is sure to come)
    awaiting_result: bool = False
    #: metric counts and samples of its own tool calls and entropies (a dropped speculative fill's describe
    #: no row of the batch, so they are summed over the kept trajectories only)
    tally: Counter = field(default_factory=Counter)
    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def append(self, ids: list[int], model: bool, entropy: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend([1 if model else 0] * len(ids))
        self.token_entropy.extend(entropy if entropy is not None else [math.nan] * len(ids))


class _BusyClock:
    """Wall time during which at least one operation of a kind runs (overlapping ones are counted once), so
    generation and tool time stay comparable with the total when both overlap (``schedule: async``)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._active = 0
        self._since = 0.0

    def __enter__(self) -> "_BusyClock":
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active -= 1
        if self._active == 0:
            self.total += time.perf_counter() - self._since


class _Metrics:
    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.values: dict[str, list[float]] = defaultdict(list)
        self.time: Counter[str] = Counter()
        self.generate_clock = _BusyClock()
        self.tools_clock = _BusyClock()


class ARPORollout:
    """ARPO (or plain GRPO) rollouts of a tool-calling policy on an injected :class:`GenerationEngine`."""

    def __init__(
        self,
        engine: GenerationEngine,
        tokenizer: Any,
        config: ARPORolloutConfig | Mapping[str, Any] | None = None,
        tools: Mapping[str, BaseTool] | Iterable[BaseTool] | None = None,
        executor: ToolExecutor | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config.validate() if isinstance(config, ARPORolloutConfig) else \
            ARPORolloutConfig.from_dict(config)
        if executor is not None and tools is not None:
            raise ValueError("pass either tools or an executor, not both")
        self._owns_executor = executor is None
        self.executor = executor or ToolExecutor(
            tools or [], max_workers=self.config.tool_workers, timeout_s=self.config.tool_timeout_s,
            retries=self.config.tool_retries, retry_on_empty=self.config.retry_on_empty,
            max_result_chars=self.config.max_result_chars,
        )
        unknown = [n for n in self.executor.tool_names if n not in TOOL_TAGS]
        if unknown:
            raise ValueError(f"tool(s) {unknown} have no ARPO tag; tag names: {sorted(TOOL_TAGS)}")
        self._calls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the last call's tool-call rates by depth: the prior of the next call's fill prediction (they decide
        #: only when fills start, never what any trajectory contains)
        self.call_rate_prior: dict[int, float] = {}

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
        call = _RolloutCall(self, cfg, [list(map(int, p)) for p in prompts], seed)
        trajectories = await call.run()
        self.call_rate_prior = call.call_rates.rates()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        batch = collate_trajectories(trajectories, pad, group_uids, group_fields, cfg.max_response_length)
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
        cfg = dataclasses.replace(self.config, **overrides) if overrides else None
        return self.generate(ids, group_uids=uids, group_fields=fields, seed=prompts.meta.get("seed"), config=cfg)

    def close(self) -> None:
        if self._owns_executor:
            self.executor.close()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


class _RolloutCall:
    """All state of one rollout call (so nothing can leak into the next call)."""

    def __init__(self, owner: ARPORollout, cfg: ARPORolloutConfig, prompts: list[list[int]], seed: int):
        self.cfg = cfg
        self.bcfg = cfg.branching()
        self.engine = owner.engine
        self.tok = owner.tokenizer
        self.executor = owner.executor
        self.prompts = prompts
        self.seed = seed
        self.vocab_size = cfg.vocab_size or len(self.tok)
        self.log_v = math.log(self.vocab_size)
        self.lookahead = ForkLookahead(self.bcfg, seed, cfg.n, cfg.tool_call_limit, self.vocab_size)
        self.tool_names = [n for n in self.executor.tool_names]
        self.close_tags = {TOOL_TAGS[n][1]: n for n in self.tool_names}
        want_logprobs = cfg.mode == "arpo" or cfg.return_entropy
        self.base_params = SamplingParams(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            repetition_penalty=cfg.repetition_penalty,
            stop=tuple(stop_strings(self.tool_names) + list(cfg.extra_stop)),
            stop_token_ids=tuple(cfg.stop_token_ids),
            logprobs=cfg.topk_logprobs if want_logprobs else None,
        )
        self.want_logprobs = want_logprobs
        #: branching needs logprobs on each segment's entropy window only (see _request)
        self.window_logprobs_only = want_logprobs and not cfg.return_entropy
        #: the stop strings as token ids, when each is one token of the vocabulary (see _request)
        self.stop_ids = self._stop_strings_as_token_ids()
        self.trajs: list[_Traj] = []
        self.by_group: list[list[_Traj]] = [[] for _ in prompts]
        self.budgets = [GroupBudget(cfg.n) for _ in prompts]
        #: who gets each group's slots, and when (ordered grants, spare slots for fills)
        self.slots = [GroupSlots(self.lookahead, self.budgets[g], g, self.by_group[g], self._first_decision_depth,
                                 cfg.branch_grant) for g in range(len(prompts))]
        self.call_rates = CallRates(len(prompts), owner.call_rate_prior)
        self.group_h0: list[float | None] = [None] * len(prompts)
        #: set once the group's initial entropy is known (``initial_entropy_scope: group``)
        self.h0_settled = [asyncio.Event() for _ in prompts]
        #: schedule async: one task per trajectory that has started, by tid
        self.tasks: dict[int, asyncio.Task] = {}
        self.live: set[asyncio.Task] = set()
        self.task_errors: list[BaseException] = []
        self.task_event = asyncio.Event()
        self.m = _Metrics()
        self.nonce = uuid.uuid4().hex[:8]  # request ids only; outputs never depend on it
        self.progress = None

    # ---- trajectory creation ------------------------------------------------------------------------
    def _new(self, group: int, kind: str, key: tuple, **state: Any) -> _Traj:
        t = _Traj(tid=len(self.trajs), group=group, local=len(self.by_group[group]), kind=kind, key=key,
                  prompt_ids=self.prompts[group], **state)
        self.trajs.append(t)
        self.by_group[group].append(t)
        return t

    def _new_root(self, group: int, kind: str) -> _Traj:
        t = self._new(group, kind, (kind, sum(1 for x in self.by_group[group] if x.kind == kind)))
        if self.bcfg.initial_entropy_scope == "group":
            t.h_initial = self.group_h0[group]
        return t

    def _fork(self, parent: _Traj, pos: int, depth: int, kind: str = "branch",
              records: list[dict[str, Any]] | None = None) -> _Traj:
        """A copy of ``parent``'s first ``pos`` response tokens (the parent may have moved on since: its tokens
        are append-only) with ``records``, its tool-call records as they were when the fork was decided at
        call ``depth``. The fork's identity is (parent, depth, sibling number), known before ``pos`` is, so
        the draws of its future decisions are known in advance too (:mod:`arpo.rollout.branch_slots`)."""
        if records is None:
            records = [c for c in parent.tool_calls if c["end"] <= pos]
        key = GroupSlots.fork_key(parent.key, depth, (x.key for x in self.by_group[parent.group]))
        child = self._new(
            parent.group, kind, key,
            response_ids=parent.response_ids[:pos], response_mask=parent.response_mask[:pos],
            token_entropy=parent.token_entropy[:pos], parent=parent.tid, branch_pos=pos,
            tool_calls=copy.deepcopy(records), n_calls=len(records),
            h_initial=parent.h_initial, own_h0=parent.own_h0, seg_start=pos,
            seg_after_tool=bool(records) and records[-1]["end"] == pos,
        )
        return child

    # ---- the loop -----------------------------------------------------------------------------------
    async def run(self) -> list[Trajectory]:
        cfg = self.cfg
        t_start = time.perf_counter()
        for g in range(len(self.prompts)):
            granted = self.budgets[g].reserve(cfg.num_initial)
            for _ in range(granted):
                self._new_root(g, "initial")
            if cfg.mode == "arpo" and cfg.fill == "fresh":
                for _ in range(min(cfg.speculative_fill, self.budgets[g].remaining)):
                    self._new_root(g, "fill").speculative = True
        try:
            from tqdm.auto import tqdm

            self.progress = tqdm(total=len(self.prompts) * cfg.n, desc="rollout", unit="traj",
                                 disable=not cfg.show_progress, leave=False)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            self.progress = None
        self._fill(range(len(self.prompts)))
        try:
            if cfg.schedule == "rounds":
                await self._run_rounds()
            else:
                await self._run_async()
        finally:
            if self.progress is not None:
                self.progress.close()
        self.m.time["total"] = time.perf_counter() - t_start
        return self._finalise()

    async def _run_rounds(self) -> None:
        """``schedule: rounds``: every round sends all active trajectories at once and waits for all of them,
        then runs all tool calls of the round at once. Decisions happen in a fixed order, so a deterministic
        engine gives identical batches whatever order requests complete in (exact replay)."""
        active = list(self.trajs)
        rounds = 0
        while active:
            rounds += 1
            tasks = [asyncio.ensure_future(self._request(t)) for t in active]
            try:
                outputs = await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:  # do not leave orphan requests running in the engine
                    task.cancel()
                raise
            finishes = [self._absorb(t, out) for t, out in zip(active, outputs)]
            self._settle_initial_entropy(range(len(self.prompts)))
            if self.bcfg.timing == "paper":
                for t in active:
                    if t.phase == "probe":
                        self._decide_paper(t)
            pending = []
            for t, out, (fin, stop_reason) in zip(active, outputs, finishes):
                call = self._classify(t, out, fin, stop_reason)
                if call is not None:
                    pending.append((t, call))
            await self._run_tools(pending)
            self._fill(range(len(self.prompts)))
            active = [t for t in self.trajs if t.phase != "done"]
        self.m.count["rounds"] = rounds

    async def _run_async(self) -> None:
        """``schedule: async``: one task per trajectory (generate, tool, generate, ...); forks and fills start
        their own task the moment they exist. No trajectory waits for another's request or tool call (except
        for the group's initial entropy under ``initial_entropy_scope: group``), so there are no round
        barriers and a group's late fills overlap other groups' work."""
        for g in range(len(self.prompts)):
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

    async def _drive(self, t: _Traj) -> None:
        """One trajectory's life under ``schedule: async``, the same steps as one round, for one trajectory."""
        while t.phase != "done":
            out = await self._request(t)
            finish, stop_reason = self._absorb(t, out)
            self._settle_initial_entropy([t.group])
            if t.phase == "probe":
                self._decide_paper(t)
            call = self._classify(t, out, finish, stop_reason)
            if call is not None:
                if t.h_initial is None and t.kind != "fill" and self.cfg.branching_enabled \
                        and self.bcfg.initial_entropy_scope == "group":
                    # the decision after this call compares against the mean over the group's initial roots
                    await self.h0_settled[t.group].wait()
                await self._run_tools([(t, call)])
            self._fill([t.group])
            self._start_tasks(t.group)

    def _start_tasks(self, group: int) -> None:
        """Start a task for each new trajectory of the group; cancel those of dropped speculative fills."""
        current = asyncio.current_task()
        for t in self.by_group[group]:
            task = self.tasks.get(t.tid)
            if t.discarded:
                if task is not None and task is not current and not task.done():
                    task.cancel()  # its in-flight request is aborted; its tokens were counted as discarded
            elif task is None and t.phase != "done":
                task = asyncio.ensure_future(self._drive(t))
                self.tasks[t.tid] = task
                self.live.add(task)
                task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self.live.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.task_errors.append(task.exception())
        self.task_event.set()

    def _stop_strings_as_token_ids(self) -> tuple[int, ...] | None:
        """The stop strings (with ``stop_token_ids``) as token ids, or None if one is not a single token."""
        ids = []
        for stop in self.base_params.stop:
            enc = self.tok.encode(stop, add_special_tokens=False)
            if len(enc) != 1 or self.tok.decode(enc) != stop:
                return None
            ids.append(int(enc[0]))
        return tuple(dict.fromkeys(tuple(self.base_params.stop_token_ids) + tuple(ids)))

    async def _request(self, t: _Traj) -> GenerationOutput:
        """One engine call for ``t``.

        Most of what top-k logprobs cost vLLM is detokenising the k candidates of every token; without
        detokenisation they cost about nothing, but the engine then cannot match stop strings. So: when every
        stop string (the tools' close tags) is a single token of the vocabulary, as the ARPO tags are in the
        tiny model's, every request runs without detokenisation and stops on those token ids, with logprobs
        on every token — one request per segment. Otherwise entropy needs logprobs only on a segment's first
        ``entropy_window`` tokens, so a fresh segment is generated as a window request (logprobs, no
        detokenisation: stop strings are found here) followed at once by a continuation without logprobs
        (same coroutine), unless ``return_entropy`` wants them all; the two are returned as one output whose
        ``logprobs`` cover the window only."""
        room = self.cfg.max_response_length - len(t.response_ids)
        window = self.bcfg.window
        if self.stop_ids is not None:
            return await self._undetokenized_call(t, min(room, window) if t.phase == "probe" else room,
                                                  logprobs=self.want_logprobs)
        split = (self.window_logprobs_only and t.phase == "generate" and len(t.response_ids) == t.seg_start
                 and room > window)
        if t.phase == "probe" or split:
            first = await self._undetokenized_call(t, min(room, window), logprobs=True)
        else:
            wants = len(t.response_ids) == t.seg_start or not self.window_logprobs_only
            return await self._engine_call(t, room, logprobs=wants)
        if not split or first.finish_reason != "length" or len(first.token_ids) < window:
            return first
        rest = await self._engine_call(t, room - len(first.token_ids), logprobs=False, after=first.token_ids)
        ids, _, finish, stop_reason = self._cut_at_stop(
            list(first.token_ids), list(rest.token_ids), [], rest.finish_reason, rest.stop_reason)
        return GenerationOutput(token_ids=list(first.token_ids) + ids, text="", finish_reason=finish,
                                stop_reason=stop_reason, logprobs=first.logprobs,
                                num_cached_tokens=first.num_cached_tokens)

    async def _undetokenized_call(self, t: _Traj, max_tokens: int, logprobs: bool) -> GenerationOutput:
        """At most ``max_tokens`` tokens without detokenisation (vLLM then skips decoding the k logprob
        candidates of every token). The engine cannot see stop strings, only their token ids when
        ``stop_ids`` has them; a stop string spelt another way is cut here, where an engine matching strings
        would have stopped (tokens sampled after it are dropped, never used)."""
        out = await self._engine_call(t, max_tokens, logprobs=logprobs, detokenize=False)
        ids, lps, finish, stop_reason = self._cut_at_stop(
            [], list(out.token_ids), list(out.logprobs or []), out.finish_reason, out.stop_reason)
        return dataclasses.replace(out, token_ids=ids, logprobs=lps if out.logprobs is not None else None,
                                   finish_reason=finish, stop_reason=stop_reason, text="")

    async def _engine_call(self, t: _Traj, max_tokens: int, logprobs: bool, after: list[int] | None = None,
                           detokenize: bool = True) -> GenerationOutput:
        params = self.base_params.with_(max_tokens=max_tokens,
                                        seed=derive_seed(self.seed, t.group, t.key, t.n_requests),
                                        logprobs=self.base_params.logprobs if logprobs else None)
        if not detokenize:
            params = params.with_(stop=(), detokenize=False,
                                  stop_token_ids=self.stop_ids or params.stop_token_ids)
        request_id = f"arpo-{self.nonce}-g{t.group}-t{t.local}-r{t.n_requests}"
        first_of_branch = t.kind == "branch" and t.n_requests == 0
        t.n_requests += 1
        prompt = t.prompt_ids + t.response_ids + list(after or [])
        with self.m.generate_clock:
            out = await self.engine.generate(prompt, params, request_id)
        self.m.count["requests"] += 1
        if out.num_cached_tokens is not None:
            self.m.count["prompt_tokens"] += len(prompt)
            self.m.count["cached_tokens"] += out.num_cached_tokens
            if first_of_branch:
                self.m.count["branch_prompt_tokens"] += len(prompt)
                self.m.count["branch_cached_tokens"] += out.num_cached_tokens
        return out

    def _absorb(self, t: _Traj, out: GenerationOutput) -> tuple[str, Any]:
        """Append a request's tokens to the trajectory; return (finish reason, stop reason) after our own
        check for a stop string split across requests. ``logprobs`` may cover only the first tokens (the
        entropy window); the rest get NaN entropy."""
        ids = list(out.token_ids)
        lps = list(out.logprobs) if out.logprobs is not None else []
        finish, stop_reason = out.finish_reason, out.stop_reason
        if t.seg_start < len(t.response_ids) and ids:
            ids, lps, finish, stop_reason = self._cut_at_stop(
                t.response_ids[t.seg_start:], ids, lps, finish, stop_reason)
        lps = lps[: len(ids)]
        first_piece = len(t.response_ids) == t.seg_start
        root_start = not t.response_ids and t.kind in ("initial", "fill")
        t.started = True
        # per-token entropy is an output only with return_entropy; decisions use the window's logprobs
        scored = lps if self.cfg.return_entropy else []
        entropy = [token_entropy(lp) / self.log_v for lp in scored] + [math.nan] * (len(ids) - len(scored))
        t.append(ids, model=True, entropy=entropy)
        t.seg_logprobs.extend(lps[: max(0, self.bcfg.window - len(t.seg_logprobs))])
        self.m.count["tokens_generated"] += len(ids)
        if first_piece and lps:
            h = self.lookahead.window_entropy(lps)
            if root_start:
                t.own_h0 = h
                t.samples["entropy_initial"].append(h)
                if self.bcfg.initial_entropy_scope == "trajectory":
                    t.h_initial = h
            if t.seg_after_tool:
                t.samples["entropy_after_tool"].append(h)
                # records inherited at a fork stay as the parent left them
                if t.tool_calls[-1]["end"] > t.branch_pos and t.tool_calls[-1]["entropy_after"] is None:
                    t.tool_calls[-1]["entropy_after"] = h
        return finish, stop_reason

    def _cut_at_stop(self, prev_ids: list[int], ids: list[int], lps: list, finish: str, stop_reason: Any):
        """Cut ``ids`` right after the first stop string that ends inside them, with ``prev_ids`` (the segment's
        tokens from an earlier request) as context. The engine cannot see a stop string split over two
        requests (window or probe + continuation), nor any stop string in a window request, which runs
        without detokenisation."""
        prev = self.tok.decode(prev_ids)
        text = prev + self.tok.decode(ids)
        found = [(i, s) for s in self.base_params.stop if s
                 for i in [text.find(s, max(0, len(prev) - len(s) + 1))] if i >= 0]
        if not found:
            return ids, lps, finish, stop_reason
        start, stop = min(found)
        for m in range(1, len(ids) + 1):
            if len(prev + self.tok.decode(ids[:m])) >= start + len(stop):
                return ids[:m], lps[:m], "stop", stop
        return ids, lps, finish, stop_reason

    def _settle_initial_entropy(self, groups: Iterable[int]) -> None:
        """Scope ``group``: once every initial root's first request is back, H_initial is the mean of their
        first windows (over those that have one; none: the group never branches)."""
        if self.bcfg.initial_entropy_scope != "group":
            return
        for g in groups:
            if self.h0_settled[g].is_set():
                continue
            roots = [t for t in self.by_group[g] if t.kind == "initial"]
            if not roots or not all(t.started for t in roots):
                continue
            hs = [t.own_h0 for t in roots if t.own_h0 is not None]
            self.group_h0[g] = sum(hs) / len(hs) if hs else None
            for t in self.by_group[g]:
                t.h_initial = self.group_h0[g]
            self.h0_settled[g].set()

    def _classify(self, t: _Traj, out: GenerationOutput, finish: str, stop_reason: Any):
        """After a request: return the tool call to run (or "malformed"), or None (finished / continues)."""
        if t.phase == "done":
            return None
        room = self.cfg.max_response_length - len(t.response_ids)
        seg_text = self.tok.decode(t.response_ids[t.seg_start:]).rstrip()
        # The engine names the stop string it matched; the token that completed it may carry more text.
        close = stop_reason if stop_reason in self.close_tags else \
            next((c for c in self.close_tags if seg_text.endswith(c)), None)
        if close is not None and close in seg_text:
            seg_text = seg_text[: seg_text.rfind(close) + len(close)]
        elif close is not None:
            close = None  # the engine's text and our decode disagree: do not guess a call
        if finish == "abort":
            self._finish(t, "abort")
        elif close is not None:
            if t.n_calls >= self.cfg.tool_call_limit:
                t.tally["tool_calls_hit_limit"] += 1
                if room > 0:
                    t.append([self.tok.eos_token_id], model=False)
                self._finish(t, "tool_limit")
            elif room <= 0:
                self._finish(t, "length")
            else:
                call = parse_trailing_tool_call(seg_text)
                t.awaiting_result = True
                self.call_rates.record(t.group, t.n_calls + 1, made=True)
                return call if call is not None else ("malformed", self.close_tags[close])
        elif room <= 0:
            self._finish(t, "length")
        elif finish == "length" and out.token_ids:
            t.phase = "generate"  # a probe or a partial segment: keep generating the same segment
        elif finish == "length":
            logger.warning("engine returned no tokens with finish_reason=length; ending trajectory")
            self._finish(t, "abort")
        else:
            self._finish(t, "stop")
        if t.phase == "done":
            self.call_rates.record(t.group, t.n_calls + 1, made=False)
        return None

    async def _run_tools(self, pending: list) -> None:
        if not pending:
            return
        real = [(t, c) for t, c in pending if not isinstance(c, tuple)]
        with self.m.tools_clock:
            results = await self.executor.arun_many([(c.tool, c.content) for _, c in real])
        by_tid = {t.tid: r for (t, _), r in zip(real, results)}
        for t, call in pending:
            if isinstance(call, tuple):
                _, tool = call
                open_tag, close_tag = TOOL_TAGS[tool]
                text, error, name = (f"Error: malformed tool call: {close_tag} without a matching {open_tag}. "
                                     f"Write {open_tag}...{close_tag}."), True, tool
                t.tally["tool_calls_malformed"] += 1
            else:
                res = by_tid[t.tid]
                text, error, name = res.text, not res.ok, call.tool
                t.tally["tool_errors"] += int(error)
            self._append_result(t, name, text, error)

    def _append_result(self, t: _Traj, tool: str, text: str, error: bool) -> None:
        cfg = self.cfg
        h_before = self.lookahead.window_entropy(t.seg_logprobs) if t.seg_logprobs else None
        if h_before is not None:
            t.samples["entropy_before_tool"].append(h_before)
        ids = self.tok.encode(format_tool_result(text), add_special_tokens=False)
        room = cfg.max_response_length - len(t.response_ids)
        truncated = len(ids) >= room
        ids = ids[:room]
        start = len(t.response_ids)
        t.append(ids, model=False)
        t.n_calls += 1
        t.awaiting_result = False
        t.tally[f"tool_calls/{tool}"] += 1
        t.tally["tokens_tool"] += len(ids)
        record = {"tool": tool, "start": start, "end": len(t.response_ids), "error": bool(error),
                  "entropy_before": h_before, "entropy_after": None, "delta_entropy": None}
        t.tool_calls.append(record)
        if truncated:
            self._finish(t, "length")
            return
        t.seg_start = len(t.response_ids)
        t.seg_logprobs = []
        t.seg_after_tool = True
        # Decide (and, timing paper, probe) even when the budget is spent: the draws and records then do not
        # depend on which trajectory spent it first.
        if not cfg.branching_enabled or t.kind == "fill":
            return
        if self.bcfg.timing == "code":
            if h_before is not None and t.h_initial is not None:
                self._branch(t, h_before - t.h_initial, t.seg_start, record)
        else:
            t.phase = "probe"
            t.branch_point = t.seg_start

    def _decide_paper(self, t: _Traj) -> None:
        """Timing ``paper``: the probe (first k tokens after the result) was just generated; decide now."""
        t.phase = "generate"
        record = t.tool_calls[-1]
        if not t.seg_logprobs or t.h_initial is None:
            return
        self._branch(t, self.lookahead.window_entropy(t.seg_logprobs) - t.h_initial, t.branch_point, record)

    def _branch(self, t: _Traj, delta_h: float, pos: int, record: dict[str, Any]) -> None:
        """One branching decision: ``beam_size - 1`` draws of the rule, from the decision's own generator
        (seeded by the trajectory's identity and call number), then slots from the group's
        :class:`~arpo.rollout.branch_slots.GroupSlots`: at once, or, under ``branch_grant: ordered`` when
        other decisions could still compete for the slots, once its turn in the fixed order comes. The
        parent never waits: it goes on generating, and the forks copy its tokens up to ``pos`` (and its
        records as they are now) when they are granted."""
        rng = self.lookahead.rng(t.group, t.key, t.n_calls)
        record["delta_entropy"] = delta_h
        self.m.values["delta_entropy"].append(delta_h)
        self.m.count["branch_points"] += 1
        wants = sum(should_branch(self.bcfg, delta_h, rng) for _ in range(self.bcfg.beam_size - 1))
        if wants == 0 or self.budgets[t.group].remaining == 0:
            return
        # the records as they are now: the parent updates its last one later (entropy after the tool)
        records = copy.deepcopy([c for c in t.tool_calls if c["end"] <= pos])
        depth = t.n_calls

        def grant(granted: int) -> None:
            for _ in range(granted):
                self._fork(t, pos, depth, records=records)
            self.m.count["branches"] += granted

        self.slots[t.group].offer(t, depth, wants, grant)

    def _first_decision_depth(self, t: _Traj) -> int | None:
        """Tool-call depth of the next decision ``t`` can still take (None: none)."""
        if t.kind == "fill" or t.speculative or t.phase == "done" or not self.cfg.branching_enabled:
            return None
        if t.phase == "probe":  # timing paper: the decision at the current result is still to come
            return t.n_calls
        return t.n_calls + 1 if t.n_calls < self.cfg.tool_call_limit else None

    def _finish(self, t: _Traj, reason: str) -> None:
        t.phase, t.finish_reason = "done", reason
        if not t.speculative:  # a speculative fill is counted when it is confirmed
            self._count_finished(t)

    def _count_finished(self, t: _Traj) -> None:
        self.m.count[f"finish/{t.finish_reason}"] += 1
        if self.progress is not None:
            self.progress.update(1)

    def _fill(self, groups: Iterable[int]) -> None:
        """Give groups their missing trajectories. Fresh fills start as soon as the budget left exceeds what
        branching could still take (so they need not wait for the group to finish; fill roots never branch,
        so every branching decision sees the same budget as with filling at the end). Duplicates need the
        group's last trajectory, so they wait until the group has finished."""
        for g in groups:
            self.slots[g].resolve()  # decisions whose turn has come hold their slots before anything is spare
            group = self.by_group[g]
            budget = self.budgets[g]
            if budget.remaining == 0 and not any(t.speculative for t in group):
                continue
            active = [t for t in group if t.phase != "done" and not t.speculative]
            if self.cfg.fill == "fresh":
                spec = [t for t in group if t.speculative]
                plan = self.slots[g].plan_fills(len(spec), self.cfg.speculative_fill_probability,
                                                self.call_rates.reach(g),
                                                lambda t: t.awaiting_result or t.phase == "probe")
                for t in spec[: plan.confirm]:
                    t.speculative = False
                    if t.phase == "done":
                        self._count_finished(t)
                for _ in range(plan.start):
                    self._new_root(g, "fill")
                self.m.count["fill_fresh"] += plan.confirm + plan.start
                for t in spec[len(spec) - plan.drop:]:
                    t.speculative, t.discarded, t.phase = False, True, "done"
                    self.m.count["fill_discarded"] += 1
                    self.m.count["tokens_discarded"] += sum(t.response_mask)
                for _ in range(plan.predict):
                    self._new_root(g, "fill").speculative = True
                self.m.count["fill_predicted"] += plan.predict
            elif not active and not self.slots[g].pending:
                granted = budget.reserve(budget.remaining)
                last = max((t for t in group if not t.discarded), key=lambda t: canonical(t.key))
                for _ in range(granted):
                    dup = self._fork(last, len(last.response_ids), self.cfg.tool_call_limit + 1, kind="duplicate")
                    dup.phase, dup.finish_reason = "done", last.finish_reason
                    if self.progress is not None:
                        self.progress.update(1)
                self.m.count["fill_duplicate"] += granted

    # ---- output -------------------------------------------------------------------------------------
    def _finalise(self) -> list[Trajectory]:
        # Rows in tree order by identity (initial roots, then fills, each followed by its forks), which does
        # not depend on the order trajectories were created in; a parent always precedes its children.
        ordered = sorted((t for t in self.trajs if not t.discarded),
                         key=lambda t: (t.group,) + canonical(t.key))
        assert all(not t.speculative for t in ordered), "a speculative fill was neither confirmed nor dropped"

        index = {t.tid: i for i, t in enumerate(ordered)}
        out = []
        for t in ordered:
            out.append(Trajectory(
                group=t.group, prompt_ids=list(t.prompt_ids), response_ids=t.response_ids,
                response_mask=t.response_mask, parent=index[t.parent] if t.parent >= 0 else -1,
                branch_pos=t.branch_pos, token_entropy=t.token_entropy if self.cfg.return_entropy else None,
                tool_calls=t.tool_calls, finish_reason=t.finish_reason,
                extra={"num_tool_calls": t.n_calls, "rollout_kind": t.kind,
                       "initial_entropy": math.nan if t.h_initial is None else t.h_initial},
            ))
        return out

    def metrics(self) -> dict[str, float]:
        """verl-style flat metrics of this call: engine work (requests, tokens generated, time) includes
        dropped speculative fills; what describes the batch (tool calls, entropies, finishes) does not."""
        m = self.m
        kept = [t for t in self.trajs if not t.discarded]
        c = m.count + sum((t.tally for t in kept), Counter())
        values: dict[str, list[float]] = defaultdict(list, {k: list(v) for k, v in m.values.items()})
        for t in kept:
            for k, v in t.samples.items():
                values[k].extend(v)

        def mean(key: str) -> float:
            return float(sum(values[key]) / len(values[key])) if values[key] else math.nan

        out: dict[str, float] = {
            "rollout/trajectories": float(len(kept)),
            "rollout/branches": float(c["branches"]),
            "rollout/branch_points": float(c["branch_points"]),
            "rollout/branch_decisions_waited": float(sum(slots.waited for slots in self.slots)),
            "rollout/fill_fresh": float(c["fill_fresh"]),
            "rollout/fill_duplicate": float(c["fill_duplicate"]),
            "rollout/fill_discarded": float(c["fill_discarded"]),
            "rollout/fill_predicted": float(c["fill_predicted"]),
            "rollout/tokens/discarded": float(c["tokens_discarded"]),
            "rollout/requests": float(c["requests"]),
            # executed calls: a fork re-uses its parent's results, so ARPO runs fewer than its trajectories hold
            "rollout/tool_calls/total": float(sum(v for k, v in c.items() if k.startswith("tool_calls/"))),
            "rollout/tool_calls/in_trajectory_mean": (float(sum(len(t.tool_calls) for t in kept)) / len(kept)
                                                      if kept else math.nan),
            "rollout/tool_calls/errors": float(c["tool_errors"]),
            "rollout/tool_calls/malformed": float(c["tool_calls_malformed"]),
            "rollout/tool_calls/hit_limit": float(c["tool_calls_hit_limit"]),
            "rollout/tokens/generated": float(c["tokens_generated"]),
            "rollout/tokens/tool_result": float(c["tokens_tool"]),
            "rollout/tokens/response_model_total": float(sum(sum(t.response_mask) for t in kept)),
            "rollout/entropy/initial_mean": mean("entropy_initial"),
            "rollout/entropy/before_tool_mean": mean("entropy_before_tool"),
            "rollout/entropy/after_tool_mean": mean("entropy_after_tool"),
            "rollout/entropy/delta_mean": mean("delta_entropy"),
            "timing_s/rollout_generate": float(m.generate_clock.total),
            "timing_s/rollout_tools": float(m.tools_clock.total),
            "timing_s/rollout_total": float(m.time["total"]),
        }
        for k, v in c.items():
            if k.startswith("tool_calls/") or k.startswith("finish/"):
                out[f"rollout/{k}"] = float(v)
        if self.cfg.schedule == "rounds":
            out["rollout/rounds"] = float(c["rounds"])
        if c["prompt_tokens"]:
            out["rollout/prefix_cache/hit_rate"] = c["cached_tokens"] / c["prompt_tokens"]
        if c["branch_prompt_tokens"]:
            out["rollout/prefix_cache/branch_hit_rate"] = c["branch_cached_tokens"] / c["branch_prompt_tokens"]
        total_time = m.time["total"]
        if total_time > 0:
            out["rollout/tokens_per_s"] = c["tokens_generated"] / total_time
        return out
