"""System prompts for evaluation, by ``eval.prompt_type``.

ARPO's evaluation (``evaluation/src/prompt_manager.py`` of the release) gives every benchmark the same
system prompt, chosen once per run: ``code_search`` (search + python, the wording of the RL training set)
for the paper's tool-integrated results; ``search`` and ``math`` name one tool only; ``base`` no tool.
The user turn is the bare question. ``synthetic`` is this project's condensed prompt
(:data:`arpo.data.synthetic.SYSTEM_PROMPT`), the one the tiny SFT model was trained on. ``tools`` is written from
the run's own tools (:func:`describe_tools`): each one's tag, its schema's description and argument, in the
``code_search`` layout, so a model evaluated with a tool of your own is told about it.

The ``code_search`` text equals the system prompt of ARPO's training parquet except for one character:
that file has ``\\x08oxed`` (an unescaped ``\\b``), the evaluation code a real ``\\boxed``; we use the latter.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

_INTRO = ("You are a helpful assistant that can solve the given question step by step with the help of {tools}. "
          "Given a question, you need to first think about the reasoning process in the mind and then provide "
          "the answer. ")
_FORMAT = ("The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags "
           "respectively{search_tags}. ")
_SEARCH_TAGS = ", and the search query and result are enclosed within <search> </search> and <result> </result> " \
               "tags respectively"
_THINK = "<think> This is the reasoning process. </think> "
_SEARCH_EXAMPLE = "<search> search query here </search> <result> search result here </result> "
_PYTHON_EXAMPLE = "<python> python code here </python> <result> python interpreter result here </result> "
_ANSWER = ("<answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In the last part of the answer, "
           "the final exact answer is enclosed within \\boxed{} with latex format.")


def _prompt(tools: str, during: str, search: bool, python: bool) -> str:
    example = "For example, "
    if search:
        example += _THINK + _SEARCH_EXAMPLE
    if python:
        example += _THINK + _PYTHON_EXAMPLE
    example += _THINK + _ANSWER
    return (_INTRO.format(tools=tools) + during
            + _FORMAT.format(search_tags=_SEARCH_TAGS if search else "") + example)


class ToolDescription(NamedTuple):
    """What the ``tools`` prompt says about one tool: the tag the model writes, what it does, what goes inside."""

    tag: str
    description: str
    argument: str


def describe_tools(source: Any) -> list[ToolDescription]:
    """The tools of ``source`` (the ``tools`` config, as :func:`tools.registry.load_tools` takes it) as the
    ``tools`` prompt names them: built once to read their schemas, then closed."""
    from tools.registry import load_tools

    registry = load_tools(source)
    try:
        out = []
        for name in registry.protocol.names:
            function = registry[name].tool_schema["function"]
            # the tag holds one text: a single required argument names it, several are written as one input
            required = function.get("parameters", {}).get("required") or []
            argument = str(required[0]) if len(required) == 1 else "input"
            out.append(ToolDescription(registry.protocol.tags[name], str(function.get("description", name)).strip(),
                                       argument))
        return out
    finally:
        registry.close()


def _tools_prompt(tools: Sequence[ToolDescription]) -> str:
    listed = "; ".join(f"<{t.tag}> {t.argument} </{t.tag}>: {t.description.rstrip('.')}" for t in tools)
    examples = "".join(f"{_THINK}<{t.tag}> {t.argument} here </{t.tag}> <result> {t.tag} result here </result> "
                       for t in tools)
    return (_INTRO.format(tools="these tools: " + listed)
            + "During thinking, you can call a tool by writing its tag; its result is returned inside <result> "
              "</result>. "
            + _FORMAT.format(search_tags="") + "For example, " + examples + _THINK + _ANSWER)


def _synthetic() -> str:
    from arpo.data.synthetic import SYSTEM_PROMPT

    return SYSTEM_PROMPT


PROMPT_TYPES = ("code_search", "search", "math", "base", "synthetic", "tools")


def system_prompt(prompt_type: str, tools: Sequence[ToolDescription] | None = None) -> str:
    """The system prompt for ``prompt_type`` (one of :data:`PROMPT_TYPES`); ``tools`` (:func:`describe_tools`)
    for ``tools``."""
    if prompt_type == "code_search":
        return _prompt(
            "the wikipedia search tool and python interpreter tool",
            "During thinking, you can invoke the wikipedia search tool to search and python interpreter tool to "
            "calculate the math problem for fact information about specific topics if needed. ",
            search=True, python=True)
    if prompt_type == "search":
        return _prompt(
            "the wikipedia search tool",
            "During thinking, you can invoke the wikipedia search tool to search for fact information about "
            "specific topics if needed. ",
            search=True, python=False)
    if prompt_type == "math":
        return _prompt(
            "the python interpreter tool",
            "During thinking, you can invoke the python interpreter tool to calculate the math problem for fact "
            "information about specific topics if needed. ",
            search=False, python=True)
    if prompt_type == "base":
        return _prompt("", "", search=False, python=False).replace(" with the help of . ", ". ")
    if prompt_type == "synthetic":
        return _synthetic()
    if prompt_type == "tools":
        if not tools:
            raise ValueError("eval.prompt_type=tools describes the run's tools, and none were given")
        return _tools_prompt(tools)
    raise ValueError(f"eval.prompt_type={prompt_type!r}: choose one of {list(PROMPT_TYPES)}")
