"""The one place that decides where training runs: device, torch.distributed backend and dtype.

CPU: gloo; ``auto`` is float32 (exact: ranks agree with one process to ~1e-9). ``fast`` is bfloat16 where the
hardware computes it natively (CUDA; a CPU with avx512_bf16 or AMX) and float32 elsewhere: on an avx2-only CPU a
bf16 matmul is emulated, ~86x slower than float32 (1024x1024, one core, AMD EPYC without avx512_bf16), so an
explicit ``bfloat16`` there would make a run take hours instead of minutes. ``bfloat16`` on CPU is
autocast: matmuls and attention in bf16, while master weights, gradients, optimizer state, norms, the
residual stream and the log-prob head stay fp32. bf16 matmuls are fast only on CPUs with native bf16
(avx512_bf16 or AMX: 3-5x fp32 on one core here); elsewhere they are emulated and slower than fp32.
GPU: nccl and bfloat16 compute with fp32 master weights and fp32 gradient reduction (FSDP2 mixed precision).
Keys: ``trainer.device`` (auto | cpu | cuda) and ``actor_rollout_ref.model.dtype`` (auto | fast | float32 |
bfloat16 | float16); ``sft.dtype`` and ``actor_rollout_ref.rollout.dtype`` resolve ``fast`` here too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: every value a dtype key takes: the named dtypes plus auto (exact on CPU) and fast (native low precision)
DTYPE_CHOICES = ("auto", "fast", *DTYPES)


@dataclass(frozen=True)
class DeviceSettings:
    """Where one training rank runs and in which precision it computes."""

    device_type: str          # "cpu" | "cuda"
    backend: str              # "gloo" | "nccl"
    compute_dtype: torch.dtype

    def device(self, local_rank: int = 0) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        return torch.device("cpu")

    @property
    def mixed_precision(self) -> bool:
        return self.compute_dtype != torch.float32

    @property
    def fast_layout(self) -> bool:
        """Whether batches may be laid out for speed rather than as one process would run them.

        float32 is the exact mode: data-parallel ranks reproduce one process's update to ~1e-7, which holds
        only while every sum is formed in the same order (Adam turns rounding noise on gradients that are 0
        in exact arithmetic into lr-sized steps). Low precision is ~1e-2 from fp32 anyway, so it takes the
        faster layout: rows dealt to ranks by length, left-aligned without a padding mask, and only loss
        positions through the output head."""
        return self.mixed_precision

    @property
    def autocast(self) -> bool:
        """Low precision by autocast (CPU) rather than by FSDP2 casting the parameters (GPU): on CPU the
        residual stream and norms stay fp32, which FSDP2's param_dtype would put in bf16 too."""
        return self.mixed_precision and self.device_type == "cpu"

    @property
    def fsdp_mixed_precision(self) -> bool:
        return self.mixed_precision and not self.autocast

    def autocast_context(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in the compute dtype when :attr:`autocast`, else a no-op."""
        if not self.autocast:
            return contextlib.nullcontext()
        # No cast cache: it would hold a bf16 copy of every gathered (unsharded) weight until the forward
        # ends, i.e. the whole model on every rank; each weight is used once per forward anyway.
        return torch.autocast(self.device_type, dtype=self.compute_dtype, cache_enabled=False)


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (avx512_bf16 or AMX); False when unknown."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_dtype(device_type: str) -> torch.dtype:
    """bfloat16 where it is computed natively (CUDA, or a CPU with avx512_bf16/AMX), else float32."""
    if device_type.startswith("cuda") or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_device_type(device: str | None) -> str:
    """``auto`` → cuda when a GPU is visible, else cpu; an explicit ``cuda`` without a GPU is an error."""
    device = (device or "auto").lower()
    if device not in DEVICES:
        raise ValueError(f"trainer.device={device!r} is not valid; choose one of: {', '.join(DEVICES)}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device=cuda but torch sees no GPU (torch.cuda.is_available() is False); "
                         "use trainer.device=cpu or auto")
    return device


def resolve_dtype(dtype: str | None, device_type: str) -> torch.dtype:
    """``auto`` → bfloat16 on cuda, float32 on cpu; ``fast`` → :func:`fast_dtype`."""
    dtype = (dtype or "auto").lower()
    if dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    if dtype == "fast":
        return fast_dtype(device_type)
    if dtype not in DTYPES:
        raise ValueError(f"actor_rollout_ref.model.dtype={dtype!r} is not valid; choose one of: "
                         f"{', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


def device_settings(device: str | None = "auto", dtype: str | None = "auto") -> DeviceSettings:
    device_type = resolve_device_type(device)
    return DeviceSettings(device_type=device_type, backend="nccl" if device_type == "cuda" else "gloo",
                          compute_dtype=resolve_dtype(dtype, device_type))


def device_settings_from_config(cfg) -> DeviceSettings:
    """:func:`device_settings` from a root config (``trainer.device``, ``actor_rollout_ref.model.dtype``)."""
    from arpo.trainer.actor_config import cfg_get

    return device_settings(cfg_get(cfg, "trainer.device", "auto"), cfg_get(cfg, "actor_rollout_ref.model.dtype", "auto"))
