"""ARPOAgentLoop: the batch rollout's tree, driven group by group from the agent loop.

The tree's own invariants are the rollout's tests (tests/rollout/test_arpo_rollout.py); here: the agent loop
gives the batch rollout's tokens, masks and tree for every setting, across servers and under stress."""

from __future__ import annotations

import asyncio
import random

import pytest

from arpo.agent_loop import AgentLoopConfig, AgentLoopManager
from arpo.agent_loop.arpo_agent_loop import ARPOAgentLoop
from arpo.batch import DataBatch
from arpo.engine.base import SamplingParams
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy
from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig
from tests.rollout.fake_tools import FakePython, FakeSearch
from tests.rollout.rollout_helpers import check_invariants, rows

#: tool settings of the batch rollout's defaults, given to the agent loop's executor too
TOOLS = {"tool_retries": 3, "retry_on_empty": True, "max_tool_response_length": None, "tool_timeout_s": 120.0}
SEED = 123


class ShuffledEngine(ScriptedEngine):
    """The scripted engine with a random delay per request: completion order changes from run to run, each
    request's output does not (it depends on the context and the request's seed only)."""

    def __init__(self, tokenizer, order_seed: int, **kw):
        super().__init__(tokenizer, **kw)
        self.order = random.Random(order_seed)

    async def generate(self, prompt_ids, sampling_params, request_id):
        await asyncio.sleep(self.order.random() * 0.002)
        return await super().generate(prompt_ids, sampling_params, request_id)


