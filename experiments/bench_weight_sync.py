"""Weight sync from the actor's FSDP2 ranks into engine actors, as the trainer does it: time, bytes, memory.

    python experiments/bench_weight_sync.py --model <smollm2 dir> --engine vllm --ranks 2 --repeats 3
    python experiments/bench_weight_sync.py --model <smollm2 dir> --bucket-megabytes 64

One JSON object on stdout (logs on stderr): the command, the git SHA of the code measured, and per push (median of
``--repeats``) the wall seconds, the bytes each engine received and their dtype, and the peak *extra* host memory
of the actor's rank 0 and of each engine actor's process tree (engine core included): the peak resident memory
during the push over that before it (``*_peak_extra_bytes``: VmHWM, which also counts the pages of Ray's object
store a process touched) and the peak of private memory alone (``*_private_bytes``: RssAnon, sampled every 10 ms).
The engine's private memory is also given for its Ray actor alone (which encodes each bucket into messages) and
its vLLM engine core alone (which holds a message and the layers waiting for weights). Also the weight files engines keep in ``/dev/shm`` and what Ray's object store holds at once. Before each push the actor's weights are scaled
a little on every rank, and a probe after it shows the engine took them.

The push is the trainer's: streamed buckets of
``actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes`` (``--bucket-megabytes``). With
``--lora-rank R`` the actor trains LoRA adapters of rank R (every linear layer) and the push is what
``actor_rollout_ref.rollout.lora_serving`` (``--lora-serving``) makes it: ``adapter``, the adapter directory saved by
rank 0 and served by each vLLM engine on its base weights, or ``merged``, the merged weights in buckets:

    python experiments/bench_weight_sync.py --model <dir> --ranks 1 --lora-rank 16 --lora-serving adapter
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from experiments import PeakSampler  # noqa: E402


def _process_tree_kb(pid: int, field: str, tree: bool = True) -> float:
    """Sum of ``field`` (VmRSS / VmHWM, kB) over ``pid`` and (``tree``) its descendants."""
    import psutil

    total = 0.0
    procs = [psutil.Process(pid)] + (psutil.Process(pid).children(recursive=True) if tree else [])
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith(field + ":"):
                    total += float(line.split()[1])
        except OSError:
            pass
    return total


def private_memory_sampler(pids: list[int], trees: list[bool] | None = None) -> PeakSampler:
    """Peak over time of the private (anonymous) resident memory of process trees, sampled every 10 ms: VmHWM also
    counts the pages of Ray's object store a process has touched, which stay mapped after the object is freed."""
    trees = trees or [True] * len(pids)
    return PeakSampler(lambda: [_process_tree_kb(pid, "RssAnon", tree) for pid, tree in zip(pids, trees)], 0.01)


def _reset_peaks(pid: int) -> None:
    import psutil

    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        try:
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")
        except OSError:
            pass


def _engine_files_bytes() -> int:
    """Bytes of weight files engines keep in RAM between pushes (the earlier vLLM path wrote one per replica)."""
    return sum(f.stat().st_size for d in Path("/dev/shm").glob("arpo_engine_weights_pid*") for f in d.rglob("*")
               if f.is_file())


def _engine_core_pid(actor_pid: int) -> int:
    """vLLM's engine core: the actor's largest child process."""
    import psutil

    return max(psutil.Process(actor_pid).children(recursive=True), key=lambda c: c.memory_info().rss).pid


def _largest_tensor_bytes(model: str, dtype: str) -> int:
    """The largest weight of the checkpoint in the engine's ``dtype``: what one layer's reload holds at a time."""
    import torch
    from safetensors import safe_open

    itemsize = getattr(torch, dtype).itemsize
    largest = 0
    for path in Path(model).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                largest = max(largest, numel * itemsize)
    return largest


