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

from arpo.engine.config import EngineConfig, default_device
from arpo.engine.hf_engine import HFEngine
from arpo.engine.vllm_engine import VLLMEngine
from arpo.runtime.placement import GpuPlacement

VLLMEngineActor = ray.remote(VLLMEngine)
HFEngineActor = ray.remote(HFEngine)

# Each in-flight generate() holds one slot of the actor; a whole rollout batch must fit at once.
_MAX_CONCURRENCY = 4096


class RayEngineClient:
    """Awaitable view of an engine actor: ``await client.generate(...)`` is ``await handle.generate.remote(...)``."""

    def __init__(self, handle: "ray.actor.ActorHandle", node_id: str | None = None):
        self.handle = handle
        #: the Ray node the actor runs on
        self.node_id = node_id

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


def launch_engine_actors(config: EngineConfig, placement: GpuPlacement | None = None) -> list[RayEngineClient]:
    """Start ``config.num_replicas`` actors of the configured backend at once (Ray must be initialised:
    :func:`arpo.runtime.ray_utils.init_ray`); return once all are ready, raising an engine's own error if one failed.
    With a ``placement`` (a cluster with GPUs) each replica runs in its bundle (:mod:`arpo.runtime.placement`); else
    several replicas go round-robin over the cluster's nodes (most CPUs first; soft: a full node passes its
    replica on)."""
    from arpo.runtime.ray_utils import cluster_nodes, node_strategy

    actor_cls = {"vllm": VLLMEngineActor, "hf": HFEngineActor}[config.name]
    num_gpus = config.tensor_model_parallel_size if ray.cluster_resources().get("GPU", 0) > 0 else 0
    options: dict[str, Any] = {"num_cpus": 1, "num_gpus": num_gpus, "max_concurrency": _MAX_CONCURRENCY}
    nodes = cluster_nodes(1, num_gpus) if config.num_replicas > 1 and placement is None else []
    if not num_gpus or default_device() == "cpu":  # Ray's logical GPUs on a CPU machine compute on CPU too
        # Ray pins OMP_NUM_THREADS to the actor's CPU share (1); the engine only computes while the trainer
        # ranks wait for its rollouts, so it may use every core (replicas share them).
        env = dict(ray.get_runtime_context().runtime_env.get("env_vars") or {})
        env["OMP_NUM_THREADS"] = str(config.cpu_threads or max(1, _cores() // config.num_replicas))
        options["runtime_env"] = {"env_vars": env}

    def where(i: int) -> dict[str, Any]:
        if placement is not None:
            return placement.engine(i).options()
        return {"scheduling_strategy": node_strategy(nodes[i % len(nodes)] if len(nodes) > 1 else None, soft=True)}

    handles = [actor_cls.options(**{**options, **where(i)}).remote(config) for i in range(config.num_replicas)]
    ray.get([h.get_startup_seconds.remote() for h in handles])
    nodes = ray.get([h.__ray_call__.remote(_node_id) for h in handles])
    return [RayEngineClient(h, node) for h, node in zip(handles, nodes)]


def _node_id(actor: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
