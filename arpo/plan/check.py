"""Whether a run fits, said before any worker starts: the plan of a composed config, the keys that would make a
plan fit, the printed table, and the start-up check :func:`check_config` (arpo/main_arpo.py calls it)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any

from omegaconf import DictConfig, OmegaConf

from arpo.plan.memory import GIB, MemoryPlan, plan_memory
from arpo.plan.settings import PlanSettings
from arpo.plan.shapes import ModelShapes, model_shapes

logger = logging.getLogger(__name__)

#: a CPU run stops only when its host need exceeds this multiple of the machine's RAM: the estimate must never
#: block the project's ordinary CPU runs, only ones that clearly cannot finish
CPU_HOST_MARGIN = 1.5
ROLLOUT = "actor_rollout_ref.rollout"


def build_plan(cfg: DictConfig, gpu_bytes: float | None, host_limit: float | None = None,
               shm_limit: float | None = None) -> MemoryPlan:
    """The plan of ``cfg`` on GPUs of ``gpu_bytes`` each (None: planned as the CPU run it is)."""
    shapes = model_shapes(str(cfg.actor_rollout_ref.model.path))
    settings = PlanSettings.from_config(cfg, gpu=gpu_bytes is not None)
    return plan_memory(shapes, settings, gpu_bytes, host_limit, shm_limit)


def _fits(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None) -> bool:
    return plan_memory(m, s, gpu_bytes, host_limit).fits


def _largest_fitting(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None,
                     field: str, candidates: list[Any]) -> Any | None:
    for value in candidates:
        if _fits(m, s.with_changes(**{field: value}), gpu_bytes, host_limit):
            return value
    return None


def fixes(cfg: DictConfig, plan: MemoryPlan, host_limit: float | None = None) -> list[str]:
    """``key=value`` changes, each of which alone makes the plan fit."""
    m, s, g = plan.shapes, plan.settings, plan.gpu_bytes
    out: list[str] = []
    util = _largest_fitting(m, s, g, host_limit, "gpu_memory_utilization",
                            [u / 100 for u in range(int(s.gpu_memory_utilization * 100) - 5, 19, -5)])
    if util is not None and s.gpu:
        out.append(f"{ROLLOUT}.gpu_memory_utilization={util:g}")
    if s.gpu and s.hybrid and not s.free_cache_engine and _fits(m, s.with_changes(free_cache_engine=True), g,
                                                                  host_limit):
        out.append(f"{ROLLOUT}.free_cache_engine=true")
    # sleep level 2 discards the base weights an engine serving the adapter keeps (resolve_lora_serving refuses it)
    deeper_sleep = s.free_cache_engine and s.sleep_level == 1 and s.lora_serving != "adapter"
    if deeper_sleep and _fits(m, s.with_changes(sleep_level=2), g, host_limit):
        out.append(f"{ROLLOUT}.sleep_level=2")
    if s.reference and _fits(m, s.with_changes(reference=False), g, host_limit):
        if OmegaConf.select(cfg, "actor_rollout_ref.actor.use_kl_loss"):
            out.append("actor_rollout_ref.actor.use_kl_loss=false")
        if OmegaConf.select(cfg, "algorithm.use_kl_in_reward"):
            out.append("algorithm.use_kl_in_reward=false")
    for field, key in (("micro_batch", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                       ("logprob_micro_batch", f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"),
                       ("ref_micro_batch", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")):
        current = getattr(s, field)
        halves = sorted({current // 2**k for k in range(1, current.bit_length())} - {0}, reverse=True)
        value = _largest_fitting(m, s, g, host_limit, field, halves)  # halving keeps it a divisor of the batch
        if value is not None:
            out.append(f"{key}={value}")
    if not s.gradient_checkpointing and _fits(m, s.with_changes(gradient_checkpointing=True), g, host_limit):
        out.append("actor_rollout_ref.model.enable_gradient_checkpointing=true")
    return out


def failure_line(cfg: DictConfig, plan: MemoryPlan, host_limit: float | None = None) -> str:
    """One line: what does not fit and the keys to change."""
    found = fixes(cfg, plan, host_limit)
    if found:
        todo = f"set one of {', '.join(found)}"
    elif plan.gpu_bytes is None:  # a CPU run: every rank and engine shares this machine's RAM
        todo = ("lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu, data.max_response_length or "
                "trainer.n_gpus_per_node (ranks on this machine), or train a smaller model")
    else:
        todo = (f"lower {ROLLOUT}.gpu_memory_utilization, data.max_response_length or the micro-batch sizes, or add "
                f"GPUs (trainer.n_gpus_per_node / trainer.nnodes)")
    return f"the run does not fit ({'; '.join(plan.problems)}): {todo} (`python -m arpo.plan` prints the plan)"


def _physical_ram() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_config(cfg: DictConfig) -> None:
    """Stop a run that cannot fit, with one ConfigError line naming the keys; called at start-up before any worker.

    With a GPU (and trainer.device not cpu) the GPU plan, host RAM and /dev/shm are checked. Without one only the
    host RAM, and only when clearly over (:data:`CPU_HOST_MARGIN`). A config the planner cannot read (an
    architecture it cannot build) is logged and let through: the plan advises, it does not gate what it cannot
    model."""
    import torch

    from arpo.config import ConfigError

    gpu = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    ram = _physical_ram()
    if gpu:
        gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
        shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else None
        host_limit = ram
    else:
        gpu_bytes, shm, host_limit = None, None, ram * CPU_HOST_MARGIN if ram else None
    try:
        plan = build_plan(cfg, gpu_bytes, host_limit, shm)
    except Exception as e:  # noqa: BLE001 - see the docstring
        logger.warning("memory plan skipped: %s", e)
        return
    if not plan.fits:
        raise ConfigError(failure_line(cfg, plan, host_limit))
    logger.info("memory plan: %s", summary_line(plan))
    for warning in plan.warnings:
        logger.warning("memory plan: %s", warning)


def summary_line(plan: MemoryPlan) -> str:
    parts = [f"{t.title} peak {t.peak()[0] / GIB:.1f} GiB ({t.peak()[1]})" for t in plan.gpu_tables]
    if plan.engine is not None:
        parts.append(f"vLLM KV cache {plan.engine.kv_cache / GIB:.1f} GiB = {plan.engine.sequences} sequences of "
                     f"{plan.engine.max_model_len}")
    parts.append(f"host {plan.host_bytes / GIB:.1f} GiB per node")
    return "; ".join(parts)


def format_plan(plan: MemoryPlan) -> str:
    """The plan as text tables (GiB): per GPU by phase, the engine's budget, per node on the host."""
    m, s = plan.shapes, plan.settings
    gpus = (f"GPUs of {plan.gpu_bytes / GIB:.1f} GiB" if plan.gpu_bytes else "CPU ranks")
    layout = "hybrid engine (colocated)" if s.hybrid else "split (engines on GPUs of their own)"
    return "\n".join([f"{m.architecture}, {m.numel:,} parameters; {s.nnodes} node(s) x {s.gpus_per_node} {gpus}; "
                      f"{layout}; {s.replicas} engine replica(s) x tensor parallel {s.tensor_parallel}; roles: actor"
                      + " + reference" * s.reference + " + critic" * s.critic, format_tables(plan)])


