"""actor_rollout_ref.rollout.free_cache_engine: the engine sleeps while the actor trains and is woken before the
weight push (verl's order), so a level-2 sleep that discarded the weights gets the new ones. The push hands an
engine in the trainer's process the tensors of the buckets the actor's rank 0 left in Ray's object store."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from arpo.engine.weights import bucket_size, pack_bucket, plan_buckets, transfer_dtype
from arpo.testing.scripted_engine import ScriptedEngine
from arpo.trainer.ray_trainer import RayARPOTrainer

STATE = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2), "model.norm.weight": torch.ones(2)}


class StateDictGroup:
    """The actor's side of a weight sync over a plain state dict (what each FSDP2 rank does over its shards):
    buckets planned, then each packed into Ray's object store, as a Ray worker group leaves them."""

    def plan_weight_sync(self, engine_dtype: str, bucket_bytes: int) -> list[int]:
        dtype = getattr(torch, engine_dtype)
        self.plan = plan_buckets(((n, t.shape, transfer_dtype(t.dtype, dtype)) for n, t in STATE.items()), 16)
        return [bucket_size(b) for b in self.plan]

    def weight_bucket(self, index: int):
        import ray

        return ray.put(pack_bucket(self.plan[index], (STATE[e.name] for e in self.plan[index])))

    def end_weight_sync(self) -> None:
        self.plan = None


@pytest.fixture(autouse=True)
def _on_ray(ray_cluster):
    """The weight push hands its buckets through Ray's object store: the worker's shared cluster."""


def _trainer(engine, free: bool, tmp_path):
    # push_weights needs only these parts; the rest of the trainer is exercised end to end in test_main_arpo
    trainer = RayARPOTrainer.__new__(RayARPOTrainer)
    trainer.engines, trainer.free_cache_engine, trainer.global_step = [engine], free, 0
    trainer.lora_serving = None  # no LoRA: the full weights are pushed
    trainer.cfg = {}  # checkpoint_engine.update_weights_bucket_megabytes: verl's default
    trainer.actor_wg = StateDictGroup()
    trainer.train_data = SimpleNamespace(dataset=[{"raw_prompt_ids": [5, 6, 7]}])
    return trainer


def test_weight_push_wakes_the_sleeping_engine_first(tmp_path):
    engine = ScriptedEngine()
    asyncio.run(engine.sleep())
    metrics = _trainer(engine, True, tmp_path).push_weights()
    assert not engine.asleep and engine.weight_version == 1
    assert list(engine.weights) == list(STATE)
    assert all(torch.equal(engine.weights[k], v) for k, v in STATE.items())
    assert "rollout/weight_sync_probe" in metrics  # the probe generated after the reload


def test_without_free_cache_engine_the_trainer_never_wakes_the_engine(tmp_path):
    engine = ScriptedEngine()
    asyncio.run(engine.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        _trainer(engine, False, tmp_path).push_weights()
