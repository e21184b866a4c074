"""Find tool calls in a generated turn: hermes JSON calls and ARPO's tag calls.

A parser never drops a malformed call silently: it reports it as a :class:`ParsedCall` with ``error``
set, and the loop sends that error back to the model as the call's result (verl's ToolAgentLoop ends
the conversation instead, which teaches the model nothing about its mistake).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from arpo.protocol import DEFAULT_PROTOCOL, HERMES_CALL_CLOSE, HERMES_CALL_OPEN, ToolProtocol

HERMES_OPEN, HERMES_CLOSE = HERMES_CALL_OPEN, HERMES_CALL_CLOSE
_HERMES_RE = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)
HERMES_HINT = 'write <tool_call>{"name": "<function name>", "arguments": {...}}</tool_call>'


@dataclass
class ParsedCall:
    """One tool call; ``error`` is set (and the call is not run) when it could not be understood."""

    name: str
    #: function arguments (hermes) or {"content": text} (ARPO tags).
    arguments: dict[str, Any] = field(default_factory=dict)
    #: the raw text inside an ARPO tag (None for hermes calls).
    text: str | None = None
    error: str | None = None


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` anywhere in the turn (Qwen's format)."""

    stop_strings: tuple[str, ...] = ()

    def __init__(self, tool_names: list[str]):
        self.tool_names = sorted(tool_names)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = [self.parse_one(body) for body in _HERMES_RE.findall(text)]
        if text.count(HERMES_OPEN) > text.count(HERMES_CLOSE):
            calls.append(ParsedCall("", error=f"Error: a tool call was opened but never closed; {HERMES_HINT}."))
        return calls

    def parse_one(self, body: str) -> ParsedCall:
        """One call's JSON body (the text between the tags); the ARPO rollout's hermes format parses here too."""
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as err:
            return ParsedCall("", error=f"Error: the tool call is not valid JSON ({err.msg}); {HERMES_HINT}.")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedCall("", error=f"Error: the tool call has no string 'name'; {HERMES_HINT}.")
        name, args = obj["name"], obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ParsedCall(name, error=f"Error: the arguments of '{name}' are not a JSON object.")
        if not isinstance(args, dict):
            return ParsedCall(name, error=f"Error: the arguments of '{name}' must be a JSON object.")
        if name not in self.tool_names:
            return ParsedCall(name, args, error=f"Error: unknown tool '{name}'; available tools: {self.tool_names}.")
        return ParsedCall(name, args)


class ArpoTagParser:
    """ARPO's tag calls (``<search>query</search>``, ``<python>code</python>``, or the tags of ``protocol``, the
    loaded tools'): one call ending the segment.

    Generation stops on the close tag (the stop strings below), so a call can only be the segment's tail.
    """

    def __init__(self, tool_names: list[str], protocol: ToolProtocol | None = None):
        # without a protocol: the default tags of the named tools that have one (search, python)
        self.protocol = protocol or ToolProtocol({n: t for n, t in DEFAULT_PROTOCOL.tags.items() if n in tool_names})
        self.tool_names = sorted(self.protocol.names)
        self.stop_strings = tuple(self.protocol.stop_strings(self.tool_names))

    def parse(self, text: str) -> list[ParsedCall]:
        stripped = text.rstrip()
        closing = next((name for name, (_, close) in self.protocol.pairs().items() if stripped.endswith(close)), None)
        if closing is None:
            return []
        call = self.protocol.parse_trailing_call(stripped)
        if call is None:
            open_tag, close_tag = self.protocol.pair(closing)
            return [ParsedCall(closing, error=f"Error: {close_tag} without a matching {open_tag}; "
                                              f"write {open_tag}...{close_tag}.")]
        if call.tool not in self.tool_names:
            return [ParsedCall(call.tool, text=call.content,
                               error=f"Error: tool '{call.tool}' is not available; available: {self.tool_names}.")]
        if not call.content:
            return [ParsedCall(call.tool, text="", error=f"Error: empty <{call.tool}> call.")]
        return [ParsedCall(call.tool, {"content": call.content}, text=call.content)]


def make_tool_parser(fmt: str, tool_names: list[str],
                     protocol: ToolProtocol | None = None) -> HermesToolParser | ArpoTagParser:
    """``protocol``: the loaded tools' tags, for ``arpo_tags`` (default: search and python's)."""
    if fmt == "hermes":
        return HermesToolParser(tool_names)
    if fmt == "arpo_tags":
        return ArpoTagParser(tool_names, protocol)
    raise ValueError(f"multi_turn.format={fmt!r}: use 'hermes' or 'arpo_tags'")
