"""Moving trainer weights into an engine. The trainer hands an engine the full state dict (through Ray's object
store, so it reaches an engine on any node); an engine that reloads from files (vLLM: its in-place
``reload_weights`` redoes the CPU kernels' weight packing) writes them itself, with :func:`save_weights_for_engine`,
into a directory in RAM on its own node. An engine also takes such a directory directly (tests, tools).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Mapping, Union

import numpy as np
import torch

from tools.python_sandbox.cgroups import pid_alive

WEIGHTS_FILE = "model.safetensors"

#: what ``update_weights`` takes: a state dict in HF names (tensors, or :func:`for_transport`'s arrays), or a
#: directory of ``*.safetensors``
EngineWeights = Union[Mapping[str, Union[torch.Tensor, np.ndarray]], str, os.PathLike]

_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8,
                 torch.bool)


def default_weights_dir(tag: str = "arpo_weights") -> Path:
    """A fresh directory in RAM (``/dev/shm``) where it exists, else in the temp dir, named with this process's
    pid. Those of ``tag`` whose process is gone (a killed engine cannot clean up) are removed first: RAM is not
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
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        t = tensor.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            continue
        seen.add(key)
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


def for_transport(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A state dict as numpy arrays, the form Ray moves out of band: one copy into its object store, none out of
    it on the same node (torch tensors are pickled: measured with SmolLM2-135M, 1.1 s to put 0.54 GB). A dtype
    numpy lacks (bfloat16) travels as float32, which holds it exactly."""
    return {k: (v if v.dtype in _NUMPY_DTYPES else v.float()).detach().cpu().contiguous().numpy()
            for k, v in state.items()}


def state_dict_of(weights: EngineWeights) -> Mapping[str, torch.Tensor]:
    """The tensors of ``weights``: a state dict (of tensors or :func:`for_transport`'s arrays) or a directory."""
    if not isinstance(weights, Mapping):
        return load_weights_from_dir(weights)
    with warnings.catch_warnings():  # arrays straight from Ray's object store are read-only; they are only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in weights.items()}
