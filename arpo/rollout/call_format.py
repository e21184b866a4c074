"""How the model calls a tool on the ARPO rollout, and how the result goes back: ``tools.format``.

``tags`` (ARPO's): the model writes ``<search>query</search>``; the engine stops on the close tag, the text goes
to the tool's ``call_text`` and `` <result>\\n…\\n</result>`` is appended inside the same assistant turn.

``hermes`` (Qwen's function calling): the model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
the engine stops on ``</tool_call>``, the JSON is parsed by the agent loop's own hermes parser, the arguments go to
the tool's ``call`` (the same :class:`~arpo.rollout.tool_executor.ToolExecutor` as tags: retries, timeouts,
error texts, truncation), and the result is appended as the tokenizer's chat template renders a ``tool``
message after an assistant turn. For Qwen2.5 that closes the turn and opens the next one::

    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n…\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

Either way those tokens are tool-result tokens (``response_mask`` 0), and the tree measures entropy and
forks on the first tokens generated after them, whatever the wrapper looks like. A call that cannot run (bad
JSON, an unknown tool, a missing required argument, a close tag without its open tag) gets an error text as
its result, so the model sees its mistake and the rollout goes on.
"""

from __future__ import annotations

from typing import Any, Mapping

from arpo.agent_loop.tool_parsers import HERMES_HINT, HermesToolParser
from arpo.chat_templates.templater import ChatTemplater
from arpo.protocol import HERMES_CALL_CLOSE, HERMES_CALL_OPEN, MalformedCall, ToolCall, ToolProtocol, \
    format_tool_result
from arpo.rollout.config import CONFIG_PREFIX, ARPORolloutConfig

KEY = f"{CONFIG_PREFIX}.tools.format"
#: the record's and metrics' tool name of a hermes call that names no loaded tool (or none at all)
INVALID_CALL = "invalid_call"
# markers rendered through the chat template to find what it writes around a tool message
_RESULT_MARK = "ARPO_HERMES_RESULT_9b1f"


class TagCalls:
    """``tools.format: tags``: the loaded tools' tags (:class:`~arpo.protocol.ToolProtocol`)."""

    format = "tags"

    def __init__(self, protocol: ToolProtocol):
        self.protocol = protocol
        #: close tag -> tool name: the stop strings, and which call a stop belongs to
        self.close_tags = {close: name for name, (_, close) in protocol.pairs().items()}

    def stop_strings(self) -> list[str]:
        return self.protocol.stop_strings()

    def parse(self, seg_text: str, close: str) -> ToolCall | MalformedCall:
        """The call a segment that ends with ``close`` makes (its text is cut right after ``close``)."""
        call = self.protocol.parse_trailing_call(seg_text)
        return call if call is not None else self.protocol.malformed(self.close_tags[close])

    def result_text(self, text: str) -> str:
        return format_tool_result(text)


def tool_message_wrapper(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, str]:
    """(text before, text after) a tool result, as the tokenizer's chat template writes a ``tool`` message after an
    assistant turn that stopped on ``</tool_call>``, through the next assistant generation prompt. The agent loops'
    :class:`ChatTemplater` renders it, so both rollout paths give a tool result the same tokens and each family its
    own markup (Qwen: ``<tool_response>`` in a user turn; Llama 3: a ``tool`` header). A ValueError names
    :data:`KEY` when there is no template or it does not render a tool message."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{KEY}=hermes: the tokenizer has no chat template, which renders the tool results; set "
                         f"actor_rollout_ref.model.custom_chat_template (e.g. qwen2.5) or use {KEY}=tags")
    templater = ChatTemplater(tokenizer, None, dict(chat_template_kwargs or {}))
    text = templater.message_text([{"role": "tool", "content": _RESULT_MARK}], closed=False)
    if text.count(_RESULT_MARK) != 1 or not templater.turn_close:
        raise ValueError(f"{KEY}=hermes: the tokenizer's chat template does not render a tool message after an "
                         f"assistant turn; give it a template that does (e.g. custom_chat_template=qwen2.5) or use "
                         f"{KEY}=tags")
    before, after = text.split(_RESULT_MARK)
    return before, after


class HermesCalls:
    """``tools.format: hermes``: ``<tool_call>{json}</tool_call>`` calls of the executor's tools, by registered
    name or by function name (the schema's, which the prompt's tools block shows the model)."""

    format = "hermes"

    def __init__(self, tools: Mapping[str, Any], tokenizer: Any,
                 chat_template_kwargs: Mapping[str, Any] | None = None):
        self.close_tags = {HERMES_CALL_CLOSE: INVALID_CALL}
        self.before, self.after = tool_message_wrapper(tokenizer, chat_template_kwargs)
        #: a name the model may write -> the executor's key (its ``name`` when that is a key), so records and
        #: rewards name the tool as tags mode does
        self.names: dict[str, str] = {}
        self.required: dict[str, list[str]] = {}
        for key, tool in tools.items():
            canonical = tool.name if tools.get(getattr(tool, "name", None)) is tool else key
            function = ((getattr(tool, "tool_schema", None) or {}).get("function") or {})
            self.names.setdefault(key, canonical)
            if function.get("name"):
                self.names.setdefault(function["name"], canonical)
            self.required[canonical] = list((function.get("parameters") or {}).get("required") or [])
        self.parser = HermesToolParser(list(self.names))

    def stop_strings(self) -> list[str]:
        return [HERMES_CALL_CLOSE]

    def parse(self, seg_text: str, close: str) -> ToolCall | MalformedCall:
        """The last ``<tool_call>`` of a segment that ends with ``</tool_call>``; never raises."""
        end = seg_text.rfind(close)
        start = seg_text.rfind(HERMES_CALL_OPEN, 0, end)
        if start < 0:
            return self._malformed(INVALID_CALL, f"Error: {HERMES_CALL_CLOSE} without a matching {HERMES_CALL_OPEN}; "
                                                 f"{HERMES_HINT}.")
        parsed = self.parser.parse_one(seg_text[start + len(HERMES_CALL_OPEN): end])
        tool = self.names.get(parsed.name, INVALID_CALL)
        if parsed.error:
            return self._malformed(tool, parsed.error)
        missing = [a for a in self.required.get(tool, []) if a not in parsed.arguments]
        if missing:
            return self._malformed(tool, f"Error: the call of '{parsed.name}' lacks the required argument(s) "
                                         f"{missing}; {HERMES_HINT}.")
        return ToolCall(tool, parsed.arguments)

    def result_text(self, text: str) -> str:
        return self.before + text + self.after

    @staticmethod
    def _malformed(tool: str, message: str) -> MalformedCall:
        return MalformedCall(tool, HERMES_CALL_OPEN, HERMES_CALL_CLOSE, message)


def make_call_format(cfg: ARPORolloutConfig, executor: Any, tokenizer: Any,
                     chat_template_kwargs: Mapping[str, Any] | None = None) -> TagCalls | HermesCalls:
    """The call format ``tools.format`` names, for these tools; tags mode checks the tools' tags here.
    ``chat_template_kwargs``: those the prompts were rendered with (``data.apply_chat_template_kwargs``), so a
    tool message ends in the same generation prompt (Qwen3 ``enable_thinking: false``: an empty think block)."""
    if cfg.tools.format == "hermes":
        return HermesCalls(executor.tools, tokenizer, chat_template_kwargs)
    return TagCalls(executor.protocol)
