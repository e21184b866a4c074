"""One branch of a rollout tree (a trajectory while it is being generated) and the phase it is in."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from arpo.batch import Trajectory


class Phase(str, Enum):
    """Where a branch stands between engine requests (verl's tool agent loop names its states the same way).

    ``GENERATE`` → (tool close tag) ``TOOL`` → (result appended) ``GENERATE``, or with ``branching.timing: paper``
    ``PROBE`` (the next request is the entropy probe; the branching decision follows it) → ``GENERATE``;
    EOS, the length limit, the tool-call limit or an abort → ``DONE``."""

    GENERATE = "generate"
    TOOL = "tool"
    PROBE = "probe"
    DONE = "done"


@dataclass
class Branch:
    """Mutable state of one trajectory inside one rollout call."""

    tid: int
    group: int
    local: int
    kind: str  # initial | branch | fill | duplicate | monitor (AEPO's pre-monitoring probe: never a row)
    #: identity within the group that does not depend on creation order (seeds derive from it):
    #: ("initial", i), ("fill", i), or the parent's key + (decision depth, j) for its j-th fork at the decision
    #: after its depth-th tool call (a duplicate: depth ``tool_call_limit + 1``).
    key: tuple
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    token_entropy: list[float] = field(default_factory=list)
    #: the engine's log-prob of each sampled token (0 on tool results), with calculate_log_probs
    rollout_log_probs: list[float] = field(default_factory=list)
    parent: int = -1  # tid of the parent
    #: the tree it belongs to within its group: its root's number (Tree-GRPO's intra-tree groups)
    tree: int = 0
    branch_pos: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    n_calls: int = 0
    h_initial: float | None = None
    own_h0: float | None = None
    seg_start: int = 0
    seg_logprobs: list[dict[int, float]] = field(default_factory=list)
    seg_after_tool: bool = False
    phase: Phase = Phase.GENERATE
    branch_point: int = 0
    #: consecutive decisions just before now, on this trajectory's path, that asked for a fork (AEPO's c)
    streak: int = 0
    n_requests: int = 0
    finish_reason: str = ""
    #: a fill started before the group knows it needs it: not in the budget, dropped if not needed.
    speculative: bool = False
    discarded: bool = False
    #: its first request has come back (group-scope initial entropy waits for every initial root's)
    started: bool = False
    #: when its first request was sent and its last came back (time.perf_counter; the rollout's critical path)
    sent_at: float | None = None
    done_at: float | None = None
    #: metric counts and samples of its own tool calls and entropies (a dropped speculative fill's describe
    #: no row of the batch, so they are summed over the kept trajectories only)
    tally: Counter = field(default_factory=Counter)
    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def append(self, ids: list[int], model: bool, entropy: list[float] | None = None,
               log_probs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend([1 if model else 0] * len(ids))
        self.token_entropy.extend(entropy if entropy is not None else [math.nan] * len(ids))
        self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    @property
    def in_batch(self) -> bool:
        """A row of the batch: neither a dropped speculative fill nor AEPO's pre-monitoring probe."""
        return not self.discarded and self.kind != "monitor"

    @property
    def may_fork(self) -> bool:
        """It may fork after its tool results (fills and the probe never do)."""
        return self.kind not in ("fill", "monitor")

    def trajectory(self, parent_row: int, with_entropy: bool, with_log_probs: bool) -> Trajectory:
        """This branch as a row of the batch (``parent_row``: its parent's row, -1 for a root)."""
        return Trajectory(
            group=self.group, prompt_ids=list(self.prompt_ids), response_ids=self.response_ids,
            response_mask=self.response_mask, parent=parent_row, branch_pos=self.branch_pos,
            token_entropy=self.token_entropy if with_entropy else None,
            rollout_log_probs=self.rollout_log_probs if with_log_probs else None,
            tool_calls=self.tool_calls, finish_reason=self.finish_reason,
            extra={"num_tool_calls": self.n_calls, "rollout_kind": self.kind, "tree_index": self.tree,
                   "initial_entropy": math.nan if self.h_initial is None else self.h_initial},
        )
