"""The ARPO tag protocol: one place that knows the tags, the result wrapper and the answer format.

The model thinks in ``<think>…</think>``, calls tools with their tags (``<search>query</search>``,
``<python>code</python>``, or any tag a loaded tool declares: :class:`ToolProtocol`), receives tool output
appended by the rollout as `` <result>\\n…\\n</result>`` (masked out of the loss), and ends with
``<answer>… \\boxed{…} </answer>``. The rollout, the SFT demonstrations, the rewards and the evaluation all
import from here so the protocol cannot drift. With ``tools.format: hermes`` (:data:`CALL_FORMATS`) the calls are
Qwen's ``<tool_call>`` JSON and the results the chat template's ``<tool_response>`` turn instead
(:mod:`arpo.rollout.call_format`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESULT_OPEN, RESULT_CLOSE = "<result>", "</result>"

#: Tags the protocol itself uses: no tool may declare one of these names.
RESERVED_TAGS = ("think", "answer", "result")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def tag_pair(tag: str) -> tuple[str, str]:
    """The open and close tag of a tag name: ``convert`` -> (``<convert>``, ``</convert>``)."""
    return f"<{tag}>", f"</{tag}>"


#: How the model calls tools on the ARPO rollout (``actor_rollout_ref.rollout.arpo.tools.format``): ``tags``
#: (``<search>q</search>`` -> `` <result>…</result>``) or ``hermes`` (``<tool_call>{json}</tool_call>`` -> the
#: chat template's tool message, ``<tool_response>…</tool_response>`` in a user turn for Qwen).
CALL_FORMATS = ("tags", "hermes")
HERMES_CALL_OPEN, HERMES_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class MalformedCall:
    """A call that cannot run (a close tag without its open tag; a hermes call with bad JSON, an unknown tool or
    a missing argument): the trajectory gets an error text as its result, so the model sees its mistake."""

    tool: str
    open_tag: str
    close_tag: str
    #: the error text when it is not the missing-open-tag one (hermes calls)
    message: str | None = None

    def error_text(self) -> str:
        if self.message is not None:
            return self.message
        return (f"Error: malformed tool call: {self.close_tag} without a matching {self.open_tag}. "
                f"Write {self.open_tag}...{self.close_tag}.")


@dataclass(frozen=True)
class ToolCall:
    """A tool call found at the end of a generated segment (``tool``: the tool's name, not its tag).
    ``content``: a tag's text, or a hermes call's arguments (the executor calls ``call`` for a dict)."""

    tool: str
    content: str | dict[str, Any]


class ToolProtocol:
    """Which tag calls which tool: tool name -> tag name, built from the loaded tools (:meth:`from_tools`).

    The one source of the tool tags: the rollout's stop strings and call parsing, the format gate and the
    entropy probe all read them from here. A tool's tag is its ``tag`` attribute (a tool YAML entry's ``tag:``
    sets it), else its ``name``; so ``search`` and ``python`` keep ``<search>`` and ``<python>``.
    """

    def __init__(self, tags: Mapping[str, str], format: str = "tags"):
        """``tags``: tool name -> tag name, in load order (``tools[i]`` in errors is the i-th tool); ``format``:
        how the model writes calls (:data:`CALL_FORMATS`), so the format gate reads the run's calls."""
        if format not in CALL_FORMATS:
            raise ValueError(f"tool call format {format!r}: use one of {list(CALL_FORMATS)}")
        described = ", ".join(f"{name} <{tag}>" for name, tag in tags.items()) or "none"
        first: dict[str, int] = {}
        for i, (name, tag) in enumerate(tags.items()):
            where = f"tools[{i}].tag ({name})"
            if not isinstance(tag, str) or not _IDENTIFIER.fullmatch(tag):
                raise ValueError(f"{where}: {tag!r} is not a simple identifier (letters, digits and _, not starting "
                                 f"with a digit); loaded tools: {described}")
            if tag in RESERVED_TAGS:
                raise ValueError(f"{where}: {tag!r} is reserved by the protocol ({', '.join(RESERVED_TAGS)}); "
                                 f"loaded tools: {described}")
            if tag in first:
                raise ValueError(f"{where}: {tag!r} is already the tag of tools[{first[tag]}]; each tool needs its "
                                 f"own tag; loaded tools: {described}")
            first[tag] = i
        #: read-only: the protocol is hashed (the format gate caches its patterns by protocol)
        self.tags: Mapping[str, str] = MappingProxyType(dict(tags))
        #: "name <tag>, ..." for error messages
        self.described = described
        self.format = format

    def with_format(self, format: str) -> "ToolProtocol":
        """The same tools with calls written in ``format`` (``tags`` or ``hermes``)."""
        return ToolProtocol(self.tags, format)

    @classmethod
    def from_tools(cls, tools: Mapping[str, Any] | Iterable[Any]) -> "ToolProtocol":
        """The protocol of loaded tools (a list, or a mapping such as a registry or an executor's tools).

        A mapping may hold one tool under several keys (its name and its function name): it counts once,
        under the key equal to its ``name`` when there is one (the key the executor runs it by)."""
        if isinstance(tools, Mapping):
            by_object: dict[int, tuple[str, Any]] = {}
            for key, tool in tools.items():
                if id(tool) not in by_object or key == getattr(tool, "name", None):
                    by_object[id(tool)] = (key, tool)
            named = list(by_object.values())
        else:
            named = [(tool.name, tool) for tool in tools]
        return cls({name: getattr(tool, "tag", "") or name for name, tool in named})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToolProtocol) and self.tags == other.tags and self.format == other.format

    def __hash__(self) -> int:
        return hash((tuple(self.tags.items()), self.format))

    def __repr__(self) -> str:
        return f"ToolProtocol({self.described})" if self.format == "tags" else \
            f"ToolProtocol({self.described}; format {self.format})"

    def __reduce__(self) -> tuple:
        return ToolProtocol, (dict(self.tags), self.format)  # pickles for reward worker processes

    @property
    def names(self) -> list[str]:
        """The tool names, in load order."""
        return list(self.tags)

    def pair(self, name: str) -> tuple[str, str]:
        """(open tag, close tag) of a tool; the close tag is the engine's stop string for that tool."""
        if name not in self.tags:
            raise ValueError(f"no loaded tool is named {name!r}, so it has no tag; loaded tools: {self.described}")
        return tag_pair(self.tags[name])

    def pairs(self) -> dict[str, tuple[str, str]]:
        """Tool name -> (open tag, close tag), for every tool."""
        return {name: tag_pair(tag) for name, tag in self.tags.items()}

    def tool_of_tag(self, tag: str) -> str:
        """The name of the tool a tag calls (ValueError naming the loaded tags when none declares it)."""
        for name, own in self.tags.items():
            if own == tag:
                return name
        raise ValueError(f"tag {tag!r}: no loaded tool declares it; loaded tools: {self.described}")

    def all_tags(self) -> list[str]:
        """Every open and close tag, tool by tool."""
        return [t for pair in self.pairs().values() for t in pair]

    def stop_strings(self, tool_names: Iterable[str] | None = None) -> list[str]:
        """Close tags that stop generation so the rollout can run the tool call (all tools by default)."""
        return [self.pair(n)[1] for n in (self.names if tool_names is None else tool_names)]

    def malformed(self, name: str) -> MalformedCall:
        return MalformedCall(name, *self.pair(name))

    def parse_trailing_call(self, segment: str) -> ToolCall | None:
        """Return the tool call a segment ends with (the engine stopped on its close tag), else None.

        Only the last open tag before the trailing close tag counts, so earlier text (or an earlier call
        whose result is already in the context) is never re-executed.
        """
        stripped = segment.rstrip()
        for name, (open_tag, close_tag) in self.pairs().items():
            if stripped.endswith(close_tag):
                start = stripped.rfind(open_tag, 0, len(stripped) - len(close_tag))
                if start < 0:
                    return None
                return ToolCall(name, stripped[start + len(open_tag): len(stripped) - len(close_tag)].strip())
        return None


#: The protocol of ARPO's own tools, where no tool list is given (rewards, SFT demonstrations, the tiny
#: tokenizer's added tokens). Loaded tools build their own with :meth:`ToolProtocol.from_tools`.
DEFAULT_PROTOCOL = ToolProtocol({"search": "search", "python": "python"})

#: Every tag the tiny tokenizer keeps as one token (real checkpoints split them; nothing depends on it).
ALL_TAGS: list[str] = [
    THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, RESULT_OPEN, RESULT_CLOSE, *DEFAULT_PROTOCOL.all_tags(),
]


def stop_strings(tool_names: list[str] | None = None) -> list[str]:
    """The default protocol's stop strings (see :meth:`ToolProtocol.stop_strings`)."""
    return DEFAULT_PROTOCOL.stop_strings(tool_names)


def format_tool_result(text: str) -> str:
    """The exact text appended after a tool call (ARPO's format, leading space included)."""
    return f" {RESULT_OPEN}\n{text}\n{RESULT_CLOSE}"


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
