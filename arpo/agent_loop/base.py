"""Agent-loop building blocks: the output record, the shared context, the base class and the registry.

A loop is instantiated per sample (cheap: it only holds a reference to the shared
:class:`AgentLoopContext`) and its ``run`` coroutine drives one conversation to the end.
The registry maps a dataset's ``agent_name`` to a class plus constructor kwargs; entries come from
``@register`` and from the agent-loop config (``configs/rollout/agent.yaml``), the YAML winning.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from arpo.batch import Trajectory
from arpo.engine.base import SamplingParams
from arpo.rollout.tool_executor import TRUNCATE_SIDES

if TYPE_CHECKING:
    from arpo.agent_loop.server_manager import ServerManager
    from arpo.rollout.tool_executor import ToolExecutor
    from arpo.chat_templates.templater import ChatTemplater
    from tools.base import BaseTool

TOOL_CALL_FORMATS = ("hermes", "arpo_tags")


@dataclass
class MultiTurnConfig:
    """verl's ``actor_rollout_ref.rollout.multi_turn`` keys (None or 0 for a turn limit means unlimited).

    ``tool_response_truncate_side`` follows verl: "left" keeps the head of an over-long tool response,
    "right" keeps the tail, "middle" keeps both ends and cuts the middle.
    """

    format: str = "hermes"
    max_user_turns: int | None = None
    max_assistant_turns: int | None = None
    max_parallel_calls: int = 1
    #: characters kept of a tool response; None: no limit.
    max_tool_response_length: int | None = 256
    tool_response_truncate_side: str = "middle"
    #: seconds before a tool call is abandoned (its result becomes an error message); None: no limit.
    tool_timeout_s: float | None = None
    #: threads that run blocking tool calls (ARPO's released code uses 64).
    tool_workers: int = 64
    #: further tries of a call that raised, timed out or (``retry_on_empty``) returned nothing (ours; verl
    #: has none, the released ARPO code 3).
    tool_retries: int = 0
    retry_on_empty: bool = False

    def validate(self) -> "MultiTurnConfig":
        if self.format not in TOOL_CALL_FORMATS:
            raise ValueError(f"multi_turn.format={self.format!r}: use one of {list(TOOL_CALL_FORMATS)}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"multi_turn.tool_response_truncate_side={self.tool_response_truncate_side!r}: "
                             f"use one of {list(TRUNCATE_SIDES)}")
        if self.max_parallel_calls < 1:
            raise ValueError(f"multi_turn.max_parallel_calls={self.max_parallel_calls}: must be >= 1")
        if self.max_tool_response_length is not None and self.max_tool_response_length < 1:
            raise ValueError(f"multi_turn.max_tool_response_length={self.max_tool_response_length}: must be >= 1, "
                             f"or null for no limit")
        if self.tool_retries < 0:
            raise ValueError(f"multi_turn.tool_retries={self.tool_retries}: must be >= 0")
        if self.tool_timeout_s is not None and self.tool_timeout_s <= 0:
            raise ValueError(f"multi_turn.tool_timeout_s={self.tool_timeout_s}: must be > 0, or null for no limit")
        for key in ("max_user_turns", "max_assistant_turns"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"multi_turn.{key}={value}: use a positive number, or null for unlimited")
        if self.tool_workers < 1:
            raise ValueError(f"multi_turn.tool_workers={self.tool_workers}: must be >= 1")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "MultiTurnConfig":
        values = dict(values or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown multi_turn key(s) {unknown}; known: {sorted(known)}")
        return cls(**values).validate()


@dataclass
class AgentLoopOutput:
    """One finished conversation, as token ids (the fields after ``metrics`` are optional extensions)."""

    prompt_ids: list[int]
    #: model tokens and tool-result tokens, in order.
    response_ids: list[int]
    #: 1 on model tokens, 0 on tool-result tokens.
    response_mask: list[int]
    #: user + assistant + tool turns, the initial user message included (verl's count).
    num_turns: int = 0
    #: seconds spent waiting for the engine (``generate_sequences``) and for tools (``tool_calls``).
    metrics: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    token_entropy: list[float] | None = None
    #: for loops that return a group (ARPO): index of the parent output within the group, -1 for a root.
    parent: int = -1
    #: response tokens shared with the parent.
    branch_pos: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the engine's log-prob of each response token (0 on tool results), with calculate_log_probs
    rollout_log_probs: list[float] | None = None

    def to_trajectory(self, group: int, parent_row: int, max_response_length: int | None = None) -> Trajectory:
        response = self.response_ids[:max_response_length] if max_response_length else self.response_ids
        entropy = self.token_entropy[: len(response)] if self.token_entropy is not None else None
        return Trajectory(
            group=group,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(response),
            response_mask=list(self.response_mask[: len(response)]),
            parent=parent_row,
            branch_pos=min(self.branch_pos, len(response)),
            token_entropy=entropy,
            rollout_log_probs=(list(self.rollout_log_probs[: len(response)]) if self.rollout_log_probs is not None
                               else None),
            tool_calls=list(self.tool_calls),
            finish_reason=self.finish_reason,
            extra={"num_turns": self.num_turns, **self.extra},
        )


@dataclass
class AgentLoopContext:
    """What every loop of one manager shares: routing, tokenizer, tools, limits."""

    server_manager: "ServerManager"
    tokenizer: Any
    templater: "ChatTemplater"
    #: tools by every name a call may use (OpenAI function name and ARPO tag name).
    tools: dict[str, "BaseTool"]
    multi_turn: MultiTurnConfig
    response_length: int
    #: the one tool-execution path of every rollout mode (retries, timeouts, error texts, truncation)
    tool_executor: "ToolExecutor"
    #: record the engine's log-prob of every sampled token (actor_rollout_ref.rollout.calculate_log_probs)
    calculate_log_probs: bool = False

    def with_sampled_log_probs(self, params: SamplingParams) -> SamplingParams:
        """``params`` asking the engine for the sampled token's log-prob (only) when log-probs are recorded."""
        return params.with_(logprobs=0) if self.calculate_log_probs and params.logprobs is None else params


