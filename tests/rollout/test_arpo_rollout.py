"""The ARPO generator on the scripted engine: invariants over many random seeds and configs, the same batch for a
seed whatever the schedule and completion order, and no state shared between calls. Each behaviour on its own:
test_arpo_rollout_behaviours.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
from arpo.rollout.arpo_rollout import ARPORollout, RolloutCall
from tests.rollout.fake_tools import FakePython, FakeSearch
from tests.rollout.rollout_helpers import BASE, CALLER, CLOSE_TAGS, check_invariants, random_case, rollout, snapshot


@pytest.mark.parametrize("seed", range(60))
def test_invariants_over_random_configs(seed):
    cfg, policy, tools, split_tags, n_prompts = random_case(seed)
    batch, engine, gen = rollout(cfg, policy, n_prompts=n_prompts, seed=seed, tools=tools, split_tags=split_tags)
    check_invariants(batch, gen.config, engine.tokenizer, n_prompts)
    # all initial trajectories went to the engine at once (AEPO's pre-monitoring: each group's after its probe)
    assert engine.max_in_flight >= (n_prompts if gen.config.pre_monitoring else n_prompts * gen.config.num_initial)
    if not split_tags:
        # the close tags are single tokens: every request stops on their ids, without detokenisation
        tag_ids = {engine.tokenizer.encode(c)[0] for c in CLOSE_TAGS}
        assert all(not q.sampling_params.detokenize and not q.sampling_params.stop
                   and tag_ids & set(q.sampling_params.stop_token_ids) for q in engine.requests)
    else:
        # multi-token tags: the engine matches them as strings, except in probes (the window only, cut here)
        assert all(q.sampling_params.detokenize or q.sampling_params.max_tokens <= gen.config.entropy.window
                   for q in engine.requests)
    if gen.config.mode == "arpo":  # one request per segment, logprobs on all of it
        assert all(q.sampling_params.logprobs is not None for q in engine.requests)


@pytest.mark.parametrize("timing", ["code", "paper"])
def test_deterministic_for_a_seed(timing):
    cfg = {**BASE, "branching.timing": timing}
    a, _, _ = rollout(cfg, seed=11, n_prompts=3)
    b, _, _ = rollout(cfg, seed=11, n_prompts=3)
    c, _, _ = rollout(cfg, seed=12, n_prompts=3)
    assert snapshot(a) == snapshot(b)
    assert snapshot(a) != snapshot(c)
    assert a.meta["metrics"]["rollout/branches"] > 0


class ShuffledLatency(ScriptedEngine):
    """Answers requests after random delays, so completion order differs run to run."""

    def __init__(self, order_seed: int, **kwargs):
        super().__init__(**kwargs)
        self.order_rng = random.Random(order_seed)

    async def generate(self, prompt_ids, sampling_params, request_id):
        await asyncio.sleep(self.order_rng.random() * 0.002)
        return await super().generate(prompt_ids, sampling_params, request_id)


def test_same_batch_whatever_the_schedule_and_the_completion_order():
    # the budget binds (branching and fills compete for slots), and requests complete in random orders
    snaps = []
    for schedule, order, spec in (("rounds", None, False), ("rounds", 1, True), ("async", 1, True),
                                  ("async", 2, False), ("async", None, True)):
        engine = ShuffledLatency(order) if order is not None else ScriptedEngine()
        batch, _, _ = rollout({**BASE, "schedule.mode": schedule, "schedule.speculative_forks": spec}, seed=3,
                              n_prompts=3, engine=engine)
        m = batch.meta["metrics"]
        assert m["rollout/fill_fresh"] > 0 and m["rollout/branches"] > 0 and m["rollout/branch_decisions_waited"] > 0
        assert (m["rollout/branches_speculative"] > 0) == spec
        snaps.append(snapshot(batch))
    assert all(s == snaps[0] for s in snaps)


class SlowFirstRoot(ScriptedEngine):
    """Answers each group's first root's first request late, so its sibling's decision comes first."""

    async def generate(self, prompt_ids, sampling_params, request_id):
        if request_id.endswith("-t0-r0"):
            await asyncio.sleep(0.05)
        return await super().generate(prompt_ids, sampling_params, request_id)


