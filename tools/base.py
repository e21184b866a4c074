"""The tool interface shared by the ARPO rollout (tag calls) and the agent loop (function calls).

A tool is one object with two entry points: ``call_text`` takes the raw text inside its ARPO tag
(``<search>query</search>`` → ``"query"``), ``call`` takes OpenAI-style function arguments. Both return
text for the model and never raise: failures become readable text in the trajectory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class BaseTool(ABC):
    """A tool addressable by ARPO tag and by OpenAI function name."""

    #: the tool's name (``search``, ``python``): its key in the registry and in the rollout's tool-call
    #: records; also the function name unless the schema says otherwise.
    name: str = ""
    #: the ARPO tag the model writes to call it (``convert``: ``<convert>…</convert>``); empty: ``name``.
    #: A tool YAML entry's ``tag:`` overrides it (:class:`arpo.protocol.ToolProtocol` reads it).
    tag: str = ""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.default_schema()

    @abstractmethod
    def default_schema(self) -> dict[str, Any]:
        """OpenAI function schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    @abstractmethod
    def call_text(self, content: str) -> str:
        """Run the tool on the text inside its ARPO tag; return the text to put inside ``<result>``."""

    def call(self, arguments: dict[str, Any]) -> str:
        """Run the tool from function-call arguments (default: the schema's single required argument)."""
        required = self.tool_schema["function"]["parameters"].get("required", [])
        key = required[0] if required else next(iter(arguments), None)
        if key is None or key not in arguments:
            return f"Error: tool '{self.function_name}' needs the argument '{key}'."
        return self.call_text(str(arguments[key]))

    @property
    def function_name(self) -> str:
        return self.tool_schema["function"]["name"]

    def close(self) -> None:
        """Release resources (pools, servers); safe to call twice."""
