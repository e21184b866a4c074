import numpy as np
import pytest
import torch

from arpo.agent_loop import AgentLoopConfig, AgentLoopManager
from arpo.agent_loop.base import registered_names
from arpo.batch import DataBatch
from tests.agent_loop.conftest import EchoSearch
from tests.agent_loop.helpers import hermes_call
from arpo.testing.scripted_engine import ScriptedEngine, reply_turn


def _policy(prompt_text: str, request_id: str) -> str:
    # Prompts about "long" take three tool turns, others answer at once: responses differ in length.
    if "long" in prompt_text and reply_turn(prompt_text) < 3:
        return "thinking " + hermes_call("search", query=f"step {reply_turn(prompt_text)}")
    return "\\boxed{1}"


def _rows():
    return [
        {"raw_prompt": [{"role": "user", "content": "a long question"}], "agent_name": "tool_agent",
         "data_source": "synthetic", "reward_model": {"ground_truth": "1"}},
        {"raw_prompt": [{"role": "user", "content": "short"}], "data_source": "synthetic",
         "reward_model": {"ground_truth": "2"}},
        {"raw_prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "long again"}],
         "agent_name": "tool_agent", "data_source": "other", "reward_model": {"ground_truth": "3"}},
    ]


def test_default_yaml_registers_every_loop():
    config = AgentLoopConfig.load()  # configs/rollout/agent.yaml: verl's rollout.agent and rollout.multi_turn
    assert config.default_agent_loop == "single_turn_agent" and config.max_concurrency == 1024
    assert config.multi_turn.tool_timeout_s == 120 and config.multi_turn.format == "hermes"
    assert {"single_turn_agent", "tool_agent", "arpo_agent"} <= set(registered_names())
    with pytest.raises(ValueError, match="unknown agent-loop config key"):
        AgentLoopConfig.load({"respons_length": 3})
    with pytest.raises(ValueError, match="multi_turn.format"):
        AgentLoopConfig.load({"multi_turn": {"format": "xml"}})


def test_generate_sequences_pads_like_the_rollout(tokenizer):
    engines = [ScriptedEngine(tokenizer, replies=_policy, latency_s=0.01) for _ in range(2)]
    manager = AgentLoopManager(engines, tokenizer, AgentLoopConfig.load(response_length=300), [EchoSearch()])
    try:
        batch = manager.generate_sequences(_rows(), n=3)  # the blocking form, on the manager's loop thread
        again = manager.generate_sequences(DataBatch(non_tensors={
            k: np.array([r.get(k) for r in _rows()], dtype=object) for k in ("raw_prompt", "data_source")}), n=1)
    finally:
        manager.close()

    assert len(batch) == 9 and len(again) == 3
    uids = list(batch["uid"])
    assert uids[0:3] == [uids[0]] * 3 and uids[3:6] == [uids[3]] * 3 and len(set(uids)) == 3
    assert list(batch["group_index"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert list(batch["agent_name"]) == ["tool_agent"] * 3 + ["single_turn_agent"] * 3 + ["tool_agent"] * 3
    assert list(batch["data_source"])[3] == "synthetic" and batch["reward_model"][8] == {"ground_truth": "3"}
    assert list(batch["parent_index"]) == [-1] * 9

    prompts, responses, mask = batch["prompts"], batch["responses"], batch["response_mask"]
    attn, pos = batch["attention_mask"], batch["position_ids"]
    p_len = prompts.shape[1]
    pad = manager.pad_token_id
    for i in range(9):
        n_prompt = int(attn[i, :p_len].sum())
        n_resp = int(attn[i, p_len:].sum())
        assert (attn[i, : p_len - n_prompt] == 0).all() and (prompts[i, : p_len - n_prompt] == pad).all()
        assert (attn[i, p_len: p_len + n_resp] == 1).all() and (responses[i, n_resp:] == pad).all()
        assert (mask[i, n_resp:] == 0).all()
        assert torch.equal(pos[i, p_len - n_prompt: p_len + n_resp], torch.arange(n_prompt + n_resp))
        assert torch.equal(batch["input_ids"][i], torch.cat([prompts[i], responses[i]]))
    # long prompts went through 3 tool rounds (mask has zeros), short ones answered in one turn
    assert all((mask[i, : int(attn[i, p_len:].sum())] == 0).any() for i in (0, 1, 2, 6, 7, 8))
    assert all(mask[i].sum() == attn[i, p_len:].sum() for i in (3, 4, 5))
    assert list(batch["num_turns"]) == [8, 8, 8, 2, 2, 2, 8, 8, 8]
    timing = batch.meta["timing"]
    assert timing["agent_loop/wall"] > 0 and timing["agent_loop/tool_calls/max"] >= 0
    assert timing["agent_loop/generate_sequences/max"] >= timing["agent_loop/generate_sequences/min"] > 0
    assert batch.meta["metrics"]["agent_loop/num_turns/max"] == 8


def test_bad_input_names_the_field(tokenizer):
    engine = ScriptedEngine(tokenizer)
    manager = AgentLoopManager([engine], tokenizer, AgentLoopConfig.load(response_length=50))
    try:
        with pytest.raises(ValueError, match="raw_prompt"):
            manager.generate_sequences([{"prompt": "hi"}])
        with pytest.raises(ValueError, match="not registered"):
            manager.generate_sequences([{"raw_prompt": [{"role": "user", "content": "x"}], "agent_name": "nope"}])
        with pytest.raises(ValueError, match="rollout.n"):
            manager.generate_sequences([{"raw_prompt": [{"role": "user", "content": "x"}]}], n=0)
    finally:
        manager.close()