def test_speculative_forks_keep_the_batch_waiting_gives_and_drop_what_is_not_granted():
    # beam 3 and every draw forks: each root's first decision asks for 2 forks with 2 slots left, and root 0
    # comes first in the order. async: root 0 is slow, so root 1 decides first, waits, and starts its 2 forks
    # speculatively; nothing else may speculate (no slot left for another), and root 0's decision takes both
    # slots: root 1's forks are dropped. rounds: root 0 decides first in the round and starts its 2, root 1
    # starts none, and root 0's are kept
    cfg = {"n": 4, "initial_rollouts": 2, "branching.beam_size": 3, "branching.branch_probability": 1.0,
           "branching.entropy_weight": 0.0, "tools.call_limit": 2, "sampling.max_response_length": 300,
           "return_entropy": True, "schedule.fill_probability": None}
    snaps = {}
    for spec in (True, False):
        for schedule in ("async", "rounds"):
            engine = SlowFirstRoot(policy=CALLER)
            batch, _, gen = rollout({**cfg, "schedule.mode": schedule, "schedule.speculative_forks": spec}, CALLER,
                                    seed=1, n_prompts=2, engine=engine)
            check_invariants(batch, gen.config, engine.tokenizer, 2)
            m = batch.meta["metrics"]
            assert m["rollout/branches"] == 4 and m["rollout/branch_decisions_waited"] >= 2
            assert list(batch["rollout_kind"]).count("branch") == 4
            if spec:
                assert m["rollout/branches_speculative"] == 4
                assert m["rollout/branches_dropped"] == (4 if schedule == "async" else 0)
                assert (m["rollout/tokens/discarded"] > 0) == (schedule == "async")
            else:
                assert m["rollout/branches_speculative"] == m["rollout/tokens/discarded"] == 0
            assert engine.in_flight == 0
            snaps[spec, schedule] = snapshot(batch)
    assert all(s == snaps[False, "rounds"] for s in snaps.values())


@pytest.mark.parametrize("seed", range(24))
def test_same_batch_whatever_the_schedule_over_random_configs(seed):
    cfg, policy, tools, split_tags, n_prompts = random_case(1000 + seed)
    snaps = []
    for schedule, order, spec in (("rounds", None, False), ("async", seed, True), ("async", seed + 1, False),
                                  ("rounds", seed, True)):
        tok = ToyTokenizer(split_tags=split_tags)
        engine = ShuffledLatency(order, tokenizer=tok, policy=policy) if order is not None else \
            ScriptedEngine(tok, policy=policy)
        batch, engine, gen = rollout({**cfg, "schedule.mode": schedule, "schedule.branch_grant": "ordered",
                                      "schedule.speculative_forks": spec}, policy,
                                     n_prompts=n_prompts, seed=seed, tools=tools, engine=engine)
        check_invariants(batch, gen.config, engine.tokenizer, n_prompts)
        assert engine.in_flight == 0
        snaps.append(snapshot(batch))
    assert all(s == snaps[0] for s in snaps[1:])


