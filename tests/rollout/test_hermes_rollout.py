"""The ARPO rollout with ``tools.format: hermes``: ``<tool_call>{json}</tool_call>`` calls run on the same tool
executor as tags, the result goes back as the chat template's tool message (masked), and entropy is measured and
forks are decided on the first tokens after it. Scripted engine, the small chat tokenizer with the real
Qwen2.5 template (arpo/chat_templates/qwen2.5.jinja): no model, a second or so in all."""

from __future__ import annotations

import math

import pytest

from arpo.chat_templates import load_tokenizer, set_chat_template
from arpo.rollout.arpo_rollout import ARPORollout
from arpo.rollout.call_format import INVALID_CALL, KEY, HermesCalls, tool_message_wrapper
from arpo.testing.scripted_engine import ScriptedEngine, build_chat_tokenizer
from tests.rollout.fake_tools import FakePython, FakeSearch
from tests.rollout.rollout_helpers import rows

CALL = ('<think> I should look it up. </think>\n<tool_call>\n'
        '{"name": "search", "arguments": {"query": "capital of France"}}\n</tool_call>')
FINAL = "<think> The result says Paris. </think> <answer> \\boxed{Paris} </answer>"
SEARCH_RESULT = "Doc 1: France of capital is known.\nDoc 2: about 3 things."
# what the Qwen2.5 template writes around a tool message after an assistant turn
QWEN_BEFORE = "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
QWEN_AFTER = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
HERMES = {"tools.format": "hermes", "n": 4, "initial_rollouts": 2, "return_entropy": True, "entropy.window": 4,
          "sampling.max_response_length": 200, "branching.timing": "paper", "branching.rule": "paper"}


class RecordingSearch(FakeSearch):
    """FakeSearch that keeps the arguments each hermes call gave it (through the executor's ``call``)."""

    def __init__(self):
        super().__init__()
        self.arguments: list[dict] = []

    def call(self, arguments: dict) -> str:
        self.arguments.append(dict(arguments))
        return super().call(arguments)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_chat_tokenizer(tmp_path_factory.mktemp("hermes-tok")), "qwen2.5")


def hermes_rollout(tok, replies, cfg=None, tools=None, n_prompts=1):
    engine = ScriptedEngine(tok, replies=replies)
    tools = tools if tools is not None else [RecordingSearch(), FakePython()]
    gen = ARPORollout(engine, tok, {**HERMES, **(cfg or {})}, tools=tools)
    schemas = [t.tool_schema for t in tools]
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Question {i}: the capital of France?"}],
                                       tools=schemas, add_generation_prompt=True, tokenize=False)
               for i in range(n_prompts)]
    try:
        batch = gen.generate([tok.encode(p, add_special_tokens=False) for p in prompts], seed=0)
    finally:
        gen.close()
    return batch, engine, gen


