"""The plan of the pipeline's other stages: the cold-start SFT (``configs/sft.yaml``) and the evaluation
(``configs/eval.yaml``), with the RL stage's formulas (:mod:`arpo.plan.memory`) and its fits / one-line contract.

* SFT trains the actor alone on ``sft.num_ranks`` FSDP2 ranks: fp32 master weights, AdamW m and v and the
  gradient sharded over the ranks, the gathered units, and a micro-batch of ``sft.max_length`` tokens of
  activations (checkpointed with ``sft.enable_gradient_checkpointing``), the log-prob head's chunks and AdamW's
  step temporary. No engine, no reference.
* The evaluation is generation only: one vLLM replica per tensor-parallel group, its budget
  ``gpu_memory_utilization`` x the GPU, whose KV cache must hold one sequence of ``max_model_len``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from arpo.plan.check import ROLLOUT
from arpo.plan.memory import (CUDA_CONTEXT_BYTES, ENGINE_HOST_BYTES, GIB, HEAD_BUFFERS_TRAIN, PROCESS_HOST_BYTES,
                              MemoryPlan, MemoryTable, adamw_step_bytes, engine_budget, gathered_grad_bytes,
                              gathered_param_bytes, head_chunk_bytes, training_activation_bytes)
from arpo.plan.settings import DEFAULT_BATCHED_TOKENS, PlanSettings, _dtype_bytes, _get
from arpo.plan.shapes import ModelShapes, model_shapes

STAGES = ("sft", "rl", "eval")
#: the config each stage is composed from
STAGE_CONFIG = {"sft": "sft", "rl": "arpo_trainer", "eval": "eval"}


def _settings(gpu: bool, **fields: Any) -> PlanSettings:
    """A PlanSettings for a stage that uses only some of the RL run's fields: the rest at neutral values."""
    base = dict(gpu=gpu, nnodes=1, gpus_per_node=1, hybrid=False, tensor_parallel=1, replicas=0, max_prompt=0,
                max_response=0, n=1, train_batch_size=1, micro_batch=1, logprob_micro_batch=1, ref_micro_batch=1,
                critic_micro_batch=1, critic_forward_micro_batch=1, gradient_checkpointing=False,
                critic_gradient_checkpointing=False, compute_bytes=4, engine_bytes=2, logprob_chunk=256,
                tree_packing=False, reference=False, critic=False, lora_rank=0, lora_targets="all-linear",
                free_cache_engine=False, cuda_graphs=False, sleep_level=1, gpu_memory_utilization=0.5,
                max_model_len=None, max_num_seqs=256, max_num_batched_tokens=DEFAULT_BATCHED_TOKENS,
                bucket_bytes=0, object_store_bytes=0, cpu_kvcache_bytes=0)
    base.update(fields)
    return PlanSettings(**base)


# -- SFT ------------------------------------------------------------------------------------------------------------

