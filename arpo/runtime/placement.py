"""GPU placement: verl's resource pools as Ray placement groups, the engine colocated with the training ranks or on
GPUs of its own.

One placement group per training node (``trainer.nnodes``), one bundle per GPU (``trainer.n_gpus_per_node``), pinned
to the node :func:`arpo.runtime.ray_utils.rank_nodes` chose for those ranks. Rank r of every worker group (actor, reference,
critic) runs in bundle r with a share of its GPU, as verl colocates them.

* ``actor_rollout_ref.hybrid_engine: true`` (verl's key and default; *colocated*): engine replica i runs in bundle
  i too, so a 1-GPU machine runs the whole job, and by default (``num_replicas: null``) every training GPU holds a
  replica, so every GPU generates. vLLM keeps ``gpu_memory_utilization`` of the GPU and, with
  ``free_cache_engine`` (on by default here), sleeps while the ranks update. Needs
  ``tensor_model_parallel_size: 1`` (a replica is one process holding a share of one GPU's bundle; spanning several
  bundles would need vLLM's workers placed into the training bundles, which its executors do not do) and at most
  one replica per training GPU.
* ``false`` (*split*): the replicas get GPUs of their own, ``tensor_model_parallel_size`` each, in a pool of their
  own (any nodes); the training GPUs hold the worker groups only. Generation never waits for memory the update
  holds, at the price of GPUs idle while the other side works. A replica's actor owns its bundle's GPUs, and
  vLLM's multiprocessing executor starts its tensor-parallel workers on them (``arpo.engine.vllm_engine``).

A cluster without GPUs uses none of this: Ray places the CPU actors (on one node) or :func:`rank_nodes` pins them,
and the engine computes on every core while the ranks wait for its rollouts. Ray's logical GPUs
(``ray_init.num_gpus`` on a CPU machine, ``--num-gpus`` for ``ray start``) exercise the placement without a GPU:
actors then hold GPU shares but compute where ``trainer.device`` says.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: seconds to wait for the placement groups before saying what the cluster lacks
READY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Slot:
    """Where one actor runs: a bundle of a placement group and its share of the bundle's resources."""

    group: Any
    bundle: int
    num_gpus: float
    num_cpus: float

    def options(self) -> dict[str, Any]:
        """Ray actor options that put the actor in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundle)
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "scheduling_strategy": strategy}


@dataclass(frozen=True)
class PlacementPlan:
    """The bundles and shares of a run on GPUs, before anything is reserved (pure arithmetic, testable alone)."""

    roles: tuple[str, ...]
    nnodes: int
    gpus_per_node: int
    cpus_per_rank: float
    replicas: int
    tensor_parallel: int
    hybrid: bool

    @classmethod
    def from_config(cls, cfg: Any, roles: list[str]) -> "PlacementPlan":
        """The plan of a root config on a cluster with GPUs (``num_replicas: null`` resolved as there)."""
        r = cfg.actor_rollout_ref.rollout
        return cls(tuple(roles), int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node),
                   float(cfg.trainer.cpus_per_worker), planned_num_replicas(cfg, gpus=True),
                   int(r.tensor_model_parallel_size), bool(cfg.actor_rollout_ref.hybrid_engine)).validate()

    def validate(self) -> "PlacementPlan":
        if self.hybrid and self.tensor_parallel > 1:
            raise ValueError(f"actor_rollout_ref.hybrid_engine=true runs each engine replica in one training GPU's "
                             f"bundle, so actor_rollout_ref.rollout.tensor_model_parallel_size="
                             f"{self.tensor_parallel} cannot be placed: set it to 1, or hybrid_engine=false (the "
                             f"engines on GPUs of their own)")
        if self.hybrid and self.replicas > self.world_size:
            raise ValueError(f"actor_rollout_ref.rollout.num_replicas={self.replicas} colocated engine replicas need "
                             f"as many training GPUs (trainer.nnodes x trainer.n_gpus_per_node = {self.world_size}): "
                             f"lower num_replicas, or set actor_rollout_ref.hybrid_engine=false")
        return self

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def share(self) -> float:
        """Each colocated actor's share of its GPU (Ray counts GPU fractions to 1e-4)."""
        return math.floor(10_000 / (len(self.roles) + int(self.hybrid))) / 10_000

    def training_bundles(self, node: int) -> list[dict[str, float]]:
        """One bundle per GPU of training node ``node``: its ranks of every role, and a colocated engine."""
        out = []
        for local in range(self.gpus_per_node):
            engine = self.hybrid and node * self.gpus_per_node + local < self.replicas
            out.append({"GPU": 1.0, "CPU": self.cpus_per_rank * len(self.roles) + float(engine)})
        return out

    def engine_bundles(self) -> list[dict[str, float]]:
        """Split: one bundle per replica, its tensor-parallel GPUs and the actor's CPU."""
        return [] if self.hybrid else [{"GPU": float(self.tensor_parallel), "CPU": 1.0}] * self.replicas

    def gpus_needed(self) -> int:
        return self.world_size + (0 if self.hybrid else self.replicas * self.tensor_parallel)


