"""ARPOAgentLoop: the ARPO rollout's invariants, checked on the asynchronous loop."""

import asyncio
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("arpo.rollout.branching", reason="arpo/rollout/branching.py (the rollout's branching module) "
                                                     "is not in this checkout yet")

from arpo.agent_loop import AgentLoopConfig, AgentLoopManager  # noqa: E402
from arpo.agent_loop.arpo_agent_loop import ARPOAgentLoop  # noqa: E402
from arpo.engine.base import SamplingParams  # noqa: E402
from arpo.protocol import format_tool_result  # noqa: E402
from tests.agent_loop.conftest import EchoSearch  # noqa: E402
from tests.agent_loop.helpers import USER, segments  # noqa: E402
from tests.agent_loop.scripted_engine import ScriptedEngine, turn_index  # noqa: E402


def tool_policy(max_calls: int, p_call: float = 0.75):
    """Each request (its id is random) calls search with probability p_call, up to max_calls results."""
    def policy(prompt_text: str, request_id: str) -> str:
        turn = turn_index(prompt_text)
        rng = random.Random(request_id)
        if turn < max_calls and rng.random() < p_call:
            return f"<think>step {turn} {rng.randint(0, 99)}</think><search>q{turn} {rng.randint(0, 9)}</search>"
        return f"<answer>\\boxed{{{rng.randint(0, 9)}}}</answer>"
    return policy


def run_group(tokenizer, engine, n, response_length=600, max_user_turns=None, request_seed=None, **loop_kwargs):
    config = AgentLoopConfig.load({"response_length": response_length,
                                   "multi_turn": {"max_user_turns": max_user_turns}})
    manager = AgentLoopManager([engine], tokenizer, config, [EchoSearch()])
    try:
        loop = ARPOAgentLoop(manager.context, **{"return_entropy": True, **loop_kwargs})
        params = SamplingParams(max_tokens=response_length, seed=request_seed)
        outs = asyncio.run(loop.run(list(USER), params, n=n))
    finally:
        manager.close()
    return outs


def check_tree(tokenizer, engine, outs, n):
    assert len(outs) == n
    generated: dict[tuple, list] = {}
    for _, prompt, ids in engine.calls:
        generated.setdefault(tuple(prompt), []).append(ids)
    for i, o in enumerate(outs):
        assert len(o.response_ids) == len(o.response_mask) == len(o.token_entropy)
        assert o.prompt_ids == outs[0].prompt_ids
        if o.parent >= 0:
            p = outs[o.parent]
            assert o.parent < i and o.extra["rollout_kind"] == "branch"
            assert 0 < o.branch_pos <= len(p.response_ids)
            assert o.response_ids[: o.branch_pos] == p.response_ids[: o.branch_pos]
            assert o.response_mask[: o.branch_pos] == p.response_mask[: o.branch_pos]
            # forks start right after a tool result
            assert p.response_mask[o.branch_pos - 1] == 0 and o.response_mask[o.branch_pos - 1] == 0
            assert any(c["end"] == o.branch_pos for c in p.tool_calls)
        else:
            assert o.branch_pos == 0 and o.extra["rollout_kind"] in ("initial", "fill")
        for value, s, e in segments(o.response_mask):
            piece = o.response_ids[s:e]
            if value == 1:  # model tokens are exactly what the engine produced for exactly this context
                assert piece in generated[tuple(o.prompt_ids + o.response_ids[:s])]
                assert all(not math.isnan(x) for x in o.token_entropy[s:e])
            else:
                text = tokenizer.decode(piece, skip_special_tokens=False)
                assert text.startswith(" <result>\nresults for q") and text.endswith("</result>")
                assert piece == list(tokenizer.encode(format_tool_result(text[len(" <result>\n"):-len("\n</result>")]),
                                                      add_special_tokens=False))
                assert all(math.isnan(x) for x in o.token_entropy[s:e])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 12), initial=st.integers(1, 6), beam=st.integers(1, 4),
       prob=st.sampled_from([0.0, 0.5, 1.0]), timing=st.sampled_from(["code", "paper"]),
       rule=st.sampled_from(["code", "paper"]), scope=st.sampled_from(["trajectory", "group"]),
       calls=st.integers(0, 4), limit=st.sampled_from([None, 1, 2, 3]), seed=st.integers(0, 1000))