def sft_settings(cfg: DictConfig, gpu: bool) -> PlanSettings:
    s = cfg.sft
    ranks = int(s.num_ranks)
    micro = s.micro_batch_size_per_gpu or max(1, int(s.batch_size) // ranks)
    return _settings(gpu, gpus_per_node=ranks, max_response=int(s.max_length), micro_batch=int(micro),
                     gradient_checkpointing=bool(s.enable_gradient_checkpointing),
                     compute_bytes=_dtype_bytes(s.dtype, gpu, "sft.dtype"),
                     logprob_chunk=int(_get(cfg, "actor_rollout_ref.actor.logprob_chunk_size", 256)))


def sft_gpu_table(m: ModelShapes, s: PlanSettings) -> MemoryTable:
    """One SFT rank's GPU during its update (its only phase)."""
    t = MemoryTable("per SFT GPU", ["update"])
    ws = s.world_size
    shard = m.shard_numel(ws)
    tokens = s.micro_batch * s.seq_len
    acts = training_activation_bytes(m, s, tokens, s.gradient_checkpointing)
    gathered, grads, head = gathered_param_bytes(m, s), gathered_grad_bytes(m, s), head_chunk_bytes(
        m, s, HEAD_BUFFERS_TRAIN)
    t.add("CUDA context", CUDA_CONTEXT_BYTES)
    t.add(f"fp32 weights + AdamW m, v (shard 1/{ws})", 12 * shard)
    t.add("fp32 gradient shard", 4 * shard)
    t.add("FSDP2 gathered params (root + 2 layers)", gathered)
    t.add("FSDP2 unsharded grads (root + 1 layer)", grads)
    ckpt = "on" if s.gradient_checkpointing else "off"
    t.add(f"activations ({tokens} tokens, checkpointing {ckpt})", acts)
    t.add(f"log-prob head ({s.logprob_chunk} x {m.vocab} fp32 chunks)", head)
    t.add("AdamW step temporary (beyond what backward freed)", adamw_step_bytes(4 * shard, gathered + grads + head
                                                                                 + acts))
    return t


def plan_sft(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None = None) -> MemoryPlan:
    tables, problems = [], []
    if s.gpu and gpu_bytes:
        tables.append(sft_gpu_table(m, s))
    host = [(f"{s.gpus_per_node} SFT rank process(es)", s.gpus_per_node * PROCESS_HOST_BYTES[s.gpu]),
            ("rank 0 loads the checkpoint (fp32, whole model)", 4.0 * m.numel)]
    if not (s.gpu and gpu_bytes):  # on a CPU each rank's state and activations live in host RAM
        host.append((f"{s.gpus_per_node} rank(s): shards, gradients, activations",
                     s.gpus_per_node * sum(sft_gpu_table(m, s).totals()) - s.gpus_per_node * CUDA_CONTEXT_BYTES))
    return _finish(s, m, gpu_bytes, tables, None, host, problems, host_limit)


def sft_fixes(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, batch_size: int,
              host_limit: float | None) -> list[str]:
    """``key=value`` changes, each of which alone makes the SFT plan fit."""
    def fits(**changes: Any) -> bool:
        return plan_sft(m, s.with_changes(**changes), gpu_bytes, host_limit).fits

    out = []
    for ranks in (2, 4, 8, 16, 32, 64):  # more ranks shard the weights and AdamW state further
        if ranks > s.gpus_per_node and batch_size % ranks == 0 and fits(gpus_per_node=ranks,
                                                                         micro_batch=min(s.micro_batch,
                                                                                         batch_size // ranks)):
            out.append(f"sft.num_ranks={ranks}")
            break
    if not s.gradient_checkpointing and fits(gradient_checkpointing=True):
        out.append("sft.enable_gradient_checkpointing=true")
    for micro in sorted({s.micro_batch // 2**k for k in range(1, s.micro_batch.bit_length())} - {0}, reverse=True):
        if fits(micro_batch=micro):
            out.append(f"sft.micro_batch_size_per_gpu={micro}")
            break
    return out


# -- evaluation -----------------------------------------------------------------------------------------------------

def eval_settings(cfg: DictConfig, gpu: bool) -> PlanSettings:
    from arpo.engine.config import resolve_enforce_eager

    model_len = _get(cfg, f"{ROLLOUT}.max_model_len")
    return _settings(gpu, tensor_parallel=int(_get(cfg, f"{ROLLOUT}.tensor_model_parallel_size", 1)), replicas=1,
                     engine_bytes=_dtype_bytes(_get(cfg, f"{ROLLOUT}.dtype", "auto"), gpu, f"{ROLLOUT}.dtype"),
                     cuda_graphs=gpu and not resolve_enforce_eager(_get(cfg, f"{ROLLOUT}.enforce_eager"), "cuda"),
                     gpu_memory_utilization=float(_get(cfg, f"{ROLLOUT}.gpu_memory_utilization", 0.5)),
                     max_model_len=None if model_len is None else int(model_len),
                     max_num_seqs=int(_get(cfg, f"{ROLLOUT}.max_num_seqs", 256)),
                     max_num_batched_tokens=int(_get(cfg, f"{ROLLOUT}.max_num_batched_tokens",
                                                     DEFAULT_BATCHED_TOKENS)),
                     cpu_kvcache_bytes=int(float(_get(cfg, f"{ROLLOUT}.cpu_kvcache_space_gb", 2)) * GIB))


def plan_eval(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None = None) -> MemoryPlan:
    tables, problems, engine = [], [], None
    if s.gpu and gpu_bytes:
        engine = engine_budget(m, s, gpu_bytes)
        t = MemoryTable(f"per engine GPU (replica of {s.tensor_parallel} GPU(s))", ["generation"])
        t.add(f"vLLM replica ({s.gpu_memory_utilization:g} x GPU): weights, activations, KV cache", engine.budget)
        tables.append(t)
        if engine.sequences < 1:
            problems.append(f"vLLM's KV cache ({engine.kv_cache / GIB:.1f} GiB) holds no sequence of max_model_len "
                            f"{engine.max_model_len}")
    host = [("evaluation process (tools, records)", PROCESS_HOST_BYTES[s.gpu]),
            ("engine process", ENGINE_HOST_BYTES[s.gpu])]
    if not (s.gpu and gpu_bytes):
        host.append(("engine: weights + KV cache", m.numel * s.engine_bytes + s.cpu_kvcache_bytes))
    return _finish(s, m, gpu_bytes, tables, engine, host, problems, host_limit)


def eval_fixes(m: ModelShapes, s: PlanSettings, gpu_bytes: float | None, host_limit: float | None) -> list[str]:
    out = []
    for util in (0.7, 0.8, 0.9):
        if util > s.gpu_memory_utilization and plan_eval(m, s.with_changes(gpu_memory_utilization=util),
                                                         gpu_bytes, host_limit).fits:
            out.append(f"{ROLLOUT}.gpu_memory_utilization={util:g}")
            break
    for tp in (2, 4, 8):
        if tp > s.tensor_parallel and plan_eval(m, s.with_changes(tensor_parallel=tp), gpu_bytes, host_limit).fits:
            out.append(f"{ROLLOUT}.tensor_model_parallel_size={tp}")
            break
    length = s.max_model_len or m.max_position
    for shorter in (length // 2, length // 4, length // 8):
        if shorter and plan_eval(m, s.with_changes(max_model_len=shorter), gpu_bytes, host_limit).fits:
            out.append(f"{ROLLOUT}.max_model_len={shorter}")
            break
    return out


# -- shared ---------------------------------------------------------------------------------------------------------

def _finish(s: PlanSettings, m: ModelShapes, gpu_bytes: float | None, tables: list[MemoryTable], engine: Any,
            host: list[tuple[str, float]], problems: list[str], host_limit: float | None) -> MemoryPlan:
    for t in tables:
        peak, phase = t.peak()
        if peak > gpu_bytes:
            problems.insert(0, f"{t.title}: {peak / GIB:.1f} GiB at {phase} > {gpu_bytes / GIB:.1f} GiB")
    plan = MemoryPlan(s, m, gpu_bytes if s.gpu else None, tables, engine, host, 0.0, problems)
    if host_limit and plan.host_bytes > host_limit:
        problems.append(f"host RAM {plan.host_bytes / GIB:.1f} GiB per node > {host_limit / GIB:.1f} GiB")
    return plan


def build_stage_plan(stage: str, cfg: DictConfig, gpu_bytes: float | None,
                     host_limit: float | None = None) -> MemoryPlan:
    """The plan of one pipeline stage's composed config (``rl``: :func:`arpo.plan.check.build_plan`)."""
    from arpo.plan.check import build_plan

    gpu = gpu_bytes is not None
    if stage == "rl":
        return build_plan(cfg, gpu_bytes, host_limit)
    shapes = model_shapes(str(cfg.actor_rollout_ref.model.path))
    if stage == "sft":
        return plan_sft(shapes, sft_settings(cfg, gpu), gpu_bytes, host_limit)
    return plan_eval(shapes, eval_settings(cfg, gpu), gpu_bytes, host_limit)


def stage_failure_line(stage: str, cfg: DictConfig, plan: MemoryPlan, host_limit: float | None = None) -> str:
    """One line: what does not fit in ``stage`` and the keys to change."""
    from arpo.plan.check import failure_line

    if stage == "rl":
        return failure_line(cfg, plan, host_limit)
    m, s, g = plan.shapes, plan.settings, plan.gpu_bytes
    found = (sft_fixes(m, s, g, int(cfg.sft.batch_size), host_limit) if stage == "sft"
             else eval_fixes(m, s, g, host_limit))
    todo = f"set one of {', '.join(found)}" if found else (
        "raise sft.num_ranks, turn on sft.enable_gradient_checkpointing or lower sft.max_length" if stage == "sft"
        else f"raise {ROLLOUT}.tensor_model_parallel_size or lower {ROLLOUT}.max_model_len")
    return (f"the {stage} stage does not fit ({'; '.join(plan.problems)}): {todo} "
            f"(`python -m arpo.plan --stage {stage}` prints the plan)")


def check_stage(stage: str, cfg: DictConfig, device: str) -> None:
    """Stop ``stage`` before it starts when it cannot fit (one ConfigError line); ``device`` is the stage's resolved
    device ("cuda" checks the GPU; "cpu" only host RAM, and only when clearly over, as the RL check does)."""
    import logging

    import torch

    from arpo.config import ConfigError
    from arpo.plan.check import CPU_HOST_MARGIN, _physical_ram

    ram = _physical_ram()
    gpu = device == "cuda" and torch.cuda.is_available()
    gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory) if gpu else None
    host_limit = ram if gpu else (ram * CPU_HOST_MARGIN if ram else None)
    try:
        plan = build_stage_plan(stage, cfg, gpu_bytes, host_limit)
    except Exception as e:  # noqa: BLE001 - an architecture the planner cannot build is let through, as in RL
        logging.getLogger(__name__).warning("memory plan of the %s stage skipped: %s", stage, e)
        return
    if not plan.fits:
        raise ConfigError(stage_failure_line(stage, cfg, plan, host_limit))


def format_stage_plan(stage: str, plan: MemoryPlan) -> str:
    """The plan as text: the RL stage's own layout, or a header line and the stage's tables."""
    from arpo.plan.check import format_plan, format_tables

    if stage == "rl":
        return format_plan(plan)
    m, s = plan.shapes, plan.settings
    where = f"GPUs of {plan.gpu_bytes / GIB:.1f} GiB" if plan.gpu_bytes else "a CPU (host RAM only)"
    what = (f"{s.gpus_per_node} FSDP2 rank(s), micro-batch {s.micro_batch} x {s.seq_len} tokens, compute "
            f"{s.compute_bytes * 8}-bit" if stage == "sft" else
            f"one vLLM replica per {s.tensor_parallel} GPU(s), max_model_len {s.max_model_len or m.max_position}")
    return "\n".join([f"{stage} stage: {m.architecture}, {m.numel:,} parameters; {what}; on {where}",
                      format_tables(plan)])
