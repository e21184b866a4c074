"""Moving trainer weights into an engine, bucket by bucket.

A weight sync never holds the whole model in one place: the trainer gathers its parameters a few at a time into
*buckets* of at most ``actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes`` (verl's key),
each packed back to back into one byte buffer in the engine's dtype (:class:`WeightBucket`). Every replica gets each
bucket (as a Ray object reference, so a replica on another node fetches it there) and loads it before the next
one arrives: :meth:`begin_weight_update`, :meth:`load_weight_bucket` per bucket, :meth:`finish_weight_update` on
each engine (see :mod:`arpo.engine.base`). A tensor bigger than a bucket travels alone in a bucket of its own size.

An engine also takes a whole state dict or a safetensors directory (:func:`save_weights_for_engine`) through
``update_weights`` (tests, tools); a state dict is then cut into buckets inside the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence, Union

import numpy as np
import torch

from tools.python_sandbox.cgroups import pid_alive

WEIGHTS_FILE = "model.safetensors"
#: verl's default bucket size (MiB)
DEFAULT_BUCKET_MEGABYTES = 512
#: each tensor starts at a multiple of this many bytes in a bucket, so it can be viewed in place as any dtype
ALIGNMENT = 64

#: what ``update_weights`` takes: a state dict in HF names, or a directory of ``*.safetensors``
EngineWeights = Union[Mapping[str, torch.Tensor], str, os.PathLike]


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a bucket's byte buffer."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _dtype(self.dtype).itemsize


@dataclass
class WeightBucket:
    """Tensors of one weight-sync step, back to back in one ``uint8`` buffer: a numpy array travels through Ray's
    object store without pickling (and without a copy out of it on the same node), a tensor within one process."""

    entries: tuple[BucketEntry, ...]
    data: np.ndarray | torch.Tensor | bytes | memoryview

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def buffer(self) -> torch.Tensor:
        """The byte buffer as a tensor (no copy); ``data`` may also be any bytes-like object (how a bucket crosses
        into vLLM's engine core)."""
        if isinstance(self.data, torch.Tensor):
            return self.data
        with warnings.catch_warnings():  # buffers from Ray's object store or a message are read-only; only read here
            warnings.filterwarnings("ignore", message="The given (NumPy array|buffer) is not writable")
            if isinstance(self.data, np.ndarray):
                return torch.from_numpy(self.data)
            if not memoryview(self.data).nbytes:
                return torch.empty(0, dtype=torch.uint8)
            return torch.frombuffer(self.data, dtype=torch.uint8)

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) per entry, views into the buffer (no copy)."""
        flat = self.buffer()
        return [(e.name, flat[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape))
                for e in self.entries]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weight bucket")
    return dtype


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def transfer_dtype(dtype: torch.dtype, engine_dtype: torch.dtype) -> torch.dtype:
    """Floating-point weights travel in the engine's dtype (bf16 halves the bytes of fp32 master weights);
    integer tensors keep theirs."""
    return engine_dtype if dtype.is_floating_point else dtype


def _aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def plan_buckets(specs: Iterable[tuple[str, Sequence[int], torch.dtype]], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Cut tensors (name, shape, dtype as sent), in the given order, into consecutive buckets of at most
    ``bucket_bytes`` each; a tensor bigger than that gets a bucket of its own (of its size). Needs no data: the
    shapes of a model on the meta device plan it as well as the real one."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes}: must be >= 1")
    buckets: list[list[BucketEntry]] = []
    current: list[BucketEntry] = []
    used = 0
    for name, shape, dtype in specs:
        size = _numel(shape) * dtype.itemsize
        if current and used + size > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(BucketEntry(name, dtype_name(dtype), tuple(int(s) for s in shape), used))
        used = _aligned(used + size)
    if current:
        buckets.append(current)
    return buckets


def bucket_size(entries: Sequence[BucketEntry]) -> int:
    """Bytes of a bucket's buffer."""
    last = entries[-1]
    return last.offset + last.nbytes if entries else 0


