"""Weight sync into an engine actor: through a file the trainer writes vs through Ray's object store.

    python experiments/bench_weight_sync.py --model outputs/tiny_arpo/models/tiny-sft
    python experiments/bench_weight_sync.py --model <smollm2 dir> --engine vllm --repeats 5

One JSON object on stdout (logs on stderr). Each repeat scales the weights a little (the engine must really take
new ones) and pushes them both ways into the same engine actor (a Ray actor, as in training):

* ``file`` (the trainer's path up to git 25151a5): the state dict is written as safetensors to a directory
  in RAM (``/dev/shm``), and the engine reloads the directory. Only an engine on the writer's node can read it.
* ``object_store`` (the trainer's path now): the state dict is put in Ray's object store, the engine actor
  fetches it to its own node and (vLLM) writes it to its own RAM directory for the in-place reload.

Medians of the wall time of each step and of the whole push, and the bytes moved.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from arpo.engine.base import SamplingParams
    from arpo.engine.config import EngineConfig
    from arpo.engine.factory import create_engines
    from arpo.engine.weights import default_weights_dir, for_transport, save_weights_for_engine
    from arpo.ray_utils import init_ray

    own_ray = not ray.is_initialized()  # in a test, the module's Ray session is used and left running
    init_ray({"num_cpus": 2})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # as the trainer sends it: a tied head is the embedding
    (engine,) = create_engines(EngineConfig(model_path=args.model, name=args.engine, ray_actor=True, max_model_len=512))
    probe = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    weights_dir = default_weights_dir("bench_weight_sync")
    steps: dict[str, list[float]] = {k: [] for k in ("file_write_s", "file_reload_s", "file_total_s",
                                                     "object_store_put_s", "object_store_reload_s",
                                                     "object_store_total_s")}
    probes: list[float] = []
    try:
        for r in range(args.repeats):
            for way in ("file", "object_store"):
                with torch.no_grad():
                    for v in state.values():
                        if v.is_floating_point():
                            v.mul_(1.0 + 1e-3)
                t0 = time.perf_counter()
                if way == "file":
                    handed: Any = str(save_weights_for_engine(state, weights_dir))
                else:
                    handed = ray.put(for_transport(state))
                t1 = time.perf_counter()
                await engine.update_weights(handed)
                t2 = time.perf_counter()
                first = "file_write_s" if way == "file" else "object_store_put_s"
                steps[first].append(t1 - t0)
                steps[f"{way}_reload_s"].append(t2 - t1)
                steps[f"{way}_total_s"].append(t2 - t0)
                out = await engine.generate([1, 2, 3, 4], probe, f"probe-{r}-{way}")
                probes.append(float(statistics.mean(out.logprobs[0].values())))
                del handed
    finally:
        engine.kill()
        shutil.rmtree(weights_dir, ignore_errors=True)
        if own_ray:
            ray.shutdown()
    result: dict[str, Any] = {
        "engine": args.engine, "model": str(args.model), "repeats": args.repeats,
        "bytes": int(sum(v.numel() * v.element_size() for v in state.values())),
        # every push changed the engine's outputs: it took the new weights each time
        "probes_all_differ": all(a != b for a, b in zip(probes, probes[1:])),
    }
    result.update({k: round(statistics.median(v), 4) for k, v in steps.items()})
    result["object_store_over_file"] = round(result["object_store_total_s"] / result["file_total_s"], 3)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from arpo.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()
    print(json.dumps(asyncio.run(amain(args)), indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
