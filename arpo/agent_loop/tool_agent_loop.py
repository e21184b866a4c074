"""Multi-turn tool use: generate, run the calls, append the results as token ids, repeat.

The response keeps exactly the ids the engine sampled; tool results are added as ids computed from the
chat template for the new messages only (hermes) or from ARPO's result wrapper (tags). Limits follow
verl's ``multi_turn`` keys; the conversation stops on the first limit reached, never after a tool
result (the last turn is always the model's, so the final token's reward has a model token to land on).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from arpo.agent_loop.base import AgentLoopBase, AgentLoopContext, AgentLoopOutput, register
from arpo.agent_loop.tool_parsers import ParsedCall, make_tool_parser
from arpo.rollout.tool_executor import truncate_text
from arpo.engine.base import GenerationOutput, SamplingParams, sampled_log_probs
from arpo.protocol import format_tool_result


@dataclass
class Conversation:
    """The running state of one conversation."""

    session_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=lambda: {"generate_sequences": 0.0, "tool_calls": 0.0})
    finish_reason: str = ""
    #: the engine's log-prob of each response token (0 on tool results); None unless calculate_log_probs
    rollout_log_probs: list[float] | None = None

    def append(self, ids: list[int], model_generated: bool, log_probs: list[float] | None = None) -> None:
        self.response_ids.extend(ids)
        self.response_mask.extend([1 if model_generated else 0] * len(ids))
        if self.rollout_log_probs is not None:
            self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(ids))

    def to_output(self, response_length: int) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids[:response_length],
            response_mask=self.response_mask[:response_length],
            num_turns=self.user_turns + self.assistant_turns + 1,
            metrics=dict(self.metrics),
            finish_reason=self.finish_reason,
            tool_calls=self.tool_calls,
            rollout_log_probs=(self.rollout_log_probs[:response_length] if self.rollout_log_probs is not None
                               else None),
        )


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """verl's ToolAgentLoop, token-consistent, with malformed calls answered instead of ending the loop."""

    def __init__(self, context: AgentLoopContext, format: str | None = None, **kwargs: Any):
        super().__init__(context, **kwargs)
        #: the tool-call format of this loop (overrides multi_turn.format; the ARPO entry uses arpo_tags).
        self.format = format or context.multi_turn.format
        # the tags are read only for arpo_tags, so hermes tools need no usable tag
        protocol = context.tool_executor.protocol if self.format == "arpo_tags" else None
        self.parser = make_tool_parser(self.format, sorted(context.tools), protocol)

    # ------------------------------------------------------------------------------------- run

    async def run(self, messages: list[dict[str, Any]], sampling_params: SamplingParams,
                  **dataset_fields: Any) -> AgentLoopOutput:
        conv = self.start(messages)
        params = self.sampling_params(sampling_params)
        try:
            while not conv.finish_reason:
                out = await self.generate_turn(conv, params)
                calls = self.after_generation(conv, out)
                if calls:
                    await self.run_tools(conv, calls)
        finally:
            self.ctx.server_manager.end_session(conv.session_id)
        return conv.to_output(self.ctx.response_length)

    def start(self, messages: list[dict[str, Any]]) -> Conversation:
        with_tools = self.format == "hermes"
        return Conversation(uuid.uuid4().hex, self.ctx.templater.prompt_ids(messages, with_tools=with_tools),
                            rollout_log_probs=[] if self.ctx.calculate_log_probs else None)

    def sampling_params(self, base: SamplingParams) -> SamplingParams:
        stops = tuple(dict.fromkeys((*base.stop, *self.parser.stop_strings)))
        return self.ctx.with_sampled_log_probs(base).with_(stop=stops)

    # ----------------------------------------------------------------------------------- steps

    async def generate_turn(self, conv: Conversation, params: SamplingParams) -> GenerationOutput:
        """One model turn, appended to the conversation with mask 1."""
        budget = self.ctx.response_length - len(conv.response_ids)
        turn_params = params.with_(max_tokens=max(1, min(params.max_tokens, budget)))
        start = time.perf_counter()
        out = await self.ctx.server_manager.generate(conv.session_id, conv.prompt_ids + conv.response_ids,
                                                     turn_params)
        conv.metrics["generate_sequences"] += time.perf_counter() - start
        log_probs = sampled_log_probs(out.token_ids, out.logprobs) if conv.rollout_log_probs is not None else None
        conv.append(list(out.token_ids), model_generated=True, log_probs=log_probs)
        conv.assistant_turns += 1
        return out

    def after_generation(self, conv: Conversation, out: GenerationOutput) -> list[ParsedCall]:
        """The calls to run now, or [] after setting ``conv.finish_reason`` when the conversation ends."""
        cfg = self.ctx.multi_turn
        if len(conv.response_ids) >= self.ctx.response_length or out.finish_reason == "length":
            conv.finish_reason = "length"
            return []
        calls = self.parser.parse(self.turn_text(out))
        if not calls:
            conv.finish_reason = out.finish_reason or "stop"
        elif cfg.max_assistant_turns and conv.assistant_turns >= cfg.max_assistant_turns:
            conv.finish_reason = "max_assistant_turns"
        elif cfg.max_user_turns and conv.user_turns >= cfg.max_user_turns:
            conv.finish_reason = "max_user_turns"
        else:
            return calls
        return []

    def turn_text(self, out: GenerationOutput) -> str:
        text = self.ctx.tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
        # A stop string can end inside the last token; the call ends where the stop string does.
        if isinstance(out.stop_reason, str) and out.stop_reason in text:
            text = text[: text.rfind(out.stop_reason) + len(out.stop_reason)]
        return text

    async def run_tools(self, conv: Conversation, calls: list[ParsedCall]) -> None:
        """Run the calls concurrently and append their results (mask 0), or finish on the length limit."""
        cfg = self.ctx.multi_turn
        start = time.perf_counter()
        results = await asyncio.gather(*(self.call_tool(c) for c in calls[: cfg.max_parallel_calls]))
        conv.metrics["tool_calls"] += time.perf_counter() - start
        skipped = [(f"Error: at most {cfg.max_parallel_calls} tool call(s) run per turn; this call was skipped.",
                    True) for _ in calls[cfg.max_parallel_calls:]]
        results = [*results, *skipped]
        ids = self.result_ids(conv, [text for text, _ in results])
        if len(conv.response_ids) + len(ids) >= self.ctx.response_length:
            conv.finish_reason = "length"
            return
        begin = len(conv.response_ids)
        conv.append(ids, model_generated=False)
        conv.user_turns += 1
        for call, (_, failed) in zip(calls, results):
            conv.tool_calls.append({"tool": call.name, "start": begin, "end": len(conv.response_ids),
                                    "error": failed})

    def result_ids(self, conv: Conversation, texts: list[str]) -> list[int]:
        templater = self.ctx.templater
        if self.format == "arpo_tags":  # results stay inside the assistant turn, as in ARPO's rollout
            return templater.encode("".join(format_tool_result(t) for t in texts))
        return templater.message_ids([{"role": "tool", "content": t} for t in texts], after=conv.response_ids)

    async def call_tool(self, call: ParsedCall) -> tuple[str, bool]:
        """(text for the model, whether the call failed); never raises. Runs on the shared tool executor, the
        same path (retries, timeouts, error texts, truncation) as every other rollout mode."""
        ex = self.ctx.tool_executor
        if call.error:
            return truncate_text(call.error, ex.max_result_chars, ex.truncate_side), True
        result = await ex.arun(call.name, call.text if call.text is not None else call.arguments)
        return result.text, not result.ok
