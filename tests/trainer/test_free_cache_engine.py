"""actor_rollout_ref.rollout.free_cache_engine: the engine sleeps while the actor trains and is woken before the
weight push (verl's order), so a level-2 sleep that discarded the weights gets the new ones. The push hands an
engine in the trainer's process the tensors of the state dict the actor's rank 0 left in Ray's object store."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from arpo.testing.scripted_engine import ScriptedEngine
from arpo.trainer.ray_trainer import RayARPOTrainer

STATE = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2)}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    import ray

    from arpo.ray_utils import init_ray

    init_ray({"ray_init": {"num_cpus": 1}})
    yield
    ray.shutdown()


def _trainer(engine, free: bool, tmp_path):
    import ray

    # push_weights needs only these parts; the rest of the trainer is exercised end to end in test_main_arpo
    trainer = RayARPOTrainer.__new__(RayARPOTrainer)
    trainer.engines, trainer.free_cache_engine, trainer.global_step = [engine], free, 0
    trainer.actor_wg = SimpleNamespace(engine_weights=lambda: ray.put(STATE))
    trainer.train_data = SimpleNamespace(dataset=[{"raw_prompt_ids": [5, 6, 7]}])
    return trainer


def test_weight_push_wakes_the_sleeping_engine_first(tmp_path):
    engine = ScriptedEngine()
    asyncio.run(engine.sleep())
    metrics = _trainer(engine, True, tmp_path).push_weights()
    assert not engine.asleep and engine.weight_version == 1
    assert torch.equal(engine.weights["model.embed_tokens.weight"], STATE["model.embed_tokens.weight"])
    assert "rollout/weight_sync_probe" in metrics  # the probe generated after the reload


def test_without_free_cache_engine_the_trainer_never_wakes_the_engine(tmp_path):
    engine = ScriptedEngine()
    asyncio.run(engine.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        _trainer(engine, False, tmp_path).push_weights()
