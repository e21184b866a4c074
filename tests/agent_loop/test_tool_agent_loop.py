import pytest

from arpo.agent_loop import MultiTurnConfig
from arpo.rollout.tool_executor import truncate_text
from arpo.protocol import format_tool_result
from tests.agent_loop.conftest import BrokenPython, EchoSearch
from arpo.engine.base import SamplingParams
from tests.agent_loop.helpers import USER, hermes_call, make_manager, run_loop, segments
from arpo.testing.scripted_engine import ScriptedEngine

CALL = "Let me look it up. " + hermes_call("search", query="capital of France")
ANSWER = "The answer is \\boxed{Paris}."


def test_model_ids_are_exactly_the_engine_ids_and_each_turn_extends_the_last(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=[CALL, CALL, ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch()])
    out = run_loop(manager)
    manager.close()

    assert out.finish_reason == "stop" and out.num_turns == 1 + 3 + 2
    assert len(engine.requests) == 3
    # Every engine call saw the previous context unchanged: prompt ‖ response so far, never re-tokenised.
    full = out.prompt_ids + out.response_ids
    for prompt in (r.prompt_ids for r in engine.requests):
        assert full[: len(prompt)] == prompt
    assert engine.requests[0].prompt_ids == out.prompt_ids
    # The model segments are exactly the engine outputs, in order; the rest are tool results.
    runs = segments(out.response_mask)
    model_runs = [out.response_ids[s:e] for v, s, e in runs if v == 1]
    assert model_runs == [r.output_ids for r in engine.requests]
    assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1]
    assert out.response_ids[-1] == tokenizer.eos_token_id
    # Tool segments are the template's rendering of the tool message alone (no system prefix).
    tool_ids = [out.response_ids[s:e] for v, s, e in runs if v == 0]
    expected = manager.context.templater.message_ids([{"role": "tool", "content": "results for capital of France"}])
    assert tool_ids == [expected, expected]
    text = tokenizer.decode(expected, skip_special_tokens=False)
    assert text.startswith("\n<|im_start|>user") and "<|im_start|>system" not in text
    assert text.endswith("<|im_start|>assistant\n")
    # The whole context is exactly the chat template's rendering of the conversation.
    tool_msg = {"role": "tool", "content": "results for capital of France"}
    conversation = [*USER, {"role": "assistant", "content": CALL}, tool_msg, {"role": "assistant", "content": CALL},
                    tool_msg, {"role": "assistant", "content": ANSWER}]
    canonical = tokenizer.apply_chat_template(conversation, tools=[EchoSearch().tool_schema], tokenize=False)
    assert tokenizer.decode(out.prompt_ids + out.response_ids, skip_special_tokens=False) == canonical.rstrip("\n")
    assert [c["error"] for c in out.tool_calls] == [False, False]
    assert all(out.response_mask[c["start"]:c["end"]] == [0] * (c["end"] - c["start"]) for c in out.tool_calls)


def test_a_turn_stopped_without_its_end_token_is_closed_before_the_tool_message(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=[CALL + " and more", ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch()])
    cls_params = SamplingParams(max_tokens=400, stop=("</tool_call>",))
    out = run_loop(manager, params=cls_params)
    manager.close()
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    assert engine.requests[0].output_ids[-1] != tokenizer.eos_token_id  # stopped on the stop string
    assert tokenizer.decode(out.response_ids[s:e], skip_special_tokens=False).startswith(
        "<|im_end|>\n<|im_start|>user\n<tool_response>")


