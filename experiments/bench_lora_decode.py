"""What serving a LoRA adapter costs vLLM's generation: decode tokens/s of a plain engine (what the merged weight
sync serves) against an engine started with LoRA support, without and with a rank-R adapter (``lora_serving:
adapter``). The cheaper sync only pays where generation does not slow down more than it saves.

    python experiments/bench_lora_decode.py --model <SmolLM2 dir> --lora-rank 16

One JSON object on stdout: the command, the git SHA, and per engine state every repeat's tokens, seconds, tok/s
(16 concurrent requests of 96 sampled tokens after a 61-token prompt, a warm-up request first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def save_test_adapter(model: str, rank: int, out: Path) -> None:
    """A rank-``rank`` adapter on every linear layer with a small nonzero B (a fresh one would be the base)."""
    import torch
    from transformers import AutoModelForCausalLM

    from arpo.trainer.lora import apply_lora, is_adapter, save_adapter

    m = apply_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), rank, 2 * rank, "all-linear",
                   seed=0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if ".lora_B." in name:
                p.add_(1e-3)
    save_adapter({n: p.detach() for n, p in m.named_parameters() if is_adapter(n)}, rank, 2 * rank, "all-linear",
                 model, out)


async def decode_speed(engine: Any, tag: str, requests: int = 16, tokens: int = 96) -> dict[str, float]:
    from arpo.engine.base import SamplingParams

    sp = SamplingParams(temperature=1.0, max_tokens=tokens, seed=0, stop_token_ids=())
    prompts = [[1 + i] + list(range(100, 160)) for i in range(requests)]
    await engine.generate(prompts[0], sp.with_(max_tokens=4), f"{tag}-warm")
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, sp, f"{tag}-{i}") for i, p in enumerate(prompts)))
    seconds = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "seconds": seconds, "tok_s": n / seconds}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    from arpo.engine.vllm_engine import VLLMEngine
    from experiments import git_sha

    adapter = Path(tempfile.mkdtemp(prefix="bench_lora_decode_"))
    save_test_adapter(args.model, args.lora_rank, adapter)
    result: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in [f"experiments/{Path(__file__).name}", *sys.argv[1:]]),
        "git_sha": git_sha(), "model": Path(args.model).name, "lora_rank": args.lora_rank}
    for lora in (False, True):
        engine = VLLMEngine({"model_path": args.model, "name": "vllm", "max_model_len": 512, "max_num_seqs": 16,
                             "lora_rank": args.lora_rank if lora else 0})
        try:
            if not lora:
                result["plain_engine"] = [await decode_speed(engine, "plain") for _ in range(args.repeats)]
                continue
            result["lora_engine_no_adapter"] = [await decode_speed(engine, "none") for _ in range(args.repeats)]
            await engine.load_adapter(str(adapter))
            result["lora_engine_adapter"] = [await decode_speed(engine, "adapter") for _ in range(args.repeats)]
        finally:
            engine.shutdown()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()
    print(json.dumps(asyncio.run(amain(args)), indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
