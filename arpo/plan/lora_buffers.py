"""vLLM's LoRA buffers: what an engine serving the policy's adapter (``lora_serving: adapter``) holds besides its
weights, per GPU of a replica, from the model's shapes.

With ``enable_lora`` vLLM wraps every linear layer of the model (not only the adapter's targets: the engine starts
before any adapter exists) and, for models whose vLLM class lists them in ``embedding_modules`` (Llama: yes;
Qwen2: no), the input embedding and the logits. Each wrapper preallocates, for each of ``max_loras`` slots,
A and B stacks of ``max_lora_rank`` in ``lora_dtype`` (``create_lora_weights`` in vllm/lora/layers/*.py), per
output slice of a packed layer:

* merged QKV (qkv_proj): 3 x A (r, h) and B (q/tp, r), 2 x (h_kv', r), h_kv' = max(1, kv_heads/tp) heads;
* merged gate_up: 2 x A (r, h) and 2 x B (i/tp, r);
* row-parallel o_proj / down_proj: A (r, in/tp) and B (h, r);
* embedding: A (V, r), B (h, r); logits: A (r, h), B (V, r) (both whole on every rank);

with ``fully_sharded_loras`` the column-parallel A stacks hold r/tp rows and the row-parallel B stacks h/tp.
They are allocated while the model loads, so vLLM counts them with its weights: they come out of the KV cache, and
a sleeping engine offloads them with the weights. The punica kernels' index metadata (a few int tensors of
``max_num_batched_tokens``) comes with them. ``tests/test_plan_lora.py`` checks these bytes against the buffers
vLLM itself allocates for tiny Llama and Qwen2 layers at several tensor-parallel sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from arpo.plan.shapes import ModelShapes

#: vLLM's LoRAConfig fields an engine's ``engine_kwargs`` may set over arpo's own engine arguments
LORA_CONFIG_KEYS = ("max_lora_rank", "max_loras", "max_cpu_loras", "fully_sharded_loras", "lora_dtype")
_LORA_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class EngineLoRA:
    """The LoRA settings a vLLM engine serving the adapter starts with (its ``LoRAConfig``)."""

    max_lora_rank: int
    max_loras: int
    max_cpu_loras: int
    fully_sharded: bool
    #: bytes per element of ``lora_dtype``; None for ``auto`` (the engine's dtype)
    dtype_bytes: int | None


def _dtype_bytes(value: Any) -> int | None:
    name = str(value).removeprefix("torch.")
    if name in ("auto", "None"):
        return None
    if name not in _LORA_DTYPE_BYTES:
        raise ValueError(f"lora_dtype={value!r}: the planner knows auto, {', '.join(_LORA_DTYPE_BYTES)}")
    return _LORA_DTYPE_BYTES[name]


def engine_lora(rank: int, engine_kwargs: Mapping[str, Any] | None = None) -> EngineLoRA:
    """The engine's LoRA settings for adapters of ``rank``: arpo's engine arguments
    (:func:`arpo.engine.lora_serving.lora_engine_args`) with ``engine_kwargs`` over them, as the engine applies them,
    and vLLM's own ``LoRAConfig`` defaults for the rest (built from the installed vLLM; without one, the
    defaults of vLLM 0.32: max_cpu_loras = max_loras, not fully sharded, lora_dtype auto)."""
    from arpo.engine.lora_serving import lora_engine_args

    args = {k: v for k, v in lora_engine_args(rank).items() if k in LORA_CONFIG_KEYS}
    args.update({k: v for k, v in (engine_kwargs or {}).items() if k in LORA_CONFIG_KEYS})
    config = _vllm_lora_config(tuple(sorted(args.items())))
    if config is None:
        return EngineLoRA(int(args["max_lora_rank"]), int(args["max_loras"]),
                          int(args.get("max_cpu_loras") or args["max_loras"]),
                          bool(args.get("fully_sharded_loras", False)), _dtype_bytes(args.get("lora_dtype", "auto")))
    return EngineLoRA(int(config.max_lora_rank), int(config.max_loras), int(config.max_cpu_loras),
                      bool(config.fully_sharded_loras), _dtype_bytes(config.lora_dtype))


@lru_cache(maxsize=16)
def _vllm_lora_config(args: tuple[tuple[str, Any], ...]) -> Any | None:
    try:
        from vllm.config.lora import LoRAConfig
    except ImportError:  # planning on a machine without vLLM: the caller mirrors its defaults
        return None
    return LoRAConfig(**dict(args))


@lru_cache(maxsize=16)
def wrapped_embeddings(architecture: str) -> tuple[bool, bool]:
    """Whether vLLM's class for ``architecture`` wraps the input embedding and the logits with LoRA (its
    ``embedding_modules``). Without vLLM, or for a class it does not know, both (the larger plan)."""
    try:
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError:
        return True, True
    model = ModelRegistry.models.get(architecture)
    if model is None:
        return True, True
    modules = dict(getattr(model.load_model_cls(), "embedding_modules", None) or {})
    return "embed_tokens" in modules, "lm_head" in modules


def buffer_bytes(m: ModelShapes, tp: int, lora: EngineLoRA, engine_bytes: int,
                 embeddings: tuple[bool, bool] | None = None) -> int:
    """Bytes of the A and B stacks vLLM preallocates on each GPU of a replica of tensor-parallel size ``tp``
    (module docstring); ``embeddings``: whether the input embedding and the logits are wrapped (default: as vLLM's
    class for the architecture says)."""
    r, slots = lora.max_lora_rank, lora.max_loras
    h, i, q = m.hidden, m.intermediate, m.heads * m.head_dim
    kv = max(1, m.kv_heads // tp) * m.head_dim  # vLLM replicates KV heads when tp exceeds them
    a_rank = r // tp if lora.fully_sharded else r  # column-parallel A: split on the rank (S-LoRA)
    row_out = h // tp if lora.fully_sharded else h  # row-parallel B: split on the output
    per_layer = (3 * a_rank * h + (q // tp + 2 * kv) * r  # qkv_proj
                 + r * (q // tp) + row_out * r  # o_proj
                 + 2 * a_rank * h + 2 * (i // tp) * r  # gate_up_proj
                 + r * (i // tp) + row_out * r)  # down_proj
    embed, logits = wrapped_embeddings(m.architecture) if embeddings is None else embeddings
    numel = m.layers * per_layer + embed * (m.vocab * r + h * r) + logits * (r * h + m.vocab * r)
    return slots * numel * (lora.dtype_bytes or engine_bytes)


def punica_metadata_bytes(max_num_batched_tokens: int, max_num_seqs: int, max_loras: int) -> int:
    """The punica kernels' index tensors (vllm/lora/punica_wrapper: four int64 per batched token, three per
    sequence; on a GPU two int32 token maps and per-slot counters for prefill and decode each)."""
    t = max_num_batched_tokens
    base = 4 * 8 * t + 3 * 8 * max_num_seqs
    kernel_meta = 2 * (2 * 4 * t + 4 * (max_loras + 1) * 2 + 4 * (max_loras + 2))
    return base + kernel_meta


def shrink_buffer_bytes(max_num_batched_tokens: int, lora: EngineLoRA) -> int:
    """The fp32 (slices, tokens, rank) buffer a packed layer's LoRA computes into during a forward, two slices at
    gate_up_proj, where the profile run's activations peak: part of the activations vLLM profiles."""
    return 2 * max_num_batched_tokens * lora.max_lora_rank * 4