@pytest.mark.parametrize("limits, engine_calls, user_turns, reason", [
    ({"max_assistant_turns": 1}, 1, 0, "max_assistant_turns"),
    ({"max_assistant_turns": 3}, 3, 2, "max_assistant_turns"),
    ({"max_user_turns": 1}, 2, 1, "max_user_turns"),
    ({"max_user_turns": 2, "max_assistant_turns": 5}, 3, 2, "max_user_turns"),
])
def test_turn_limits_stop_after_a_model_turn(tokenizer, limits, engine_calls, user_turns, reason):
    engine = ScriptedEngine(tokenizer, replies=[CALL])  # the model never stops calling
    manager = make_manager(tokenizer, engine, [EchoSearch()], **limits)
    out = run_loop(manager)
    manager.close()
    assert out.finish_reason == reason
    assert len(engine.requests) == engine_calls
    assert sum(1 for v, _, _ in segments(out.response_mask) if v == 0) == user_turns
    assert out.num_turns == 1 + engine_calls + user_turns
    assert out.response_mask[-1] == 1  # the last turn is the model's


def test_response_length_limit_never_ends_on_a_tool_result(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=[CALL])
    manager = make_manager(tokenizer, engine, [EchoSearch()], response_length=120)
    out = run_loop(manager)
    manager.close()
    assert out.finish_reason == "length"
    assert len(out.response_ids) <= 120 and out.response_mask[-1] == 1
    # every generate call was capped at what was left of the budget
    used = 0
    for prompt, ids in ((r.prompt_ids, r.output_ids) for r in engine.requests):
        used = len(prompt) - len(out.prompt_ids)
        assert used + len(ids) <= 120


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_tool_response_truncation_sides(tokenizer, side):
    tool = EchoSearch(pad=300)
    engine = ScriptedEngine(tokenizer, replies=[CALL, ANSWER])
    manager = make_manager(tokenizer, engine, [tool], max_tool_response_length=40, tool_response_truncate_side=side)
    out = run_loop(manager)
    manager.close()
    full = "results for capital of France" + "x" * 300
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    text = tokenizer.decode(out.response_ids[s:e], skip_special_tokens=False)
    body = text.split("<tool_response>\n", 1)[1].rsplit("\n</tool_response>", 1)[0]
    assert body == truncate_text(full, 40, side)
    if side == "left":
        assert body == full[:40] + "...(truncated)"
    elif side == "right":
        assert body == "(truncated)..." + full[-40:]
    else:
        assert body == full[:20] + "...(truncated)..." + full[-20:]


def test_truncation_keeps_short_text_and_rejects_unknown_side():
    assert truncate_text("short", 40, "left") == "short"
    with pytest.raises(ValueError, match="tool_response_truncate_side"):
        MultiTurnConfig(tool_response_truncate_side="top").validate()


def test_parallel_calls_run_concurrently_and_extra_calls_are_answered(tokenizer):
    tool = EchoSearch(latency_s=0.3)
    three = "".join(hermes_call("search", query=q) for q in ("a", "b", "c"))
    engine = ScriptedEngine(tokenizer, replies=[three, ANSWER])
    manager = make_manager(tokenizer, engine, [tool], max_parallel_calls=2)
    out = run_loop(manager)
    manager.close()
    assert sorted(tool.queries) == ["a", "b"]
    (a0, a1), (b0, b1) = tool.intervals
    assert max(a0, b0) < min(a1, b1)  # the two 0.3 s calls overlapped (not a wall-clock bound: CI may be busy)
    assert out.metrics["tool_calls"] < (a1 - a0) + (b1 - b0)  # the turn's tool time: less than the calls in turn
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    text = tokenizer.decode(out.response_ids[s:e], skip_special_tokens=False)
    assert text.count("<tool_response>") == 3
    assert "results for a" in text and "results for b" in text and "this call was skipped" in text
    assert [c["error"] for c in out.tool_calls] == [False, False, True]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize("bad_turn, message", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    (hermes_call("browse", url="x"), "unknown tool 'browse'"),
    ('<tool_call>{"arguments": {"query": "x"}}</tool_call>', "no string 'name'"),
    ('<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "search", "arguments": {"query": "x"}}', "never closed"),
    (hermes_call("python", code="1/0"), "tool 'python' failed: RuntimeError: sandbox exploded"),
])
def test_malformed_calls_get_an_error_message_and_the_loop_goes_on(tokenizer, bad_turn, message):
    engine = ScriptedEngine(tokenizer, replies=[bad_turn, ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch(), BrokenPython()])
    out = run_loop(manager)
    manager.close()
    assert len(engine.requests) == 2 and out.finish_reason == "stop"
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    text = tokenizer.decode(out.response_ids[s:e], skip_special_tokens=False)
    assert "Error:" in text and message in text
    assert out.tool_calls[0]["error"] is True


