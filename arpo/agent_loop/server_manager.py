"""Route generate calls over engine servers: least in-flight requests first, sticky per conversation.

Every turn of a conversation (and every branch of an ARPO group, one session) goes to the server that served its
first turn, so that server's prefix cache already holds the shared history. New conversations go to
the server with the fewest requests in flight (a heap, updated when requests start and finish — verl
counts assignments and never decrements, which drifts once conversations differ in length).

A server is any object with the :class:`~arpo.engine.base.GenerationEngine` methods: a local engine,
an :class:`~arpo.agent_loop.async_server.AsyncEngineServer`, or a Ray actor handle of one (whose
methods are called with ``.remote`` and whose ObjectRefs are awaited).
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import logging
import uuid
from collections import OrderedDict
from typing import Any, Sequence

from arpo.engine.base import GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)


async def call_server(server: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``server.method`` whether the server is a local object or a Ray actor handle."""
    fn = getattr(server, method)
    result = fn.remote(*args, **kwargs) if hasattr(fn, "remote") else fn(*args, **kwargs)
    if inspect.isawaitable(result):  # coroutines and Ray ObjectRefs alike
        result = await result
    return result


class ServerManager:
    """Least-request load balancing with sticky sessions over a fixed list of engine servers."""

    def __init__(self, servers: Sequence[Any], max_cache_size: int = 10000):
        if not servers:
            raise ValueError("ServerManager needs at least one server")
        if max_cache_size < 1:
            raise ValueError(f"max_cache_size={max_cache_size}: must be >= 1")
        self.servers = list(servers)
        self.max_cache_size = max_cache_size
        self.in_flight = [0] * len(self.servers)
        #: requests each server has served (for metrics and balance checks).
        self.num_requests = [0] * len(self.servers)
        # Lazy heap of (in-flight count, server index): entries whose count is stale are skipped on pop.
        self._heap: list[tuple[int, int]] = [(0, i) for i in range(len(self.servers))]
        self._sessions: OrderedDict[str, int] = OrderedDict()

    # --------------------------------------------------------------------------------- routing

    def _least_loaded(self) -> int:
        while True:
            count, idx = self._heap[0]
            if count == self.in_flight[idx]:
                return idx
            heapq.heappop(self._heap)

    def _set_load(self, idx: int, delta: int) -> None:
        self.in_flight[idx] += delta
        heapq.heappush(self._heap, (self.in_flight[idx], idx))
        if len(self._heap) > 4 * len(self.servers) + 64:  # drop the stale entries now and then
            self._heap = [(c, i) for i, c in enumerate(self.in_flight)]
            heapq.heapify(self._heap)

    def server_index(self, session_id: str) -> int:
        """The server for ``session_id``: its sticky server, else the least-loaded one (then sticky)."""
        idx = self._sessions.get(session_id)
        if idx is not None:
            self._sessions.move_to_end(session_id)
            return idx
        idx = self._least_loaded()
        self._remember(session_id, idx)
        return idx

    def _remember(self, session_id: str, idx: int) -> None:
        self._sessions[session_id] = idx
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_cache_size:
            self._sessions.popitem(last=False)

    def end_session(self, session_id: str) -> None:
        """Forget a finished conversation (frees its LRU slot)."""
        self._sessions.pop(session_id, None)

    def session_server(self, session_id: str) -> int | None:
        return self._sessions.get(session_id)

    # ------------------------------------------------------------------------------ generation

    async def generate(self, session_id: str, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput:
        """Generate on the session's server; a turn without a ``request_id`` gets a fresh one."""
        idx = self.server_index(session_id)
        self._set_load(idx, +1)
        self.num_requests[idx] += 1
        try:
            return await call_server(self.servers[idx], "generate", prompt_ids=prompt_ids,
                                     sampling_params=sampling_params,
                                     request_id=request_id or f"{session_id}-{uuid.uuid4().hex[:12]}")
        finally:
            self._set_load(idx, -1)

    async def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``method`` on every server concurrently (weight sync, cache reset, sleep/wake)."""
        return list(await asyncio.gather(*(call_server(s, method, *args, **kwargs) for s in self.servers)))

    async def update_weights(self, weights: Any) -> None:
        await self.call_all("update_weights", weights)
        self._sessions.clear()  # the prefix caches are gone, so stickiness buys nothing until rebuilt

    async def reset_prefix_cache(self) -> None:
        await self.call_all("reset_prefix_cache")
        self._sessions.clear()

    async def sleep(self) -> None:
        await self.call_all("sleep")

    async def wake_up(self) -> None:
        await self.call_all("wake_up")


class SessionEngine:
    """One session's view of a :class:`ServerManager`, with the engine's ``generate``: every request goes to the
    session's server, so an ARPO group's branches share one replica's prefix cache. :meth:`close` ends it."""

    def __init__(self, server_manager: ServerManager, session_id: str):
        self.server_manager, self.session_id = server_manager, session_id

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput:
        return await self.server_manager.generate(self.session_id, prompt_ids, sampling_params, request_id)

    def close(self) -> None:
        self.server_manager.end_session(self.session_id)
