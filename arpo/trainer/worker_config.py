"""What a training rank reads from the config, as typed objects built once (verl's ``omega_conf_to_dataclass``).

:func:`WorkerConfig.from_config` takes the root config (a DictConfig or the plain dict a Ray actor receives) and a
role; every default lives here once, and the workers read attributes instead of looking keys up by string. The
keys' values are checked at start-up, with one-line errors, by :mod:`arpo.trainer.actor_config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from arpo.trainer.actor_config import cfg_get, resolve_tree_packing, rollout_n, rollout_temperature
from arpo.trainer.logprobs import DEFAULT_CHUNK_SIZE


def _from_section(cls: type, section: Any, **given: Any):
    """``cls`` from the section's keys that are its fields (other keys and nulls ignored), then ``given``."""
    section = section if isinstance(section, Mapping) or hasattr(section, "get") else {}
    values = {f.name: section.get(f.name) for f in fields(cls) if f.name not in given}
    return cls(**{k: v for k, v in values.items() if v is not None}, **given)


@dataclass(frozen=True)
class ModelConfig:
    """``actor_rollout_ref.model`` (the critic's: ``critic.model``, its path defaulting to the actor's)."""

    path: str | None = None
    attn_implementation: str = "sdpa"
    enable_gradient_checkpointing: bool = True
    share_prefix: bool = True
    tree_packing: bool | str = "auto"
    lora_rank: int = 0                          # 0: full fine-tuning; > 0: peft LoRA adapters only (lora.py)
    lora_alpha: float = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    custom_chat_template: str | None = None     # arpo.chat_templates: a name, a .jinja path or Jinja text

    def packs_trees(self, device_type: str) -> bool:
        return resolve_tree_packing(self.tree_packing, device_type)


@dataclass(frozen=True)
class OptimConfig:
    """``actor_rollout_ref.actor.optim`` or ``critic.optim``: AdamW and its LR schedule."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    eps: float = 1e-8
    warmup_style: str = "constant"
    lr_warmup_steps: int = -1           # -1: lr_warmup_steps_ratio of the total
    lr_warmup_steps_ratio: float = 0.0
    total_training_steps: int = -1      # -1: trainer.total_training_steps
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5


@dataclass(frozen=True)
class UpdateConfig:
    """The keys verl's dp_actor and dp_critic share: how an update walks its mini-batch and clips its gradient."""

    ppo_micro_batch_size_per_gpu: int = 1
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    loss_agg_mode: str = "token-mean"


@dataclass(frozen=True)
class PolicyLossConfig(UpdateConfig):
    """``actor_rollout_ref.actor`` (verl's dp_actor keys) plus ``algorithm.rollout_correction``'s weights."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None     # None: clip_ratio
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    enable_entropy_balanced_clipping: bool = False
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    loss_scale_factor: float | None = None  # None: the batch's max response length
    logprob_chunk_size: int = DEFAULT_CHUNK_SIZE
    rollout_is: str | None = None           # algorithm.rollout_correction.rollout_is
    rollout_is_threshold: float = 2.0
    use_dynamic_bsz: bool = False           # micro-batches by token budget (micro_batches.py), not row count
    ppo_max_token_len_per_gpu: int = 16384


@dataclass(frozen=True)
class ValueLossConfig(UpdateConfig):
    """``critic`` (verl's dp_critic keys)."""

    forward_micro_batch_size_per_gpu: int = 8
    cliprange_value: float = 0.5


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one rank of ``role`` (actor, ref or critic) reads from the config."""

    model: ModelConfig
    optim: OptimConfig
    policy: PolicyLossConfig
    value: ValueLossConfig
    mini_batch_rows: int            # rows of one optimizer step over all ranks (mini-batch size x rollout.n)
    log_prob_micro_batch_size: int  # rows per forward of the log-prob pass (the rollout's or the ref's key)
    log_prob_use_dynamic_bsz: bool  # the log-prob pass packs rows up to log_prob_max_token_len tokens instead
    log_prob_max_token_len: int     # log_prob_max_token_len_per_gpu (the rollout's or the ref's key)
    temperature: float              # the rollout's sampling temperature, which the log-probs are taken at
    total_training_steps: int
    device: str                     # trainer.device: auto | cpu | cuda
    nnodes: int
    cpus_per_worker: float
    seed: int
    save_contents: tuple[str, ...]  # actor_rollout_ref.actor.checkpoint.save_contents
    reshard_after_forward: bool = True  # actor_rollout_ref.actor.fsdp_config.reshard_after_forward (the update only)
    use_torch_compile: bool = False     # actor_rollout_ref.actor.use_torch_compile (the actor's decoder layers)

    @classmethod
    def from_config(cls, cfg: Any, role: str = "actor") -> "WorkerConfig":
        actor = cfg_get(cfg, "actor_rollout_ref.actor", {})
        model = _from_section(ModelConfig, cfg_get(cfg, "actor_rollout_ref.model", {}))
        if role == "critic":
            critic_model = cfg_get(cfg, "critic.model", {})
            model = _from_section(ModelConfig, critic_model, path=cfg_get(critic_model, "path", model.path),
                                  attn_implementation=model.attn_implementation, share_prefix=False,
                                  tree_packing=False)  # the packed forward is the policy head's
        optim_section = cfg_get(cfg, "critic.optim" if role == "critic" else "actor_rollout_ref.actor.optim", {})
        optim = _from_section(OptimConfig, optim_section, betas=tuple(cfg_get(optim_section, "betas", (0.9, 0.999))))
        correction = cfg_get(cfg, "algorithm.rollout_correction", {})
        policy = _from_section(PolicyLossConfig, actor, rollout_is=cfg_get(correction, "rollout_is"),
                               rollout_is_threshold=float(cfg_get(correction, "rollout_is_threshold", 2.0)))
        value = _from_section(ValueLossConfig, cfg_get(cfg, "critic", {}))
        mini_key = "critic.ppo_mini_batch_size" if role == "critic" else "actor_rollout_ref.actor.ppo_mini_batch_size"
        log_prob_key = "ref" if role == "ref" else "rollout"
        return cls(
            model=model, optim=optim, policy=policy, value=value,
            mini_batch_rows=int(cfg_get(cfg, mini_key, 1)) * rollout_n(cfg),
            log_prob_micro_batch_size=int(cfg_get(
                cfg, f"actor_rollout_ref.{log_prob_key}.log_prob_micro_batch_size_per_gpu", 8)),
            log_prob_use_dynamic_bsz=bool(cfg_get(
                cfg, f"actor_rollout_ref.{log_prob_key}.log_prob_use_dynamic_bsz", False)),
            log_prob_max_token_len=int(cfg_get(
                cfg, f"actor_rollout_ref.{log_prob_key}.log_prob_max_token_len_per_gpu", 16384)),
            temperature=rollout_temperature(cfg),
            total_training_steps=int(cfg_get(cfg, "trainer.total_training_steps", -1) or -1),
            device=str(cfg_get(cfg, "trainer.device", "auto")),
            nnodes=int(cfg_get(cfg, "trainer.nnodes", 1)),
            cpus_per_worker=float(cfg_get(cfg, "trainer.cpus_per_worker", 1)),
            seed=int(cfg_get(cfg, "trainer.seed", 0)),
            save_contents=tuple(cfg_get(actor, "checkpoint.save_contents", ("model", "optimizer", "extra"))),
            reshard_after_forward=bool(cfg_get(actor, "fsdp_config.reshard_after_forward", True)),
            use_torch_compile=role == "actor" and bool(cfg_get(actor, "use_torch_compile", False)))
