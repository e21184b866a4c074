"""Sleep mode through the trainer's own step: with ``free_cache_engine`` resolved on (colocated on GPUs, the
default), one ``train_step`` generates, puts every replica to sleep before the actor's update, wakes each one before
any weight reaches it, then probes it; the order is recorded on scripted engines (the payload is
tests/trainer/test_free_cache_engine.py's and the weight-sync tests' business)."""

from __future__ import annotations

import inspect

import pytest

from arpo.testing.scripted_engine import ScriptedEngine


class RecordingEngine(ScriptedEngine):
    """A scripted engine that records the name of every engine call, in order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if name.startswith("_") or not inspect.iscoroutinefunction(attr):
            return attr
        calls = object.__getattribute__(self, "calls")

        async def recorded(*args, **kwargs):
            calls.append(name)
            return await attr(*args, **kwargs)

        return recorded


@pytest.mark.slow  # one real update of the tiny model in this process: ~15 s on 2 busy cores
def test_train_step_sleeps_every_replica_and_wakes_it_before_the_weights(tiny_model_dir, synthetic_dir):
    from arpo.runtime.placement import resolve_rollout_auto
    from tests.trainer.train_step_helpers import one_train_step

    def as_on_gpus(cfg) -> None:  # free_cache_engine null resolves on, as colocated on GPUs
        assert resolve_rollout_auto(cfg, gpus=True) == {"num_replicas": 2, "free_cache_engine": True}

    metrics, engines = one_train_step(tiny_model_dir, synthetic_dir, ["actor_rollout_ref.rollout.num_replicas=2",
                                      "actor_rollout_ref.rollout.n=2"], RecordingEngine, as_on_gpus)
    assert "rollout/weight_sync_probe" in metrics
    for engine in engines:
        calls = engine.calls
        assert calls.count("sleep") == 1 and calls.count("wake_up") == 2, calls
        asleep = calls.index("sleep")
        wake_weights, wake_cache = [i for i, c in enumerate(calls) if c == "wake_up"]
        weights = [i for i, c in enumerate(calls) if "weight" in c]
        assert "generate" in calls[:asleep]  # the rollout ran before the sleep
        assert asleep < wake_weights < weights[0], calls  # no weight reaches a sleeping engine
        assert weights[-1] < wake_cache < len(calls) - 1, calls  # the KV cache comes back after the push
        assert calls[asleep + 1:wake_weights] == []  # nothing runs on a sleeping engine
        assert calls[-1] == "generate" and not engine.asleep  # the probe, on the new weights
