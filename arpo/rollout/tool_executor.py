"""Run ARPO tag tool calls in a thread pool with a per-call timeout and retries; never raise.

Tools are blocking (HTTP to a search server, a Python subprocess), so they run in worker threads while the
event loop keeps the engine busy. Each call is tried up to ``1 + retries`` times: an exception, a timeout
or (with ``retry_on_empty``, as in the released ARPO code) an empty result triggers another try. Whatever
happens, the caller gets text for the ``<result>`` block: failures become a readable ``Error: …`` line.

A timed-out call cannot be killed (Python threads cannot be), so its thread keeps a worker until the tool
returns; tools should enforce their own deadlines (the Python sandbox does) and ``max_workers`` should leave
room for stragglers (ARPO uses 64 workers and a 120 s timeout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Mapping

from arpo.protocol import ToolProtocol
from tools.base import BaseTool

logger = logging.getLogger(__name__)


@dataclass
class ToolResult:
    """The outcome of one tool call: the text the model will see plus bookkeeping for metrics."""

    tool: str
    text: str
    ok: bool
    attempts: int
    elapsed_s: float
    error: str | None = None


TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_text(text: str, max_chars: int | None, side: str = "middle") -> str:
    """Cut an over-long result to ``max_chars`` characters with a visible marker, as verl does
    (``tool_response_truncate_side``): "left" keeps the head, "right" the tail, "middle" both ends."""
    if max_chars is None or len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    if side == "middle":
        head = max_chars // 2
        return text[:head] + "...(truncated)..." + text[len(text) - (max_chars - head):]
    raise ValueError(f"tool_response_truncate_side={side!r}: use one of {list(TRUNCATE_SIDES)}")


class ToolExecutor:
    """Executes tool calls on :class:`~tools.base.BaseTool` objects by name: an ARPO tag's content, or a
    function call's arguments (hermes). Every rollout mode runs its tools here, so a result reads the same
    (retries, timeouts, error texts, truncation) whichever path produced the trajectory."""

    def __init__(
        self,
        tools: Mapping[str, BaseTool] | Iterable[BaseTool],
        max_workers: int = 64,
        timeout_s: float | None = 120.0,
        retries: int = 3,
        retry_on_empty: bool = True,
        max_result_chars: int | None = None,
        truncate_side: str = "middle",
    ):
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"tool timeout_s must be > 0, or None for no limit (got {timeout_s})")
        if truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"tool truncate_side={truncate_side!r}: use one of {list(TRUNCATE_SIDES)}")
        if retries < 0:
            raise ValueError(f"tool retries must be >= 0 (got {retries})")
        if max_workers < 1:
            raise ValueError(f"tool max_workers must be >= 1 (got {max_workers})")
        self.tools: dict[str, BaseTool] = dict(tools) if isinstance(tools, Mapping) else {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_on_empty = retry_on_empty
        self.max_result_chars = max_result_chars
        self.truncate_side = truncate_side
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="arpo-tool")

    @property
    def tool_names(self) -> list[str]:
        return list(self.tools)

    @cached_property
    def protocol(self) -> ToolProtocol:
        """The ARPO tags of these tools; built on first use, so function-call-only paths never check tags."""
        return ToolProtocol.from_tools(self.tools)

    async def arun(self, tool: str, content: str | dict[str, Any]) -> ToolResult:
        """Run one call (retrying as configured) without blocking the event loop; ``content`` is a tag's text
        or a function call's arguments."""
        start = time.perf_counter()
        impl = self.tools.get(tool)
        if impl is None:
            return ToolResult(tool, f"Error: unknown tool '{tool}'; available tools: {sorted(self.tools)}.",
                              ok=False, attempts=0, elapsed_s=0.0, error="unknown tool")
        loop = asyncio.get_running_loop()
        text, error = "", None
        attempts = 0
        for attempts in range(1, self.retries + 2):
            try:
                run = impl.call_text if isinstance(content, str) else impl.call
                text = await asyncio.wait_for(loop.run_in_executor(self._pool, run, content), timeout=self.timeout_s)
                text = "" if text is None else str(text)
                error = None if text.strip() or not self.retry_on_empty else "empty result"
            except asyncio.TimeoutError:
                text, error = f"Error: tool '{tool}' timed out after {self.timeout_s:g} s.", "timeout"
            except Exception as exc:  # a tool bug must not kill the rollout
                text, error = f"Error: tool '{tool}' failed: {type(exc).__name__}: {exc}", "exception"
            if error is None:
                break
            logger.debug("tool %s attempt %d/%d: %s", tool, attempts, self.retries + 1, error)
        return ToolResult(tool, truncate_text(text, self.max_result_chars, self.truncate_side), ok=error is None,
                          attempts=attempts, elapsed_s=time.perf_counter() - start, error=error)

    async def arun_many(self, calls: list[tuple[str, str | dict[str, Any]]]) -> list[ToolResult]:
        """Run calls concurrently; results come back in the order of ``calls``."""
        return list(await asyncio.gather(*(self.arun(tool, content) for tool, content in calls)))

    def run_many(self, calls: list[tuple[str, str]]) -> list[ToolResult]:
        """Blocking :meth:`arun_many` for callers without an event loop."""
        return asyncio.run(self.arun_many(calls))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
