"""One real trainer step in this process: the tiny model's FSDP2 update on one in-process rank, real rewards and
weight push, a rollout on scripted engines. What the glossary, the example reward and the sleep/wake tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

STEP_OVERRIDES = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                  "trainer.n_gpus_per_node=1", "reward.executor=serial", "actor_rollout_ref.rollout.n=4",
                  "actor_rollout_ref.rollout.arpo.initial_rollouts=2", "actor_rollout_ref.rollout.num_replicas=1"]


def one_train_step(model_dir: Path, synthetic_dir: Path, overrides: Sequence[str] = (),
                   make_engine: Callable[[Any], Any] | None = None,
                   prepare: Callable[[Any], None] | None = None) -> tuple[dict[str, float], list[Any]]:
    """``RayARPOTrainer.train_step`` on the first batch; returns its metrics and the engines (one per
    ``num_replicas``, ``make_engine(tokenizer)`` each, a ScriptedEngine by default). ``prepare(cfg)`` runs on the
    composed config first (what start-up would resolve in it)."""
    from transformers import AutoTokenizer

    from arpo.config import load_config
    from arpo.data.rl_dataset import create_rl_dataloaders
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.testing.scripted_engine import ScriptedEngine
    from arpo.trainer.ray_trainer import RayARPOTrainer
    from arpo.trainer.worker_group import LocalWorkerGroup
    from reward_fns.manager import RewardManager

    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={model_dir}",
                                       f"synthetic.out_dir={synthetic_dir}", *STEP_OVERRIDES, *overrides])
    if prepare is not None:
        prepare(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    train, _ = create_rl_dataloaders(cfg, tokenizer)
    r = cfg.actor_rollout_ref.rollout
    engines = [(make_engine or ScriptedEngine)(tokenizer) for _ in range(r.num_replicas)]
    rollout = ARPORollout(engines, tokenizer, {**dict(r.arpo), "mode": r.mode, "sampling.max_response_length": 16})
    actor = LocalWorkerGroup(cfg, "actor")
    trainer = RayARPOTrainer(cfg, tokenizer, train, None, rollout, actor, None, engines,
                             RewardManager.from_config(cfg), None, None)
    try:
        metrics = trainer.train_step(train.next_batch())
    finally:
        rollout.close()
        actor.shutdown()
        trainer.close()
    return metrics, engines
