"""The default loop: one generation, no tools."""

from __future__ import annotations

import time
import uuid
from typing import Any

from arpo.agent_loop.base import AgentLoopBase, AgentLoopOutput, register
from arpo.engine.base import SamplingParams, sampled_log_probs


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """Apply the chat template, generate once, return the ids the engine produced."""

    async def run(self, messages: list[dict[str, Any]], sampling_params: SamplingParams,
                  **dataset_fields: Any) -> AgentLoopOutput:
        ctx = self.ctx
        prompt_ids = ctx.templater.prompt_ids(messages, with_tools=False)
        session = uuid.uuid4().hex
        params = ctx.with_sampled_log_probs(
            sampling_params.with_(max_tokens=min(sampling_params.max_tokens, ctx.response_length)))
        start = time.perf_counter()
        out = await ctx.server_manager.generate(session, prompt_ids, params)
        elapsed = time.perf_counter() - start
        ctx.server_manager.end_session(session)
        response = list(out.token_ids[: ctx.response_length])
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response,
            response_mask=[1] * len(response),
            num_turns=2,
            metrics={"generate_sequences": elapsed, "tool_calls": 0.0},
            finish_reason=out.finish_reason,
            rollout_log_probs=(sampled_log_probs(response, out.logprobs) if ctx.calculate_log_probs else None),
        )