def _scale_weights(worker: Any, factor: float) -> None:
    """Every weight times ``factor``; with LoRA the adapters alone (the base is frozen), shifted, as B starts at 0."""
    import torch

    from arpo.trainer.lora import has_lora, is_adapter

    lora = has_lora(worker.model)
    with torch.no_grad():
        for name, p in worker.model.named_parameters():
            if lora and is_adapter(name):
                p.add_(factor - 1.0)
            elif not lora:
                p.mul_(factor)


def _pid(actor: Any) -> int:
    return os.getpid()


def _actor_config(model: str, ranks: int, lora_rank: int = 0) -> dict:
    return {"trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": ranks, "cpus_per_worker": 1},
            "data": {"train_batch_size": 2},
            "actor_rollout_ref": {"model": {"path": model, "dtype": "auto", "lora_rank": lora_rank,
                                            "lora_alpha": 2 * lora_rank or 16},
                                  "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1,
                                            "optim": {"lr": 1e-6}},
                                  "rollout": {"n": 1, "log_prob_micro_batch_size_per_gpu": 1}}}


async def _push(group: Any, engines: list, bucket_bytes: int, adapter_dir: Path | None = None) -> dict[str, Any]:
    """One push as the trainer makes it (``adapter_dir``: the adapter alone, saved there); what it sent."""
    from arpo.trainer.weight_sync import stream_weights, sync_adapter

    if adapter_dir is not None:
        stats = await sync_adapter(group, engines, adapter_dir)
    else:
        stats = await stream_weights(group, engines, bucket_bytes)
    return {"path": "adapter" if adapter_dir is not None else "buckets", "bytes": stats["bytes"], "dtype": stats["dtype"], "buckets": stats["buckets"],
            "largest_bucket_bytes": stats["largest_bucket_bytes"]}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from arpo.engine.base import SamplingParams
    from arpo.engine.config import EngineConfig
    from arpo.engine.factory import create_engines
    from arpo.runtime.ray_utils import init_ray
    from arpo.trainer.worker_group import RayWorkerGroup
    from experiments import git_sha

    lora_rank = getattr(args, "lora_rank", 0)
    adapter = lora_rank > 0 and getattr(args, "lora_serving", "adapter") == "adapter"
    adapter_root = Path(tempfile.mkdtemp(prefix="bench_lora_adapters_")) if adapter else None
    own_ray = not ray.is_initialized()
    init_ray({"ray_init": {"num_cpus": args.ranks + args.replicas + 1}})
    engines = create_engines(EngineConfig(model_path=args.model, name=args.engine, ray_actor=True, max_model_len=512,
                                          num_replicas=args.replicas, lora_rank=lora_rank if adapter else 0,
                                          update_weights_bucket_megabytes=args.bucket_megabytes))
    group = RayWorkerGroup(_actor_config(args.model, args.ranks, lora_rank), role="actor")
    engine_pids = ray.get([e.handle.__ray_call__.remote(_pid) for e in engines])
    rank0_pid = ray.get(group.workers[0].__ray_call__.remote(_pid))
    core_pids = [_engine_core_pid(pid) for pid in engine_pids] if args.engine == "vllm" else []
    probe = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    runs: list[dict[str, Any]] = []
    probes: list[float] = []
    try:
        for r in range(args.repeats):
            ray.get([w.__ray_call__.remote(_scale_weights, 1.0 + 1e-3) for w in group.workers])
            pids = [rank0_pid, *engine_pids]
            rss_before = [_process_tree_kb(pid, "VmRSS") for pid in pids]
            private_before = [_process_tree_kb(pid, "RssAnon") for pid in pids]
            for pid in pids:
                _reset_peaks(pid)
            t0 = time.perf_counter()
            # the engine actor alone and its engine core alone, beside the process trees
            parts = [*engine_pids, *core_pids]
            parts_before = [_process_tree_kb(pid, "RssAnon", tree=False) for pid in parts]
            with private_memory_sampler(pids) as private, private_memory_sampler(parts, [False] * len(parts)) as alone:
                sent = await _push(group, engines, args.bucket_megabytes * 1024 * 1024,
                                   adapter_root / f"step_{r + 1}" if adapter_root else None)
            alone_extra = [(p - b) * 1024 for p, b in zip(alone.peaks, parts_before)]
            seconds = time.perf_counter() - t0
            rss = [(_process_tree_kb(pid, "VmHWM") - b) * 1024 for pid, b in zip(pids, rss_before)]
            anon = [(p - b) * 1024 for p, b in zip(private.peaks, private_before)]
            runs.append({**sent, "seconds": seconds,
                         "rank0_peak_extra_bytes": int(rss[0]), "rank0_peak_extra_private_bytes": int(anon[0]),
                         "engine_peak_extra_bytes": int(max(rss[1:])),
                         "engine_peak_extra_private_bytes": int(max(anon[1:])),
                         "engine_actor_peak_extra_private_bytes": int(max(alone_extra[:len(engine_pids)])),
                         "engine_core_peak_extra_private_bytes": int(max(alone_extra[len(engine_pids):], default=0)),
                         "engine_files_bytes": _engine_files_bytes()})
            out = await engines[0].generate([1, 2, 3, 4], probe, f"probe-{r}")
            probes.append(float(statistics.mean(out.logprobs[0].values())))
    finally:
        group.shutdown()
        for e in engines:
            e.kill()
        if own_ray:
            ray.shutdown()
        if adapter_root is not None:
            shutil.rmtree(adapter_root, ignore_errors=True)
    last = runs[-1]
    result: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in [f"experiments/{Path(__file__).name}",
                                                                  *sys.argv[1:]]),
        "git_sha": git_sha(), "engine": args.engine, "model": Path(args.model).name, "actor_ranks": args.ranks,
        "replicas": args.replicas, "repeats": args.repeats, "lora_rank": lora_rank, "path": last["path"],
        "dtype": last["dtype"],
        "bucket_megabytes": args.bucket_megabytes,
        "buckets": last["buckets"], "bytes_per_engine": last["bytes"],
        "largest_bucket_bytes": last["largest_bucket_bytes"],
        "bytes_moved": last["bytes"] * args.replicas,
        "largest_tensor_bytes": _largest_tensor_bytes(args.model, last["dtype"]) if not adapter else None,
        # what the object store holds at once: a bucket loading and the next being gathered
        "object_store_bound_bytes": 0 if adapter else 2 * last["largest_bucket_bytes"],  # an adapter: a file
        # every push changed the engine's outputs: it took the new weights each time
        "probes_all_differ": all(a != b for a, b in zip(probes, probes[1:])),
    }
    for key in ("seconds", "rank0_peak_extra_bytes", "rank0_peak_extra_private_bytes", "engine_peak_extra_bytes",
                "engine_peak_extra_private_bytes", "engine_actor_peak_extra_private_bytes",
                "engine_core_peak_extra_private_bytes", "engine_files_bytes"):
        result[key] = statistics.median(run[key] for run in runs)
        result[f"{key}_all"] = [run[key] for run in runs]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory")
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--ranks", type=int, default=2, help="the actor's FSDP2 ranks")
    ap.add_argument("--replicas", type=int, default=1, help="engine replicas (each a Ray actor)")
    ap.add_argument("--bucket-megabytes", type=int, default=512,
                    help="actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=0, help="actor_rollout_ref.model.lora_rank (0: no LoRA)")
    ap.add_argument("--lora-serving", choices=["adapter", "merged"], default="adapter",
                    help="actor_rollout_ref.rollout.lora_serving, with --lora-rank")
    args = ap.parse_args()
    from arpo.runtime.logging_utils import json_stdout, setup_logging

    out = json_stdout()
    setup_logging()
    print(json.dumps(asyncio.run(amain(args)), indent=2), file=out, flush=True)


if __name__ == "__main__":
    main()
