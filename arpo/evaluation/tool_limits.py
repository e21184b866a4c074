"""Per-tool call limits for one trajectory, as ARPO's evaluation enforces them (5 python, 10 search).

The rollout (:mod:`arpo.rollout.arpo_rollout`) knows one limit, ``tools.call_limit``, on all calls of a
trajectory together, after which it ends the trajectory. ARPO's evaluation instead counts each tool
on its own and, past a tool's limit, does not run the call but answers it with a refusal the model
can read, then lets it continue (it may still answer, or use the other tool). It also refuses a
search query the trajectory already sent.

:class:`TrajectoryToolLimits` wraps the shared :class:`~arpo.rollout.tool_executor.ToolExecutor` for ONE
trajectory (evaluation rolls out each sample on its own), so the same tools and executor as training
run every call that is allowed. Refusals come back with ``ok=False`` so the rollout records them as
errors and the rewards do not count them as tool use. The rollout's total ``tools.call_limit`` is set
by the evaluation to ``eval.max_total_calls`` (calls run or refused), which bounds a model that keeps
calling after its limits (ARPO's code bounds it only by the token budget).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Mapping

from arpo.protocol import ToolProtocol
from arpo.rollout.tool_executor import ToolExecutor, ToolResult

REFUSAL_LIMIT = "The {tool} tool may be called at most {limit} times per question; that limit is reached, so " \
                "this call was not run. Continue without {tool}."
REFUSAL_REPEAT = "This exact search query was already sent for this question; see its earlier result."


class TrajectoryToolLimits:
    """The executor interface the rollout uses (``tool_names``, ``tools``, ``protocol``, ``arun_many``, ``close``),
    with per-tool limits and repeated-query refusals for a single trajectory."""

    def __init__(self, executor: ToolExecutor, limits: Mapping[str, int], refuse_repeated: tuple[str, ...] = ()):
        self.executor = executor
        self.limits = dict(limits)
        self.refuse_repeated = tuple(refuse_repeated)
        self.executed: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self._seen: set[tuple[str, str]] = set()

    @property
    def tool_names(self) -> list[str]:
        return self.executor.tool_names

    @property
    def protocol(self) -> ToolProtocol:
        return self.executor.protocol

    @property
    def tools(self) -> dict[str, Any]:
        """The wrapped executor's tools (a hermes rollout resolves function names through them)."""
        return self.executor.tools

    @staticmethod
    def _query(content: str | dict[str, Any]) -> str:
        """A call's query for the repeat check: a tag's text, or a hermes call's arguments in a fixed order."""
        return content.strip() if isinstance(content, str) else json.dumps(content, sort_keys=True)

    def _refusal(self, tool: str, content: str | dict[str, Any]) -> str | None:
        limit = self.limits.get(tool)
        if limit is not None and self.executed[tool] >= limit:
            return REFUSAL_LIMIT.format(tool=tool, limit=limit)
        if tool in self.refuse_repeated and (tool, self._query(content)) in self._seen:
            return REFUSAL_REPEAT
        return None

    async def arun_many(self, calls: list[tuple[str, str | dict[str, Any]]]) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        allowed: list[int] = []
        for i, (tool, content) in enumerate(calls):
            refusal = self._refusal(tool, content)
            if refusal is not None:
                self.refused[tool] += 1
                results[i] = ToolResult(tool, refusal, ok=False, attempts=0, elapsed_s=0.0, error="refused")
            else:
                self.executed[tool] += 1
                self._seen.add((tool, self._query(content)))
                allowed.append(i)
        ran = await self.executor.arun_many([calls[i] for i in allowed])
        for i, result in zip(allowed, ran):
            results[i] = result
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Nothing to release: the wrapped executor is shared and closed by its owner."""
