"""The named chat templates (arpo/chat_templates/) against the official formats' text, and the one config key
that picks them (actor_rollout_ref.model.custom_chat_template) from start-up validation to the dataset's prompts.

Rendered with the small test tokenizer (arpo.testing.scripted_engine): no download, milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from arpo.chat_templates import KEY, TEMPLATES, load_tokenizer, resolve_chat_template, set_chat_template
from arpo.config import ConfigError, load_config
from arpo.protocol import format_tool_result
from arpo.testing.scripted_engine import build_chat_tokenizer

SYSTEM_USER = [{"role": "system", "content": "You are a careful researcher."},
               {"role": "user", "content": "Who wrote Hamlet?"}]

# system + user with add_generation_prompt=True, as the official templates render it
EXPECTED_PROMPT = {
    "qwen2.5": ("<|im_start|>system\nYou are a careful researcher.<|im_end|>\n"
                "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3": ("<|im_start|>system\nYou are a careful researcher.<|im_end|>\n"
              "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a careful researcher.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nWho wrote Hamlet?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}

# an ARPO conversation: the tags inside the turns must come out exactly as written
USER = "Answer with <answer>...</answer>; search with <search>query</search>."
CALL = "<think> I should look it up. </think> <search> author of Hamlet </search>"
RESULT = format_tool_result("Hamlet is a tragedy by William Shakespeare.")
FINAL = "<think> The result says Shakespeare. </think> <answer> \\boxed{Shakespeare} </answer>"
CONVERSATION = [{"role": "system", "content": "You are a careful researcher."}, {"role": "user", "content": USER},
                {"role": "assistant", "content": CALL}, {"role": "tool", "content": RESULT},
                {"role": "assistant", "content": FINAL}]
EXPECTED_CONVERSATION = {
    "qwen2.5": (f"<|im_start|>system\nYou are a careful researcher.<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
                f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
                f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
                f"<|im_start|>assistant\n{FINAL}<|im_end|>\n"),
    # Qwen3 rewrites the think block of each turn after the last user query as <think>\n...\n</think>\n\n and keeps
    # the rest of the turn (the tool tags, the answer) as written
    "qwen3": (f"<|im_start|>system\nYou are a careful researcher.<|im_end|>\n<|im_start|>user\n{USER}<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n I should look it up. \n</think>\n\n"
              " <search> author of Hamlet </search><|im_end|>\n"
              f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n<think>\n The result says Shakespeare. \n</think>\n\n"
              " <answer> \\boxed{Shakespeare} </answer><|im_end|>\n"),
    # Llama 3 trims each message's content
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a careful researcher.<|eot_id|>"
               f"<|start_header_id|>user<|end_header_id|>\n\n{USER}<|eot_id|>"
               f"<|start_header_id|>assistant<|end_header_id|>\n\n{CALL}<|eot_id|>"
               f"<|start_header_id|>tool<|end_header_id|>\n\n{RESULT.strip()}<|eot_id|>"
               f"<|start_header_id|>assistant<|end_header_id|>\n\n{FINAL}<|eot_id|>"),
}

QWEN_TOOLS_BLOCK = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "search", "description": "Web search."}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')
SEARCH_SCHEMA = {"type": "function", "function": {"name": "search", "description": "Web search."}}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return Path(build_chat_tokenizer(tmp_path_factory.mktemp("chat-tok")))


@pytest.fixture()
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def render(tokenizer, name: str, messages: list[dict], **kwargs) -> str:
    set_chat_template(tokenizer, name)
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_system_and_user_prompt_renders_the_official_text(tokenizer, name):
    assert render(tokenizer, name, SYSTEM_USER, add_generation_prompt=True) == EXPECTED_PROMPT[name]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_arpo_tags_pass_through_the_user_assistant_and_tool_turns(tokenizer, name):
    assert render(tokenizer, name, CONVERSATION) == EXPECTED_CONVERSATION[name]


def test_qwen_defaults_and_hermes_tools_block(tokenizer):
    user = SYSTEM_USER[1:]
    qwen25_system = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    tail = "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n"
    assert render(tokenizer, "qwen2.5", user, add_generation_prompt=True) == qwen25_system + "<|im_end|>\n" + tail
    assert render(tokenizer, "qwen2.5", user, add_generation_prompt=True, tools=[SEARCH_SCHEMA]) == \
        qwen25_system + QWEN_TOOLS_BLOCK + tail
    assert render(tokenizer, "qwen3", user, add_generation_prompt=True) == tail  # Qwen3: no default system prompt
    assert render(tokenizer, "qwen3", SYSTEM_USER, add_generation_prompt=True, tools=[SEARCH_SCHEMA]) == \
        "<|im_start|>system\nYou are a careful researcher." + QWEN_TOOLS_BLOCK + tail
    # hermes tool calls in an assistant turn
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "Hamlet"}}}]}
    assert render(tokenizer, "qwen2.5", [*user, call]).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "Hamlet"}}\n</tool_call>'
        "<|im_end|>\n")


def test_qwen3_enable_thinking_false_opens_the_answer_with_an_empty_think_block(tokenizer):
    off = render(tokenizer, "qwen3", SYSTEM_USER, add_generation_prompt=True, enable_thinking=False)
    assert off == EXPECTED_PROMPT["qwen3"] + "<think>\n\n</think>\n\n"
    assert render(tokenizer, "qwen3", SYSTEM_USER, add_generation_prompt=True, enable_thinking=True) == \
        EXPECTED_PROMPT["qwen3"]


def test_own_jinja_text_or_file_and_null(tokenizer, tmp_path):
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert resolve_chat_template(own) == own
    path = tmp_path / "mine.jinja"
    path.write_text(own)
    assert resolve_chat_template(str(path)) == own
    shipped = tokenizer.chat_template
    assert resolve_chat_template(None) is None and set_chat_template(tokenizer, None).chat_template == shipped
    assert render(tokenizer, own, SYSTEM_USER) == "[system] You are a careful researcher.\n[user] Who wrote Hamlet?\n"


def test_every_named_template_ships_as_package_data():
    import tomllib

    globs = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["arpo"]
    for name, file in TEMPLATES.items():
        assert f"chat_templates/{file}" in [g.replace("*.jinja", file) for g in globs], name
        assert resolve_chat_template(name).strip()


def _config(tokenizer_dir: Path, tmp_path: Path, *overrides: str):
    import pandas as pd

    data = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": [SYSTEM_USER] * 4, "data_source": ["synthetic"] * 4}).to_parquet(data)
    return load_config("arpo_trainer", [f"actor_rollout_ref.model.path={tokenizer_dir}", f"data.train_files={data}",
                                        f"data.val_files={data}", *overrides])


def test_the_config_key_reaches_the_datasets_prompts(tokenizer_dir, tmp_path):
    from arpo.chat_templates import tokenizer_for
    from arpo.data.rl_dataset import create_rl_dataloaders

    cfg = _config(tokenizer_dir, tmp_path, f"{KEY}=llama3")
    tokenizer = tokenizer_for(cfg)
    train, _ = create_rl_dataloaders(cfg, tokenizer)
    prompt = tokenizer.decode(train.dataset.rows[0]["raw_prompt_ids"])
    assert prompt == EXPECTED_PROMPT["llama3"]  # the test tokenizer has no BOS token: Llama 3's is written

    cfg = _config(tokenizer_dir, tmp_path, f"{KEY}=qwen3", "+data.apply_chat_template_kwargs.enable_thinking=false")
    tokenizer = tokenizer_for(cfg)
    train, _ = create_rl_dataloaders(cfg, tokenizer)
    assert tokenizer.decode(train.dataset.rows[0]["raw_prompt_ids"]) == \
        EXPECTED_PROMPT["qwen3"] + "<think>\n\n</think>\n\n"


def test_an_unknown_name_is_one_start_up_error_naming_the_key_and_the_choices(tokenizer_dir, tmp_path):
    from arpo.main_arpo import validate_config

    cfg = _config(tokenizer_dir, tmp_path, f"{KEY}=qwen4")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{KEY}='qwen4' is not a template: choose one of qwen2.5, qwen3, llama3")
    assert "null" in message and ".jinja" in message
    validate_config(_config(tokenizer_dir, tmp_path, f"{KEY}=qwen3"))  # a known name passes


def test_sft_and_eval_check_the_key_before_any_work(tmp_path):
    from arpo.evaluation.evaluate import evaluate
    from arpo.sft import run_sft

    for entry, cfg in ((run_sft, load_config("sft", [f"{KEY}=chatml"])),
                       (evaluate, load_config("eval", [f"{KEY}=chatml"]))):
        with pytest.raises(ConfigError, match=f"^{KEY}='chatml' is not a template"):
            entry(cfg)


def test_the_pipeline_gives_sft_and_rl_the_same_template():
    from arpo.pipeline import overrides_for_stage

    override = f"{KEY}=qwen2.5"
    assert overrides_for_stage("sft", ["trainer.total_training_steps=2", override]) == [override]
    assert overrides_for_stage("arpo_trainer", [override]) == [override]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_agent_loops_render_tool_turns_incrementally_with_every_named_template(tokenizer_dir, name):
    from arpo.chat_templates.templater import ChatTemplater

    tokenizer = load_tokenizer(tokenizer_dir, name)
    if name == "llama3":  # Llama 3.1 Instruct's EOS is its end-of-turn token
        tokenizer.eos_token = "<|eot_id|>"
    templater = ChatTemplater(tokenizer, [SEARCH_SCHEMA])
    after_turn = templater.message_ids([{"role": "tool", "content": RESULT}], after=[tokenizer.eos_token_id])
    expected = {"qwen2.5": f"\n<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n",
                "llama3": f"<|start_header_id|>tool<|end_header_id|>\n\n{RESULT.strip()}<|eot_id|>"
                          "<|start_header_id|>assistant<|end_header_id|>\n\n"}
    assert tokenizer.decode(after_turn) == expected.get(name, expected["qwen2.5"])


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_both_rollout_paths_give_a_tool_result_the_same_text_closing_the_turn_as_the_template_does(tokenizer_dir,
                                                                                                   name):
    """The ARPO rollout's hermes wrapper is the agent loops' rendering of a tool message after a turn that stopped
    on ``</tool_call>``; the turn is closed with the template's own end-of-turn text, also where the tokenizer's
    EOS is another token (this tokenizer's ``<|im_end|>`` under the Llama 3 template) and a sampled EOS does not
    close the turn."""
    from arpo.chat_templates.templater import ChatTemplater
    from arpo.rollout.call_format import tool_message_wrapper

    tokenizer = load_tokenizer(tokenizer_dir, name)
    templater = ChatTemplater(tokenizer, [SEARCH_SCHEMA])
    result = "Hamlet is a tragedy by William Shakespeare."
    close = {"llama3": "<|eot_id|>"}.get(name, "<|im_end|>\n")
    assert templater.turn_close == close
    before, after = tool_message_wrapper(tokenizer)
    for sampled in ("</tool_call>", tokenizer.eos_token):
        ids = templater.message_ids([{"role": "tool", "content": result}],
                                    after=tokenizer.encode(sampled, add_special_tokens=False))
        if name == "llama3" or sampled == "</tool_call>":  # the turn is not closed yet: the whole close comes first
            assert tokenizer.decode(ids) == before + result + after and before.startswith(close)
        else:  # the model sampled ChatML's end-of-turn token: only the newline after it is added
            assert tokenizer.decode(ids) == before[len(tokenizer.eos_token):] + result + after