@pytest.mark.parametrize("seed", range(40))
def test_look_ahead_over_future_draws_never_undercounts(seed, monkeypatch):
    # Ordered grants and early fills rest on _tree_forks: the most forks a trajectory's future decisions can
    # take, from draws known in advance. Check it against what the decisions really did.
    calls = []
    run = RolloutCall.run

    async def keep(self):
        calls.append(self)
        return await run(self)

    monkeypatch.setattr(RolloutCall, "run", keep)
    cfg, policy, tools, split_tags, n_prompts = random_case(2000 + seed)
    n = max(4, cfg["n"])  # room to fork: at most half the budget starts, every decision may fork
    cfg = {**cfg, "mode": "arpo", "n": n, "initial_rollouts": max(1, min(cfg["initial_rollouts"], n // 2)),
           "branching.beam_size": max(2, cfg["branching.beam_size"]),
           "tools.call_limit": max(2, cfg["tools.call_limit"]),
           "branching.branch_probability": 0.3 + 0.7 * cfg["branching.branch_probability"],
           "sampling.max_response_length": 400}
    rollout(cfg, policy, n_prompts=n_prompts, seed=seed, tools=tools, split_tags=split_tags)
    call = calls[-1].tree
    live = [t for t in call.branches if not t.discarded]
    forks = [t for t in live if t.kind == "branch"]
    by_tid = {t.tid: t for t in call.branches}

    def root_of(t):
        while t.parent >= 0:
            t = by_tid[t.parent]
        return t

    for t in live:
        for depth in range(1, call.cfg.tools.call_limit + 1):
            made = sum(1 for f in forks if f.parent == t.tid and f.key[len(t.key)] == depth)
            assert made <= call.lookahead.may_want(t.group, t.key, t.h_initial, depth)
            assert made <= call.lookahead.may_want(t.group, t.key, None, depth)
    for r in (t for t in live if t.kind == "initial"):
        descendants = sum(1 for f in forks if root_of(f) is r)
        assert descendants <= call.lookahead.tree_forks(r.group, r.key, r.h_initial, 1)
        assert descendants <= call.lookahead.tree_forks(r.group, r.key, None, 1)
    # the look-ahead assumes window entropies in [0, h_max]
    measured = [h for t in call.branches for k in ("entropy_initial", "entropy_before_tool") for h in t.samples[k]]
    assert measured and all(0.0 <= h <= call.lookahead.h_max for h in measured)


def test_first_come_grants_at_once_and_replays_under_rounds():
    cfg = {**BASE, "schedule.branch_grant": "first_come"}
    a, _, _ = rollout({**cfg, "schedule.mode": "rounds"}, seed=3, n_prompts=3, engine=ShuffledLatency(1))
    b, _, _ = rollout({**cfg, "schedule.mode": "rounds"}, seed=3, n_prompts=3, engine=ShuffledLatency(2))
    assert snapshot(a) == snapshot(b)
    c, engine, gen = rollout({**cfg, "schedule.mode": "async"}, seed=3, n_prompts=3, engine=ShuffledLatency(3))
    check_invariants(c, gen.config, engine.tokenizer, 3)
    for batch in (a, c):
        m = batch.meta["metrics"]
        assert m["rollout/branch_decisions_waited"] == 0 and m["rollout/branches"] > 0


def test_async_trajectories_do_not_wait_for_a_slow_tool_call():
    """One tool call takes 0.3 s: under ``async`` the other trajectories keep sending requests meanwhile;
    under ``rounds`` nobody does until the round's tools are all back."""
    import threading
    import time

    slow = {}

    class SlowOnce(FakeSearch):
        lock = threading.Lock()

        def call_text(self, content):
            with self.lock:
                first = not slow
                if first:
                    slow["start"] = time.monotonic()
            if first:
                time.sleep(0.3)
                slow["end"] = time.monotonic()
            return super().call_text(content)

    class StartTimes(ScriptedEngine):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.starts = []

        async def generate(self, prompt_ids, sampling_params, request_id):
            self.starts.append(time.monotonic())
            return await super().generate(prompt_ids, sampling_params, request_id)

    for schedule, expect_overlap in (("async", True), ("rounds", False)):
        slow.clear()
        engine = StartTimes(policy=CALLER, latency_s=0.001)
        batch, _, gen = rollout({**BASE, "n": 6, "initial_rollouts": 3, "schedule.mode": schedule}, CALLER,
                                engine=engine, tools=[SlowOnce(), FakePython()], n_prompts=2)
        check_invariants(batch, gen.config, engine.tokenizer, 2)
        during = [t for t in engine.starts if slow["start"] < t < slow["end"]]
        assert bool(during) is expect_overlap, (schedule, len(during))


def test_entropy_state_does_not_leak_between_calls():
    engine = ScriptedEngine()
    tok = engine.tokenizer
    p1 = [tok.encode(f"First batch {i}") for i in range(3)]
    p2 = [tok.encode(f"Second batch {i}") for i in range(3)]
    used = ARPORollout(engine, tok, BASE, tools=[FakeSearch(), FakePython()])
    used.generate(p1, seed=1)
    after = used.generate(p2, seed=2)
    fresh = ARPORollout(ScriptedEngine(), tok, BASE, tools=[FakeSearch(), FakePython()])
    alone = fresh.generate(p2, seed=2)
    assert snapshot(after) == snapshot(alone)
    # and each root's initial entropy is its own first window in this call
    check_invariants(after, used.config, tok, 3)
    # without explicit seeds a fresh generator replays the same sequence of batches
    g1 = ARPORollout(ScriptedEngine(), tok, BASE, tools=[FakeSearch()])
    g2 = ARPORollout(ScriptedEngine(), tok, BASE, tools=[FakeSearch()])
    s1 = [snapshot(g1.generate(p1)) for _ in range(2)]
    s2 = [snapshot(g2.generate(p1)) for _ in range(2)]
    assert s1 == s2 and s1[0] != s1[1]


@pytest.mark.parametrize("schedule", ["rounds", "async"])
def test_replicas_take_whole_groups_and_give_the_same_batch(schedule):
    """Two engine replicas: each prompt group runs on one of them (sticky: its branches share one prefix cache),
    both get groups, and the batch is the one a single engine gives (request seeds follow groups and branches)."""
    cfg = {**BASE, "schedule.mode": schedule}
    single, _, _ = rollout(cfg, seed=5, n_prompts=6)
    replicas = [ShuffledLatency(1), ShuffledLatency(2)]
    gen = ARPORollout(replicas, replicas[0].tokenizer, cfg, tools=[FakeSearch(), FakePython()])
    prompts = [replicas[0].tokenizer.encode(f"Question {i}: what is the number?") for i in range(6)]
    try:
        spread = gen.generate(prompts, seed=5)
    finally:
        gen.close()
    assert snapshot(spread) == snapshot(single)
    groups = [{r.request_id.split("-g")[1].split("-")[0] for r in e.requests} for e in replicas]
    assert all(groups) and not groups[0] & groups[1] and len(groups[0] | groups[1]) == 6
    # a speculative fill dropped mid-request may be cancelled after routing, before its engine saw it
    assert all(routed >= len(e.requests) > 0 for routed, e in zip(gen.router.num_requests, replicas))
    assert gen.router.in_flight == [0, 0]  # nothing left counted in flight, cancelled requests included
