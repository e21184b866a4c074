"""Seconds per ARPO training step from stated component throughputs (docs/scaling/cost_model.md).

Generation is decode-bound: each decode step of a replica reads its weights and the batch's KV cache from GPU
memory, so a replica's rate is concurrency / step time, with step time = bytes read / (bandwidth x efficiency)
and concurrency capped by max_num_seqs, by the trajectories it serves and by the KV cache the memory plan leaves
(:mod:`arpo.plan.memory`). Training is compute-bound: FLOPs (2P a token forward plus attention, three forwards'
worth for forward+backward, one more when gradient checkpointing recomputes) at a stated MFU of the GPUs' peak.
The weight sync moves the engine's weights over the host link.
"""

from __future__ import annotations

from dataclasses import dataclass

from arpo.plan.memory import MemoryPlan


@dataclass(frozen=True)
class Throughputs:
    """The component rates a step's time is predicted from (defaults: one H100 SXM; see the cost-model doc)."""

    hbm_bytes_per_s: float = 3.35e12  # H100 SXM5 datasheet
    decode_bandwidth_efficiency: float = 0.6  # share of HBM bandwidth a decode step achieves
    peak_flops: float = 989e12  # H100 SXM5 dense BF16 (datasheet, without sparsity)
    training_mfu: float = 0.30  # FSDP RL update; Llama 3 reports 38-43% for large-scale pretraining
    prefill_mfu: float = 0.5
    host_link_bytes_per_s: float = 20e9  # achieved GPU <-> page-locked host copy (PCIe Gen5 x16 peaks at 64 GB/s)
    mean_prompt_tokens: int = 512
    mean_response_tokens: int | None = None  # None: half of data.max_response_length
    tool_calls_per_trajectory: float = 2.0
    tool_result_tokens: int = 500
    tool_latency_s: float = 2.0  # a live search; a replayed cache answers in milliseconds


def step_seconds(plan: MemoryPlan, rates: Throughputs = Throughputs()) -> dict[str, float]:
    """Predicted seconds of one step by part (``generation``, ``old_log_probs``, ``ref_log_probs``, ``update``,
    ``weight_sync``, ``step``) and the rates behind them (``decode_tokens_per_s_per_gpu``, ``concurrency``)."""
    m, s, e = plan.shapes, plan.settings, plan.engine
    if e is None:
        raise ValueError("the cost model needs a GPU plan (python -m arpo.plan --gpu-memory-gb G --cost ...)")
    response = rates.mean_response_tokens or s.max_response // 2
    prompt = rates.mean_prompt_tokens
    trajectories = s.train_batch_size * s.n
    per_replica = trajectories / s.replicas
    context = prompt + rates.tool_calls_per_trajectory * rates.tool_result_tokens + response / 2
    concurrency = max(1.0, min(s.max_num_seqs, per_replica, e.kv_tokens / context))
    bandwidth = rates.hbm_bytes_per_s * rates.decode_bandwidth_efficiency
    decode_step = (e.weights + concurrency * context * e.kv_bytes_per_token) / bandwidth
    replica_rate = concurrency / decode_step
    decode = per_replica * response / replica_rate
    critical_path = (s.max_response * e.weights / bandwidth
                     + rates.tool_calls_per_trajectory * rates.tool_latency_s)
    prefill_tokens = (s.train_batch_size * prompt / s.replicas
                      + per_replica * rates.tool_calls_per_trajectory * rates.tool_result_tokens)
    prefill = prefill_tokens * 2 * m.numel / (s.tensor_parallel * rates.peak_flops * rates.prefill_mfu)
    generation = max(decode, critical_path) + prefill

    tokens = trajectories * (prompt + response)
    attention = 4 * m.layers * m.hidden * (prompt + response) / 2  # QK^T and AV, causal: half the context
    forward_flops = tokens * (2 * m.numel + attention)
    compute = s.world_size * rates.peak_flops * rates.training_mfu
    out = {"generation": generation, "old_log_probs": forward_flops / compute}
    if s.reference:
        out["ref_log_probs"] = forward_flops / compute
    out["update"] = forward_flops * (3 + s.gradient_checkpointing) / compute
    if s.critic:
        out["critic"] = forward_flops * (4 + s.critic_gradient_checkpointing) / compute
    engine_bytes_per_gpu = e.weights
    sleep = 2 * engine_bytes_per_gpu / rates.host_link_bytes_per_s if s.free_cache_engine else 0.0
    out["weight_sync"] = engine_bytes_per_gpu / rates.host_link_bytes_per_s + sleep
    out["step"] = sum(out.values())
    out.update(decode_tokens_per_s_per_gpu=replica_rate / s.tensor_parallel, concurrency=concurrency,
               decoded_tokens=trajectories * response, trained_tokens=tokens)
    return out
