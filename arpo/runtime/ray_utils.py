"""Starting Ray the same way everywhere: a private local cluster on loopback, small, nothing under $HOME.

Keys under ``ray_init`` (documented in ``configs/rollout/engine.yaml``): ``num_cpus``, ``num_gpus``,
``object_store_memory`` (bytes), ``temp_dir``, ``include_dashboard``, ``address`` (join an existing cluster
for multi-node runs instead of starting a private one; a section without the key joins ``$RAY_ADDRESS`` when set,
Ray's own convention, as the trainer config's default does).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from typing import Any

from arpo import THREAD_ENV
from arpo.config import REPO_ROOT

logger = logging.getLogger(__name__)

#: 2 GiB: a weight push holds two of its buckets in it at a time (512 MiB each by default, or the largest tensor),
#: and an object too big for it spills to disk; Ray's default (30% of RAM) is far too much on a shared laptop. The memory
#: is taken as objects arrive, not at start-up.
DEFAULT_OBJECT_STORE_MEMORY = 2 * 1024 * 1024 * 1024
_START_ATTEMPTS = 3


def _ray_init_section(cfg: Any) -> dict:
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    section = cfg.get("ray_init", cfg) if isinstance(cfg, dict) else {}
    return dict(section or {})


def init_ray(cfg: Any = None) -> None:
    """Start (or join the already started) Ray in this process.

    ``cfg`` is a root config with a ``ray_init`` section, that section itself, or None for the defaults.
    The cluster is local only (``address="local"``), binds to 127.0.0.1, has token auth and usage stats off,
    and keeps its session files under ``temp_dir`` (default ``$TMPDIR/ray``) instead of ``~``.
    """
    # Ray reads these at import and start-up (its child processes inherit them); setdefault keeps a user's export.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Without this Ray "resolves" 127.0.0.1 to the machine's routable address and binds its servers there.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    # The constant was read when ray was first imported, possibly before the line above.
    ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"].lower() in ("1", "true")
    section = _ray_init_section(cfg)
    # How long the raylet waits to register with the GCS (Ray's default 10 s; 15-25 s measured on a busy 2-core
    # machine). Not the raylet's fixed 15 s wait for its agents' ports (ray-project/ray#65983): the retry below.
    os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
    address = section["address"] if "address" in section else os.environ.get("RAY_ADDRESS")
    runtime_env, log_to_driver = _worker_logging()
    if not log_to_driver:  # Ray's own console handler (installed at import) would print around our filter
        from arpo.runtime.logging_utils import adopt_library_logger

        adopt_library_logger("ray")
    # Workers must import this checkout's code, not whatever `arpo` the venv's editable install points at; on a
    # cluster every node holds the checkout at the same path (docs/scaling/index.md).
    python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env["env_vars"]["PYTHONPATH"] = python_path
    # Read by OpenMP when torch loads in a worker (training ranks, engine actors and their engine cores).
    runtime_env["env_vars"].update({key: os.environ[key] for key in THREAD_ENV if key in os.environ})
    if address:
        # A cluster on this machine's loopback (a head started with --node-ip-address=127.0.0.1): the driver must
        # say it is on that node too, or Ray looks for a raylet at the machine's routable address.
        host = str(address).rsplit(":", 1)[0]
        local = {"_node_ip_address": "127.0.0.1"} if host in ("127.0.0.1", "localhost") else {}
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=log_to_driver, runtime_env=runtime_env,
                 configure_logging=log_to_driver, **local)
        logger.info("joined ray cluster at %s: %s", address, ray.cluster_resources())
        return
    temp_dir = section.get("temp_dir") or os.path.join(tempfile.gettempdir(), "ray")
    kwargs: dict[str, Any] = dict(
        address="local",
        num_cpus=section.get("num_cpus") or os.cpu_count() or 1,
        object_store_memory=int(section.get("object_store_memory") or DEFAULT_OBJECT_STORE_MEMORY),
        include_dashboard=bool(section.get("include_dashboard", False)),
        _node_ip_address="127.0.0.1",
        _temp_dir=os.path.abspath(temp_dir),
        ignore_reinit_error=True,
        log_to_driver=log_to_driver,
        configure_logging=log_to_driver,
    )
    kwargs["runtime_env"] = runtime_env
    if section.get("num_gpus") is not None:
        kwargs["num_gpus"] = section["num_gpus"]
    os.makedirs(kwargs["_temp_dir"], exist_ok=True)
    # Private clusters started at once on one machine (ablation runs in parallel) start one at a time: Ray waits a
    # hard-coded 30 s for its raylet to register, and three concurrent starts on 2 cores missed that every try.
    with open(os.path.join(kwargs["_temp_dir"], "arpo-ray-start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                ray.init(**kwargs)
                break
            except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for this
                # The raylet waits a hard-coded 15 s for its dashboard agent (a Python process) to start; on a busy
                # machine the agent's imports take longer and the raylet aborts. A fresh start usually makes it.
                if "timed out during startup" not in str(e) or attempt == _START_ATTEMPTS:
                    raise
                logger.warning("ray start attempt %d/%d timed out (busy machine?); retrying", attempt,
                               _START_ATTEMPTS)
                ray.shutdown()
    logger.info("ray started: %s", ray.cluster_resources())


def _worker_logging() -> tuple[dict[str, Any], bool]:
    """The job's runtime env for workers' logging, and whether Ray forwards workers' output to this console:
    once the driver logs to a run folder, workers write there (``setup_worker_logging``) and nothing is forwarded
    unless engine logs are shown live."""
    from arpo.runtime.logging_utils import ENGINE_LOGS_ENV, LOG_DIR_ENV, engine_logs_live

    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir or engine_logs_live():
        return {"env_vars": {}}, True
    env = {LOG_DIR_ENV: log_dir, ENGINE_LOGS_ENV: os.environ.get(ENGINE_LOGS_ENV, "file")}
    return {"env_vars": env, "worker_process_setup_hook": "arpo.runtime.logging_utils.setup_worker_logging"}, False


def stop_ray() -> None:
    """Shut down this process's Ray, if started: actors' output forwarded to the console ends here, so an entry
    point's final lines are really its last."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def cluster_nodes(cpus: float = 0.0, gpus: float = 0.0) -> list[str]:
    """Ids of the alive nodes with at least ``cpus`` CPUs and ``gpus`` GPUs in all, most CPUs first (ties by id), so
    that every caller sees the nodes in the same order."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")
             and n["Resources"].get("CPU", 0.0) >= cpus and n["Resources"].get("GPU", 0.0) >= gpus]
    return [n["NodeID"] for n in sorted(nodes, key=lambda n: (-n["Resources"].get("CPU", 0.0), n["NodeID"]))]


def rank_nodes(nnodes: int, ranks_per_node: int, cpus_per_rank: float, gpus_per_rank: float) -> list[str] | None:
    """The node of each training rank when the ranks span ``nnodes`` nodes (``trainer.nnodes``): rank r on the
    (r // ranks_per_node)-th node with room for its ranks. None for one node (Ray places the ranks). Every worker
    group gets the same assignment, so rank r of the actor, the reference and the critic share a node."""
    if nnodes == 1:
        return None
    nodes = cluster_nodes(cpus_per_rank * ranks_per_node, gpus_per_rank * ranks_per_node)
    if len(nodes) < nnodes:
        raise ValueError(f"trainer.nnodes={nnodes}: the Ray cluster has {len(nodes)} node(s) with room for "
                         f"trainer.n_gpus_per_node={ranks_per_node} ranks of {cpus_per_rank:g} CPU(s) and "
                         f"{gpus_per_rank:g} GPU(s); add nodes (ray start --address=...) or lower trainer.nnodes")
    return [nodes[r // ranks_per_node] for r in range(nnodes * ranks_per_node)]


def node_strategy(node_id: str | None, soft: bool = False) -> Any:
    """Ray scheduling strategy pinning an actor to ``node_id`` (None: Ray's default placement)."""
    if node_id is None:
        return "DEFAULT"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)
