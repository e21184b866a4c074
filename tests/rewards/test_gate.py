"""The ARPO format gate: every failure reason, the cases the official check gets wrong, tool counting."""

from __future__ import annotations

import pytest

from arpo.protocol import format_tool_result
from reward_fns.deep_research import compute_score
from reward_fns.gate import check_format, count_real_tool_calls, lenient_tool_uses

from .conftest import PYTHON_CHECK, SEARCH_CITIBANK, respond

GOOD = respond(SEARCH_CITIBANK, PYTHON_CHECK, answer="James Madison")
RES = format_tool_result  # " <result>\n…\n</result>"


def test_well_formed_response_passes_and_lists_its_tool_calls():
    check = check_format(GOOD)
    assert check.ok, check.reason
    assert check.answer == "James Madison"
    assert [(u.tool, u.query) for u in check.tool_uses] == [
        ("search", "Citibank founded year"), ("python", "print(1809 <= 1812 <= 1817)")]
    assert check.tool_uses[1].result == "True"


BAD_CASES = {
    "no think block": ("<answer> \\boxed{James Madison} </answer>", "no <think> block"),
    "close before open": ("</think> reasoning <think> more </think><answer>\\boxed{1}</answer>",
                          "</think> without an open <think>"),
    "nested think": ("<think> a <think> b </think> c </think><answer>\\boxed{1}</answer>", "nested <think>"),
    "think never closed": ("<think> a </think><answer>\\boxed{1}</answer><think> trailing thoughts",
                           "<think> is never closed"),
    "truncated, no answer": ("<think> Citibank was founded in 1812 </think> so the president then was",
                             "no <answer> block"),
    "two answers": ("<think> a </think><answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>",
                    "more than one <answer>"),
    "close answer without open": ("<think> a </think> \\boxed{1} </answer>", "</answer> without <answer>"),
    "answer never closed": ("<think> a </think><answer> The answer is \\boxed{1}", "<answer> is never closed"),
    "answer inside think": ("<think> so <answer>\\boxed{1}</answer> </think>", "<answer> inside an open <think>"),
    "tool call inside answer": ("<think> a </think><answer> <search> q </search> \\boxed{1} </answer>",
                                "<search> inside <answer>"),
    "answer without boxed": ("<think> a </think><answer> James Madison </answer>",
                             "<answer> has no complete \\boxed{}"),
    "boxed braces unbalanced": ("<think> a </think><answer> \\boxed{\\frac{1}{2} </answer>",
                                "<answer> has no complete \\boxed{}"),
    "call never closed (truncated)": ("<think> a </think><search> Citibank founded", "<search> call is never closed"),
    "call without result (tool limit hit)": ("<think> a </think><python> print(1) </python><think> b </think>"
                                             "<answer>\\boxed{1}</answer>",
                                             "<python> call is not followed by its <result>"),
    "text between call and result": ("<think> a </think><search> q </search> hmm" + RES("r")
                                     + "<think> b </think><answer>\\boxed{1}</answer>",
                                     "<search> call is not followed by its <result>"),
    "result never closed (truncated)": ("<think> a </think><search> q </search> <result>\nPage 1: Citi",
                                        "<result> is never closed"),
    "hallucinated result": ("<think> a </think>" + RES("Citibank was founded in 1812")
                            + "<think> b </think><answer>\\boxed{1}</answer>",
                            "<result> without a tool call before it (the model wrote its own tool output)"),
    "stray close result": ("<think> a </think></result><answer>\\boxed{1}</answer>", "</result> without <result>"),
    "stray close tool tag": ("<think> a </think></search><answer>\\boxed{1}</answer>", "</search> without <search>"),
    "tag inside call": ("<think> a </think><search> q <think> x </search>" + RES("r")
                        + "<answer>\\boxed{1}</answer>", "tag inside a <search> call"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_every_format_failure_is_caught_and_scores_minus_one(case):
    text, reason = BAD_CASES[case]
    check = check_format(text)
    assert not check.ok
    assert check.reason == reason
    result = compute_score("DR_grpo_mix", text, "1")
    assert result["score"] == -1.0
    assert result["format_ok"] == 0.0 and result["f1"] == 0.0 and result["format_reason"] == reason


def test_tags_inside_tool_results_are_not_read_as_the_models_tags():
    # a scraped page quoting the protocol; the official check counts these tags and fails the response
    page = "Page 1: the prompt says <think> reasoning </think> then <answer> ... \\boxed{} </answer> <result>"
    text = respond(("search", "ARPO prompt format", page), answer="yes")
    check = check_format(text)
    assert check.ok, check.reason
    assert check.answer == "yes" and check.tool_uses[0].result == page


def test_empty_boxed_is_good_format_but_wrong():
    text = "<think> not sure </think><answer> \\boxed{} </answer>"
    assert check_format(text).ok
    assert compute_score("DR_grpo_mix", text, "1812")["score"] == 0.0


def test_whitespace_and_newlines_between_call_and_result_are_fine():
    text = "<think> a </think><search>q</search>\n\n<result>\nr\n</result><think> b </think><answer>\\boxed{1}</answer>"
    assert check_format(text).ok


def test_real_tool_calls_need_a_query_and_a_result():
    text = ("<think> a </think><python></python>" + RES("") + "<search> Citibank </search>" + RES("Page 1: 1812")
            + "<think> b </think><answer>\\boxed{1812}</answer>")
    check = check_format(text)
    assert check.ok
    assert count_real_tool_calls(check.tool_uses) == {"search": 1, "python": 0}


def test_rollout_record_overrides_text_and_excludes_failed_calls():
    check = check_format(GOOD)
    record = [{"tool": "search", "error": False}, {"tool": "python", "error": True}]
    assert count_real_tool_calls(check.tool_uses, {"tool_calls": record}) == {"search": 1, "python": 0}


def test_lenient_tool_uses_find_calls_in_badly_formatted_text():
    text = "<search> q1 </search>" + RES("r1") + " <python> x </python> <think> unclosed"
    uses = lenient_tool_uses(text)
    assert [(u.tool, u.query, u.result) for u in uses] == [("search", "q1", "r1")]


def test_gate_never_raises_and_ok_always_comes_with_an_answer():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    pieces = st.sampled_from(["<think>", "</think>", "<answer>", "</answer>", "<search>", "</search>", "<python>",
                              "</python>", "<result>", "</result>", "\\boxed{", "}", "{", " x ", "\n", "1812"])

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(st.lists(pieces, max_size=30))
    def check(parts):
        text = "".join(parts)
        result = check_format(text)
        assert result.ok == (result.answer is not None)
        if result.ok:
            assert compute_score("DR_grpo_mix", text, "1812")["score"] >= 0.0
        else:
            assert compute_score("DR_grpo_mix", text, "1812")["score"] == -1.0

    check()


def test_gate_reads_the_loaded_tools_tags_when_given_their_protocol():
    """A tool declaring ``<convert>`` (unit_converter): rejected by the default gate (search and python only),
    accepted, counted by tool name and required for the bonus when the run's protocol is given."""
    from arpo.protocol import ToolProtocol
    from reward_fns.gate import score_with_gate

    protocol = ToolProtocol({"search": "search", "python": "python", "unit_converter": "convert"})
    text = respond(SEARCH_CITIBANK, ("convert", "3 km to mi", "3 km = 1.864 mi"), answer="1812")
    assert check_format(text).reason == "<result> without a tool call before it (the model wrote its own tool output)"
    check = check_format(text, protocol)
    assert check.ok, check.reason
    assert [(u.tool, u.query, u.result) for u in check.tool_uses] == [
        ("search", "Citibank founded year", SEARCH_CITIBANK[2]), ("unit_converter", "3 km to mi", "3 km = 1.864 mi")]
    assert count_real_tool_calls(check.tool_uses, protocol=protocol) == {"search": 1, "python": 0, "unit_converter": 1}
    assert [u.tool for u in lenient_tool_uses(text + "<think> unclosed", protocol)] == ["search", "unit_converter"]
    assert check_format("<think> a </think><answer> <convert> q </convert> \\boxed{1} </answer>",
                        protocol).reason == "<convert> inside <answer>"

    def grade(pred):
        return {"acc": float(pred == "1812"), "em": 0.0, "f1": 0.0}

    assert score_with_gate(text, grade, tool_bonus=0.1)["score"] == -1.0
    assert score_with_gate(text, grade, tool_bonus=0.1, protocol=protocol)["score"] == 1.0  # python never ran
    every_tool = respond(SEARCH_CITIBANK, PYTHON_CHECK, ("convert", "3 km to mi", "3 km = 1.864 mi"), answer="1812")
    assert score_with_gate(every_tool, grade, tool_bonus=0.1, protocol=protocol)["score"] == pytest.approx(1.1)


def hermes(name: str, arguments: dict, result: str, markup: str = "<|im_end|>\n<|im_start|>user\n") -> str:
    """A hermes call and its tool response as the Qwen2.5 template appends it (``markup``: the turn change)."""
    import json

    return (f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>{markup}'
            f"<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


HERMES_GOOD = ("<think> look it up </think>\n" + hermes("search", {"query": "Citibank founded"}, "Founded 1812.")
               + "<think> check </think>\n" + hermes("python", {"code": "print(1812)"}, "1812", markup="\nuser\n")
               + "<think> so 1812 </think> <answer> \\boxed{1812} </answer>")
HERMES_BAD = {
    "no response": ("<think> a </think><tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call> <think> b "
                    "</think><answer>\\boxed{1}</answer>", "<tool_call> call is not followed by its <tool_response>"),
    "bad json": ("<think> a </think>" + hermes("search", {}, "r").replace('{"name"', '{name') +
                 "<answer>\\boxed{1}</answer>",
                 "<tool_call> is not a JSON object with a string name and object arguments"),
    "own response": ("<think> a </think><tool_response>\nr\n</tool_response><answer>\\boxed{1}</answer>",
                     "<tool_response> without a tool call before it (the model wrote its own tool output)"),
    "never closed": ("<think> a </think><tool_call>{\"name\": \"search\"", "<tool_call> call is never closed"),
    "stray close": ("<think> a </think></tool_call><answer>\\boxed{1}</answer>", "</tool_call> without <tool_call>"),
    "text between": ("<think> a </think>" + hermes("search", {"query": "q"}, "r", markup=" hmm ")
                     + "<answer>\\boxed{1}</answer>", "<tool_call> call is not followed by its <tool_response>"),
}


def test_a_hermes_run_gates_tool_call_json_and_tool_responses():
    """``tools.format: hermes``: a call is <tool_call>{json}</tool_call> followed by its <tool_response> (through the
    chat template's turn change, special tokens kept or skipped); each way to get it wrong has its reason."""
    from arpo.protocol import DEFAULT_PROTOCOL
    from reward_fns.gate import score_with_gate

    protocol = DEFAULT_PROTOCOL.with_format("hermes")
    check = check_format(HERMES_GOOD, protocol)
    assert check.ok and check.answer == "1812", check.reason
    assert [(u.tool, u.result) for u in check.tool_uses] == [("search", "Founded 1812."), ("python", "1812")]
    assert check_format(HERMES_GOOD).tool_uses == ()  # read as tags: text without a call
    for case, (text, reason) in HERMES_BAD.items():
        assert check_format(text, protocol).reason == reason, case
    # tags inside a tool response are external text; an ARPO tag is plain text in a hermes run
    quoted = ("<think> a </think>" + hermes("search", {"query": "q"}, "page: <answer> <think> <search>")
              + "<search> not a call </search><answer>\\boxed{1}</answer>")
    assert check_format(quoted, protocol).ok
    # an unloaded tool name is well formed (the rollout answered with an error) but counts for no tool
    unknown = ("<think> a </think>" + hermes("browse", {"url": "x"}, "Error: unknown tool")
               + "<answer>\\boxed{1}</answer>")
    assert check_format(unknown, protocol).ok
    assert count_real_tool_calls(check_format(unknown, protocol).tool_uses, protocol=protocol) == \
        {"search": 0, "python": 0}
    assert [u.tool for u in lenient_tool_uses(HERMES_GOOD + "<think> unclosed", protocol)] == ["search", "python"]

    def grade(pred):
        return {"acc": float(pred == "1812"), "em": 0.0, "f1": 0.0}

    assert score_with_gate(HERMES_GOOD, grade, tool_bonus=0.1, protocol=protocol)["score"] == pytest.approx(1.1)
    assert score_with_gate(HERMES_GOOD, grade, tool_bonus=0.1)["score"] == 1.0  # read as tags: no call, no bonus


def test_the_run_protocol_takes_the_rollouts_call_format():
    import pickle

    from reward_fns.registry import build_compute_score, run_protocol

    tools = [{"class_name": "tests.rollout.fake_tools.FakeSearch"}]
    assert run_protocol({"tools": tools}).format == "tags"
    config = {"tools": tools, "actor_rollout_ref": {"rollout": {"arpo": {"tools": {"format": "hermes"}}}}}
    protocol = run_protocol(config)
    assert protocol.format == "hermes" and pickle.loads(pickle.dumps(protocol)) == protocol
    assert protocol != run_protocol({"tools": tools})
    assert build_compute_score(config).protocol == protocol
