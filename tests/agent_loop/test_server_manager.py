import asyncio
import random
from collections import defaultdict

import pytest

from arpo.agent_loop.server_manager import ServerManager
from arpo.engine.base import GenerationOutput, SamplingParams


class TimedServer:
    """A server that takes ``base_s * (1 + jitter)`` per request and records which sessions it served."""

    def __init__(self, base_s: float, seed: int):
        self.base_s = base_s
        self.rng = random.Random(seed)
        self.sessions: list[str] = []
        self.active = 0
        self.peak = 0

    async def generate(self, prompt_ids, sampling_params, request_id):
        self.active += 1
        self.peak = max(self.peak, self.active)
        self.sessions.append(request_id.rsplit("-", 1)[0])
        await asyncio.sleep(self.base_s * (1 + self.rng.random()))
        self.active -= 1
        return GenerationOutput(token_ids=[1], text="x", finish_reason="stop")


async def _conversations(manager: ServerManager, n: int, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    turns = {f"conv{i}": rng.randint(1, 6) for i in range(n)}
    gate = asyncio.Semaphore(concurrency)

    async def talk(session: str):
        async with gate:
            for _ in range(turns[session]):
                await manager.generate(session, [1, 2, 3], SamplingParams())
                await asyncio.sleep(rng.random() * 0.004)  # a tool call between turns

    await asyncio.gather(*(talk(s) for s in turns))
    return turns


def test_500_conversations_over_3_servers_are_sticky_and_balanced():
    servers = [TimedServer(0.002, seed=i) for i in range(3)]
    manager = ServerManager(servers, max_cache_size=10000)
    turns = asyncio.run(_conversations(manager, 500, concurrency=90, seed=0))

    where: dict[str, set[int]] = defaultdict(set)
    for idx, server in enumerate(servers):
        for session in server.sessions:
            where[session].add(idx)
    assert len(where) == 500
    assert all(len(s) == 1 for s in where.values()), "a conversation's turns went to different servers"
    for session, count in turns.items():
        (idx,) = where[session]
        assert servers[idx].sessions.count(session) == count

    requests = [len(s.sessions) for s in servers]
    assert sum(requests) == sum(turns.values()) == sum(manager.num_requests)
    mean = sum(requests) / 3
    assert (max(requests) - min(requests)) / mean < 0.1, requests
    peaks = [s.peak for s in servers]
    assert max(peaks) - min(peaks) <= 0.15 * max(peaks) + 2, peaks
    assert manager.in_flight == [0, 0, 0]


def test_least_in_flight_routes_new_conversations_away_from_a_slow_server():
    servers = [TimedServer(0.02, seed=0), TimedServer(0.002, seed=1), TimedServer(0.002, seed=2)]
    manager = ServerManager(servers)
    asyncio.run(_conversations(manager, 300, concurrency=30, seed=1))
    sessions = [len(set(s.sessions)) for s in servers]
    # The slow server holds its requests 10x longer, so it is rarely the least loaded when a
    # conversation starts (verl's assignment counter would give it a third of them).
    assert sessions[0] < 0.6 * min(sessions[1:]), sessions


def test_sticky_map_is_an_lru_of_configurable_size():
    servers = [TimedServer(0.0, seed=i) for i in range(2)]
    manager = ServerManager(servers, max_cache_size=2)
    a = manager.server_index("a")
    manager.server_index("b")
    assert manager.server_index("a") == a  # touch a: b is now the oldest
    manager.server_index("c")
    assert manager.session_server("b") is None and manager.session_server("a") == a
    manager.end_session("a")
    assert manager.session_server("a") is None
    with pytest.raises(ValueError, match="max_cache_size"):
        ServerManager(servers, max_cache_size=0)
    with pytest.raises(ValueError, match="at least one server"):
        ServerManager([])


def test_heap_stays_small_and_broadcast_reaches_every_server(tokenizer):
    from arpo.testing.scripted_engine import ScriptedEngine

    engines = [ScriptedEngine(tokenizer, replies=["hi"]) for _ in range(3)]
    manager = ServerManager(engines)

    async def go():
        for i in range(200):
            await manager.generate(f"s{i}", [1, 2], SamplingParams())
        await manager.update_weights("/tmp/w")
        await manager.sleep()

    asyncio.run(go())
    assert len(manager._heap) <= 4 * 3 + 64
    assert [e.weights for e in engines] == ["/tmp/w"] * 3 and all(e.asleep for e in engines)
    assert manager.session_server("s5") is None  # new weights: the prefix caches are gone