class GpuPlacement:
    """The placement groups of one run (see the module docstring); built once, after Ray starts, before any actor."""

    def __init__(self, plan: PlacementPlan, nodes: list[str] | None):
        import ray
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group

        self.plan = plan
        have = ray.cluster_resources().get("GPU", 0.0)
        if have < plan.gpus_needed():
            raise ValueError(f"the Ray cluster has {have:g} GPU(s), fewer than the run's {self._needs()}: add GPUs or "
                             f"lower trainer.n_gpus_per_node / actor_rollout_ref.rollout.num_replicas")
        self.training = []
        for n in range(plan.nnodes):
            bundles = plan.training_bundles(n)
            labels = [{NODE_ID_LABEL_KEY: nodes[n * plan.gpus_per_node]}] * len(bundles) if nodes else None
            self.training.append(placement_group(bundles, strategy="STRICT_PACK", name=f"arpo_train_node{n}",
                                                 bundle_label_selector=labels))
        engine_bundles = plan.engine_bundles()
        self.engines = placement_group(engine_bundles, strategy="PACK", name="arpo_rollout") if engine_bundles else None
        groups = self.training + [self.engines] * (self.engines is not None)
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=READY_TIMEOUT_S)
        if len(ready) < len(groups):
            self.remove()
            raise ValueError(f"the Ray cluster could not place the run's {self._needs()} within "
                             f"{READY_TIMEOUT_S:.0f} s (free GPUs per node too few, or taken by other jobs): free "
                             f"them, or lower trainer.n_gpus_per_node / actor_rollout_ref.rollout.num_replicas")
        logger.info("GPU placement: %s", self.describe())

    def _needs(self) -> str:
        p = self.plan
        split = "" if p.hybrid else f" + {p.replicas} engine replica(s) x {p.tensor_parallel}"
        return f"{p.gpus_needed()} GPUs ({p.nnodes} node(s) x {p.gpus_per_node} training GPUs{split})"

    def rank(self, rank: int, num_cpus: float) -> Slot:
        """Training rank ``rank`` of any role: its GPU's bundle, a share of the GPU."""
        node, local = divmod(rank, self.plan.gpus_per_node)
        return Slot(self.training[node], local, self.plan.share, num_cpus)

    def engine(self, replica: int) -> Slot:
        """Engine replica ``replica``: a training GPU's bundle (hybrid) or its own GPUs (split)."""
        if self.plan.hybrid:
            node, local = divmod(replica, self.plan.gpus_per_node)
            return Slot(self.training[node], local, self.plan.share, 1.0)
        return Slot(self.engines, replica, float(self.plan.tensor_parallel), 1.0)

    def describe(self) -> str:
        p = self.plan
        how = (f"colocated (hybrid engine): {p.replicas} engine replica(s) in the training GPUs' bundles"
               if p.hybrid else f"split: {p.replicas} engine replica(s) x {p.tensor_parallel} GPU(s) of their own")
        return (f"{p.nnodes} node(s) x {p.gpus_per_node} training GPU(s), {'/'.join(p.roles)} ranks "
                f"{p.share:g} GPU each; {how}; {p.gpus_needed()} GPU(s) in all")

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.training + [self.engines] * (self.engines is not None):
            remove_placement_group(g)


def auto_num_replicas(hybrid: bool, world_size: int, tensor_parallel: int, gpus: bool) -> int:
    """``actor_rollout_ref.rollout.num_replicas: null``: verl's rule, one replica per tensor-parallel group of
    training GPUs when the engine is colocated (every GPU generates); split, the engines' GPUs are extra, so 1
    unless set; without GPUs 1 (the replicas would share the same cores, and each costs its own start-up and
    memory)."""
    if not (gpus and hybrid):
        return 1
    return max(1, world_size // max(1, tensor_parallel))


def planned_num_replicas(cfg: Any, gpus: bool) -> int:
    """The run's engine replicas: ``actor_rollout_ref.rollout.num_replicas``, or when null
    :func:`auto_num_replicas` for ``gpus`` (whether the run's actors go into GPU placement groups)."""
    r = cfg.actor_rollout_ref.rollout
    if r.num_replicas is not None:
        return int(r.num_replicas)
    if not r.get("ray_actor", False):  # an engine in the caller's process is one engine
        return 1
    t = cfg.trainer
    return auto_num_replicas(bool(cfg.actor_rollout_ref.hybrid_engine), int(t.nnodes) * int(t.n_gpus_per_node),
                             int(r.tensor_model_parallel_size), gpus)


def resolve_rollout_auto(cfg: Any, gpus: bool) -> dict[str, Any]:
    """Resolve the rollout keys whose null means "decide by placement", once at start-up, into ``cfg`` itself (so
    every later reader sees the number, not null), and log what was decided:

    * ``num_replicas`` (:func:`planned_num_replicas`);
    * ``free_cache_engine``: on when the engine shares the training GPUs (hybrid on GPUs), where its KV cache and
      weights must make room for the actor's update; split engines keep their GPUs, and without GPUs there is no
      sleep mode.

    ``gpus``: whether the run uses GPU placement (:func:`arpo.main_arpo.uses_gpu_placement`).
    """
    r = cfg.actor_rollout_ref.rollout
    hybrid = bool(cfg.actor_rollout_ref.hybrid_engine)
    decided: dict[str, Any] = {}
    if r.num_replicas is None:
        decided["num_replicas"] = planned_num_replicas(cfg, gpus)
    if r.get("free_cache_engine") is None:
        decided["free_cache_engine"] = bool(gpus and hybrid)
    for key, value in decided.items():
        r[key] = value
    how = "colocated" if hybrid else "split"
    where = f"{'GPUs' if gpus else 'no GPUs'}, {how}, {int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)} " \
            f"training rank(s), tensor_model_parallel_size={r.tensor_model_parallel_size}"
    for key, value in decided.items():
        logger.info("actor_rollout_ref.rollout.%s: null (auto) -> %s (%s)", key, value, where)
    return {"num_replicas": int(r.num_replicas), "free_cache_engine": bool(r.free_cache_engine)}
