"""The vLLM engine arguments a GPU run gets, checked on CPU against vLLM's own decisions: CUDA graphs by device, the
multiprocessing executor for tensor-parallel engines inside a Ray placement group, Model Runner V1 pinned."""

from __future__ import annotations

import pytest
import torch

from arpo.engine.config import EngineConfig, resolve_enforce_eager
from arpo.engine.vllm_engine import vllm_engine_args


def _args(tmp_path, device: str, **kw) -> dict:
    return vllm_engine_args(EngineConfig(model_path=str(tmp_path), max_model_len=256, **kw).validate(), device)


def test_cuda_graphs_on_cuda_eager_on_cpu_unless_set(tmp_path):
    assert _args(tmp_path, "cuda")["enforce_eager"] is False
    assert _args(tmp_path, "cpu")["enforce_eager"] is True
    assert _args(tmp_path, "cuda", enforce_eager=True)["enforce_eager"] is True
    assert resolve_enforce_eager(False, "cpu") is False  # a set value is taken as it is
    with pytest.raises(ValueError, match="enforce_eager='yes': true, false or null"):
        EngineConfig(model_path=str(tmp_path), enforce_eager="yes").validate()


def test_sleep_mode_only_where_it_exists(tmp_path):
    assert _args(tmp_path, "cuda", free_cache_engine=True)["enable_sleep_mode"] is True
    assert _args(tmp_path, "cpu", free_cache_engine=True)["enable_sleep_mode"] is False
    assert _args(tmp_path, "cuda")["enable_sleep_mode"] is False  # null unresolved (no trainer): off


def test_tensor_parallel_engine_in_a_placement_group_gets_the_multiprocessing_executor(tmp_path):
    """vLLM picks its Ray executor inside a placement group, and that executor refuses a bundle of several GPUs
    (the split placement gives a replica one bundle of tensor_model_parallel_size GPUs): our args say "mp"."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup
    from vllm.config import ParallelConfig

    group = PlacementGroup(PlacementGroupID.from_random())  # as vLLM sees the group of the actor it runs in
    assert ParallelConfig(tensor_parallel_size=2, placement_group=group).distributed_executor_backend == "ray"
    args = _args(tmp_path, "cuda", tensor_model_parallel_size=2)
    assert args["distributed_executor_backend"] == "mp"
    chosen = ParallelConfig(tensor_parallel_size=args["tensor_parallel_size"], placement_group=group,
                            distributed_executor_backend=args["distributed_executor_backend"])
    assert chosen.distributed_executor_backend == "mp" and chosen.world_size == 2
    one = _args(tmp_path, "cuda")  # one GPU: vLLM's in-process worker, its own choice
    assert "distributed_executor_backend" not in one
    assert ParallelConfig(tensor_parallel_size=1, placement_group=group).distributed_executor_backend == "uni"
    user = _args(tmp_path, "cuda", tensor_model_parallel_size=2, engine_kwargs={"distributed_executor_backend": "ray"})
    assert user["distributed_executor_backend"] == "ray"  # engine_kwargs still have the last word


def test_model_runner_v1_is_what_vllm_reads(monkeypatch):
    from vllm import envs

    from arpo.engine.vllm_env import configure_vllm_env

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    configure_vllm_env()
    assert envs.VLLM_USE_V2_MODEL_RUNNER is False  # vLLM's VllmConfig.use_v2_model_runner returns it when set
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # a user's export opts in to V2
    configure_vllm_env()
    assert envs.VLLM_USE_V2_MODEL_RUNNER is True


def test_the_args_build_the_pinned_vllms_own_engine_config(tmp_path):
    """vllm_engine_args' keys and values are ones the installed vLLM's AsyncEngineArgs takes and its engine config
    keeps: built from a model's config.json alone (no weights, no engine started)."""
    from transformers import Qwen2Config
    from vllm.engine.arg_utils import AsyncEngineArgs

    Qwen2Config(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=64, max_position_embeddings=512).save_pretrained(tmp_path)
    for dtype, prefix_caching in (("auto", True), ("bfloat16", False)):
        cfg = EngineConfig(model_path=str(tmp_path), max_model_len=256, max_num_seqs=8, dtype=dtype,
                           enable_prefix_caching=prefix_caching).validate()
        built = AsyncEngineArgs(**vllm_engine_args(cfg, "cpu")).create_engine_config()
        assert built.model_config.max_model_len == 256
        assert built.scheduler_config.max_num_seqs == 8
        assert built.cache_config.enable_prefix_caching is prefix_caching
        assert built.model_config.dtype == (torch.float32 if dtype == "auto" else torch.bfloat16)  # auto: fp32 on CPU
        assert built.cache_config.block_size == 32 and built.scheduler_config.enable_chunked_prefill is False
        assert built.parallel_config.worker_extension_cls == "arpo.engine.vllm_worker_ext.ArpoWorkerExtension"
        assert built.model_config.logprobs_mode == "raw_logprobs"
    # CUDA's arguments: vLLM's config checks need a GPU platform (sleep mode), so only vLLM's own argument class here
    cfg = EngineConfig(model_path=str(tmp_path), max_model_len=256, max_num_seqs=8, free_cache_engine=True,
                       tensor_model_parallel_size=2).validate()
    cuda = AsyncEngineArgs(**vllm_engine_args(cfg, "cuda"))
    assert (cuda.max_model_len, cuda.max_num_seqs, cuda.enable_prefix_caching, cuda.dtype) == \
           (256, 8, True, "bfloat16")
    assert (cuda.enable_sleep_mode, cuda.enforce_eager, cuda.tensor_parallel_size) == (True, False, 2)
