"""An engine in its own Ray actor process, used from the driver as a local :class:`GenerationEngine`.

``VLLMEngineActor`` / ``HFEngineActor`` are the engine classes themselves made remote (every method runs in the
actor; their ``async`` methods run concurrently on the actor's event loop, so concurrent ``generate`` calls still
meet in vLLM's continuous batch). :class:`RayEngineClient` turns Ray's ``handle.method.remote(...)`` calling
convention into ``await client.method(...)`` for every method at once.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import ray

from arpo.engine.config import EngineConfig
from arpo.engine.hf_engine import HFEngine
from arpo.engine.vllm_engine import VLLMEngine

VLLMEngineActor = ray.remote(VLLMEngine)
HFEngineActor = ray.remote(HFEngine)

# Each in-flight generate() holds one slot of the actor; a whole rollout batch must fit at once.
_MAX_CONCURRENCY = 4096


class RayEngineClient:
    """Awaitable view of an engine actor: ``await client.generate(...)`` is ``await handle.generate.remote(...)``."""

    def __init__(self, handle: "ray.actor.ActorHandle"):
        self.handle = handle

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self.handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await method.remote(*args, **kwargs)

        call.__name__ = name
        return call

    def kill(self) -> None:
        """Stop the engine and its actor process."""
        try:
            ray.get(self.handle.shutdown.remote(), timeout=60)
        finally:
            ray.kill(self.handle)


def launch_engine_actor(config: EngineConfig) -> RayEngineClient:
    """Start the configured backend in a new actor (Ray must be initialised: :func:`arpo.ray_utils.init_ray`);
    return once the engine is ready, raising the engine's own error if it failed to start."""
    actor_cls = {"vllm": VLLMEngineActor, "hf": HFEngineActor}[config.name]
    num_gpus = config.tensor_model_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": num_gpus, "max_concurrency": _MAX_CONCURRENCY}
    if not num_gpus:
        # Ray pins OMP_NUM_THREADS to the actor's CPU share (1); the engine only computes while the trainer
        # ranks wait for its rollouts, so it may use every core.
        env = dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
        env["OMP_NUM_THREADS"] = str(config.cpu_threads or _cores())
        options["runtime_env"] = {"env_vars": env}
    handle = actor_cls.options(**options).remote(config)
    ray.get(handle.get_startup_seconds.remote())
    return RayEngineClient(handle)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