def format_tables(plan: MemoryPlan) -> str:
    """Per GPU by phase, the engine's budget, per node on the host, and the verdict (GiB)."""
    lines: list[str] = []
    for t in plan.gpu_tables:
        width = max(len(name) for name, _ in t.rows) + 2
        lines += ["", f"{t.title} (GiB)".ljust(width) + "".join(p.rjust(15) for p in t.phases)]
        lines += [name.ljust(width) + "".join(f"{v / GIB:15.2f}" for v in values) for name, values in t.rows]
        lines.append("total".ljust(width) + "".join(f"{v / GIB:15.2f}" for v in t.totals()))
        peak, phase = t.peak()
        lines.append(f"peak {peak / GIB:.2f} GiB at {phase}, {plan.gpu_bytes / GIB - peak / GIB:+.2f} GiB to spare")
    e = plan.engine
    if e is not None:
        lora = f"LoRA buffers {e.lora / GIB:.2f} + " if e.lora else ""
        lines += ["", f"vLLM replica per GPU: budget {e.budget / GIB:.2f} GiB = weights {e.weights / GIB:.2f} + "
                      f"{lora}profile activations {e.activations / GIB:.2f} + non-torch {e.non_torch / GIB:.2f} + "
                      f"CUDA graphs {e.cuda_graphs / GIB:.2f} + KV cache "
                      f"{e.kv_cache / GIB:.2f} GiB = {e.kv_tokens:,} tokens ({e.kv_bytes_per_token / 1024:.0f} KiB "
                      f"a token) = {e.sequences} sequences of max_model_len {e.max_model_len}"]
    width = max(len(name) for name, _ in plan.host) + 2
    lines += ["", "host RAM, busiest node (GiB)"]
    lines += [name.ljust(width) + f"{v / GIB:10.2f}" for name, v in plan.host]
    lines.append("total".ljust(width) + f"{plan.host_bytes / GIB:10.2f}")
    if plan.shm_bytes:
        lines.append(f"shared memory (/dev/shm) needed: {plan.shm_bytes / GIB:.2f} GiB (Ray's object store)")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += ["", "fits" if plan.fits else "DOES NOT FIT: " + "; ".join(plan.problems)]
    return "\n".join(lines)
