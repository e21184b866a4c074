"""The rollout's clocks: busy time counts overlapping operations once, load counts each, so their ratio is how many
ran at once (the engine batch a rollout keeps full, ``rollout/requests_in_flight_mean``)."""

from __future__ import annotations

import math

import arpo.rollout.rollout_metrics as rollout_metrics
from arpo.rollout.rollout_metrics import BusyClock


def test_busy_time_counts_overlap_once_and_load_counts_each_operation(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(rollout_metrics.time, "perf_counter", lambda: now[0])
    clock = BusyClock()
    assert math.isnan(clock.mean_active)
    # one operation from 0 to 4 s, another from 1 to 3 s inside it, nothing until a third from 10 to 12 s
    clock.__enter__()
    now[0] = 1.0
    clock.__enter__()
    now[0] = 3.0
    clock.__exit__(None, None, None)
    now[0] = 4.0
    clock.__exit__(None, None, None)
    now[0] = 10.0
    with clock:
        now[0] = 12.0
    assert clock.total == 6.0                   # 0-4 and 10-12: the gap without an operation not counted
    assert clock.load == 4.0 + 2.0 + 2.0        # each operation's own duration
    assert clock.mean_active == 8.0 / 6.0


def test_forks_start_late_where_plain_sampling_starts_every_row_at_once():
    """``rollout/last_start_frac`` measures ARPO's critical path: a fork cannot start before its parent's tool
    result, while plain sampling sends every row's first request at once."""
    from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
    from tests.rollout.rollout_helpers import BASE, CALLER, rollout

    def metrics(mode: str) -> dict:
        engine = ScriptedEngine(ToyTokenizer(), policy=CALLER, latency_s=0.01)
        batch, _, _ = rollout({**BASE, "mode": mode}, engine=engine, n_prompts=2, seed=1)
        return batch.meta["metrics"]

    arpo, single = metrics("arpo"), metrics("single")
    assert arpo["rollout/branches"] > 0 and single["rollout/branches"] == 0
    assert single["rollout/last_start_frac"] < 0.2 < arpo["rollout/last_start_frac"] <= 1
    for m in (arpo, single):
        assert 0 < m["rollout/tail_after_half_done_frac"] < 1 and m["rollout/requests_in_flight_mean"] >= 1


def test_grant_wait_is_timed_for_ordered_grants_and_zero_first_come():
    """``timing_s/rollout_grant_wait``: the seconds branching decisions queued for their turn in the fixed grant
    order (which keeps the batch independent of timing); first-come grants never queue."""
    from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
    from tests.rollout.rollout_helpers import BASE, CALLER, rollout

    def metrics(grant: str) -> dict:
        engine = ScriptedEngine(ToyTokenizer(), policy=CALLER, latency_s=0.01)
        batch, _, _ = rollout({**BASE, "schedule.branch_grant": grant}, engine=engine, n_prompts=2, seed=1)
        return batch.meta["metrics"]

    ordered, first_come = metrics("ordered"), metrics("first_come")
    assert ordered["rollout/branch_decisions_waited"] > 0 and ordered["timing_s/rollout_grant_wait"] > 0
    assert first_come["rollout/branch_decisions_waited"] == 0 and first_come["timing_s/rollout_grant_wait"] == 0
