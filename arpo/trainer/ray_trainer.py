"""The ARPO fit loop: rollout → rewards → old/ref log-probs (+ critic values) → advantages (soft | hard | GAE) →
critic update → actor update → weights pushed to the engine, with validation, checkpoints and tracking (verl's
RayPPOTrainer, trimmed).

The driver owns the loop and the rollout; FSDP2 actor/ref workers live in Ray actors (``worker_group``); the
generation engine lives in its own Ray actor. On a 2-core CPU these take turns: the rollout runs while the
workers idle, then the workers train while the engine idles.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

from arpo.batch import DataBatch
from arpo.engine.lora_serving import lora_serving_from_cfg
from arpo.trainer import core_algos
from arpo.trainer.actor_config import needs_old_log_prob_pass, reference_policy, validation_sampling
from arpo.trainer.dynamic_sampling import GroupCollector, filter_groups_config
from arpo.trainer.hard_advantage import apply_advantage_mode
from arpo.trainer.metrics import Timer, compute_data_metrics

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def compute_advantage(batch: DataBatch, cfg: DictConfig) -> DataBatch:
    """Advantages and returns with the configured estimator, then soft/hard sharing over the branch tree."""
    algo = cfg.algorithm
    if algo.adv_estimator == "gae":  # token-level: values in, no group structure (hard mode is refused at start-up)
        batch.tensors["advantages"], batch.tensors["returns"] = core_algos.compute_gae_advantage_return(
            batch.tensors["token_level_rewards"], batch.tensors["values"], batch.tensors["response_mask"],
            gamma=algo.gamma, lam=algo.lam)
        return batch
    fn = core_algos.get_adv_estimator_fn(algo.adv_estimator)
    index = np.asarray(batch.non_tensors["uid"])
    adv, ret = fn(token_level_rewards=batch.tensors["token_level_rewards"],
                  response_mask=batch.tensors["response_mask"], index=index,
                  tree_index=batch.non_tensors.get("tree_index"),
                  norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo, gamma=algo.gamma)
    adv = apply_advantage_mode(adv, batch.tensors["response_mask"], index,
                               np.asarray(batch.non_tensors["parent_index"]),
                               np.asarray(batch.non_tensors["branch_pos"]), algo.advantage_mode)
    batch.tensors["advantages"] = adv
    batch.tensors["returns"] = ret if algo.advantage_mode == "soft" else adv.clone()
    return batch


class RayARPOTrainer:
    """Runs ``trainer.total_training_steps`` (or ``trainer.total_epochs``) of ARPO on a Ray cluster."""

    def __init__(self, cfg: DictConfig, tokenizer, train_data, val_data, rollout, actor_wg, ref_wg, engines,
                 reward_manager, tracker, checkpointer, critic_wg=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_data = train_data
        self.val_data = val_data
        self.rollout = rollout
        self.actor_wg = actor_wg
        self.ref_wg = ref_wg
        self.critic_wg = critic_wg
        self.engines = list(engines)  # the rollout's replicas: each gets every weight push
        self.reward_manager = reward_manager
        self.tracker = tracker
        self.checkpointer = checkpointer
        self.global_step = 0
        self.kl_ctrl = core_algos.get_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
        self.filter_groups = filter_groups_config(cfg)
        self.free_cache_engine = bool(cfg.actor_rollout_ref.rollout.get("free_cache_engine", False))
        self.sleep_level = int(cfg.actor_rollout_ref.rollout.get("sleep_level") or 1)
        #: where the reference log-probs come from (actor_config.reference_policy); "actor": LoRA's frozen base
        ref = reference_policy(cfg)
        self.reference = ref if ref == "actor" or ref_wg is not None else None
        #: how LoRA weights reach the engines after an update ("adapter" | "merged"; None without LoRA), as
        #: resolved and logged at config validation
        self.lora_serving = lora_serving_from_cfg(cfg)
        if self.reference is not None:
            logger.info("reference policy: %s", "the actor's base model (LoRA adapters disabled; no reference "
                        "worker group)" if self.reference == "actor" else "its own worker group")

    # ---- one step --------------------------------------------------------------------------------------
    def _prompt_batch(self, rows: list[dict[str, Any]]) -> DataBatch:
        nt = {k: _column([r[k] for r in rows]) for k in rows[0] if k != "raw_prompt_ids"}
        nt["raw_prompt_ids"] = _column([r["raw_prompt_ids"] for r in rows])
        nt["uid"] = _column([str(uuid.uuid4()) for _ in rows])
        return DataBatch({}, nt, {})

    def _generate(self, prompts: DataBatch, validation: bool, gen_round: int = 0) -> DataBatch:
        """Roll out with the configured path; validation samples ``rollout.val_kwargs.n`` per prompt with its
        own sampling (greedy by default, as ARPO validates) and never branches. ``gen_round``: the step's
        generation round under dynamic sampling."""
        r = self.cfg.actor_rollout_ref.rollout
        v = validation_sampling(r.val_kwargs)
        # Seeds follow the step, so a resumed run samples exactly what the uninterrupted one would have.
        prompts.meta["seed"] = (int(self.cfg.trainer.seed) * 1_000_003 + self.global_step * 2 + validation
                                + gen_round * 7_919) & 0x7FFFFFFF
        if validation:
            prompts.meta["rollout_overrides"] = {"mode": "single", "n": v["n"], "initial_rollouts": v["n"],
                                                 **{f"sampling.{k}": v[k] for k in ("temperature", "top_p", "top_k")}}
        if r.mode == "agent_loop":  # per-sample loops take verl's sampling params; group loops the overrides too
            from arpo.engine.base import SamplingParams

            params = SamplingParams(
                **{k: v[k] if validation else r[k] for k in ("temperature", "top_p", "top_k")},
                max_tokens=int(self.cfg.data.max_response_length), seed=prompts.meta["seed"])
            return self.rollout.generate_sequences(prompts, n=v["n"] if validation else r.n, sampling_params=params)
        return self.rollout.generate_sequences(prompts)

    def _score(self, batch: DataBatch) -> tuple[DataBatch, dict[str, float]]:
        from reward_fns.manager import build_token_level_rewards, decode_response_texts

        texts = decode_response_texts(batch, self.tokenizer)
        scores, result = build_token_level_rewards(batch, texts, self.reward_manager)
        batch.tensors["token_level_scores"] = scores
        batch.non_tensors["response_text"] = _column(texts)
        extra = result.extra_info_lists()
        # A reward function that returns a bare float has no "acc": its score stands in.
        acc = extra.get("acc") or [None] * len(texts)
        batch.non_tensors["reward_acc"] = _column([float(a) if a is not None else float(s)
                                                   for a, s in zip(acc, result.scores)])
        batch.non_tensors["reward_score"] = _column([float(s) for s in result.scores])  # before any shaping
        if "format_ok" in extra:
            batch.non_tensors["reward_format_ok"] = _column(extra["format_ok"])
        return batch, result.metrics

    def _rollout_round(self, rows: list[dict[str, Any]], timer: Timer, gen_round: int) -> tuple[DataBatch, dict]:
        """One generation round of a step: roll out and score ``rows``."""
        with timer.phase("gen"):
            batch = self._generate(self._prompt_batch(rows), validation=False, gen_round=gen_round)
        metrics = {k if "/" in k else f"rollout/{k}": v for k, v in batch.meta.get("metrics", {}).items()}
        batch.meta["max_response_length"] = self.cfg.data.max_response_length
        batch.meta["max_prompt_length"] = self.cfg.data.max_prompt_length
        with timer.phase("reward"):
            batch, reward_metrics = self._score(batch)
        return batch, {**metrics, **reward_metrics}

    def _collect_batch(self, rows: list[dict[str, Any]], timer: Timer) -> tuple[DataBatch | None, dict]:
        """The step's scored batch: one round, or with dynamic sampling the informative groups of as many
        rounds as it takes (None when no group was informative). Round metrics are averaged over rounds."""
        if not self.filter_groups.enable:
            return self._rollout_round(rows, timer, 0)
        collector = GroupCollector(self.filter_groups, int(self.cfg.data.train_batch_size),
                                   self.tokenizer.pad_token_id)
        round_metrics: list[dict[str, float]] = []
        while True:
            batch, m = self._rollout_round(rows, timer, collector.rounds)
            collector.add(batch)
            round_metrics.append(m)
            if collector.done:
                break
            rows = self.train_data.next_batch()
        keys = dict.fromkeys(k for m in round_metrics for k in m)
        metrics = {k: float(np.mean([m[k] for m in round_metrics if k in m])) for k in keys}
        metrics.update(collector.metrics())
        if collector.kept < collector.target:
            logger.warning("step %d: %d of %d prompt groups informative after %d generation rounds (the cap); %s",
                           self.global_step + 1, collector.kept, collector.target, collector.rounds,
                           "training on those" if collector.kept else "no update this step")
        return collector.batch(), metrics

    def train_step(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        cfg = self.cfg
        timer = Timer()
        with timer.phase("step"):
            batch, metrics = self._collect_batch(rows, timer)
            if batch is None:  # dynamic sampling kept nothing: no signal to train on, the weights stay
                return {**metrics, **timer.metrics()}
            if self.free_cache_engine:  # verl: the engine gives its GPU memory back while the actor trains
                _run_all(e.sleep() for e in self.engines)
            # On-policy (one mini-batch, one epoch: ARPO's setting) the update takes old log-probs and
            # actor/entropy from its own forward, as verl's dp_actor does; the released ARPO code (older
            # verl) always ran this pass, which changes only float rounding.
            old_entropy = None
            if needs_old_log_prob_pass(cfg):
                with timer.phase("old_log_prob"):
                    out = self.actor_wg.compute_log_prob(batch, calc_entropy=True)
                    batch.tensors["old_log_probs"] = out["log_probs"]
                    old_entropy = out.get("entropy")
                    if old_entropy is not None:
                        m = batch.tensors["response_mask"].bool()
                        metrics["actor/entropy"] = old_entropy[m].mean().item() if m.any() else 0.0
            if self.reference is not None:
                with timer.phase("ref"):
                    batch.tensors["ref_log_prob"] = self.reference_log_probs(batch)
            if self.critic_wg is not None:
                with timer.phase("values"):
                    batch.tensors["values"] = self.critic_wg.compute_values(batch)["values"]
            with timer.phase("adv"):
                if self.kl_ctrl is not None:
                    batch, kl_metrics = core_algos.apply_kl_penalty(batch, self.kl_ctrl, cfg.algorithm.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    batch.tensors["token_level_rewards"] = batch.tensors["token_level_scores"]
                batch = compute_advantage(batch, cfg)
                actor = cfg.actor_rollout_ref.actor
                if actor.enable_entropy_balanced_advantage:  # AEPO; needs_old_log_prob_pass made the entropies
                    batch.tensors["advantages"] = core_algos.compute_entropy_balanced_advantage(
                        batch.tensors["advantages"], old_entropy, batch.tensors["response_mask"],
                        actor.entropy_advantage_alpha)
            self._dump_rollouts(batch)
            if self.critic_wg is not None:
                with timer.phase("update_critic"):
                    metrics.update(self.critic_wg.update_critic(batch))
            # verl's warm-up rule (its steps count from 1): the critic learns alone until step critic_warmup
            if int(cfg.trainer.critic_warmup) <= self.global_step + 1:
                with timer.phase("update_actor"):
                    metrics.update(self.actor_wg.update_policy(batch))
                with timer.phase("update_weights"):
                    metrics.update(self.push_weights())
            elif self.free_cache_engine:  # no push to wake them: the next rollout would wait on sleeping engines
                with timer.phase("update_weights"):
                    self.wake_unchanged()
        metrics.update(compute_data_metrics(batch))
        metrics.update(timer.metrics(int(batch.tensors["attention_mask"].sum())))
        return metrics

    def reference_log_probs(self, batch: DataBatch) -> "torch.Tensor":
        """The reference policy's log-probs of ``batch`` (B, T): with LoRA the actor's workers with the adapters
        disabled (the frozen base model is the reference), else the reference worker group."""
        if self.reference == "actor":
            return self.actor_wg.compute_log_prob(batch, calc_entropy=False, base_model=True)["log_probs"]
        return self.ref_wg.compute_log_prob(batch)["log_probs"]

    def wake_unchanged(self) -> None:
        """Wake the engines after a step that left the actor as it was (critic warm-up), so that every sleep has
        its wake-up before the next rollout. A level-1 sleep kept the weights in host memory and the wake-up brings
        them back; a level-2 sleep discarded them, so they are pushed again (the actor's, unchanged)."""
        if self.sleep_level == 2:
            self.push_weights()
        else:
            _run_all(e.wake_up() for e in self.engines)

    def push_weights(self) -> dict[str, float]:
        """Actor weights → every replica, streamed in buckets of
        ``actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes`` in the engines' dtype
        (:mod:`arpo.trainer.weight_sync`): each bucket goes through Ray's object store, where every engine actor
        fetches it to its own node (an engine in this process gets the tensors); no file, and never the whole
        model in one object. Each engine pauses for the whole update and resets its prefix cache after it.

        Returns ``rollout/weight_sync_probe``: the first replica's mean log-prob of its top-5 next tokens on a fixed
        probe prompt after the reload — it moves with every update, so a flat curve means the engine is not
        receiving the weights; with several replicas also ``rollout/weight_sync_replica_gap``, the largest
        difference of the others' probes from the first's (0 up to kernel rounding when all got the weights)."""
        import asyncio

        from arpo.engine.base import SamplingParams
        from arpo.engine.config import bucket_bytes_from_cfg
        from arpo.trainer.weight_sync import stream_weights, sync_adapter

        # Weights awake before the reload (sleep level 2 discarded them), the KV cache only after it: the push's
        # buckets and the cache never share the GPU (verl's order).
        if self.free_cache_engine:
            _run_all(e.wake_up(["weights"]) for e in self.engines)
        if self.lora_serving == "adapter":  # the base never changes: the adapter alone, MBs
            # named for the step whose rollout it serves, as rollouts/step_N.jsonl
            out = Path(self.cfg.trainer.get("output_dir") or ".") / "lora_adapters" / f"step_{self.global_step + 1}"
            sync = asyncio.run(sync_adapter(self.actor_wg, self.engines, out))
        else:
            sync = asyncio.run(stream_weights(self.actor_wg, self.engines, bucket_bytes_from_cfg(self.cfg)))
        if self.free_cache_engine:
            _run_all(e.wake_up(["kv_cache"]) for e in self.engines)
        logger.info("weights pushed to %d engine(s): %d buckets, %.1f MB each engine, %s, %.2f s",
                    len(self.engines), sync["buckets"], sync["bytes"] / 1e6, sync["dtype"], sync["seconds"])
        probe = list(self.train_data.dataset[0]["raw_prompt_ids"])
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
        outs = _run_all(e.generate(probe, params, f"weight-sync-probe-{self.global_step}-{r}")
                        for r, e in enumerate(self.engines))
        # The greedy token is often near-certain (log-prob ~0, it barely moves); the runners-up move with
        # every update, so the probe is the mean log-prob of the top 5.
        probes = [float(np.mean(list(out.logprobs[0].values()))) for out in outs]
        metrics = {"rollout/weight_sync_probe": probes[0]}
        if len(probes) > 1:
            metrics["rollout/weight_sync_replica_gap"] = max(abs(p - probes[0]) for p in probes[1:])
        return metrics

    # ---- validation --------------------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy (by default) validation: mean reward and accuracy per data source, and one JSONL record per
        sample in ``trainer.validation_data_dir/step_<N>.jsonl`` (verl's key) for paired before/after tests."""
        if self.val_data is None:
            return {}
        rows = self.val_data.all_rows()
        if int(self.cfg.data.val_max_samples) >= 0:
            rows = rows[: int(self.cfg.data.val_max_samples)]
        batch = self._generate(self._prompt_batch(rows), validation=True)
        batch, _ = self._score(batch)
        scores = batch.tensors["token_level_scores"].sum(-1).numpy()
        acc = np.asarray(batch.non_tensors["reward_acc"], dtype=float)
        sources = np.asarray(batch.non_tensors["data_source"])
        out: dict[str, float] = {}
        n = int(self.cfg.actor_rollout_ref.rollout.val_kwargs.n)
        for src in sorted(set(sources)):
            sel = sources == src
            out[f"val-core/{src}/reward/mean@{n}"] = float(scores[sel].mean())
            out[f"val-core/{src}/acc/mean@{n}"] = float(acc[sel].mean())
        out["val-core/all/reward/mean"] = float(scores.mean())
        out["val-core/all/acc/mean"] = float(acc.mean())
        self._dump_validation(batch, scores, acc)
        return out

    def _dump_validation(self, batch: DataBatch, scores: np.ndarray, acc: np.ndarray) -> None:
        folder = self.cfg.trainer.validation_data_dir
        if not folder:
            return
        nt = batch.non_tensors
        group = nt.get("group_index", np.arange(len(scores)))
        tool_calls = nt.get("tool_calls", [None] * len(scores))
        _write_jsonl(Path(folder) / f"step_{self.global_step}.jsonl", ({
            "step": self.global_step, "prompt_index": int(group[i]), "data_source": str(nt["data_source"][i]),
            "score": float(scores[i]), "acc": float(acc[i]),
            "format_ok": float(nt["reward_format_ok"][i]) if "reward_format_ok" in nt else None,
            "num_tool_calls": len(tool_calls[i] or []),
            "ground_truth": str(nt["reward_model"][i].get("ground_truth")),
            "response": str(nt["response_text"][i])} for i in range(len(scores))))

    def _dump_rollouts(self, batch: DataBatch) -> None:
        """This step's trajectories under ``trainer.rollout_data_dir`` (verl's key), one JSON row each."""
        from arpo.analysis import rollout_rows

        folder = self.cfg.trainer.rollout_data_dir
        if folder:
            _write_jsonl(Path(folder) / f"step_{self.global_step + 1}.jsonl", rollout_rows(batch))

    # ---- the loop ----------------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        t = self.cfg.trainer
        self.global_step = self.checkpointer.resume(self)
        total = self.total_steps()
        self.tracker.total_steps = total
        last_val: dict[str, float] = {}
        if self.global_step == 0 and t.val_before_train:
            last_val = self.validate()
            self.tracker.log(last_val, step=0)
        bar = tqdm(total=total, initial=self.global_step, desc="arpo", unit="step")
        while self.global_step < total:
            rows = self.train_data.next_batch()
            metrics = self.train_step(rows)
            self.global_step += 1
            metrics["training/global_step"] = self.global_step
            metrics["training/epoch"] = self.train_data.epoch
            if t.test_freq > 0 and (self.global_step % t.test_freq == 0 or self.global_step == total):
                last_val = self.validate()
                metrics.update(last_val)
            if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or self.global_step == total):
                self.checkpointer.save(self, self.global_step)
            self.tracker.log(metrics, step=self.global_step)
            bar.update(1)
        bar.close()
        return last_val

    def total_steps(self) -> int:
        t = self.cfg.trainer
        if t.total_training_steps:
            return int(t.total_training_steps)
        return int(t.total_epochs) * self.train_data.steps_per_epoch

    def close(self) -> None:
        self.reward_manager.close()  # its worker processes would otherwise live until the interpreter's exit


class TrainerCheckpointer:
    """Driver side of checkpoints: actor (and critic) shards (the workers write them) + the driver's own state —
    dataloader position, RNG states, step, KL controller — committed atomically as one ``global_step_N`` directory."""

    def __init__(self, root: str | Path, resume_mode: str = "auto", resume_from_path: str | None = None,
                 max_to_keep: int | None = None, max_critic_to_keep: int | None = None):
        from arpo.trainer.checkpoint import CheckpointManager

        self.manager = CheckpointManager(root, max_to_keep, max_critic_to_keep)
        self.resume_mode = resume_mode
        self.resume_from_path = resume_from_path

    def save(self, trainer: "RayARPOTrainer", step: int) -> Path:
        from arpo.trainer.checkpoint import save_checkpoint

        kl = trainer.kl_ctrl.value if trainer.kl_ctrl is not None else None
        return save_checkpoint(self.manager, step, trainer.actor_wg, dataloader=trainer.train_data,
                               trainer_state={"kl_coef": kl}, critic_group=trainer.critic_wg)

    def resume(self, trainer: "RayARPOTrainer") -> int:
        """Restore the newest (or the configured) checkpoint; returns the step to continue from (0: fresh)."""
        from arpo.trainer.checkpoint import load_checkpoint

        path = self.manager.resolve_resume(self.resume_mode, self.resume_from_path)
        if path is None:
            return 0
        state = load_checkpoint(path, trainer.actor_wg, dataloader=trainer.train_data, critic_group=trainer.critic_wg)
        if trainer.kl_ctrl is not None and state.get("kl_coef") is not None:
            trainer.kl_ctrl.value = state["kl_coef"]
        # The engine started from the initial weights: give it the restored ones (named for the step they serve).
        trainer.global_step = int(state["global_step"])
        trainer.push_weights()
        return trainer.global_step


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """One JSON row per line, written to a temporary file and renamed: a killed run never leaves half a file."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    tmp.replace(path)


def _column(values: list[Any]) -> np.ndarray:
    col = np.empty(len(values), dtype=object)
    col[:] = values
    return col


def _run_all(calls: Iterable[Any]) -> list[Any]:
    """Await several engine calls at once (one per replica; a synchronous engine's results pass through); results
    in order."""
    import asyncio
    import inspect

    async def gather() -> list[Any]:
        results = list(calls)
        pending = [r for r in results if inspect.isawaitable(r)]
        done = iter(await asyncio.gather(*pending))
        return [next(done) if inspect.isawaitable(r) else r for r in results]

    return asyncio.run(gather())


