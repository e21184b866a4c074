"""Critic warm-up with sleep mode: a step that leaves the actor as it was pushes no weights, yet it put the engines to
sleep for the training phases; the trainer must still wake them before the next rollout, or that rollout waits on a
sleeping vLLM engine for ever. Driven through ``RayARPOTrainer.train_step`` itself (the real config, rollout, rewards
and advantages) with the worker groups stubbed, on engines that record every call."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from arpo.engine.weights import bucket_size, pack_bucket, plan_buckets, transfer_dtype
from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer

STATE = {"model.embed_tokens.weight": torch.arange(6.0).reshape(3, 2), "model.norm.weight": torch.ones(2)}


class SleepingEngine(ScriptedEngine):
    """A scripted engine that records its calls and, at sleep level 2, discards its weights while asleep as vLLM
    does: it then generates only after new weights were loaded."""

    def __init__(self, level: int):
        super().__init__()
        self.level, self.calls, self.weights_lost = level, [], False

    async def generate(self, *args, **kwargs):
        self.calls.append("generate")
        assert not self.asleep, "generate on a sleeping engine (a real one waits for ever)"
        assert not self.weights_lost, "generate with the weights a level-2 sleep discarded"
        return await super().generate(*args, **kwargs)

    async def sleep(self) -> None:
        self.calls.append("sleep")
        self.weights_lost = self.level == 2
        await super().sleep()

    async def wake_up(self, tags=None) -> None:
        self.calls.append("wake_up")
        await super().wake_up(tags)

    async def finish_weight_update(self) -> None:
        self.calls.append("weights")
        await super().finish_weight_update()
        self.weights_lost = False


class ActorStub:
    """The actor's worker group: an update that changes nothing here, and the weight-sync side over a plain state
    dict (buckets handed over in process, as to an in-process engine)."""

    def __init__(self):
        self.updates = 0

    def update_policy(self, batch):
        self.updates += 1
        return {"actor/pg_loss": 0.0}

    def plan_weight_sync(self, engine_dtype: str, bucket_bytes: int) -> list[int]:
        dtype = getattr(torch, engine_dtype)
        self.plan = plan_buckets(((n, t.shape, transfer_dtype(t.dtype, dtype)) for n, t in STATE.items()), 16)
        return [bucket_size(b) for b in self.plan]

    def weight_bucket(self, index: int):
        return pack_bucket(self.plan[index], (STATE[e.name] for e in self.plan[index]))

    def end_weight_sync(self) -> None:
        self.plan = None


class CriticStub:
    def compute_values(self, batch):
        return {"values": torch.zeros_like(batch.tensors["response_mask"], dtype=torch.float32)}

    def update_critic(self, batch):
        return {"critic/vf_loss": 0.0}


@pytest.mark.parametrize("level", [1, 2])
def test_critic_warmup_steps_wake_the_engines_they_put_to_sleep(level):
    from arpo.config import load_config
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.trainer.ray_trainer import RayARPOTrainer
    from reward_fns.manager import RewardManager

    # PPO with a critic, sleep mode on (as colocated on GPUs); the actor is updated from step 3 on
    cfg = load_config("arpo_trainer", ["preset=ppo", "trainer.critic_warmup=3", "data.train_batch_size=2",
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                                       "actor_rollout_ref.rollout.free_cache_engine=true", "reward.executor=serial",
                                       f"actor_rollout_ref.rollout.sleep_level={level}"])
    tokenizer = ToyTokenizer()
    engine = SleepingEngine(level)
    r = cfg.actor_rollout_ref.rollout
    rollout = ARPORollout([engine], tokenizer, {**dict(r.arpo), "mode": r.mode, "sampling.max_response_length": 16})
    actor = ActorStub()
    prompts = [tokenizer.encode("who wrote the answer"), tokenizer.encode("find the capital city")]
    rows = [{"raw_prompt_ids": p, "data_source": "nq", "reward_model": {"ground_truth": "paris"}} for p in prompts]
    trainer = RayARPOTrainer(cfg, tokenizer, SimpleNamespace(dataset=[{"raw_prompt_ids": prompts[0]}]), None,
                             rollout, actor, None, [engine], RewardManager.from_config(cfg), None, None,
                             critic_wg=CriticStub())
    try:
        for step in range(3):
            engine.calls.clear()
            trainer.train_step(rows)
            trainer.global_step += 1
            asleep = engine.calls.index("sleep")
            assert asleep > 0 and set(engine.calls[:asleep]) == {"generate"}, engine.calls  # the rollout, awake
            assert actor.updates == (1 if step == 2 else 0)  # warm-up: the actor waits while the critic learns
            # a push (the update's, or a level-2 sleep's discarded weights again) wakes the weights, loads them,
            # wakes the cache and probes; a warm-up step at level 1 just wakes the engine
            pushed = step == 2 or level == 2
            after = ["sleep", "wake_up", "weights", "wake_up", "generate"] if pushed else ["sleep", "wake_up"]
            assert engine.calls[asleep:] == after, (step, engine.calls)
            assert not engine.asleep and not engine.weights_lost, (step, engine.calls)  # ready for the next rollout
        trainer.global_step = 3
        trainer.train_step(rows)  # a rollout after the warm-up steps and the first update
    finally:
        rollout.close()
        trainer.close()
