"""The settings a memory plan depends on, read once from the composed training config (configs/arpo_trainer.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

# the engine's token budget per step when max_num_batched_tokens is null: the planner sizes what a GPU engine gets
from arpo.engine.config import DEFAULT_BATCHED_TOKENS
from arpo.plan.lora_buffers import EngineLoRA, engine_lora

#: ``actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes`` when the config has no such key
DEFAULT_BUCKET_MB = 512
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    value = OmegaConf.select(cfg, key, default=default)
    return default if value is None else value


def _dtype_bytes(name: str, gpu: bool, key: str) -> int:
    """Bytes per element of a dtype key's value: ``auto`` and ``fast`` are bf16 on a GPU; on a CPU what this
    machine resolves them to (arpo/trainer/device.py: ``fast`` is bf16 only with native bf16 instructions)."""
    name = str(name).lower()
    if name in ("auto", "fast"):
        from arpo.trainer.device import resolve_dtype

        return 2 if gpu else resolve_dtype(name, "cpu").itemsize
    if name not in _DTYPE_BYTES:
        raise ValueError(f"{key}={name!r}: the planner knows {sorted(_DTYPE_BYTES)} and auto/fast")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True)
class PlanSettings:
    """Layout, batch and memory keys of one run, with verl's meaning; ``gpu`` says whether ranks sit on GPUs."""

    gpu: bool
    nnodes: int
    gpus_per_node: int
    hybrid: bool
    tensor_parallel: int
    replicas: int
    max_prompt: int
    max_response: int
    n: int
    train_batch_size: int
    micro_batch: int  # actor ppo_micro_batch_size_per_gpu
    logprob_micro_batch: int  # actor (old log-probs) rollout.log_prob_micro_batch_size_per_gpu
    ref_micro_batch: int
    critic_micro_batch: int
    critic_forward_micro_batch: int
    gradient_checkpointing: bool
    critic_gradient_checkpointing: bool
    compute_bytes: int  # actor/ref/critic compute dtype
    engine_bytes: int  # vLLM's dtype
    logprob_chunk: int
    tree_packing: bool
    reference: bool  # a reference worker group (a KL term without LoRA; with LoRA the actor's base model serves)
    critic: bool
    lora_rank: int  # 0: full fine-tuning; > 0: only adapters have gradients and AdamW state
    lora_targets: str | tuple[str, ...]
    free_cache_engine: bool
    cuda_graphs: bool  # vLLM captures CUDA graphs (enforce_eager false, or null on a GPU)
    sleep_level: int
    gpu_memory_utilization: float
    max_model_len: int | None  # None: the model's max_position_embeddings
    max_num_seqs: int
    max_num_batched_tokens: int
    bucket_bytes: int
    object_store_bytes: int
    cpu_kvcache_bytes: int
    #: how LoRA weights reach the engines (resolved for the planned device: adapter | merged; None without LoRA)
    lora_serving: str | None = None
    #: with ``lora_serving: adapter``: the engine's LoRA settings, which size vLLM's LoRA buffers
    engine_lora: EngineLoRA | None = None
    #: actor_rollout_ref.actor.fsdp_config.reshard_after_forward: false keeps every layer gathered through the update
    reshard_after_forward: bool = True

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def seq_len(self) -> int:
        """A trajectory's padded length in the trainer: the longest prompt plus the longest response."""
        return self.max_prompt + self.max_response

    def with_changes(self, **changes: Any) -> "PlanSettings":
        return replace(self, **changes)

    @classmethod
    def from_config(cls, cfg: DictConfig, gpu: bool) -> "PlanSettings":
        from arpo.engine.config import resolve_enforce_eager
        from arpo.trainer.actor_config import needs_reference, uses_critic

        r = "actor_rollout_ref.rollout"
        t = cfg.trainer
        hybrid = bool(_get(cfg, "actor_rollout_ref.hybrid_engine", True))
        tp = int(_get(cfg, f"{r}.tensor_model_parallel_size", 1))
        world = int(t.nnodes) * int(t.n_gpus_per_node)
        replicas = _get(cfg, f"{r}.num_replicas")
        if replicas is None:  # the run's own rule: one per tensor-parallel group of training GPUs when colocated
            from arpo.runtime.placement import auto_num_replicas

            replicas = auto_num_replicas(hybrid, world, tp, gpu)
        free_cache = _get(cfg, f"{r}.free_cache_engine")  # null: on when colocated on GPUs, as the run resolves it
        tree = str(_get(cfg, "actor_rollout_ref.model.tree_packing", "auto")).lower()
        bucket_mb = float(_get(cfg, f"{r}.checkpoint_engine.update_weights_bucket_megabytes", DEFAULT_BUCKET_MB))
        kv_gb = _get(cfg, f"{r}.cpu_kvcache_space_gb", 2)
        model_len = _get(cfg, f"{r}.max_model_len")
        lora_rank = int(_get(cfg, "actor_rollout_ref.model.lora_rank", 0))
        serving = _lora_serving(cfg, gpu)
        kwargs = OmegaConf.select(cfg, f"{r}.engine_kwargs", default=None)
        kwargs = OmegaConf.to_container(kwargs, resolve=True) if isinstance(kwargs, DictConfig) else kwargs
        return cls(
            gpu=gpu, nnodes=int(t.nnodes), gpus_per_node=int(t.n_gpus_per_node), hybrid=hybrid, tensor_parallel=tp,
            replicas=int(replicas),
            max_prompt=int(cfg.data.max_prompt_length), max_response=int(cfg.data.max_response_length),
            n=int(_get(cfg, f"{r}.n", 1)), train_batch_size=int(cfg.data.train_batch_size),
            micro_batch=int(_get(cfg, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1)),
            logprob_micro_batch=int(_get(cfg, f"{r}.log_prob_micro_batch_size_per_gpu", 1)),
            ref_micro_batch=int(_get(cfg, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1)),
            critic_micro_batch=int(_get(cfg, "critic.ppo_micro_batch_size_per_gpu", 1)),
            critic_forward_micro_batch=int(_get(cfg, "critic.forward_micro_batch_size_per_gpu", 1)),
            gradient_checkpointing=bool(_get(cfg, "actor_rollout_ref.model.enable_gradient_checkpointing", True)),
            critic_gradient_checkpointing=bool(_get(cfg, "critic.model.enable_gradient_checkpointing", True)),
            compute_bytes=_dtype_bytes(_get(cfg, "actor_rollout_ref.model.dtype", "auto"), gpu,
                                       "actor_rollout_ref.model.dtype"),
            engine_bytes=_dtype_bytes(_get(cfg, f"{r}.dtype", "auto"), gpu, f"{r}.dtype"),
            logprob_chunk=int(_get(cfg, "actor_rollout_ref.actor.logprob_chunk_size", 256)),
            tree_packing=tree == "true" or (tree == "auto" and not gpu),
            reference=needs_reference(cfg), critic=uses_critic(cfg),
            lora_rank=lora_rank,
            lora_targets=_lora_targets(_get(cfg, "actor_rollout_ref.model.target_modules", "all-linear")),
            free_cache_engine=bool(hybrid and gpu) if free_cache is None else bool(free_cache),
            cuda_graphs=gpu and not resolve_enforce_eager(_get(cfg, f"{r}.enforce_eager"), "cuda"),
            sleep_level=int(_get(cfg, f"{r}.sleep_level", 1)),
            gpu_memory_utilization=float(_get(cfg, f"{r}.gpu_memory_utilization", 0.5)),
            max_model_len=None if model_len is None else int(model_len),
            max_num_seqs=int(_get(cfg, f"{r}.max_num_seqs", 256)),
            max_num_batched_tokens=int(_get(cfg, f"{r}.max_num_batched_tokens", DEFAULT_BATCHED_TOKENS)),
            bucket_bytes=int(bucket_mb * 2**20),
            object_store_bytes=int(_get(cfg, "ray_init.object_store_memory", 2 * 2**30)),
            cpu_kvcache_bytes=int(float(kv_gb) * 2**30),
            lora_serving=serving,
            reshard_after_forward=bool(_get(cfg, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward", True)),
            engine_lora=engine_lora(lora_rank, kwargs) if serving == "adapter" else None)


def _lora_serving(cfg: DictConfig, gpu: bool) -> str | None:
    """``lora_serving`` as resolved at start-up; on a config that never started (``python -m arpo.plan``), for the
    device planned (a GPU plan on a CPU machine plans what a GPU run would do)."""
    from arpo.engine.lora_serving import lora_serving_from_cfg

    return lora_serving_from_cfg(cfg, "cuda" if gpu else "cpu")


def _lora_targets(value: Any) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(str(t) for t in value)