def messages(n_prompts: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Question {i}: what is the number?"}] for i in range(n_prompts)]


def agent_loop_batch(tokenizer, engines, cfg: dict, n_prompts: int, seed: int = SEED,
                     calculate_log_probs: bool = False) -> DataBatch:
    config = AgentLoopConfig.load({"response_length": cfg["sampling.max_response_length"], "multi_turn": TOOLS,
                                   "default_agent_loop": "arpo_agent", "agents": [
                                       {"name": "arpo_agent", "_target_": "arpo.agent_loop.arpo_agent_loop.ARPOAgentLoop",
                                        "rollout": cfg}]})
    manager = AgentLoopManager(engines, tokenizer, config, [FakeSearch(), FakePython()],
                               calculate_log_probs=calculate_log_probs)
    prompts = DataBatch({}, {"raw_prompt": messages(n_prompts)}, {"seed": seed})
    try:
        return manager.generate_sequences(prompts, n=cfg["n"], sampling_params=SamplingParams(
            temperature=cfg.get("sampling.temperature", 1.0), max_tokens=cfg["sampling.max_response_length"]))
    finally:
        manager.close()


def batch_rollout(tokenizer, engine, cfg: dict, n_prompts: int, seed: int = SEED) -> DataBatch:
    from arpo.chat_templates.templater import ChatTemplater

    templater = ChatTemplater(tokenizer, [], {})
    prompts = [templater.prompt_ids(m, with_tools=False) for m in messages(n_prompts)]
    gen = ARPORollout(engine, tokenizer, cfg, tools=[FakeSearch(), FakePython()])
    try:
        return gen.generate(prompts, seed=seed)
    finally:
        gen.close()


def tree(batch: DataBatch) -> list[tuple]:
    return [(r["ids"], r["mask"], r["parent"], r["bpos"], r["group"], r["kind"], r["finish"],
             [(c["tool"], c["start"], c["end"], c["error"]) for c in r["calls"]]) for r in rows(batch)]


CASES = {
    "code timing": {},
    "paper timing, group entropy": {"branching.timing": "paper", "branching.rule": "paper",
                                    "entropy.initial_scope": "group"},
    "speculative fills": {"schedule.speculative_fill": 2},
    "no speculative forks": {"schedule.speculative_forks": False},
    "no fill prediction, first come": {"schedule.fill_probability": None, "schedule.branch_grant": "first_come",
                                       "schedule.mode": "rounds"},
    "duplicate fills": {"schedule.fill": "duplicate", "schedule.fill_probability": None},
    "plain sampling": {"mode": "single"},
    "aepo, released fill": {"policy": "aepo", "aepo.penalty": 0.5, "schedule.fill": "released"},
    "aepo, pre-monitoring, group entropy": {"policy": "aepo", "aepo.pre_monitoring": True, "aepo.beta": 5.0,
                                            "entropy.initial_scope": "group", "schedule.speculative_fill": 1},
    "tree_grpo": {"policy": "tree_grpo", "initial_rollouts": 2, "tree_grpo.expansions": 2},
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_group_is_the_batch_rollouts_group(tokenizer, case):
    cfg = {"n": 8, "initial_rollouts": 3, "branching.beam_size": 3, "branching.branch_probability": 0.7,
           "entropy.window": 5, "tools.call_limit": 3, "sampling.max_response_length": 300, "return_entropy": True,
           **CASES[case]}
    policy = ScriptPolicy(call_prob=0.8, call_decay=0.15)
    expected = batch_rollout(tokenizer, ScriptedEngine(tokenizer, policy), cfg, n_prompts=3)
    check_invariants(expected, ARPORolloutConfig.from_dict(cfg), tokenizer, n_prompts=3)
    got = agent_loop_batch(tokenizer, [ShuffledEngine(tokenizer, 7, policy=policy)], cfg, n_prompts=3)
    assert tree(got) == tree(expected)
    kinds = {k for *_, k, _, _ in tree(expected)}
    assert case == "plain sampling" or "branch" in kinds  # the cases really fork
    for a, b in zip(got["token_entropy"], expected["token_entropy"]):
        assert a == pytest.approx(b, nan_ok=True)
    # the same counts under the batch rollout's metric names: tool calls run once per tree, not per branch
    for key in ("rollout/trajectories", "rollout/tool_calls/total"):
        assert got.meta["metrics"][key] == expected.meta["metrics"][key], key


def test_groups_spread_over_servers_and_each_stays_on_one(tokenizer):
    engines = [ShuffledEngine(tokenizer, s, policy=ScriptPolicy(call_prob=0.9)) for s in range(2)]
    cfg = {"n": 6, "initial_rollouts": 2, "branching.branch_probability": 1.0, "branching.entropy_weight": 0.0,
           "tools.call_limit": 3, "sampling.max_response_length": 300}
    batch = agent_loop_batch(tokenizer, engines, cfg, n_prompts=8)
    assert list(batch["group_index"]) == [g for g in range(8) for _ in range(6)]
    sessions = [{r.request_id.split("-t")[0] for r in e.requests} for e in engines]  # arpo-<call>-g<group>
    assert all(sessions) and not (sessions[0] & sessions[1])  # both used; no group on both
    assert len(sessions[0] | sessions[1]) == 8  # one session (one server) per group


@pytest.mark.parametrize("timing,scope", [("code", "trajectory"), ("paper", "group")])
def test_no_batch_is_lost_under_fill_prediction_stress(tokenizer, timing, scope):
    # M=16, N=8, fill prediction and speculative fills, random completion order, 40 batches a setting (each a new
    # order; 0.24 s a batch alone, ~1.5 s beside the suite's other worker): dropped fills are cancelled mid-request,
    # and none of that may escape into a group or lose a batch
    cfg = {"n": 16, "initial_rollouts": 8, "tools.call_limit": 3, "sampling.max_response_length": 200,
           "branching.timing": timing, "entropy.initial_scope": scope, "schedule.speculative_fill": 2,
           "entropy.window": 5}
    lost = []
    for batch_no in range(40):
        try:
            batch = agent_loop_batch(tokenizer, [ShuffledEngine(tokenizer, batch_no)], cfg, n_prompts=1,
                                     seed=batch_no)
        except BaseException as err:  # noqa: BLE001 - a lost batch is what the test counts
            lost.append((batch_no, repr(err)))
            continue
        assert list(batch["group_index"]) == [0] * 16
    assert lost == []


def test_bad_config_names_the_key(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with pytest.raises(ValueError, match="beam_size"):
        agent_loop_batch(tokenizer, [engine], {"n": 4, "initial_rollouts": 2, "branching.beam_size": 0,
                                               "sampling.max_response_length": 100}, 1)
    with pytest.raises(ValueError, match="unknown key"):
        agent_loop_batch(tokenizer, [engine], {"n": 4, "initial_rollouts": 2, "beams": 2,
                                               "sampling.max_response_length": 100}, 1)
    with pytest.raises(ValueError, match="initial_rollouts"):
        agent_loop_batch(tokenizer, [engine], {"n": 4, "initial_rollouts": 5, "sampling.max_response_length": 100}, 1)
    manager = AgentLoopManager([engine], tokenizer, AgentLoopConfig.load({}), [])
    try:
        with pytest.raises(ValueError, match="needs a tool named by an ARPO tag"):
            ARPOAgentLoop(manager.context)
    finally:
        manager.close()


def test_the_agent_loop_records_the_batch_rollouts_log_probs(tokenizer):
    """actor_rollout_ref.rollout.calculate_log_probs reaches the agent loop through its manager."""
    import torch

    cfg = {"n": 6, "initial_rollouts": 2, "branching.branch_probability": 0.7, "tools.call_limit": 2,
           "sampling.max_response_length": 200}
    policy = ScriptPolicy(call_prob=0.8, call_decay=0.15)
    expected = batch_rollout(tokenizer, ScriptedEngine(tokenizer, policy), {**cfg, "calculate_log_probs": True},
                             n_prompts=2)
    got = agent_loop_batch(tokenizer, [ShuffledEngine(tokenizer, 3, policy=policy)], cfg, n_prompts=2,
                           calculate_log_probs=True)
    assert tree(got) == tree(expected)
    assert torch.equal(got["rollout_log_probs"], expected["rollout_log_probs"])
    assert (got["rollout_log_probs"][got["response_mask"].bool()] < 0).all()


def test_hermes_calls_give_the_batch_rollouts_group_with_the_tools_in_the_prompt(tokenizer):
    """``tools.format: hermes`` in the agent loop: the prompt carries the tools block (the schemas the model calls
    by name), and the group is the batch rollout's over the same prompt, forks after the tool response included."""
    from arpo.chat_templates.templater import ChatTemplater
    from tests.rollout.test_hermes_rollout import CALL, FINAL

    cfg = {"n": 4, "initial_rollouts": 2, "tools.format": "hermes", "branching.timing": "paper",
           "branching.rule": "paper", "entropy.window": 4, "sampling.max_response_length": 200, "return_entropy": True}
    tools = [FakeSearch(), FakePython()]
    templater = ChatTemplater(tokenizer, [t.tool_schema for t in tools], {})
    prompts = [templater.prompt_ids(m, with_tools=True) for m in messages(2)]
    gen = ARPORollout(ScriptedEngine(tokenizer, replies=[CALL, FINAL]), tokenizer, cfg, tools=tools)
    try:
        expected = gen.generate(prompts, seed=SEED)
    finally:
        gen.close()
    got = agent_loop_batch(tokenizer, [ShuffledEngine(tokenizer, 7, replies=[CALL, FINAL])], cfg, n_prompts=2)
    assert tree(got) == tree(expected)
    assert '"name": "search"' in tokenizer.decode(got["prompts"][0].tolist())  # the tools block
    rs = rows(got)
    assert any(r["kind"] == "branch" for r in rs)
    assert all([(c["tool"], c["error"]) for c in r["calls"]] == [("search", False)] for r in rs)
