"""Weight sync streamed in buckets, and loading on N ranks from rank 0 (arpo/trainer/weight_sync.py,
arpo/trainer/model_init.py): a 7B bucket plan on the meta device, the 2-rank gather against DCP's full state dict
bit for bit, and a 2-rank load whose second rank never holds the model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from arpo.engine.weights import bucket_size, plan_buckets, transfer_dtype
from arpo.testing.scripted_engine import ScriptedEngine
from tests.trainer.workers_helpers import base_config, random_batch, small_model  # noqa: F401

QWEN7B_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen2.5-7b" / "config.json"
MIB = 1024 * 1024


def qwen7b_config():
    from transformers import Qwen2Config

    if QWEN7B_CONFIG.is_file():
        return Qwen2Config(**json.loads(QWEN7B_CONFIG.read_text()))
    return Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)


def test_bucket_plan_for_qwen2_5_7b_on_the_meta_device():
    """512 MiB bf16 buckets over Qwen2.5-7B's real shapes: every weight exactly once, in order, no bucket over the
    limit except a lone tensor bigger than it (the 152064 x 3584 embedding and head, 1.09 GB each)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen7b_config(), dtype=torch.float32)
    state = model.state_dict()
    limit = 512 * MIB
    plan = plan_buckets(((n, t.shape, transfer_dtype(t.dtype, torch.bfloat16)) for n, t in state.items()), limit)

    assert [e.name for bucket in plan for e in bucket] == list(state)  # each once, in state-dict (layer) order
    assert all(e.dtype == "bfloat16" for bucket in plan for e in bucket)
    oversized = [bucket for bucket in plan if bucket_size(bucket) > limit]
    assert [[e.name for e in b] for b in oversized] == [["model.embed_tokens.weight"], ["lm_head.weight"]]
    assert bucket_size(oversized[0]) == 152064 * 3584 * 2
    n_params = sum(t.numel() for t in state.values())
    assert 7.6e9 < n_params < 7.7e9
    payload = sum(e.nbytes for bucket in plan for e in bucket)
    assert payload == 2 * n_params  # bf16: half the fp32 master weights
    assert sum(bucket_size(b) for b in plan) < payload + 64 * len(state)  # alignment is the only overhead
    # a bucket closes only when the next tensor would overflow it
    for bucket, following in zip(plan, plan[1:]):
        assert bucket_size(bucket) + following[0].nbytes > limit
    assert 14 <= len(plan) <= 40


def _gather_buckets(group, dtype: str, bucket_bytes: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    import ray

    sizes = group.plan_weight_sync(dtype, bucket_bytes)
    got: dict[str, torch.Tensor] = {}
    for i in range(len(sizes)):
        bucket = ray.get(group.weight_bucket(i))
        assert bucket.nbytes == sizes[i]
        for name, t in bucket.tensors():
            assert name not in got
            got[name] = t.clone()
    group.end_weight_sync()
    return sizes, got


@pytest.mark.slow
def test_two_rank_bucketed_sync_equals_the_full_state_dict(small_model, ray_cluster):
    """On 2 gloo ranks: small buckets (many, one tensor bigger than a bucket) in fp32 and bf16 carry exactly DCP's
    full state dict (same names, dtypes, values; the tied head once); a scripted engine in this process gets the
    same through the trainer's sync, and the other rank's results are checked."""
    from arpo.trainer.weight_sync import stream_weights
    from arpo.trainer.worker_group import RayWorkerGroup

    group = RayWorkerGroup(base_config(small_model, world=2), role="actor")
    try:
        full = group.execute_all("state_dict_for_engine")
        assert full[1] is None
        full = full[0]
        assert "lm_head.weight" not in full  # the tiny model ties its head: sent once, as the embedding
        biggest = max(t.numel() * 4 for t in full.values())
        sizes, fp32 = _gather_buckets(group, "float32", 16 * 1024)
        assert biggest > 16 * 1024 and len(sizes) > 4 and max(sizes) == biggest
        assert list(fp32) == list(full)
        assert all(fp32[k].dtype == v.dtype and torch.equal(fp32[k], v) for k, v in full.items())
        _, bf16 = _gather_buckets(group, "bfloat16", 16 * 1024)
        assert list(bf16) == list(full)
        assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], v.to(torch.bfloat16))
                   for k, v in full.items())

        engines = [ScriptedEngine(), ScriptedEngine()]
        stats = asyncio.run(stream_weights(group, engines, 16 * 1024))
        assert stats["buckets"] == len(sizes) and stats["bytes"] == sum(sizes) and stats["dtype"] == "float32"
        for engine in engines:
            assert engine.weight_version == 1 and list(engine.weights) == list(full)
            assert all(torch.equal(engine.weights[k], v) for k, v in full.items())
    finally:
        group.shutdown()