def test_the_tool_message_wrapper_comes_from_the_chat_template(tok):
    assert tool_message_wrapper(tok) == (QWEN_BEFORE, QWEN_AFTER)
    set_chat_template(tok, "llama3")
    try:
        assert tool_message_wrapper(tok) == (
            "<|eot_id|><|start_header_id|>tool<|end_header_id|>\n\n",
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
        # Qwen3 with thinking off opens every generation prompt with an empty think block, after a tool result too
        set_chat_template(tok, "qwen3")
        assert tool_message_wrapper(tok) == (QWEN_BEFORE, QWEN_AFTER)
        gen = ARPORollout(ScriptedEngine(tok), tok, {"tools.format": "hermes"}, tools=[FakeSearch()],
                          chat_template_kwargs={"enable_thinking": False})
        assert gen.call_format.after == QWEN_AFTER + "<think>\n\n</think>\n\n"
        gen.close()
        tok.chat_template = None
        with pytest.raises(ValueError, match=f"^{KEY}=hermes: the tokenizer has no chat template"):
            tool_message_wrapper(tok)
    finally:
        set_chat_template(tok, "qwen2.5")


def test_a_hermes_call_runs_the_tool_masks_its_response_and_forks_on_the_entropy_after_it(tok):
    batch, engine, gen = hermes_rollout(tok, [CALL, FINAL])
    search = gen.executor.tools["search"]
    # the engine stopped on </tool_call>; the JSON's arguments reached the tool's call()
    assert all(r.output_ids[-1] == tok.convert_tokens_to_ids("</tool_call>") for r in engine.requests
               if tok.decode(r.output_ids).endswith("</tool_call>"))
    assert search.arguments and all(a == {"query": "capital of France"} for a in search.arguments)
    rs = rows(batch)
    assert len(rs) == 4 and all(r["finish"] == "stop" for r in rs)
    m = batch.meta["metrics"]
    assert m["rollout/branches"] > 0
    assert m["rollout/tool_calls/search"] == sum(c["end"] > r["bpos"] for r in rs for c in r["calls"])
    for r in rs:
        (call,) = r["calls"]
        assert call["tool"] == "search" and not call["error"]
        start, end = call["start"], call["end"]
        assert tok.decode(r["ids"][:start]) == CALL
        assert tok.decode(r["ids"][start:end]) == QWEN_BEFORE + SEARCH_RESULT + QWEN_AFTER
        assert tok.decode(r["ids"][end:]) == FINAL + "<|im_end|>"
        # the response is masked out of the loss and has no entropy; the model's tokens all have it
        assert r["mask"][:r["length"]] == [1] * start + [0] * (end - start) + [1] * (r["length"] - end)
        assert [math.isnan(e) for e in r["entropy"]] == [m == 0 for m in r["mask"][:r["length"]]]
        # entropy measured on the first tokens after the response (flat there): the fork decision's ΔH
        assert call["entropy_after"] > call["entropy_before"]
        assert call["delta_entropy"] == pytest.approx(call["entropy_after"] - r["h0"])
        if r["kind"] == "branch":
            assert r["bpos"] == end and r["ids"][:end] == rs[r["parent"]]["ids"][:end]
    # the rewards' format gate reads the run's calls as well formed (as the reward manager decodes them)
    from reward_fns.gate import check_format

    assert gen.protocol.format == "hermes"
    for skip_special in (True, False):
        check = check_format(tok.decode(rs[0]["ids"], skip_special_tokens=skip_special), gen.protocol)
        assert check.ok and check.answer == "Paris", check
        assert [(u.tool, u.result) for u in check.tool_uses] == [("search", SEARCH_RESULT)]


@pytest.mark.parametrize("body, error", [
    ('{"name": "search", "arguments": {"query": }', "Error: the tool call is not valid JSON"),
    ('{"name": "browse", "arguments": {"url": "x"}}', "Error: unknown tool 'browse'"),
    ('{"name": "search", "arguments": {"q": "x"}}', "Error: the call of 'search' lacks the required argument(s) "
                                                    "['query']"),
    ('["search"]', "Error: the tool call has no string 'name'"),
])
def test_a_malformed_call_gets_an_error_text_as_its_result(tok, body, error):
    batch, _, gen = hermes_rollout(tok, [f"<think> go </think>\n<tool_call>\n{body}\n</tool_call>", FINAL],
                                   cfg={"n": 2, "initial_rollouts": 2})
    assert gen.executor.tools["search"].arguments == []  # nothing ran
    for r in rows(batch):
        (call,) = r["calls"]
        assert call["error"] and call["tool"] in ("search", INVALID_CALL)
        text = tok.decode(r["ids"][call["start"]: call["end"]])
        assert text.startswith(QWEN_BEFORE + error) and text.endswith(QWEN_AFTER)
        assert r["finish"] == "stop" and tok.decode(r["ids"][call["end"]:]) == FINAL + "<|im_end|>"
    assert batch.meta["metrics"]["rollout/tool_calls/malformed"] == 2


def test_a_close_tag_without_its_call_and_the_call_limit(tok):
    batch, _, _ = hermes_rollout(tok, ["<think> go </think> search it </tool_call>", FINAL],
                                 cfg={"n": 2, "initial_rollouts": 2})
    for r in rows(batch):
        text = tok.decode(r["ids"][r["calls"][0]["start"]: r["calls"][0]["end"]])
        assert text.startswith(QWEN_BEFORE + "Error: </tool_call> without a matching <tool_call>")
    # at the call limit the call is not run: the turn is closed with EOS (mask 0) and the trajectory ends
    batch, _, gen = hermes_rollout(tok, [CALL], cfg={"n": 2, "initial_rollouts": 2, "tools.call_limit": 1})
    for r in rows(batch):
        assert r["finish"] == "tool_limit" and len(r["calls"]) == 1
        assert r["ids"][-1] == tok.eos_token_id and r["mask"][r["length"] - 1] == 0


def test_function_names_reach_the_tool_by_its_registered_name(tok):
    class Lookup(RecordingSearch):
        name = "lookup"  # registered name; the schema's function name stays "search"

    tools = [Lookup(), FakePython()]
    calls = HermesCalls({t.name: t for t in tools}, tok)
    call = calls.parse('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', "</tool_call>")
    assert (call.tool, call.content) == ("lookup", {"query": "x"})
    batch, _, _ = hermes_rollout(tok, [CALL, FINAL], cfg={"n": 2, "initial_rollouts": 2}, tools=tools)
    assert [c["tool"] for r in rows(batch) for c in r["calls"]] == ["lookup", "lookup"]
    assert tools[0].arguments == [{"query": "capital of France"}] * 2


def test_hermes_needs_a_chat_template_at_start_up():
    from arpo.testing.scripted_engine import ToyTokenizer

    engine = ScriptedEngine(ToyTokenizer())
    with pytest.raises(ValueError, match=f"^{KEY}=hermes: the tokenizer has no chat template"):
        ARPORollout(engine, engine.tokenizer, {"tools.format": "hermes"}, tools=[FakeSearch()])
    with pytest.raises(ValueError, match=r"^actor_rollout_ref\.rollout\.arpo\.tools\.format='json': use one of"):
        ARPORollout(engine, engine.tokenizer, {"tools.format": "json"}, tools=[FakeSearch()])
