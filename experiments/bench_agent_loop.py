"""Wall time of one ARPO tree under three schedules, same budget M, same engine and tool: the batch rollout
with round barriers (``schedule: rounds``, the released code's loop), the batch rollout with one task per
branch (``schedule: async``, default), and the agent loop (one ``arpo_agent`` loop per prompt group, the
same tree driven per group). With a deterministic engine all three roll out the same trees (the agent loop's
identity is tested in tests/agent_loop/test_arpo_agent_loop.py); only the waiting differs.

The engine is simulated (a request takes ``delay + per_token × tokens``, as a continuous-batching server
with spare capacity would) and the search tool sleeps about one generation turn. Trajectories differ in
their number of tool calls and segment lengths, which is where a round barrier costs time: every round
waits for its longest segment and its slowest tool call. Prints one JSON object: medians over
``--repeats`` runs in rotating order.

    python experiments/bench_agent_loop.py [--prompts 16] [--n 16] [--initial 8] [--timing code|paper] [--repeats 5]
    python experiments/bench_agent_loop.py --prompts 2 --n 4 --initial 2 --repeats 1 --response-length 256 \\
        --tool-s 0.01                                                            # smoke: seconds
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
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
from arpo.chat_templates.templater import ChatTemplater  # noqa: E402
from arpo.batch import DataBatch  # noqa: E402
from arpo.engine.base import SamplingParams  # noqa: E402
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, build_chat_tokenizer  # noqa: E402
from arpo.rollout.arpo_rollout import ARPORollout  # noqa: E402
from tools.base import BaseTool  # noqa: E402


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


def rollout_config(args, seed: int, schedule: str = "async") -> dict[str, Any]:
    return {"n": args.n, "initial_rollouts": args.initial, "seed": seed, "branching.beam_size": args.beam,
            "branching.branch_probability": args.branch_probability, "branching.entropy_weight": 0.2,
            "branching.timing": args.timing, "entropy.window": 20, "tools.call_limit": args.max_calls,
            "sampling.max_response_length": args.response_length, "tools.workers": args.tool_workers,
            "tools.retries": 0, "schedule.mode": schedule}


def make_engine(args, tokenizer) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, ScriptPolicy(tools=("search",), call_prob=args.p_call),
                          latency_s=args.delay_s, token_latency_s=args.per_token_s)


def summary(engine: ScriptedEngine, tool: SlowSearch, batch: DataBatch, wall: float) -> dict[str, Any]:
    # the trees rolled out (tokens, masks, parents): equal for every schedule, whatever the timing
    tree = hashlib.sha1(repr([batch["responses"].tolist(), batch["response_mask"].tolist(),
                              list(batch["parent_index"])]).encode()).hexdigest()[:16]
    return {"wall_s": wall, "rows": len(batch), "tree_sha": tree, "requests": len(engine.requests),
            "tool_calls": len(tool.latencies), "branches": int(sum(p >= 0 for p in batch["parent_index"])),
            "tokens_generated": sum(r.output_len for r in engine.requests),
            "mean_tool_s": statistics.mean(tool.latencies) if tool.latencies else 0.0}


def messages(args) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"question {i}"}] for i in range(args.prompts)]


async def run_agent_loop(args, tokenizer, seed: int) -> dict[str, Any]:
    engine, tool = make_engine(args, tokenizer), SlowSearch(args.tool_s, seed)
    config = AgentLoopConfig.load(
        response_length=args.response_length, default_agent_loop="arpo_agent",
        multi_turn={"tool_workers": args.tool_workers, "max_tool_response_length": None},
        agents=[{"name": "arpo_agent", "_target_": "arpo.agent_loop.arpo_agent_loop.ARPOAgentLoop",
                 "rollout": rollout_config(args, seed)}])
    manager = AgentLoopManager([engine], tokenizer, config, [tool])
    prompts = DataBatch({}, {"raw_prompt": messages(args)}, {"seed": seed})
    start = time.perf_counter()
    batch = await manager.generate_sequences_async(prompts, n=args.n, sampling_params=SamplingParams(
        max_tokens=args.response_length))
    wall = time.perf_counter() - start
    manager.close()
    return summary(engine, tool, batch, wall)


async def run_rollout(args, tokenizer, seed: int, schedule: str) -> dict[str, Any]:
    engine, tool = make_engine(args, tokenizer), SlowSearch(args.tool_s, seed)
    rollout = ARPORollout(engine, tokenizer, rollout_config(args, seed, schedule), tools=[tool])
    templater = ChatTemplater(tokenizer)
    prompts = [templater.prompt_ids(m, with_tools=False) for m in messages(args)]
    start = time.perf_counter()
    batch = await rollout.agenerate(prompts, seed=seed)
    wall = time.perf_counter() - start
    rollout.close()
    return summary(engine, tool, batch, wall)


SIDES = {
    "rollout_rounds": lambda a, t, s: run_rollout(a, t, s, "rounds"),
    "rollout_async": lambda a, t, s: run_rollout(a, t, s, "async"),
    "agent_loop": run_agent_loop,
}


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

    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:  # built into a temporary directory, removed once loaded
        with tempfile.TemporaryDirectory(prefix="bench_tok_") as tmp:
            tokenizer = AutoTokenizer.from_pretrained(build_chat_tokenizer(tmp))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SIDES}
    names = list(SIDES)
    for r in range(args.repeats):
        for name in names[r % 3:] + names[: r % 3]:  # rotate the order: no side always runs first
            runs[name].append(asyncio.run(SIDES[name](args, tokenizer, r)))
    wall = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
    print(json.dumps({
        "benchmark": "arpo_schedules",
        "config": vars(args),
        "median_wall_s": {k: round(v, 3) for k, v in wall.items()},
        "speedup_over_rounds": {k: round(wall["rollout_rounds"] / v, 3) for k, v in wall.items()},
        "runs": runs,
    }, indent=1, default=float))


if __name__ == "__main__":
    main()
