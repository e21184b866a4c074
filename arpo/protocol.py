"""The ARPO tag protocol: one place that knows the tags, the result wrapper and the answer format.

The model thinks in ``<think>…</think>``, calls tools with ``<search>query</search>`` or
``<python>code</python>``, receives tool output appended by the rollout as `` <result>\\n…\\n</result>``
(masked out of the loss), and ends with ``<answer>… \\boxed{…} </answer>``. The rollout, the SFT
demonstrations, the rewards and the evaluation all import from here so the protocol cannot drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

#: tool tag name -> (open tag, close tag). The close tag is the engine's stop string for that tool.
TOOL_TAGS: dict[str, tuple[str, str]] = {
    "search": ("<search>", "</search>"),
    "python": ("<python>", "</python>"),
}

#: Every tag the tiny tokenizer keeps as one token (real checkpoints split them; nothing depends on it).
ALL_TAGS: list[str] = [
    THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESULT_OPEN, RESULT_CLOSE,
    *(t for pair in TOOL_TAGS.values() for t in pair),
]


def stop_strings(tool_names: list[str] | None = None) -> list[str]:
    """Close tags that stop generation so the rollout can run the tool call."""
    names = list(TOOL_TAGS) if tool_names is None else tool_names
    unknown = [n for n in names if n not in TOOL_TAGS]
    if unknown:
        raise ValueError(f"unknown tool tag(s) {unknown}; known: {sorted(TOOL_TAGS)}")
    return [TOOL_TAGS[n][1] for n in names]


def format_tool_result(text: str) -> str:
    """The exact text appended after a tool call (ARPO's format, leading space included)."""
    return f" {RESULT_OPEN}\n{text}\n{RESULT_CLOSE}"


@dataclass(frozen=True)
class MalformedCall:
    """A close tag without its open tag: no call to run; the trajectory gets an error text as its result."""

    tool: str

    def error_text(self) -> str:
        open_tag, close_tag = TOOL_TAGS[self.tool]
        return f"Error: malformed tool call: {close_tag} without a matching {open_tag}. Write {open_tag}...{close_tag}."


@dataclass(frozen=True)
class ToolCall:
    """A tool call found at the end of a generated segment."""

    tool: str
    content: str


def parse_trailing_tool_call(segment: str) -> ToolCall | None:
    """Return the tool call a segment ends with (the engine stopped on its close tag), else None.

    Only the last open tag before the trailing close tag counts, so earlier text (or an earlier call
    whose result is already in the context) is never re-executed.
    """
    stripped = segment.rstrip()
    for name, (open_tag, close_tag) in TOOL_TAGS.items():
        if stripped.endswith(close_tag):
            start = stripped.rfind(open_tag, 0, len(stripped) - len(close_tag))
            if start < 0:
                return None
            return ToolCall(name, stripped[start + len(open_tag): len(stripped) - len(close_tag)].strip())
    return None


_BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` with balanced braces, or None."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i, depth = start + len(_BOXED), 1
    out = []
    while i < len(text):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.S)


def extract_answer(text: str) -> str | None:
    """The final answer: the boxed content inside the last ``<answer>`` block (or anywhere if none)."""
    blocks = _ANSWER_RE.findall(text)
    scope = blocks[-1] if blocks else text
    return extract_boxed(scope)
