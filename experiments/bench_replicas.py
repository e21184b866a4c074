"""ARPO rollout throughput on 1 vs K engine replicas with the same total cores, and what the routing costs.

    python experiments/bench_replicas.py                                  # scripted engines only (seconds)
    python experiments/bench_replicas.py --model outputs/tiny_arpo/models/tiny-sft \
        --data outputs/tiny_arpo/data/synthetic/test.parquet --replicas 1 2 --repeats 3

Two measurements, one JSON object on stdout (logs on stderr):

* ``scripted``: K scripted engines with a fixed latency per request and per token (a replica's speed does not
  depend on how many there are), so any wall-time difference between 1 and K replicas is the router's own cost
  (least-request choice, sticky sessions) and the batch must be identical (``same_batch``).
* ``vllm`` (with ``--model``): K vLLM replicas, each a Ray actor with ``cores / K`` threads, against one replica
  with every core; the same prompts, seeds and tools (the synthetic benchmark's, ``--data``). The ratio shows what
  splitting the cores between engines gains or loses at this model size; the token counts are equal because the
  batch does not depend on the split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig  # noqa: E402
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy  # noqa: E402


async def _timed(engines: list[Any], tokenizer: Any, tools: Any, prompts: list[list[int]], cfg: ARPORolloutConfig,
                 seed: int) -> tuple[float, Any]:
    for engine in engines:
        await engine.reset_prefix_cache()
    gen = ARPORollout(engines, tokenizer, cfg, tools=tools)
    start = time.perf_counter()
    try:
        batch = await gen.agenerate(prompts, seed=seed)
    finally:
        gen.close()
    return time.perf_counter() - start, batch


def _summary(walls: list[float], batch: Any) -> dict[str, Any]:
    tokens = batch.meta["metrics"]["rollout/tokens/generated"]
    return {"wall_s_median": statistics.median(walls), "wall_s_all": [round(w, 3) for w in walls],
            "tokens_generated": tokens, "tokens_per_s": tokens / statistics.median(walls)}


async def _compare(make_engines, replicas: list[int], tokenizer, tools, prompts, cfg, repeats: int,
                   seed: int) -> dict[str, Any]:
    """Median wall per replica count, runs interleaved (a drift of the machine's speed hits every count alike)."""
    pools = {k: make_engines(k) for k in replicas}
    walls: dict[int, list[float]] = {k: [] for k in replicas}
    batches: dict[int, Any] = {}
    for k in replicas:  # one untimed run each: first requests pay for allocations
        await _timed(pools[k], tokenizer, tools, prompts, cfg, seed + 1000)
    for r in range(repeats):
        for k in replicas:
            wall, batches[k] = await _timed(pools[k], tokenizer, tools, prompts, cfg, seed)
            walls[k].append(wall)
    out: dict[str, Any] = {f"replicas_{k}": _summary(walls[k], batches[k]) for k in replicas}
    base = replicas[0]
    for k in replicas[1:]:
        out[f"replicas_{k}_over_{base}_wall"] = statistics.median(walls[k]) / statistics.median(walls[base])
        out[f"replicas_{k}_same_batch"] = all(
            (batches[k].tensors[c] == batches[base].tensors[c]).all().item() for c in ("responses", "response_mask"))
    return out, pools


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from experiments.bench_arpo_rollout import InstantPython, InstantSearch

    cfg = ARPORolloutConfig.from_dict({"mode": "arpo", "n": args.n, "initial_rollouts": args.initial,
                                       "sampling.max_response_length": args.max_response_length,
                                       "tools.call_limit": 3, "tools.retries": 0})
    result: dict[str, Any] = {"prompts": args.prompts, "budget_m": args.n, "initial_rollouts": args.initial,
                              "cores": _cores()}

    def scripted(k: int) -> list[ScriptedEngine]:
        return [ScriptedEngine(policy=ScriptPolicy(), latency_s=0.002, token_latency_s=0.001) for _ in range(k)]

    tok = scripted(1)[0].tokenizer
    prompts = [tok.encode(f"Question {i}: which city is the capital of country number {i}?",
                          add_special_tokens=False) for i in range(args.prompts)]
    result["scripted"], _ = await _compare(scripted, args.replicas, tok, [InstantSearch(), InstantPython()],
                                           prompts, cfg, args.repeats, args.seed)
    if args.model:
        result["vllm"] = await _vllm(args, cfg)
    return result


async def _vllm(args: argparse.Namespace, cfg: ARPORolloutConfig) -> dict[str, Any]:
    import pandas as pd
    from transformers import AutoTokenizer

    from arpo.engine.config import EngineConfig
    from arpo.engine.factory import create_engines
    from experiments.rollout_factories import synthetic_tools

    if args.data:
        os.environ.setdefault("ARPO_SYNTHETIC_DIR", str(Path(args.data).parent))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    rows = pd.read_parquet(args.data).prompt[: args.prompts]
    prompts = [tokenizer.apply_chat_template(list(m), add_generation_prompt=True, tokenize=True)["input_ids"]
               for m in rows]

    from arpo.runtime.ray_utils import init_ray

    # every pool stays up for the interleaved repeats: one logical CPU per replica (they compute one pool at a time)
    init_ray({"num_cpus": sum(args.replicas)})

    def replicas(k: int) -> list[Any]:
        return create_engines(EngineConfig(model_path=args.model, name="vllm", ray_actor=True, num_replicas=k,
                                           max_model_len=2048))

    tools = synthetic_tools()
    out, pools = await _compare(replicas, args.replicas, tokenizer, tools, prompts, cfg, args.repeats, args.seed)
    out["threads_per_replica"] = {f"replicas_{k}": max(1, _cores() // k) for k in args.replicas}
    for engines in pools.values():
        for engine in engines:
            engine.kill()
    return out


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF checkpoint: also measure vLLM replicas (Ray actors)")
    ap.add_argument("--data", default=None, help="verl parquet of the synthetic benchmark (its prompts and tools)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2], help="replica counts; the first is the base")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8, help="budget M")
    ap.add_argument("--initial", type=int, default=4, help="initial rollouts N")
    ap.add_argument("--max-response-length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.model and not args.data:
        ap.error("--model needs --data (the synthetic benchmark's parquet: prompts, and its tools beside it)")
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()
    print(json.dumps(asyncio.run(amain(args)), indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