def engine_lora_bytes(m: ModelShapes, tp: int, lora: EngineLoRA, engine_bytes: int, max_num_batched_tokens: int,
                      max_num_seqs: int) -> int:
    """Everything a replica's GPU preallocates for LoRA at load: the buffers and the punica metadata."""
    return (buffer_bytes(m, tp, lora, engine_bytes)
            + punica_metadata_bytes(max_num_batched_tokens, max_num_seqs, lora.max_loras))


def adapter_host_bytes(m: ModelShapes, rank: int, targets: str | tuple[str, ...], lora: EngineLoRA,
                       engine_bytes: int) -> float:
    """Host RAM of one engine for the served adapter: vLLM keeps ``max_cpu_loras`` loaded adapters in CPU memory
    (``lora_dtype``) and reads a new version (fp32, as the trainer saves it) before the oldest is evicted."""
    numel = m.lora_numel(rank, targets)
    return lora.max_cpu_loras * numel * (lora.dtype_bytes or engine_bytes) + numel * 4


def largest_adapter_numel(m: ModelShapes, rank: int) -> int:
    """The largest adapter tensor (r x the widest of hidden, MLP and attention widths): what one gather holds."""
    return rank * max(m.hidden, m.intermediate, m.heads * m.head_dim)


__all__ = ["EngineLoRA", "adapter_host_bytes", "buffer_bytes", "engine_lora", "engine_lora_bytes",
           "largest_adapter_numel", "punica_metadata_bytes", "shrink_buffer_bytes", "wrapped_embeddings"]
