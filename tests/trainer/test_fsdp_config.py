"""Trainer config checks (one clear line per bad value), device/dtype choice, LR schedule, rank splitting."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from omegaconf import OmegaConf

from arpo.config import ConfigError, config_dir
from arpo.trainer.actor_config import validate_actor_config
from arpo.trainer.device import device_settings
from arpo.trainer.optim import lr_lambda
from arpo.trainer.worker_group import gather_rows, split_for_ranks
from tests.trainer.workers_helpers import random_batch

GOOD = {
    "trainer": {"device": "cpu", "nnodes": 1, "n_gpus_per_node": 2, "resume_mode": "auto",
                "max_actor_ckpt_to_keep": None},
    "data": {"train_batch_size": 4, "max_prompt_length": 512, "truncation": "error"},
    "actor_rollout_ref": {
        "model": {"dtype": "auto"},
        "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 2, "ppo_epochs": 1,
                  "grad_clip": 1.0, "optim": {"lr": 1e-6, "weight_decay": 0.01, "betas": [0.9, 0.999],
                                              "warmup_style": "constant"}},
        "rollout": {"n": 4},
    },
}


def _with(key: str, value):
    cfg = copy.deepcopy(GOOD)
    node = cfg
    *path, last = key.split(".")
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value
    return cfg


def test_good_config_passes():
    validate_actor_config(GOOD)


@pytest.mark.parametrize("key,value,message", [
    ("trainer.n_gpus_per_node", 3, r"train_batch_size \* rollout.n = 4 \* 4 = 16 trajectories do not split over 3"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 3, "ppo_mini_batch_size=3 must divide data.train_batch_size=4"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 3, "ppo_micro_batch_size_per_gpu=3 must divide"),
    ("actor_rollout_ref.actor.ppo_epochs", 0, "ppo_epochs must be a positive integer"),
    ("actor_rollout_ref.actor.strategy", "fsdp", "only fsdp2"),
    ("actor_rollout_ref.actor.grad_clip", 0, "grad_clip must be > 0"),
    ("actor_rollout_ref.actor.optim.lr", -1.0, "optim.lr must be a number"),
    ("actor_rollout_ref.actor.optim.betas", [0.9, 1.5], "betas must be two numbers"),
    ("actor_rollout_ref.actor.optim.warmup_style", "linear", "warmup_style='linear' is not valid"),
    ("trainer.device", "tpu", "trainer.device='tpu' is not valid"),
    ("actor_rollout_ref.model.dtype", "fp8", "model.dtype='fp8' is not valid"),
    ("data.truncation", "middle", "data.truncation='middle'"),
    ("trainer.resume_mode", "/no/such/dir", "neither auto, disable nor an existing checkpoint"),
    ("trainer.max_actor_ckpt_to_keep", 0, "max_actor_ckpt_to_keep must be null"),
    ("actor_rollout_ref.actor.checkpoint.save_contents", ["optimizer"], "must include 'model'"),
])
def test_bad_values_fail_with_one_line_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate_actor_config(_with(key, value))
    assert "\n" not in str(err.value)


def test_shipped_yaml_defaults_validate():
    # configs/trainer/*.yaml are @package _global_ fragments the root config composes; merge them here.
    merged = OmegaConf.merge(*(OmegaConf.load(config_dir() / "trainer" / f"{n}.yaml")
                               for n in ("actor", "checkpoint", "data")))
    merged.actor_rollout_ref.rollout.n = 16
    validate_actor_config(merged)


def test_device_settings_cpu_defaults_and_errors():
    s = device_settings("cpu", "auto")
    assert (s.device_type, s.backend, s.compute_dtype, s.mixed_precision) == ("cpu", "gloo", torch.float32, False)
    assert device_settings("cpu", "bfloat16").mixed_precision
    auto = device_settings("auto", "auto")
    assert auto.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="trainer.device=cuda but torch sees no GPU"):
            device_settings("cuda", "auto")


def test_fast_dtype_is_bf16_only_where_it_is_native(monkeypatch):
    from arpo.engine.config import resolve_dtype as engine_dtype
    from arpo.trainer import device

    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(device, "cpu_has_native_bf16", lambda native=native: native)
        s = device_settings("cpu", "fast")
        assert s.compute_dtype == expected and s.autocast == native and s.fast_layout == native
        assert engine_dtype("fast", "cpu") == expected  # the vLLM/HF engine key resolves it the same way
    assert device.fast_dtype("cuda") == torch.bfloat16
    assert engine_dtype("fast", "cuda:0") == torch.bfloat16
    with pytest.raises(ValueError, match="choose one of: auto, fast, float32, bfloat16, float16"):
        device_settings("cpu", "bf16")


def test_this_cpus_bf16_support_is_read_from_cpuinfo():
    flags = open("/proc/cpuinfo").read()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert device_settings("cpu", "fast").compute_dtype == (torch.bfloat16 if native else torch.float32)


def test_lr_schedule_warmup_constant_and_cosine():
    assert [lr_lambda(s, 2, 10, "constant", 0.0, 0.5) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cos = [lr_lambda(s, 2, 10, "cosine", 0.1, 0.5) for s in range(12)]
    assert cos[:3] == [0.5, 1.0, 1.0]
    assert cos[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cos[10] == pytest.approx(0.1) and cos[11] == pytest.approx(0.1)


def test_split_for_ranks_gives_each_rank_its_slice_of_every_mini_batch():
    batch = random_batch(10, seed=0)
    batch.non_tensors["row"] = torch.arange(10).numpy()
    shares, per_rank = split_for_ranks(batch, world_size=2, mini_batch_rows=4)
    assert per_rank == 2
    # mini-batches [0..3], [4..7], [8, 9]: rank 0 gets 0,1 | 4,5 | 8 and rank 1 gets 2,3 | 6,7 | 9.
    assert list(shares[0]["row"]) == [0, 1, 4, 5, 8]
    assert list(shares[1]["row"]) == [2, 3, 6, 7, 9]
    odd, _ = split_for_ranks(random_batch(7, seed=1), world_size=2, mini_batch_rows=4)
    assert [len(s) for s in odd] == [4, 4]
    assert odd[1]["is_pad"].tolist() == [0, 0, 0, 1]  # the 3-row mini-batch padded with one copy
    plain, _ = split_for_ranks(batch, world_size=3)
    assert [len(s) for s in plain] == [4, 4, 4]
    back = gather_rows([{"ids": s["input_ids"]} for s in plain], [s["is_pad"] for s in plain])
    assert torch.equal(back["ids"], batch["input_ids"])
