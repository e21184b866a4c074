"""ARPO inside the asynchronous agent loop: one ``run`` rolls out one prompt's whole group of M trajectories.

The group is the batch rollout's own tree (:class:`~arpo.rollout.arpo_rollout.RolloutCall` over
:mod:`arpo.rollout.tree`): the same branching decisions, fills, requests, tool path and result tokens, so a
policy sees the same protocol in either mode, and with the manager's call seed and the group's row a
deterministic engine gives the same tokens as the batch rollout. What the agent loop adds is where the
group runs: its requests go to one server of the manager's pool (a sticky session: the group shares that
server's prefix cache), and groups start and finish independently of each other.
"""

from __future__ import annotations

import uuid
from typing import Any

from arpo.agent_loop.base import AgentLoopBase, AgentLoopContext, AgentLoopOutput, register
from arpo.agent_loop.server_manager import SessionEngine
from arpo.engine.base import SamplingParams
from arpo.rollout.arpo_rollout import RolloutCall
from arpo.rollout.config import ARPORolloutConfig


@register("arpo_agent")
class ARPOAgentLoop(AgentLoopBase):
    """Returns the prompt's whole group: exactly ``n`` outputs forming ARPO's trajectory tree.

    ``rollout``: ``actor_rollout_ref.rollout.arpo`` keys (``configs/rollout/arpo.yaml``); the manager's ``n``
    and sampling parameters (temperature, top-p, top-k) replace the config's, and the batch's
    ``rollout_overrides`` (e.g. validation's plain greedy sampling, ``mode: single``) replace those."""

    returns_group = True

    def __init__(self, context: AgentLoopContext, rollout: dict[str, Any] | ARPORolloutConfig | None = None):
        super().__init__(context)
        self.cfg = rollout if isinstance(rollout, ARPORolloutConfig) else ARPORolloutConfig.from_dict(rollout)
        if not context.tool_executor.protocol.names:  # building the protocol also checks the tools' tags
            raise ValueError("arpo_agent needs a tool named by an ARPO tag; the manager has no tools")

    async def run(self, messages: list[dict[str, Any]], sampling_params: SamplingParams, *, n: int = 1,
                  group: int = 0, call_seed: int | None = None, rollout_overrides: dict[str, Any] | None = None,
                  **dataset_fields: Any) -> list[AgentLoopOutput]:
        """``group`` and ``call_seed``: the prompt's row and the batch's seed (the draws and request seeds
        derive from both, as in the batch rollout); ``rollout_overrides``: config keys for this call."""
        cfg = self.cfg.updated({
            "n": n, "sampling.temperature": sampling_params.temperature, "sampling.top_p": sampling_params.top_p,
            "sampling.top_k": sampling_params.top_k, "calculate_log_probs": self.ctx.calculate_log_probs,
            **(rollout_overrides or {})})
        seed = call_seed if call_seed is not None else (sampling_params.seed if sampling_params.seed is not None
                                                        else cfg.seed)
        # hermes calls need the tools block (the function schemas) that tags do not
        prompt = self.ctx.templater.prompt_ids(messages, with_tools=cfg.tools.format == "hermes")
        session = SessionEngine(self.ctx.server_manager, f"arpo-{uuid.uuid4().hex}")
        call = RolloutCall(session, self.ctx.tokenizer, self.ctx.tool_executor, cfg, [prompt], seed,
                           group_ids=[group], chat_template_kwargs=self.ctx.templater.kwargs)
        try:
            trajectories = await call.run()
        finally:
            session.close()
        metrics = call.metrics()
        timing = {"generate_sequences": metrics["timing_s/rollout_generate"],
                  "tool_calls": metrics["timing_s/rollout_tools"]}
        return [AgentLoopOutput(
            prompt_ids=t.prompt_ids, response_ids=t.response_ids, response_mask=t.response_mask,
            num_turns=2 * t.extra["num_tool_calls"] + 2,  # verl's count: user + assistant + tool
            metrics=timing, finish_reason=t.finish_reason,
            tool_calls=t.tool_calls, token_entropy=t.token_entropy, parent=t.parent, branch_pos=t.branch_pos,
            extra=dict(t.extra), rollout_log_probs=t.rollout_log_probs,
        ) for t in trajectories]