def test_property_exactly_m_shared_prefixes_and_masks(tokenizer, n, initial, beam, prob, timing, rule, scope,
                                                     calls, limit, seed):
    initial = min(initial, n)
    engine = ScriptedEngine(tokenizer, policy=tool_policy(calls), delay_s=0.0005)
    outs = run_group(tokenizer, engine, n, initial_rollouts=initial, seed=seed, max_user_turns=limit,
                     branching={"beam_size": beam, "branch_probability": prob, "timing": timing, "rule": rule,
                                "initial_entropy_scope": scope, "window": 5})
    check_tree(tokenizer, engine, outs, n)
    kinds = [o.extra["rollout_kind"] for o in outs]
    # tree order: initial roots (each followed by its forks), then fills
    assert kinds[0] == "initial" and kinds.count("initial") == initial
    assert all(k != "initial" for k in kinds[kinds.index("fill"):]) if "fill" in kinds else True
    if beam == 1 or calls == 0:
        assert "branch" not in kinds


@pytest.mark.parametrize("timing", ["code", "paper"])
@pytest.mark.parametrize("limit", [None, 3])
def test_fork_decisions_follow_the_shared_rule_exactly(tokenizer, timing, limit):
    # rule "paper" with α=0, β=1, τ=0 forks iff ΔH > 0. 8 roots with at most 3 calls can reach at most 64
    # trajectories = M, so the budget never binds: the tree must hold a fork at exactly the tool results
    # whose ΔH (recomputed from the outputs) is positive. With a call limit, fresh roots start early on
    # slots no fork can reach any more — and must never take a slot a positive decision needed.
    window = 4
    engine = ScriptedEngine(tokenizer, policy=tool_policy(3, p_call=0.9), vary_logprobs="request")
    outs = run_group(tokenizer, engine, 64, initial_rollouts=8, seed=1, max_user_turns=limit, branching={
        "rule": "paper", "paper_alpha": 0.0, "paper_beta": 1.0, "paper_tau": 0.0, "timing": timing,
        "beam_size": 2, "window": window, "entropy_reduction": "mean"})
    check_tree(tokenizer, engine, outs, 64)

    def first_window(o, start):
        end = start
        while end < len(o.response_mask) and o.response_mask[end] == 1:
            end += 1
        vals = o.token_entropy[start:min(end, start + window)]
        return sum(vals) / len(vals)

    roots = {}
    for i, o in enumerate(outs):
        root = i
        while outs[root].parent >= 0:
            root = outs[root].parent
        roots[i] = first_window(outs[root], 0)
    forks = {(o.parent, o.branch_pos) for o in outs if o.parent >= 0}
    decided = 0
    for i, o in enumerate(outs):
        assert o.extra["initial_entropy"] == pytest.approx(roots[i])
        for k, call in enumerate(o.tool_calls):
            if call["end"] <= o.branch_pos:
                continue  # inherited: decided by an ancestor
            if o.extra["rollout_kind"] == "fill":  # fills take every remaining slot: nothing left to decide
                assert call["delta_entropy"] is None and all(p != i for p, _ in forks)
                continue
            runs = segments(o.response_mask)
            before = [s for v, s, e in runs if v == 1 and e == call["start"]][0]
            if timing == "code":
                h_now = first_window(o, before)
            elif call["end"] < len(o.response_ids):
                h_now = first_window(o, call["end"])
            else:
                continue
            delta = h_now - roots[i]
            assert call["delta_entropy"] == pytest.approx(delta)
            assert ((i, call["end"]) in forks) == (delta > 0)
            decided += 1
    assert decided >= 8 and forks  # ~16 independent ΔH draws: some are positive


