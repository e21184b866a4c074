"""HF vs vLLM generation speed on the same model and prompts, in one process; prints one JSON object.

Stdout carries that object and nothing else; logs (vLLM's included) go to stderr.

    python experiments/bench_engine.py --model outputs/models/tiny-base
    python experiments/bench_engine.py --model PATH --prompts 64 --prompt-len 256 --max-tokens 256 --repeats 3
    python experiments/bench_engine.py --model PATH --backends vllm --dtype float32,bfloat16   # one row per dtype
    python experiments/bench_engine.py --model PATH --backends vllm --enforce-eager false       # vLLM compiled
    python experiments/bench_engine.py --model PATH --backends hf --prompts 2 --prompt-len 16 --max-tokens 8 \\
        --repeats 1                                                                            # smoke: seconds

Every request of a round is submitted at once (as the rollout does), sampled at temperature 1 with top-k
logprobs (ARPO needs them for entropy), each with its own seed. Per backend: start-up seconds (engine creation,
imports excluded, and the import time separately), and per round the wall time, generated tokens and tokens/s;
the summary takes the median round. ``vllm_over_hf_tokens_per_s`` is the speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for the JSON

from arpo.engine.base import SamplingParams  # noqa: E402
from arpo.engine.config import EngineConfig  # noqa: E402


def make_prompts(vocab_size: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids (special tokens in the tiny tokenizer) so prompts look like text.
    return [[rng.randrange(16, vocab_size) for _ in range(length)] for _ in range(n)]


async def one_round(engine, prompts: list[list[int]], sp: SamplingParams, tag: str) -> dict:
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp.with_(seed=i), f"{tag}-{i}") for i, p in enumerate(prompts)))
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1)}


async def bench_backend(name: str, model: str, prompts, sp: SamplingParams, repeats: int, max_model_len: int,
                        dtype: str = "auto", enforce_eager: bool | None = None) -> dict:
    import_start = time.perf_counter()
    if name == "vllm":
        import vllm  # noqa: F401

        from arpo.engine.vllm_engine import VLLMEngine as Engine
    else:
        import transformers  # noqa: F401

        from arpo.engine.hf_engine import HFEngine as Engine
    import_s = time.perf_counter() - import_start
    cfg = EngineConfig(model_path=model, name=name, max_model_len=max_model_len, hf_max_batch_size=len(prompts),
                       dtype=dtype, enforce_eager=enforce_eager)
    start = time.perf_counter()
    engine = Engine(cfg)
    startup_s = time.perf_counter() - start
    try:
        await engine.generate(prompts[0], sp.with_(max_tokens=4), f"{name}-warmup")
        rounds = []
        for r in range(repeats):
            await engine.reset_prefix_cache()  # no round reuses another's KV
            rounds.append(await one_round(engine, prompts, sp, f"{name}-r{r}"))
    finally:
        engine.shutdown()
    best = sorted(rounds, key=lambda x: x["tokens_per_s"])[len(rounds) // 2]
    return {"import_s": round(import_s, 2), "startup_s": round(startup_s, 2), "rounds": rounds,
            "median_tokens_per_s": best["tokens_per_s"],
            "median_wall_s": round(statistics.median(x["wall_s"] for x in rounds), 3)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outputs/models/tiny-base", help="HF-format checkpoint dir")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="engine dtype(s), comma-separated: auto | float32 | bfloat16; "
                                                     "each backend runs once per dtype (key <backend>@<dtype>)")
    ap.add_argument("--enforce-eager", choices=("auto", "true", "false"), default="auto",
                    help="vLLM's enforce_eager (actor_rollout_ref.rollout.enforce_eager): auto = by device (eager on "
                         "CPU); false on CPU compiles the model")
    args = ap.parse_args()
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()  # console on stderr
    if not (Path(args.model) / "config.json").exists():
        sys.exit(f"--model {args.model}: no HF checkpoint there; build the tiny one with `python -m arpo.models.tiny` "
                 f"or pass a checkpoint dir")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    prompts = make_prompts(vocab, args.prompts, args.prompt_len, args.seed)
    sp = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=args.logprobs)
    max_model_len = args.prompt_len + args.max_tokens + 8
    result: dict = {"model": str(args.model), "prompts": args.prompts, "prompt_len": args.prompt_len,
                    "max_tokens": args.max_tokens, "logprobs": args.logprobs, "repeats": args.repeats,
                    "enforce_eager": args.enforce_eager,
                    "machine": {"platform": platform.platform(), "python": platform.python_version()}}
    dtypes = args.dtype.split(",")
    eager = None if args.enforce_eager == "auto" else args.enforce_eager == "true"
    for name in args.backends.split(","):
        for dtype in dtypes:
            key = name if len(dtypes) == 1 else f"{name}@{dtype}"
            key += f"#{sum(k.split('#')[0] == key for k in result)}" if key in result else ""  # a repeated dtype
            result[key] = await bench_backend(name, args.model, prompts, sp, args.repeats, max_model_len, dtype,
                                              eager)
    if "hf" in result and "vllm" in result:
        result["vllm_over_hf_tokens_per_s"] = round(result["vllm"]["median_tokens_per_s"]
                                                    / result["hf"]["median_tokens_per_s"], 2)
    print(json.dumps(result, indent=1), file=out, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
