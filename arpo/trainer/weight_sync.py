"""The actor's weights into every engine replica, streamed in buckets (see :mod:`arpo.engine.weights`).

Each engine pauses (requests in flight are kept) and names the dtype it computes in; the actor's ranks plan the
same buckets from their parameters' shapes, then per bucket gather its parameters whole (rank 0 packs them) while
the engines load the bucket before: bucket i+1 is gathered while bucket i loads. A bucket from a Ray worker group
is one object in Ray's object store, which every engine actor fetches to its own node; an engine in this process
gets the tensors. At any time rank 0 holds the bucket it packs, the object store the one being loaded and the
next, each engine the bucket it loads (plus vLLM's layer in progress): memory is bounded by about two buckets
everywhere, whatever the model's size. The engines finish (and resume generation) even when a bucket fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Sequence

#: adapter versions kept on disk: the newest is being served; older ones only for requests still finishing on them
KEEP_ADAPTERS = 3


def _ray() -> Any:
    return sys.modules.get("ray")  # nothing is a Ray object where Ray was never imported


def _is_remote(engine: Any) -> bool:
    ray_engine = sys.modules.get("arpo.engine.ray_engine")
    return ray_engine is not None and isinstance(engine, ray_engine.RayEngineClient)


async def stream_weights(group: Any, engines: Sequence[Any], bucket_bytes: int) -> dict[str, float]:
    """Push the weights of ``group`` (a :class:`~arpo.trainer.worker_group.WorkerGroup` of the actor) into every
    engine of ``engines``, ``bucket_bytes`` at most per bucket (one tensor bigger than that: a bucket of its own).
    Returns the number of buckets, the bytes sent to each engine, the largest bucket and the seconds taken."""
    start = time.perf_counter()
    dtypes = await asyncio.gather(*(e.begin_weight_update() for e in engines))
    n_buckets = total = largest = 0
    try:
        if len(set(dtypes)) != 1:
            raise RuntimeError(f"engine replicas compute in different dtypes {sorted(set(dtypes))}; give them one "
                               f"actor_rollout_ref.rollout.dtype")
        sizes = group.plan_weight_sync(dtypes[0], bucket_bytes)
        n_buckets = len(sizes)
        upcoming = group.weight_bucket(0) if n_buckets else None
        for index in range(n_buckets):
            bucket = upcoming
            # the next gather runs on the actor's ranks while the engines load this bucket
            upcoming = group.weight_bucket(index + 1) if index + 1 < n_buckets else None
            await _deliver(bucket, engines)
            total += sizes[index]
            largest = max(largest, sizes[index])
            del bucket
    finally:
        try:
            await asyncio.gather(*(e.finish_weight_update() for e in engines))
        finally:
            group.end_weight_sync()
    return {"buckets": n_buckets, "bytes": total, "largest_bucket_bytes": largest, "dtype": dtypes[0],
            "seconds": time.perf_counter() - start}


async def _deliver(bucket: Any, engines: Sequence[Any]) -> None:
    """One bucket to every engine: by reference to engine actors (each fetches it to its node), as the bucket to
    engines in this process."""
    ray = _ray()
    is_ref = ray is not None and isinstance(bucket, ray.ObjectRef)
    remote = [_is_remote(e) for e in engines]
    ref = bucket if is_ref or not any(remote) else ray.put(bucket)
    value = (await bucket) if is_ref and not all(remote) else bucket  # an ObjectRef is awaitable
    await asyncio.gather(*(e.load_weight_bucket(ref if r else value) for e, r in zip(engines, remote)))


async def sync_adapter(group: Any, engines: Sequence[Any], out_dir: str | Path,
                       keep: int = KEEP_ADAPTERS) -> dict[str, float]:
    """With ``lora_serving: adapter``: rank 0 of ``group`` saves the adapters alone (gathered whole) to ``out_dir``
    (peft layout) and every engine of ``engines`` serves them from there on its base weights as a new LoRA request
    (:meth:`arpo.engine.vllm_engine.VLLMEngine.load_adapter`); only the newest ``keep`` versions beside it stay on
    disk. Engine actors read the directory themselves, so on several nodes it must be on a shared filesystem.
    Returns what :func:`stream_weights` does (one "bucket": the adapter's files)."""
    start = time.perf_counter()
    path = Path(group.execute_all("save_lora_adapter", str(out_dir))[0])
    os.utime(path)  # files rewritten in place (a resumed run's step) leave the directory's time as it was
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    await asyncio.gather(*(e.load_adapter(str(path)) for e in engines))
    prune_adapters(path.parent, keep)
    return {"buckets": 1, "bytes": size, "largest_bucket_bytes": size, "dtype": "adapter",
            "seconds": time.perf_counter() - start}


def prune_adapters(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently written adapter directories (``step_*``) under ``root``: by time,
    not N, so a resumed run's first version is never taken for an old one beside a dead run's higher steps."""
    written = sorted((d for d in root.glob("step_*") if d.is_dir()),
                     key=lambda d: (d.stat().st_mtime_ns, int(d.name[5:]) if d.name[5:].isdigit() else -1))
    for old in written[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