def test_budget_is_exact_under_concurrency_across_groups(tokenizer):
    # Branch at every tool result (beam 4, probability 1) on many groups at once over two servers with
    # random latencies: every group must end with exactly M rows and a consistent tree.
    engines = [ScriptedEngine(tokenizer, policy=tool_policy(4, p_call=1.0), delay_s=0.002, per_token_s=0.0002)
               for _ in range(2)]
    config = AgentLoopConfig.load({"response_length": 600, "agents": [
        {"name": "arpo_agent", "_target_": "arpo.agent_loop.arpo_agent_loop.ARPOAgentLoop", "initial_rollouts": 3,
         "branching": {"beam_size": 4, "branch_probability": 1.0, "entropy_weight": 0.0, "window": 5}}]})
    manager = AgentLoopManager(engines, tokenizer, config, [EchoSearch()])
    rows = [{"raw_prompt": [{"role": "user", "content": f"question {i}"}], "agent_name": "arpo_agent",
             "data_source": "synthetic"} for i in range(12)]
    try:
        batch = manager.generate_sequences(rows, n=10)
        sessions_per_engine = [{rid.rsplit("-", 1)[0] for rid, _, _ in e.calls} for e in engines]
    finally:
        manager.close()
    assert len(batch) == 120
    groups = list(batch["group_index"])
    assert groups == sorted(groups) and all(groups.count(g) == 10 for g in range(12))
    parents, pos = list(batch["parent_index"]), list(batch["branch_pos"])
    responses, mask, attn = batch["responses"], batch["response_mask"], batch["attention_mask"]
    p_len = batch["prompts"].shape[1]
    for row, (parent, bp) in enumerate(zip(parents, pos)):
        if parent >= 0:
            assert groups[parent] == groups[row] and parent < row and batch["uid"][parent] == batch["uid"][row]
            assert (responses[row, :bp] == responses[parent, :bp]).all() and (mask[row, :bp] == mask[parent, :bp]).all()
        assert mask[row].sum() > 0 and (mask[row] <= attn[row, p_len:]).all()
    kinds = list(batch["rollout_kind"])
    assert kinds.count("initial") == 36 and kinds.count("branch") == 84  # forks took every free slot
    assert batch.meta["metrics"]["agent_loop/branched_fraction"] == pytest.approx(84 / 120)
    # both servers were used, and no conversation id appears on both (forks follow their parent)
    assert all(sessions_per_engine) and not (sessions_per_engine[0] & sessions_per_engine[1])


def test_fill_with_fresh_roots_when_branching_cannot_spend_the_budget(tokenizer):
    engine = ScriptedEngine(tokenizer, policy=tool_policy(0))  # never calls a tool: no branch points
    outs = run_group(tokenizer, engine, 6, initial_rollouts=2, seed=0)
    check_tree(tokenizer, engine, outs, 6)
    assert [o.extra["rollout_kind"] for o in outs] == ["initial"] * 2 + ["fill"] * 4


@pytest.mark.parametrize("limit, prob, concurrent", [(1, 1.0, 4), (None, 1.0, 2), (1, 0.0, 6), (None, 0.0, 2)])
def test_spare_slots_start_fresh_roots_without_waiting_for_the_group(tokenizer, limit, prob, concurrent):
    # M=6, N=2, beam 2. With one call allowed, each root can fork at most once, so 2 of the 4 free slots are
    # spare from the start and two fresh roots run alongside the initial ones; when no draw can fork (the
    # look-ahead knows every decision's draws), all 4 are. Without a call limit the forks a root may make
    # are unbounded and the fill waits for the roots to finish.
    engine = ScriptedEngine(tokenizer, policy=tool_policy(0), delay_s=0.02)
    outs = run_group(tokenizer, engine, 6, initial_rollouts=2, seed=0, max_user_turns=limit,
                     branching={"branch_probability": prob, "entropy_weight": 0.0},
                     speculative_fill_probability=None)  # the look-ahead alone
    check_tree(tokenizer, engine, outs, 6)
    first_end = next(i for i, (kind, _) in enumerate(engine.events) if kind == "end")
    assert sum(kind == "start" for kind, _ in engine.events[:first_end]) == concurrent