def pack_bucket(entries: Sequence[BucketEntry], tensors: Iterable[torch.Tensor],
                out: torch.Tensor | None = None) -> WeightBucket:
    """Copy ``tensors`` (one per entry, in order, converted to the entry's dtype) into ``out`` (a ``uint8`` buffer
    of at least :func:`bucket_size` bytes; a fresh one when None) and return the bucket over it."""
    size = bucket_size(entries)
    buf = torch.empty(size, dtype=torch.uint8) if out is None else out[:size]
    bucket = WeightBucket(tuple(entries), buf)
    for (_, view), tensor in zip(bucket.tensors(), tensors, strict=True):
        view.copy_(tensor.detach().reshape(view.shape), non_blocking=buf.is_pinned())
    return bucket


def split_bucket(bucket: WeightBucket, max_bytes: int) -> Iterator[WeightBucket]:
    """``bucket`` as consecutive smaller buckets of whole tensors, at most ``max_bytes`` each (a bigger tensor
    alone), sharing its buffer (no copy)."""
    flat = bucket.buffer()
    for entries in plan_buckets(((e.name, e.shape, _dtype(e.dtype)) for e in bucket.entries), max_bytes):
        start = next(e.offset for e in bucket.entries if e.name == entries[0].name)
        yield WeightBucket(tuple(entries), flat[start:start + bucket_size(entries)])


def state_dict_buckets(state: Mapping[str, torch.Tensor], engine_dtype: torch.dtype,
                       bucket_bytes: int) -> Iterator[WeightBucket]:
    """A whole state dict as buckets in ``engine_dtype`` (``update_weights`` of a state dict); tensors that share
    storage (tied embeddings) are sent once under their first name, as HF checkpoints store them."""
    tensors = dict(_unique_tensors(state))
    plan = plan_buckets(((n, t.shape, transfer_dtype(t.dtype, engine_dtype)) for n, t in tensors.items()),
                        bucket_bytes)
    for entries in plan:
        yield pack_bucket(entries, (tensors[e.name].to("cpu") for e in entries))


def _unique_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t


def default_weights_dir(tag: str = "arpo_weights") -> Path:
    """A fresh directory in RAM (``/dev/shm``) where it exists, else in the temp dir, named with this process's
    pid. Those of ``tag`` whose process is gone (a killed process cannot clean up) are removed first: RAM is not
    given back by a reboot-free machine otherwise."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    for old in Path(base or tempfile.gettempdir()).glob(f"{tag}_pid*_*"):
        pid = old.name[len(tag) + 4:].split("_", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{tag}_pid{os.getpid()}_", dir=base))


def save_weights_for_engine(weights: torch.nn.Module | Mapping[str, torch.Tensor], out_dir: str | Path,
                            dtype: torch.dtype | None = None) -> Path:
    """Write a model's (or a state dict's) weights to ``out_dir/model.safetensors`` in HF checkpoint names.

    Earlier ``*.safetensors`` in ``out_dir`` are removed first, since engines load every such file there.
    Tensors sharing storage (tied embeddings) are written once under their first name, as HF checkpoints do.
    ``dtype`` converts floating-point tensors (e.g. to bfloat16 to halve the bytes moved).
    """
    from safetensors.torch import save_file

    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in _unique_tensors(state):
        t = t.to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[name] = t.contiguous()
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    # Rename last, so a reader never sees a half-written file under a name it loads.
    tmp.replace(out / WEIGHTS_FILE)
    return out


def load_weights_from_dir(weights_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every ``*.safetensors`` in ``weights_dir`` (on CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(weights_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {weights_dir}: write them with save_weights_for_engine")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def state_dict_of(weights: EngineWeights) -> Mapping[str, torch.Tensor]:
    """The tensors of ``weights``: a state dict, or a directory of ``*.safetensors``."""
    return weights if isinstance(weights, Mapping) else load_weights_from_dir(weights)
