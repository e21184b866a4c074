"""SFT from trajectory files (arpo/data/sft_dataset.py): OpenAI messages and ShareGPT layouts in the tag protocol,
the loss mask token by token, short SFT runs on the tiny model, one-line errors for bad rows."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from arpo.config import ConfigError, load_config
from arpo.data.sft_dataset import (CallTargets, SFTDataError, detect_format, iter_trajectory_examples,
                                   load_trajectories)
from arpo.protocol import ToolProtocol

FIXTURES = Path(__file__).parent / "fixtures" / "sft"
MESSAGES = FIXTURES / "messages.jsonl"
SHAREGPT = FIXTURES / "sharegpt_arpo.json"
#: search and python as configs/tools/synthetic.yaml declares them (function name = tool name = tag)
TARGETS = CallTargets(ToolProtocol({"search": "search", "python": "python"}), {}, {"search": "query", "python": "code"})
SEARCH_CALL = "<think> I will search. </think> <search> Quuthdem country </search>"
SEARCH_RESULT = " <result>\nPage 1: Quuthdem: Quuthdem is a city in Konaesbrir.\n</result>"
ANSWER = " <think> I have the answer. </think> <answer> The final answer is \\boxed{ Konaesbrir } </answer>"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.suffix == ".jsonl" else \
        json.loads(path.read_text())


def test_layouts_are_detected_from_the_first_row(synthetic_dir):
    assert detect_format(MESSAGES) == "messages"
    assert detect_format(SHAREGPT) == "sharegpt"
    assert detect_format(synthetic_dir / "train.parquet") == "synthetic"
    assert detect_format(SHAREGPT, "messages") == "messages"  # the config key wins over detection


def test_tool_calls_become_tags_and_tool_turns_masked_results():
    first, python, two_calls, no_tool = load_trajectories(MESSAGES, "messages", TARGETS)
    assert [(s.text, s.is_model) for s in first.segments] == [(SEARCH_CALL, True), (SEARCH_RESULT, False),
                                                              (ANSWER, True)]
    assert [m["role"] for m in first.prompt] == ["system", "user"]
    # arguments as a dict are read by the schema's required argument, as a JSON string alike
    assert python.segments[0].text.endswith("<python> print(2024 - 1987) </python>")
    # two calls of one turn: each runs after the other's result, as the rollout runs one call per segment
    assert [s.is_model for s in two_calls.segments] == [True, False, True, False, True]
    assert two_calls.segments[2].text == " <python> print(2024 - 1987) </python>"
    assert two_calls.segments[3].text == " <result>\n37\n</result>"
    assert [s.is_model for s in no_tool.segments] == [True]


def test_sharegpt_layouts_match_the_messages_layout():
    messages = load_trajectories(MESSAGES, "messages", TARGETS)
    call_turn, inline, human_result, system_turn = load_trajectories(SHAREGPT, "sharegpt", TARGETS)
    # ARPO's own layout (results inline in the gpt value) and a human <result> turn render as the messages rows
    assert (inline.prompt, inline.segments) == (messages[0].prompt, messages[0].segments)
    assert (human_result.segments, human_result.prompt[1:]) == (messages[1].segments, messages[1].prompt[1:])
    assert human_result.prompt[0] == messages[1].prompt[0]  # the row-level system field is the system turn
    # a function_call turn is a call without thought text, its observation the masked result
    assert [(s.text, s.is_model) for s in call_turn.segments] == [("<search> Quuthdem country </search>", True),
                                                                  (SEARCH_RESULT, False), (ANSWER, True)]
    assert system_turn.prompt[0]["role"] == "system" and system_turn.segments == messages[3].segments


def test_loss_mask_token_by_token_against_the_chat_template(tok):
    (ids, mask), kind = next(iter_trajectory_examples(load_trajectories(MESSAGES, "messages", TARGETS), tok))
    assert kind == "messages"
    row = _rows(MESSAGES)[0]["messages"]
    prompt_text = tok.apply_chat_template(row[:2], add_generation_prompt=True, tokenize=False)
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    pieces = [(SEARCH_CALL, 1), (SEARCH_RESULT, 0), (ANSWER, 1)]
    expect_ids, expect_mask = list(prompt), [0] * len(prompt)
    for text, trained in pieces:
        piece = tok.encode(text, add_special_tokens=False)
        expect_ids += piece
        expect_mask += [trained] * len(piece)
    assert ids == expect_ids + [tok.eos_token_id]
    assert mask == expect_mask + [1]  # EOS trained: the model learns to stop after its answer
    # what is trained decodes to exactly the assistant's text and calls, what is masked to prompt and result
    assert tok.decode([i for i, m in zip(ids[:-1], mask[:-1]) if m]) == SEARCH_CALL + ANSWER
    assert tok.decode([i for i, m in zip(ids[len(prompt):], mask[len(prompt):]) if not m]) == SEARCH_RESULT
    assert tok.decode(ids[:len(prompt)]) == prompt_text


def test_function_names_come_from_the_tools_schemas():
    cfg = load_config("sft", [])
    targets = CallTargets.from_tools(cfg.tools)
    assert targets.call_text("search", '{"query": "q"}', "x") == "<search> q </search>"
    renamed = CallTargets.from_tools([{"class_name": "tools.search.tool.SearchTool", "tag": "lookup",
                                       "tool_schema": {"type": "function", "function": {
                                           "name": "web_search", "description": "",
                                           "parameters": {"type": "object", "properties": {"q": {}},
                                                          "required": ["q"]}}}}])
    assert renamed.call_text("web_search", {"q": "x", "top_k": 3}, "x") == "<lookup> x </lookup>"


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "bot", "content": "A"}]},
     "bad.jsonl[0].messages[1].role='bot' is not a role; use one of system, user, assistant, tool"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": "{\"x\": 1}"}}]},
                   {"role": "tool", "content": "1"}, {"role": "assistant", "content": "A"}]},
     "bad.jsonl[0].messages[1].tool_calls[0].function: calls 'calculator', which no loaded tool declares"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                   {"role": "tool", "content": "r"}, {"role": "assistant", "content": "B"}]},
     "bad.jsonl[0].messages[2]: a tool result with no tool call before it"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<search> q </search>"}]},
     "bad.jsonl[0].messages[1]: the trajectory ends on this call without its result"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "bot", "value": "A"}]},
     "bad.jsonl[0].conversations[1].from='bot' is not a ShareGPT role"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "function_call", "value": "search(q)"}]},
     "bad.jsonl[0].conversations[1].value: a function_call holds JSON"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                   {"role": "user", "content": "and?"}, {"role": "assistant", "content": "B"}]},
     "bad.jsonl[0].messages[2]: a user turn after the assistant began"),
    ({"messages": [{"role": "user", "content": {"text": "Q"}}, {"role": "assistant", "content": "A"}]},
     "bad.jsonl[0].messages[0].content: expected text"),
])
def test_a_bad_row_is_one_clear_error(tmp_path, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(SFTDataError) as e:
        load_trajectories(path, detect_format(path), TARGETS)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def _sft_cfg(tmp_path, model_dir, train_file, *extra):
    return load_config("sft", [f"actor_rollout_ref.model.path={model_dir}", f"sft.train_file={train_file}",
                               f"sft.out_dir={tmp_path / 'sft'}", "sft.batch_size=2", "sft.epochs=20",
                               "sft.max_steps=16", "sft.lr=3e-3", *extra])


def test_bad_data_format_and_bad_rows_stop_run_sft_before_the_model_loads(tmp_path, tiny_model_dir):
    from arpo.sft import run_sft

    with pytest.raises(ConfigError, match=r"^sft.data_format='chatml' is not valid; choose one of auto, "):
        run_sft(_sft_cfg(tmp_path, tiny_model_dir, MESSAGES, "sft.data_format=chatml"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "Q"}, {"role": "robot", "content": "A"}]}))
    with pytest.raises(ConfigError, match=r"role='robot' is not a role"):
        run_sft(_sft_cfg(tmp_path, tiny_model_dir, bad))
    assert not (tmp_path / "sft").exists()


@pytest.mark.parametrize("train_file, kind", [(MESSAGES, "messages"), (SHAREGPT, "sharegpt")])
def test_sft_from_a_trajectory_file_lowers_the_loss(tmp_path, tiny_model_dir, train_file, kind):
    from arpo.sft import run_sft

    out = run_sft(_sft_cfg(tmp_path, tiny_model_dir, train_file))
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["demos"] == {kind: 4, "too_long": 0}
    assert summary["steps"] == 16
    losses = summary["losses"]
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:2]) / 2, losses  # ~3.5 vs ~6.5 (log 610)
    assert (out / "model.safetensors").exists()


def test_rows_over_max_length_are_dropped_and_counted(tmp_path, tiny_model_dir, tok):
    from arpo.sft import run_sft

    lengths = [len(ids) for (ids, _), _ in iter_trajectory_examples(load_trajectories(MESSAGES, "messages", TARGETS),
                                                                     tok)]
    cut = f"sft.max_length={max(lengths) - 1}"
    out = run_sft(_sft_cfg(tmp_path, tiny_model_dir, MESSAGES, cut, "sft.max_steps=1"))
    assert json.loads((out / "sft_summary.json").read_text())["demos"] == {"messages": 3, "too_long": 1}


def test_a_parquet_file_of_messages_reads_as_the_jsonl(tmp_path):
    import pandas as pd

    rows = [r for i, r in enumerate(_rows(MESSAGES)) if i != 1]  # row 1's dict arguments: one type per parquet column
    pd.DataFrame(rows).to_parquet(tmp_path / "messages.parquet")
    assert detect_format(tmp_path / "messages.parquet") == "messages"
    from_parquet = load_trajectories(tmp_path / "messages.parquet", "messages", TARGETS)
    from_jsonl = load_trajectories(MESSAGES, "messages", TARGETS)
    assert [(t.prompt, t.segments) for t in from_parquet] == [(t.prompt, t.segments) for i, t in enumerate(from_jsonl)
                                                              if i != 1]


def test_synthetic_format_needs_the_generators_parquet():
    with pytest.raises(SFTDataError, match=r"sft.data_format=synthetic needs the parquet of `python -m arpo.data"):
        detect_format(MESSAGES, "synthetic")