class AgentLoopBase(ABC):
    """Drives one conversation (or, when ``returns_group``, one prompt's whole group) to the end."""

    #: True for loops whose ``run`` returns the whole group of ``n`` outputs for a prompt (ARPO).
    returns_group: bool = False

    def __init__(self, context: AgentLoopContext, **kwargs: Any):
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unknown config key(s) {sorted(kwargs)}")
        self.ctx = context

    @abstractmethod
    async def run(self, messages: list[dict[str, Any]], sampling_params: SamplingParams,
                  **dataset_fields: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        """Run the loop; ``dataset_fields`` are the sample's other dataset columns (tools_kwargs, …)."""


# --------------------------------------------------------------------------------------------- registry

#: agent name -> {"_target_": "module.Class", **constructor kwargs}
_REGISTRY: dict[str, dict[str, Any]] = {}


def register(agent_name: str):
    """Class decorator: make a loop selectable by ``agent_name``."""

    def decorator(cls: type[AgentLoopBase]) -> type[AgentLoopBase]:
        # a YAML entry registered before this module was imported (resolve_agent_loop imports lazily) wins
        _REGISTRY.setdefault(agent_name, {"_target_": f"{cls.__module__}.{cls.__qualname__}"})
        return cls

    return decorator


def register_entry(name: str, entry: dict[str, Any]) -> None:
    """Register a YAML entry ``{name, _target_, **kwargs}`` (overrides a decorator registration)."""
    entry = {k: v for k, v in entry.items() if k != "name"}
    if "_target_" not in entry:
        if name not in _REGISTRY:
            raise ValueError(f"agent loop {name!r} has no _target_ and is not registered; "
                             f"add `_target_: module.ClassName` to its config entry")
        entry = {**_REGISTRY[name], **entry}
    _REGISTRY[name] = entry


def registered_names() -> list[str]:
    return sorted(_REGISTRY)


def resolve_agent_loop(agent_name: str) -> tuple[type[AgentLoopBase], dict[str, Any]]:
    """Class and constructor kwargs for ``agent_name``."""
    if agent_name not in _REGISTRY:
        raise ValueError(f"agent loop {agent_name!r} is not registered; registered: {registered_names()}. "
                         f"Add it to the agent-loop YAML or decorate the class with @register({agent_name!r}).")
    entry = dict(_REGISTRY[agent_name])
    target = entry.pop("_target_")
    module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"agent loop {agent_name!r}: cannot import _target_ {target!r} ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise ValueError(f"agent loop {agent_name!r}: {target} is not an AgentLoopBase subclass")
    return cls, entry