def test_bad_config_names_the_key(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(ValueError, match="beam_size"):
        run_group(tokenizer, engine, 4, branching={"beam_size": 0})
    with pytest.raises(ValueError, match="unknown key"):
        run_group(tokenizer, engine, 4, branching={"beams": 2})
    with pytest.raises(ValueError, match="initial_rollouts"):
        run_group(tokenizer, engine, 4, initial_rollouts=5)


class SeededEngine(ScriptedEngine):
    """Replies depend on the context and the request's seed only (not on ids or timing), after a random delay,
    so completion order changes from run to run while every request's output stays the same."""

    def __init__(self, tokenizer, order_seed: int):
        super().__init__(tokenizer, policy=self._reply, vary_logprobs=True)
        self.order = random.Random(order_seed)
        self.seed = None

    def _reply(self, prompt_text: str, request_id: str) -> str:
        turn = turn_index(prompt_text)
        rng = random.Random(f"{self.seed}|{prompt_text}")
        if turn < 3 and rng.random() < 0.8:
            return f"<think>step {turn} {rng.randint(0, 99)}</think><search>q{turn} {rng.randint(0, 9)}</search>"
        return f"<answer>\\boxed{{{rng.randint(0, 9)}}}</answer>"

    async def generate(self, prompt_ids, sampling_params, request_id):
        self.seed = sampling_params.seed  # read synchronously, before the first await below
        delay = self.order.random() * 0.003
        out = await super().generate(prompt_ids, sampling_params, request_id)
        await asyncio.sleep(delay)
        return out


@pytest.mark.parametrize("timing", ["code", "paper"])
def test_same_group_whatever_the_completion_order(tokenizer, timing):
    # The budget binds (3 roots, beam 3, up to 3 calls each, M = 8): which decisions get the slots must not
    # depend on which requests come back first.
    def run(order_seed, grant="ordered"):
        engine = SeededEngine(tokenizer, order_seed)
        outs = run_group(tokenizer, engine, 8, initial_rollouts=3, seed=5, max_user_turns=3, request_seed=11,
                         branch_grant=grant, branching={"beam_size": 3, "branch_probability": 0.6,
                                                        "timing": timing, "window": 5})
        check_tree(tokenizer, engine, outs, 8)
        return [(o.response_ids, o.parent, o.branch_pos, o.extra["rollout_kind"]) for o in outs]

    first = run(0)
    assert sum(kind == "branch" for *_, kind in first) > 0
    assert all(run(order) == first for order in (1, 2, 3))
    assert len(run(1, grant="first_come")) == 8
    with pytest.raises(ValueError, match="branch_grant"):
        run(0, grant="whenever")


def test_fill_prediction_changes_when_fills_start_not_the_group(tokenizer):
    # the budget binds, so some predicted fills lose their slot to a fork and are dropped mid-flight
    def run(probability):
        engine = SeededEngine(tokenizer, 0)
        outs = run_group(tokenizer, engine, 8, initial_rollouts=3, seed=5, max_user_turns=3, request_seed=11,
                         speculative_fill_probability=probability,
                         branching={"beam_size": 3, "branch_probability": 0.1, "window": 5})
        check_tree(tokenizer, engine, outs, 8)
        return [(o.response_ids, o.parent, o.branch_pos, o.extra["rollout_kind"]) for o in outs], len(engine.calls)

    plain, plain_requests = run(None)
    assert {"branch", "fill"} <= {kind for *_, kind in plain}
    eager, eager_requests = run(0.01)
    assert eager == plain and eager_requests > plain_requests  # dropped fills' requests, none in the group
    assert run(1.0)[0] == plain
    with pytest.raises(ValueError, match="speculative_fill_probability"):
        run(1.5)


def test_fill_prediction_starts_the_fills_of_a_group_whose_draws_cannot_fork_them_all(tokenizer):
    # one call allowed and every draw forks: 2 slots are spare for sure, and the other 2 go to fills unless
    # the roots call again (chance 0.5 each before any evidence), so the prediction starts a third fill early
    engine = ScriptedEngine(tokenizer, policy=tool_policy(0), delay_s=0.02)
    outs = run_group(tokenizer, engine, 6, initial_rollouts=2, seed=0, max_user_turns=1,
                     branching={"branch_probability": 1.0, "entropy_weight": 0.0}, speculative_fill_probability=0.5)
    check_tree(tokenizer, engine, outs, 6)
    first_end = next(i for i, (kind, _) in enumerate(engine.events) if kind == "end")
    assert sum(kind == "start" for kind, _ in engine.events[:first_end]) == 5


@pytest.mark.parametrize("timing,scope", [("code", "trajectory"), ("paper", "trajectory"), ("paper", "group")])
def test_no_batch_is_lost_under_fill_prediction_stress(tokenizer, timing, scope):
    # M=16, N=8, default branch probability and fill prediction, random completion order: dropped speculative
    # fills are cancelled (by their own task, before they start, or while waiting for the group's initial
    # entropy) and none of that may escape into the group
    lost = []
    for batch in range(100):
        engine = SeededEngine(tokenizer, batch)
        try:
            outs = run_group(tokenizer, engine, 16, initial_rollouts=8, seed=batch, max_user_turns=3,
                             request_seed=batch,
                             branching={"timing": timing, "initial_entropy_scope": scope, "window": 5})
        except asyncio.CancelledError:
            lost.append(batch)
            continue
        check_tree(tokenizer, engine, outs, 16)
    assert lost == []