def test_tool_timeout_becomes_text(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=[CALL, ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch(latency_s=0.5)], tool_timeout_s=0.05)
    out = run_loop(manager)
    manager.close()
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    assert "timed out after 0.05 s" in tokenizer.decode(out.response_ids[s:e])
    assert out.finish_reason == "stop"


def test_arpo_tags_stop_on_close_tag_and_append_the_result_wrapper(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=["<think>hm</think><search>capital of France</search> junk after",
                                        "<answer>\\boxed{Paris}</answer>"])
    manager = make_manager(tokenizer, engine, [EchoSearch(), BrokenPython()], format="arpo_tags")
    out = run_loop(manager)
    manager.close()
    runs = segments(out.response_mask)
    assert [v for v, _, _ in runs] == [1, 0, 1]
    first = tokenizer.decode(out.response_ids[runs[0][1]:runs[0][2]], skip_special_tokens=False)
    assert first.endswith("</search>")  # the engine stopped on the close tag; junk never generated
    result = out.response_ids[runs[1][1]:runs[1][2]]
    assert result == list(tokenizer.encode(format_tool_result("results for capital of France"),
                                           add_special_tokens=False))
    assert [r.output_ids for r in engine.requests] == [out.response_ids[s:e] for v, s, e in runs if v == 1]
    assert out.finish_reason == "stop"
    # tag prompts carry no hermes tool schema
    assert "<tools>" not in tokenizer.decode(out.prompt_ids)


def test_arpo_tags_malformed_close_without_open(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=["I will search now</search>", "<answer>\\boxed{1}</answer>"])
    manager = make_manager(tokenizer, engine, [EchoSearch()], format="arpo_tags")
    out = run_loop(manager)
    manager.close()
    (_, s, e), = [r for r in segments(out.response_mask) if r[0] == 0]
    assert "without a matching <search>" in tokenizer.decode(out.response_ids[s:e])
    assert len(engine.requests) == 2


def test_single_turn_loop(tokenizer):
    engine = ScriptedEngine(tokenizer, replies=[ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch()])
    out = run_loop(manager, name="single_turn_agent")
    manager.close()
    assert out.response_ids == engine.requests[0].output_ids and set(out.response_mask) == {1}
    assert out.num_turns == 2 and "<tools>" not in tokenizer.decode(out.prompt_ids)


@pytest.mark.parametrize("name", ["tool_agent", "single_turn_agent"])
def test_calculate_log_probs_records_each_model_tokens_log_prob_and_zero_on_tool_results(tokenizer, name):
    engine = ScriptedEngine(tokenizer, replies=[CALL, ANSWER])
    manager = make_manager(tokenizer, engine, [EchoSearch()])
    manager.context.calculate_log_probs = True  # AgentLoopManager(calculate_log_probs=True) in training
    out = run_loop(manager, name=name)
    manager.close()
    assert all(r.sampling_params.logprobs == 0 for r in engine.requests)  # the sampled token's only
    assert len(out.rollout_log_probs) == len(out.response_ids)
    assert (0 in out.response_mask) == (name == "tool_agent")  # the tool loop's response holds a tool result
    assert all((lp < 0) == (m == 1) for lp, m in zip(out.rollout_log_probs, out.response_mask))
    traj = out.to_trajectory(group=0, parent_row=-1)
    assert traj.rollout_log_probs == out.rollout_log_probs
