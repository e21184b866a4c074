"""Wall time of ARPO inside the asynchronous agent loop vs the round-synchronous ARPO rollout, same budget M.

Both paths drive the same simulated engine (a request takes ``delay + per_token × tokens``, as a
continuous-batching server with spare capacity would) and the same search tool with injected latency of
about one generation turn. Trajectories differ in their number of tool calls and segment lengths, which is
where a round barrier costs time: every round waits for its longest segment and its slowest tool call.
Prints one JSON object.

    python experiments/bench_agent_loop.py [--prompts 16] [--n 16] [--initial 8] [--timing code|paper] [--repeats 5]
    python experiments/bench_agent_loop.py --prompts 2 --n 4 --initial 2 --repeats 1 --response-length 256 \\
        --tool-s 0.01                                                            # smoke: seconds

The round-synchronous side is :class:`arpo.rollout.arpo_rollout.ARPORollout` (the ARPO rollout path);
wall times are medians over ``--repeats`` alternating runs; ``mean_turn_s`` / ``mean_tool_s`` show the
injected tool latency is about one generation turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from arpo.agent_loop import AgentLoopConfig, AgentLoopManager  # noqa: E402
from arpo.engine.base import SamplingParams  # noqa: E402
from tests.agent_loop.scripted_engine import ScriptedEngine, turn_index  # noqa: E402  (deterministic fake engine)
from tests.agent_loop.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from tools.base import BaseTool  # noqa: E402

WORDS = "the model thinks about numbers and searches for facts before it answers".split()


class SlowSearch(BaseTool):
    """Search whose latency is uniform in [0.25, 1.75] × mean (blocking, like an HTTP call)."""

    name = "search"

    def __init__(self, mean_s: float, seed: int):
        super().__init__()
        self.mean_s = mean_s
        self.rng = random.Random(seed)
        self.latencies: list[float] = []

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "search", "description": "search", "parameters": {
            "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

    def call_text(self, content: str) -> str:
        latency = self.mean_s * self.rng.uniform(0.25, 1.75)
        self.latencies.append(latency)
        time.sleep(latency)
        return f"results for {content}"


def policy(max_calls: int, p_call: float):
    def reply(prompt_text: str, request_id: str) -> str:
        rng = random.Random(request_id)
        turn = turn_index(prompt_text)
        filler = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
        if turn < max_calls and rng.random() < p_call:
            return f"<think>{filler}</think><search>q{turn} {rng.randint(0, 9)}</search>"
        return f"<answer>{filler} \\boxed{{{rng.randint(0, 9)}}}</answer>"
    return reply


def engine_time(engine: ScriptedEngine) -> list[float]:
    return [engine.delay_s + engine.per_token_s * len(ids) for _, _, ids in engine.calls]


async def run_async(args, tokenizer, seed: int) -> dict[str, Any]:
    engine = ScriptedEngine(tokenizer, policy=policy(args.max_calls, args.p_call), delay_s=args.delay_s,
                            per_token_s=args.per_token_s)
    tool = SlowSearch(args.tool_s, seed)
    config = AgentLoopConfig.load(
        response_length=args.response_length, default_agent_loop="arpo_agent",
        multi_turn={"max_user_turns": args.max_calls, "tool_workers": args.tool_workers},
        agents=[{"name": "arpo_agent", "_target_": "arpo.agent_loop.arpo_agent_loop.ARPOAgentLoop",
                 "initial_rollouts": args.initial, "seed": seed,
                 "branching": {"beam_size": args.beam, "branch_probability": args.branch_probability,
                               "entropy_weight": 0.2, "timing": args.timing, "window": 20}}])
    manager = AgentLoopManager([engine], tokenizer, config, [tool])
    rows = [{"raw_prompt": [{"role": "user", "content": f"question {i}"}]} for i in range(args.prompts)]
    start = time.perf_counter()
    batch = await manager.generate_sequences_async(rows, n=args.n, sampling_params=SamplingParams(
        max_tokens=args.response_length))
    wall = time.perf_counter() - start
    manager.close()
    groups = list(batch["group_index"])
    assert all(groups.count(g) == args.n for g in range(args.prompts))
    return {"wall_s": wall, "rows": len(batch), "requests": len(engine.calls), "tool_calls": len(tool.latencies),
            "branches": int(sum(p >= 0 for p in batch["parent_index"])),
            "tokens_generated": sum(len(ids) for _, _, ids in engine.calls),
            "mean_turn_s": statistics.mean(engine_time(engine)), "mean_tool_s": statistics.mean(tool.latencies)}


async def run_sync(args, tokenizer, seed: int) -> dict[str, Any]:
    from arpo.agent_loop.templating import ChatTemplater
    from arpo.rollout.arpo_rollout import ARPORollout

    engine = ScriptedEngine(tokenizer, policy=policy(args.max_calls, args.p_call), delay_s=args.delay_s,
                            per_token_s=args.per_token_s)
    tool = SlowSearch(args.tool_s, seed)
    rollout = ARPORollout(engine, tokenizer, {
        "n": args.n, "initial_rollouts": args.initial, "beam_size": args.beam,
        "branch_probability": args.branch_probability, "entropy_weight": 0.2, "timing": args.timing,
        "entropy_window": 20, "tool_call_limit": args.max_calls, "max_response_length": args.response_length,
        "seed": seed, "tool_workers": args.tool_workers, "tool_retries": 0}, tools=[tool])
    templater = ChatTemplater(tokenizer)
    prompts = [templater.prompt_ids([{"role": "user", "content": f"question {i}"}], with_tools=False)
               for i in range(args.prompts)]
    start = time.perf_counter()
    batch = await rollout.agenerate(prompts)
    wall = time.perf_counter() - start
    rollout.close()
    return {"wall_s": wall, "rows": len(batch), "requests": len(engine.calls), "tool_calls": len(tool.latencies),
            "branches": int(sum(p >= 0 for p in batch["parent_index"])),
            "tokens_generated": sum(len(ids) for _, _, ids in engine.calls),
            "rounds": batch.meta["metrics"].get("rollout/rounds"),
            "mean_turn_s": statistics.mean(engine_time(engine)), "mean_tool_s": statistics.mean(tool.latencies)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=16, help="budget M per prompt (ARPO's released scripts: 16)")
    ap.add_argument("--initial", type=int, default=8, help="initial rollouts N (ARPO: 8)")
    ap.add_argument("--beam", type=int, default=2)
    ap.add_argument("--branch-probability", type=float, default=0.5)
    ap.add_argument("--timing", default="code", choices=["code", "paper"])
    ap.add_argument("--max-calls", type=int, default=3, help="tool-call limit per trajectory")
    ap.add_argument("--p-call", type=float, default=0.7, help="chance a turn calls the tool")
    ap.add_argument("--per-token-s", type=float, default=0.002)
    ap.add_argument("--delay-s", type=float, default=0.01, help="per-request latency (prefill)")
    ap.add_argument("--tool-s", type=float, default=0.15, help="mean tool latency (about one turn)")
    ap.add_argument("--response-length", type=int, default=1024)
    ap.add_argument("--tool-workers", type=int, default=256, help="tool threads (both paths)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir with a chat template (default: built here)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or build_tiny_tokenizer(tempfile.mkdtemp(prefix="bench_tok_"))
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    runs: dict[str, list[dict[str, Any]]] = {"async": [], "sync": []}
    for r in range(args.repeats):
        order = [("async", run_async), ("sync", run_sync)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            runs[name].append(asyncio.run(fn(args, tokenizer, seed=r)))
    med = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
    print(json.dumps({
        "benchmark": "agent_loop_vs_round_synchronous_arpo",
        "config": vars(args),
        "async_agent_loop_wall_s": round(med["async"], 3),
        "round_synchronous_rollout_wall_s": round(med["sync"], 3),
        "speedup": round(med["sync"] / med["async"], 3),
        "goal_speedup": 1.6,
        "runs": runs,
    }, indent=1, default=float))


if __name__ == "__main__":
    main()