def _buffers_and_tie(worker) -> tuple[dict[str, torch.Tensor], bool]:
    model = worker.model
    return ({n: b.detach().cpu() for n, b in model.named_buffers()},
            model.get_output_embeddings().weight is model.get_input_embeddings().weight)


@pytest.mark.slow
def test_two_rank_load_from_rank0_keeps_the_model_off_rank1_and_changes_nothing(smollm2_base_dir, ray_cluster):
    """SmolLM2-135M (0.54 GB in fp32, tied head): rank 0 alone reads the checkpoint; rank 1 grows by its half of the
    shards and one whole tensor in flight, never the model. Every parameter and buffer (rotary inv_freq: built on
    the meta device) is the checkpoint's bit for bit, so the forward is the one of a model loaded on every rank;
    the head is still tied."""
    import ray
    from transformers import AutoModelForCausalLM

    from arpo.trainer.worker_group import RayWorkerGroup

    reference = AutoModelForCausalLM.from_pretrained(smollm2_base_dir, dtype=torch.float32)
    sizes = [t.numel() * t.element_size() / MIB for n, t in reference.state_dict().items() if n != "lm_head.weight"]
    model_mb, largest_mb = sum(sizes), max(sizes)
    group = RayWorkerGroup(base_config(smollm2_base_dir, world=2), role="actor")
    try:
        info = group.init_info
        growth = [i["peak_rss_load_mb"] - i["rss_before_load_mb"] for i in info]
        params = group.full_parameters()
        buffers, tied = zip(*ray.get([w.__ray_call__.remote(_buffers_and_tie) for w in group.workers]))
        batch = random_batch(4, seed=7, vocab=2000)
        log_probs = group.compute_log_prob(batch, calc_entropy=False)["log_probs"]
    finally:
        group.shutdown()
    print(f"load growth per rank (MiB): {growth}; model {model_mb:.0f}, largest tensor {largest_mb:.0f}")
    assert growth[0] > model_mb  # rank 0 read the whole checkpoint
    # rank 1: its half of the shards, one whole tensor in flight, allocator slack; the model alone would be more
    assert growth[1] < min(0.5 * model_mb + largest_mb + 64, 0.8 * model_mb), (growth, model_mb)
    expected = reference.state_dict()
    assert set(params) <= set(expected)
    assert all(torch.equal(params[k], expected[k]) for k in params)
    ref_buffers = dict(reference.named_buffers())
    assert buffers[0].keys() == ref_buffers.keys() and any("inv_freq" in k for k in ref_buffers)
    assert all(torch.equal(b[k], ref_buffers[k]) for b in buffers for k in ref_buffers)
    assert tied == (True, True)
    with torch.no_grad():
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           position_ids=batch["position_ids"]).logits
    r = batch["responses"].shape[1]
    ref_lp = torch.log_softmax(logits[:, -r - 1:-1], -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ref_lp = ref_lp * batch["attention_mask"][:, -r:]
    torch.testing.assert_close(log_probs, ref_lp, atol=1e-5, rtol=1e-5)  # one process vs 2 ranks: thread rounding
