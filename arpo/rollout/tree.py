"""The rollout tree of one call: ARPO's Algorithm 1 as transitions of its branches.

roots (N per prompt) → first entropy window (H_initial) → after each tool result: measure ΔH, decide, fork or
not within the group's budget M → fill groups left short → finish → the tree, in a fixed row order. No I/O
happens here: the driver (:mod:`arpo.rollout.arpo_rollout`) sends each branch's requests
(:mod:`arpo.rollout.segments`) and runs its tool calls, and feeds the results to these transitions. How a
group starts and is topped up is its policy's (:mod:`arpo.rollout.policies`: sampling, ARPO, AEPO, Tree-GRPO);
who gets its slots, and when, :mod:`arpo.rollout.branch_slots`; the decision rule, :mod:`arpo.rollout.branching`.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Iterable

from arpo.batch import Trajectory
from arpo.engine.base import GenerationOutput, sampled_log_probs
from arpo.protocol import MalformedCall, ToolCall
from arpo.rollout.branch import Branch, Phase
from arpo.rollout.branch_slots import CallRates, ForkLookahead, GroupSlots, canonical
from arpo.rollout.call_format import HermesCalls, TagCalls
from arpo.rollout.branching import GroupBudget, InitialEntropy, aepo_damping, should_branch, token_entropy
from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.policies import make_policy
from arpo.rollout.rollout_metrics import RolloutMetrics

logger = logging.getLogger(__name__)

class RolloutTree:
    """Every branch of one rollout call over a batch of prompt groups, and the transitions between phases."""

    def __init__(self, cfg: ARPORolloutConfig, tok: Any, prompts: list[list[int]], seed: int,
                 call_format: TagCalls | HermesCalls, call_rate_prior: dict[int, float],
                 metrics: RolloutMetrics, cut_at_stop: Callable[..., tuple], group_ids: list[int]):
        self.cfg, self.tok, self.prompts, self.seed = cfg, tok, prompts, seed
        #: each group's identity in the seeds of its decisions (its row in the batch), so a group rolled out
        #: alone (one agent loop) draws exactly what it draws in the batch rollout
        self.group_ids = group_ids
        self.m, self.cut_at_stop = metrics, cut_at_stop
        vocab_size = cfg.entropy.vocab_size or len(tok)
        self.log_v = math.log(vocab_size)
        self.lookahead = ForkLookahead(cfg, seed, cfg.n, cfg.tools.call_limit, vocab_size)
        #: how the model calls tools (tools.format): the stop strings the engine was given, how a call is
        #: parsed and how its result is written back
        self.call_format = call_format
        self.close_tags = call_format.close_tags
        self.branches: list[Branch] = []
        self.by_group: list[list[Branch]] = [[] for _ in prompts]
        self.budgets = [GroupBudget(cfg.n) for _ in prompts]
        #: who gets each group's slots, and when (ordered grants, spare slots for fills)
        self.slots = [GroupSlots(self.lookahead, self.budgets[g], group_ids[g], self.by_group[g],
                                 self.first_decision_depth, cfg.schedule.branch_grant) for g in range(len(prompts))]
        self.call_rates = CallRates(len(prompts), call_rate_prior)
        self.h0 = InitialEntropy(cfg.entropy.initial_scope, len(prompts))
        self.policy = make_policy(cfg)
        self.progress = None

    # ---- roots and forks ----------------------------------------------------------------------------
    def start(self) -> None:
        """Each group's first trajectories, as its policy starts them (:mod:`arpo.rollout.policies`)."""
        for g in range(len(self.prompts)):
            self.policy.start(self, g)
        self.top_up(range(len(self.prompts)))

    def new(self, group: int, kind: str, key: tuple, **state: Any) -> Branch:
        b = Branch(tid=len(self.branches), group=group, local=len(self.by_group[group]), kind=kind, key=key,
                   prompt_ids=self.prompts[group], **state)
        self.branches.append(b)
        self.by_group[group].append(b)
        return b

    def new_root(self, group: int, kind: str, tree_root: Branch | None = None) -> Branch:
        """A root from the prompt: a new tree, or (Tree-GRPO picking the root of ``tree_root``'s tree) one
        more chain in that tree, keyed under its first root so that the key does not depend on which tree
        expanded first."""
        if tree_root is None:
            tree = len({x.tree for x in self.by_group[group] if x.kind != "monitor"})
            key = (kind, sum(1 for x in self.by_group[group] if x.kind == kind))
        else:
            tree = tree_root.tree
            key = GroupSlots.fork_key(tree_root.key, 0, (x.key for x in self.by_group[group]))
        return self.new(group, kind, key, tree=tree, h_initial=self.h0.of_new_root(group))

    def fork(self, parent: Branch, pos: int, depth: int, kind: str = "branch",
              records: list[dict[str, Any]] | None = None) -> Branch:
        """A copy of ``parent``'s first ``pos`` response tokens (the parent may have moved on since: its tokens
        are append-only) with ``records``, its tool-call records as they were when the fork was decided at
        call ``depth``. The fork's identity is (parent, depth, sibling number), known before ``pos`` is, so
        the draws of its future decisions are known in advance too (:mod:`arpo.rollout.branch_slots`)."""
        if records is None:
            records = [c for c in parent.tool_calls if c["end"] <= pos]
        key = GroupSlots.fork_key(parent.key, depth, (x.key for x in self.by_group[parent.group]))
        return self.new(
            parent.group, kind, key,
            response_ids=parent.response_ids[:pos], response_mask=parent.response_mask[:pos],
            token_entropy=parent.token_entropy[:pos], rollout_log_probs=parent.rollout_log_probs[:pos],
            parent=parent.tid, branch_pos=pos, tree=parent.tree,
            tool_calls=copy.deepcopy(records), n_calls=len(records),
            h_initial=parent.h_initial, own_h0=parent.own_h0, seg_start=pos,
            seg_after_tool=bool(records) and records[-1]["end"] == pos,
        )

    # ---- after a request ----------------------------------------------------------------------------
    def absorb(self, b: Branch, out: GenerationOutput) -> tuple[str, Any]:
        """Append a request's tokens to the branch; return (finish reason, stop reason) after our own check
        for a stop string split across requests. Without logprobs (plain sampling) or ``return_entropy`` the
        tokens get NaN entropy."""
        ids = list(out.token_ids)
        lps = list(out.logprobs) if out.logprobs is not None else []
        finish, stop_reason = out.finish_reason, out.stop_reason
        if b.seg_start < len(b.response_ids) and ids:
            ids, lps, finish, stop_reason = self.cut_at_stop(
                b.response_ids[b.seg_start:], ids, lps, finish, stop_reason)
        lps = lps[: len(ids)]
        first_piece = len(b.response_ids) == b.seg_start
        root_start = not b.response_ids and b.kind in ("initial", "fill", "monitor")
        b.started = True
        # per-token entropy is an output only with return_entropy; decisions use the window's logprobs
        scored = lps if self.cfg.return_entropy else []
        entropy = [token_entropy(lp) / self.log_v for lp in scored] + [math.nan] * (len(ids) - len(scored))
        log_probs = sampled_log_probs(ids, lps) if self.cfg.calculate_log_probs else None
        b.append(ids, model=True, entropy=entropy, log_probs=log_probs)
        b.seg_logprobs.extend(lps[: max(0, self.cfg.entropy.window - len(b.seg_logprobs))])
        self.m.count["tokens_generated"] += len(ids)
        if b.kind == "monitor":
            self.m.count["tokens_monitor"] += len(ids)
        if first_piece and lps:
            h = self.policy.window_uncertainty(self, lps)
            if root_start:
                self.h0.root_measured(b, h)
                b.samples["entropy_initial"].append(h)
            if b.seg_after_tool:
                b.samples["entropy_after_tool"].append(h)
                # records inherited at a fork stay as the parent left them
                if b.tool_calls[-1]["end"] > b.branch_pos and b.tool_calls[-1]["entropy_after"] is None:
                    b.tool_calls[-1]["entropy_after"] = h
        return finish, stop_reason

    def classify(self, b: Branch, out: GenerationOutput, finish: str,
                 stop_reason: Any) -> ToolCall | MalformedCall | None:
        """After a request: the tool call to run (the branch is then in phase ``TOOL``), or None (finished,
        or the segment goes on)."""
        if b.phase is Phase.DONE:
            return None
        room = self.cfg.sampling.max_response_length - len(b.response_ids)
        seg_text = self.tok.decode(b.response_ids[b.seg_start:]).rstrip()
        # The engine names the stop string it matched; the token that completed it may carry more text.
        close = stop_reason if stop_reason in self.close_tags else \
            next((c for c in self.close_tags if seg_text.endswith(c)), None)
        if close is not None and close in seg_text:
            seg_text = seg_text[: seg_text.rfind(close) + len(close)]
        elif close is not None:
            close = None  # the engine's text and our decode disagree: do not guess a call
        if finish == "abort":
            self._finish(b, "abort")
        elif close is not None:
            if b.n_calls >= self.cfg.tools.call_limit:
                b.tally["tool_calls_hit_limit"] += 1
                if room > 0:
                    b.append([self.tok.eos_token_id], model=False)
                self._finish(b, "tool_limit")
            elif room <= 0:
                self._finish(b, "length")
            else:
                b.phase = Phase.TOOL
                self.call_rates.record(b.group, b.n_calls + 1, made=True)
                return self.call_format.parse(seg_text, close)
        elif room <= 0:
            self._finish(b, "length")
        elif finish == "length" and out.token_ids:
            b.phase = Phase.GENERATE  # a probe or a partial segment: keep generating the same segment
        elif finish == "length":
            logger.warning("engine returned no tokens with finish_reason=length; ending trajectory")
            self._finish(b, "abort")
        else:
            self._finish(b, "stop")
        if b.phase is Phase.DONE:
            self.call_rates.record(b.group, b.n_calls + 1, made=False)
        return None

    # ---- after a tool call: measure, decide, fork ---------------------------------------------------
    def append_tool_result(self, b: Branch, call: ToolCall | MalformedCall, result: Any) -> None:
        """Append a tool's result (``result``: the executor's, None for a malformed call) as masked tokens,
        then decide on forks (timing ``code``) or probe first (timing ``paper``)."""
        if isinstance(call, MalformedCall):
            text, error, tool = call.error_text(), True, call.tool
            b.tally["tool_calls_malformed"] += 1
        else:
            text, error, tool = result.text, not result.ok, call.tool
            b.tally["tool_errors"] += int(error)
        cfg = self.cfg
        h_before = self.policy.window_uncertainty(self, b.seg_logprobs) if b.seg_logprobs else None
        if h_before is not None:
            b.samples["entropy_before_tool"].append(h_before)
        ids = self.tok.encode(self.call_format.result_text(text), add_special_tokens=False)
        room = cfg.sampling.max_response_length - len(b.response_ids)
        truncated = len(ids) >= room
        ids = ids[:room]
        start = len(b.response_ids)
        b.append(ids, model=False)
        b.n_calls += 1
        b.phase = Phase.GENERATE
        b.tally[f"tool_calls/{tool}"] += 1
        b.tally["tokens_tool"] += len(ids)
        record = {"tool": tool, "start": start, "end": len(b.response_ids), "error": bool(error),
                  "entropy_before": h_before, "entropy_after": None, "delta_entropy": None}
        b.tool_calls.append(record)
        if truncated:
            self._finish(b, "length")
            return
        b.seg_start = len(b.response_ids)
        b.seg_logprobs = []
        b.seg_after_tool = True
        # Decide (and, timing paper, probe) even when the budget is spent: the draws and records then do not
        # depend on which trajectory spent it first.
        if not cfg.branching_enabled or not b.may_fork:
            return
        if self.cfg.branching.timing == "code":
            if h_before is not None and b.h_initial is not None:
                self._branch(b, h_before - b.h_initial, b.seg_start, record)
        else:
            b.phase = Phase.PROBE
            b.branch_point = b.seg_start

    def decide_after_probe(self, b: Branch) -> None:
        """Timing ``paper``: the probe (first k tokens after the result) was just generated; decide now."""
        b.phase = Phase.GENERATE
        if not b.seg_logprobs or b.h_initial is None:
            return
        self._branch(b, self.policy.window_uncertainty(self, b.seg_logprobs) - b.h_initial, b.branch_point,
                     b.tool_calls[-1])

    def _branch(self, b: Branch, delta_h: float, pos: int, record: dict[str, Any]) -> None:
        """One branching decision: ``beam_size - 1`` draws of the rule, from the decision's own generator
        (seeded by the branch's identity and call number), then slots from the group's
        :class:`~arpo.rollout.branch_slots.GroupSlots`: at once, or, under ``schedule.branch_grant: ordered`` when
        other decisions could still compete for the slots, once its turn in the fixed order comes. The
        parent never waits: it goes on generating, and the forks copy its tokens up to ``pos`` (and its
        records as they are now). A waiting decision's forks start at once, speculatively
        (``schedule.speculative_forks``): when its turn comes, the granted ones are kept and the rest dropped."""
        rng = self.lookahead.rng(self.group_ids[b.group], b.key, b.n_calls)
        record["delta_entropy"] = delta_h
        self.m.values["delta_entropy"].append(delta_h)
        self.m.count["branch_points"] += 1
        self.m.count["branch_points_damped"] += int(aepo_damping(self.cfg, b.streak) < 1.0)
        wants = sum(should_branch(self.cfg, delta_h, rng, b.streak) for _ in range(self.cfg.branching.beam_size - 1))
        self.m.count["branch_wants"] += wants
        b.streak = b.streak + 1 if wants else 0  # from the draws, not the grants: the same under any schedule
        if wants == 0 or self.budgets[b.group].remaining == 0:
            return
        # the records as they are now: the parent updates its last one later (entropy after the tool)
        records = copy.deepcopy([c for c in b.tool_calls if c["end"] <= pos])
        depth, streak = b.n_calls, b.streak
        started: list[Branch] = []  # forks started speculatively while the decision waits for its turn

        def new_fork() -> Branch:
            f = self.fork(b, pos, depth, records=records)
            f.streak = streak
            return f

        def grant(granted: int) -> None:
            for f in started[:granted]:
                self.confirm(f)
            for f in started[granted:]:
                self.drop(f)
            for _ in range(granted - len(started)):
                new_fork()
            self.m.count["branches"] += granted

        if not self.slots[b.group].offer(b, depth, wants, grant) and self.cfg.schedule.speculative_forks:
            # never more speculative trajectories running than slots left: at most that many can be kept
            group = self.by_group[b.group]
            room = self.budgets[b.group].remaining - sum(x.speculative for x in group)
            for _ in range(min(wants, max(0, room))):
                f = new_fork()
                f.speculative = True
                started.append(f)
            self.m.count["branches_speculative"] += len(started)

    def first_decision_depth(self, b: Branch) -> int | None:
        """Tool-call depth of the next decision ``b`` can still take (None: none)."""
        if not b.may_fork or b.speculative or b.phase is Phase.DONE or not self.cfg.branching_enabled:
            return None
        if b.phase is Phase.PROBE:  # timing paper: the decision at the current result is still to come
            return b.n_calls
        return b.n_calls + 1 if b.n_calls < self.cfg.tools.call_limit else None

    # ---- finishing and filling ----------------------------------------------------------------------
    def _finish(self, b: Branch, reason: str) -> None:
        b.phase, b.finish_reason = Phase.DONE, reason
        if b.in_batch and not b.speculative:  # a speculative one is counted when it is confirmed
            self.count_finished(b)

    def confirm(self, b: Branch) -> None:
        """A speculative fill or fork took its slot: it is a row of the batch."""
        b.speculative = False
        if b.phase is Phase.DONE:
            self.count_finished(b)

    def drop(self, b: Branch) -> None:
        """A speculative fill or fork did not get a slot: it and the speculative forks of its own waiting
        decisions are thrown away (their tokens counted as discarded), and those decisions with them."""
        gone = [x for x in self.by_group[b.group] if x.key[: len(b.key)] == b.key and not x.discarded]
        for x in gone:
            x.speculative, x.discarded, x.phase = False, True, Phase.DONE
            self.m.count["tokens_discarded"] += sum(x.response_mask[x.branch_pos:])
            self.m.count["fill_discarded" if x.kind == "fill" else "branches_dropped"] += 1
        self.slots[b.group].forget(gone)

    def count_finished(self, b: Branch) -> None:
        self.m.count[f"finish/{b.finish_reason}"] += 1
        if self.progress is not None:
            self.progress.update(1)

    def top_up(self, groups: Iterable[int]) -> None:
        """After a trajectory of each group moved: grant the branching decisions whose turn has come (they hold
        their slots before anything is spare), then let the policy start what the group needs next."""
        for g in groups:
            self.slots[g].resolve()
            self.policy.top_up(self, g)

    # ---- output -------------------------------------------------------------------------------------
    def trajectories(self) -> list[Trajectory]:
        """The kept branches as trajectories, in tree order by identity (initial roots, then fills, each
        followed by its forks), which does not depend on the order they were created in; a parent always
        precedes its children."""
        ordered = sorted((b for b in self.branches if b.in_batch), key=lambda b: (b.group,) + canonical(b.key))
        assert all(not b.speculative for b in ordered), "a speculative trajectory was neither confirmed nor dropped"
        index = {b.tid: i for i, b in enumerate(ordered)}
        return [b.trajectory(index[b.parent] if b.parent >= 0 else -1, self.cfg.return_entropy,
                             self.cfg.calculate_log_probs) for b in ordered]
