"""The rollout's counters and clocks, and the verl-style metrics a call reports (``rollout/*``,
``timing_s/rollout_*``)."""

from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from typing import Any

from arpo.rollout.branch import Branch
from arpo.rollout.branch_slots import GroupSlots


class BusyClock:
    """Wall time during which at least one operation of a kind runs (overlapping ones are counted once), so
    generation and tool time stay comparable with the total when both overlap (``schedule.mode: async``); and
    the operations' summed durations (``load``), whose ratio to ``total`` is how many ran at once on average —
    for engine requests, how full the engine's batch was kept."""

    def __init__(self) -> None:
        self.total = 0.0
        self.load = 0.0
        self._active = 0
        self._since = 0.0
        self._last = 0.0

    def _tick(self) -> float:
        now = time.perf_counter()
        self.load += self._active * (now - self._last)
        self._last = now
        return now

    def __enter__(self) -> "BusyClock":
        now = self._tick()
        if self._active == 0:
            self._since = now
        self._active += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        now = self._tick()
        self._active -= 1
        if self._active == 0:
            self.total += now - self._since

    @property
    def mean_active(self) -> float:
        """Operations in flight on average over the time any was (nan before any ran)."""
        return self.load / self.total if self.total > 0 else math.nan


class RolloutMetrics:
    """What one rollout call counts as it goes; :func:`summarize` turns it into metrics at the end."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.values: dict[str, list[float]] = defaultdict(list)
        self.time: Counter[str] = Counter()
        self.generate_clock = BusyClock()
        self.tools_clock = BusyClock()
        self.started_at = 0.0  # time.perf_counter() when the call began


def summarize(m: RolloutMetrics, branches: list[Branch], slots: list[GroupSlots], schedule: str) -> dict[str, float]:
    """verl-style flat metrics of one rollout call: engine work (requests, tokens generated, time) includes
    dropped speculative fills and AEPO's probes; what describes the batch (tool calls, entropies, finishes) does
    not."""
    kept = [t for t in branches if t.in_batch]
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
        # fork candidates the rule said yes to, granted or not: the rule's own rate, which the budget does not cap
        "rollout/branch_wants": float(c["branch_wants"]),
        "rollout/branch_points_damped": float(c["branch_points_damped"]),
        "rollout/branch_decisions_waited": float(sum(s.waited for s in slots)),
        # forks started before their decision's turn (schedule.speculative_forks), and those that then got no slot
        "rollout/branches_speculative": float(c["branches_speculative"]),
        "rollout/branches_dropped": float(c["branches_dropped"]),
        # seconds the waiting decisions waited for their turn, summed (their forks started that much later)
        "timing_s/rollout_grant_wait": float(sum(s.wait_s for s in slots)),
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
    if values["aepo_initial_rollouts"]:  # AEPO's pre-monitoring: its probes' entropies, N and cost
        out.update({"rollout/aepo/initial_rollouts_mean": mean("aepo_initial_rollouts"),
                    "rollout/aepo/h_root_mean": mean("aepo_h_root"), "rollout/aepo/h_tool_mean": mean("aepo_h_tool"),
                    "rollout/tokens/monitor": float(c["tokens_monitor"])})
    if schedule == "rounds":
        out["rollout/rounds"] = float(c["rounds"])
    if c["prompt_tokens"]:
        out["rollout/prefix_cache/hit_rate"] = c["cached_tokens"] / c["prompt_tokens"]
        # prompt tokens the engine computed (not served by its prefix cache): the prefill work of every request
        out["rollout/tokens/prefilled"] = float(c["prompt_tokens"] - c["cached_tokens"])
    if c["branch_prompt_tokens"]:
        out["rollout/prefix_cache/branch_hit_rate"] = c["branch_cached_tokens"] / c["branch_prompt_tokens"]
    total_time = m.time["total"]
    if total_time > 0:
        out["rollout/tokens_per_s"] = c["tokens_generated"] / total_time
        # where a rollout's wall time goes on the engine side: time with no request in flight, and how many
        # requests it had at once otherwise (a fuller batch makes each decode step cost less per token)
        out["rollout/engine_idle_fraction"] = max(0.0, 1.0 - m.generate_clock.total / total_time)
        out["rollout/requests_in_flight_mean"] = m.generate_clock.mean_active
        # the critical path, as shares of the call: when the last row started (forks and fills start late), and
        # how long the call ran after half its rows had finished (the tail a few long trajectories hold up)
        sent = [t.sent_at for t in kept if t.sent_at is not None]
        done = sorted(t.done_at for t in kept if t.done_at is not None)
        if sent and done:
            out["rollout/last_start_frac"] = (max(sent) - m.started_at) / total_time
            out["rollout/tail_after_half_done_frac"] = (done[-1] - done[(len(done) - 1) // 2]) / total_time
    return out
