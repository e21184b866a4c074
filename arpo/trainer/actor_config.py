"""Reading and checking the trainer-side keys (configs/trainer/actor.yaml, checkpoint.yaml, data.yaml).

:func:`validate_actor_config` runs at start-up and raises :class:`arpo.config.ConfigError` with one line
naming the key and the fix, so a bad batch-size combination fails before Ray or a model is started.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from arpo.config import ConfigError

WARMUP_STYLES = ("constant", "cosine")
SAVE_CONTENTS = ("model", "optimizer", "extra", "hf_model")


def resolve_tree_packing(value: bool | str, device_type: str) -> bool:
    """``actor_rollout_ref.model.tree_packing``: true, false, or ``auto`` — on where packing was measured faster
    (CPU, compute-bound: 1.59x on SmolLM2-135M), off on CUDA (one H100, the same trees: old log-probs 3.9x and
    the update 2.0x slower packed; a 135M model there is bound by per-kernel CPU work, which packing adds)."""
    return device_type != "cuda" if value == "auto" else bool(value)


def cfg_get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg.a.b.c`` for a DictConfig or nested dicts; ``default`` when any part is missing or None."""
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "get"):
            node = node.get(part)
        else:
            node = getattr(node, part, None)
    return default if node is None else node


def to_plain(cfg: Any) -> dict:
    """A plain nested dict (what Ray actors receive): resolves a DictConfig, copies a dict."""
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except ImportError:  # pragma: no cover
        pass
    import copy

    return copy.deepcopy(dict(cfg))


def world_size(cfg: Any) -> int:
    """Training ranks: ``trainer.nnodes * trainer.n_gpus_per_node`` (on CPU: Ray actor processes)."""
    return int(cfg_get(cfg, "trainer.nnodes", 1)) * int(cfg_get(cfg, "trainer.n_gpus_per_node", 1))


def rollout_n(cfg: Any) -> int:
    """Trajectories per prompt: ``actor_rollout_ref.rollout.n`` (verl) or the ARPO budget ``rollout.arpo.n``."""
    return int(cfg_get(cfg, "actor_rollout_ref.rollout.n", cfg_get(cfg, "actor_rollout_ref.rollout.arpo.n", 1)))


def rollout_temperature(cfg: Any) -> float:
    """Sampling temperature the log-probs are taken at (verl divides the logits by it)."""
    return float(cfg_get(cfg, "actor_rollout_ref.rollout.temperature",
                         cfg_get(cfg, "actor_rollout_ref.rollout.arpo.sampling.temperature", 1.0)))


#: verl's greedy validation (``val_kwargs.do_sample: false``)
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


def validation_sampling(val_kwargs: Any) -> dict[str, Any]:
    """``actor_rollout_ref.rollout.val_kwargs`` as validation samples: ``n`` and, unless ``do_sample``, greedy."""
    chosen = {k: val_kwargs[k] for k in GREEDY} if val_kwargs["do_sample"] else GREEDY
    return {"n": int(val_kwargs["n"]), **chosen}


def validate_validation_config(cfg: Any) -> None:
    """``actor_rollout_ref.rollout.val_kwargs`` and ``data.val_max_samples``; raise ConfigError."""
    p = "actor_rollout_ref.rollout.val_kwargs"
    v = cfg_get(cfg, p)
    if not isinstance(v["do_sample"], bool):
        raise ConfigError(f"{p}.do_sample must be true or false, got {v['do_sample']!r}")
    if not isinstance(v["n"], int) or isinstance(v["n"], bool) or v["n"] < 1:
        raise ConfigError(f"{p}.n must be an integer >= 1 (samples per validation prompt), got {v['n']!r}")
    for key, ok, what in (("temperature", lambda x: x >= 0, ">= 0"), ("top_p", lambda x: 0 < x <= 1, "in (0, 1]"),
                          ("top_k", lambda x: x == -1 or x >= 1, "-1 (off) or >= 1")):
        if not isinstance(v[key], (int, float)) or isinstance(v[key], bool) or not ok(v[key]):
            raise ConfigError(f"{p}.{key} must be {what}, got {v[key]!r}")
        if not v["do_sample"] and v[key] != GREEDY[key]:
            raise ConfigError(f"{p}.{key}={v[key]} is ignored with {p}.do_sample=false (greedy): set "
                              f"{p}.do_sample=true to sample with it, or leave it at {GREEDY[key]}")
    m = cfg_get(cfg, "data.val_max_samples", -1)
    if not isinstance(m, int) or isinstance(m, bool) or not (m == -1 or m >= 1):
        raise ConfigError(f"data.val_max_samples must be -1 (all) or an integer >= 1, got {m!r}")


def mini_batch_rows(cfg: Any) -> int:
    """Rows (trajectories) in one PPO mini-batch over all ranks: ``ppo_mini_batch_size * rollout.n``."""
    return int(cfg_get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size", 1)) * rollout_n(cfg)


def needs_old_log_prob_pass(cfg: Any) -> bool:
    """Whether the trainer must compute old log-probs before the update.

    Not when the update is on-policy (one mini-batch per step: ``ppo_mini_batch_size`` =
    ``data.train_batch_size``, and ``ppo_epochs`` = 1): the update then uses its own detached log-probs
    (ratio exactly 1, as verl's dp_actor does) and reports ``actor/entropy`` itself. KL in the reward reads
    the old log-probs before the advantages, and AEPO's entropy-balanced advantage its entropies, so both
    always need the pass."""
    if cfg_get(cfg, "algorithm.use_kl_in_reward", False):
        return True
    if cfg_get(cfg, "actor_rollout_ref.actor.enable_entropy_balanced_advantage", False):
        return True  # the advantage needs the sampling policy's token entropies before the update
    epochs = int(cfg_get(cfg, "actor_rollout_ref.actor.ppo_epochs", 1))
    mini = int(cfg_get(cfg, "actor_rollout_ref.actor.ppo_mini_batch_size", 1))
    return not (epochs == 1 and mini == int(cfg_get(cfg, "data.train_batch_size", 1)))


def _positive_int(cfg: Any, key: str, default: Any) -> int:
    value = cfg_get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _boolean(cfg: Any, key: str, default: bool) -> bool:
    value = cfg_get(cfg, key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _number_in(cfg: Any, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = cfg_get(cfg, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            (low < value if low_open else low <= value) and value <= high):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{key} must be a number in {bracket}{low}, {high}], got {value!r}")
    return float(value)


def _validate_optimizer(cfg: Any, section: str) -> None:
    """``<section>.grad_clip`` and ``<section>.optim.*`` (the actor's or the critic's)."""
    grad_clip = cfg_get(cfg, f"{section}.grad_clip", 1.0)
    if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or grad_clip <= 0:
        raise ConfigError(f"{section}.grad_clip must be > 0, got {grad_clip!r}")
    optim = f"{section}.optim"
    _number_in(cfg, f"{optim}.lr", 1e-6, 0.0, 1.0, low_open=True)
    _number_in(cfg, f"{optim}.weight_decay", 0.01, 0.0, 1.0)
    _number_in(cfg, f"{optim}.eps", 1e-8, 0.0, 1.0, low_open=True)
    betas = cfg_get(cfg, f"{optim}.betas", [0.9, 0.999])
    if len(list(betas)) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
        raise ConfigError(f"{optim}.betas must be two numbers in [0, 1), got {list(betas)!r}")
    style = cfg_get(cfg, f"{optim}.warmup_style", "constant")
    if style not in WARMUP_STYLES:
        raise ConfigError(f"{optim}.warmup_style={style!r} is not valid; choose one of: {', '.join(WARMUP_STYLES)}")
    _number_in(cfg, f"{optim}.lr_warmup_steps_ratio", 0.0, 0.0, 1.0)
    _number_in(cfg, f"{optim}.min_lr_ratio", 0.0, 0.0, 1.0)
    _number_in(cfg, f"{optim}.num_cycles", 0.5, 0.0, 1e6, low_open=True)
    for key in ("lr_warmup_steps", "total_training_steps"):
        value = cfg_get(cfg, f"{optim}.{key}", -1)
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ConfigError(f"{optim}.{key} must be an integer >= -1 (-1: derived), got {value!r}")


def _validate_batch_split(cfg: Any, section: str) -> None:
    """``<section>.ppo_mini_batch_size`` and ``ppo_micro_batch_size_per_gpu`` against the batch and the ranks."""
    ws, n = world_size(cfg), rollout_n(cfg)
    train_bs = _positive_int(cfg, "data.train_batch_size", 1)
    mini = _positive_int(cfg, f"{section}.ppo_mini_batch_size", 1)
    micro = _positive_int(cfg, f"{section}.ppo_micro_batch_size_per_gpu", 1)
    _positive_int(cfg, f"{section}.ppo_epochs", 1)
    if mini > train_bs or train_bs % mini:
        raise ConfigError(f"{section}.ppo_mini_batch_size={mini} must divide data.train_batch_size={train_bs}")
    if (mini * n) % ws:
        raise ConfigError(f"{section}.ppo_mini_batch_size * rollout.n = {mini * n} trajectories do not split over "
                          f"{ws} training ranks; make it a multiple of {ws}")
    per_rank = mini * n // ws
    if per_rank % micro:
        raise ConfigError(f"{section}.ppo_micro_batch_size_per_gpu={micro} must divide the per-rank mini-batch "
                          f"ppo_mini_batch_size * rollout.n / world_size = {per_rank}")


def reference_policy(cfg: Any) -> str | None:
    """Where the reference log-probs come from: None (no KL term: neither ``actor.use_kl_loss`` nor
    ``algorithm.use_kl_in_reward``), ``"actor"`` (LoRA on: the actor's own workers with the adapters disabled, which
    is the frozen base model; verl's ref_in_actor, no second copy of the weights) or ``"ref"`` (a worker group of
    its own holding the base model)."""
    if not (cfg_get(cfg, "actor_rollout_ref.actor.use_kl_loss", False) or cfg_get(cfg, "algorithm.use_kl_in_reward",
                                                                                    False)):
        return None
    return "actor" if int(cfg_get(cfg, "actor_rollout_ref.model.lora_rank", 0)) > 0 else "ref"


def needs_reference(cfg: Any) -> bool:
    """A reference worker group is needed for the KL loss or the KL-in-reward penalty, unless LoRA is on (the
    actor's workers then give the reference log-probs with the adapters disabled, see :func:`reference_policy`)."""
    return reference_policy(cfg) == "ref"


def uses_critic(cfg: Any) -> bool:
    """PPO with a critic: GAE is the one estimator that needs values."""
    return cfg_get(cfg, "algorithm.adv_estimator", "grpo") == "gae"


def validate_critic_config(cfg: Any) -> None:
    """Check the ``critic.*`` keys and ``trainer.critic_warmup`` (configs/trainer/critic.yaml); raise ConfigError."""
    from arpo.trainer.core_algos import LOSS_AGG_MODES

    _validate_batch_split(cfg, "critic")
    _positive_int(cfg, "critic.forward_micro_batch_size_per_gpu", 8)
    _validate_optimizer(cfg, "critic")
    _number_in(cfg, "critic.cliprange_value", 0.5, 0.0, 1e9, low_open=True)
    mode = cfg_get(cfg, "critic.loss_agg_mode", "token-mean")
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"critic.loss_agg_mode={mode!r} is not valid; choose one of: {', '.join(LOSS_AGG_MODES)}")
    if not isinstance(cfg_get(cfg, "critic.model.enable_gradient_checkpointing", True), bool):
        raise ConfigError("critic.model.enable_gradient_checkpointing must be true or false")
    warmup = cfg_get(cfg, "trainer.critic_warmup", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"trainer.critic_warmup must be an integer >= 0, got {warmup!r}")
    path = cfg_get(cfg, "critic.model.path")
    if path is not None and uses_critic(cfg) and not (Path(str(path)) / "config.json").is_file():
        raise ConfigError(f"critic.model.path={path} is not an HF model directory (no config.json): point it at "
                          f"one, or null for actor_rollout_ref.model.path")


def validate_actor_config(cfg: Any) -> None:
    """Check device, world size, batch sizes, optimizer, data and checkpoint keys; raise ConfigError."""
    from arpo.trainer.device import DEVICES, DTYPE_CHOICES, resolve_device_type

    device = cfg_get(cfg, "trainer.device", "auto")
    if device not in DEVICES:
        raise ConfigError(f"trainer.device={device!r} is not valid; choose one of: {', '.join(DEVICES)}")
    dtype = cfg_get(cfg, "actor_rollout_ref.model.dtype", "auto")
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"actor_rollout_ref.model.dtype={dtype!r} is not valid; choose one of: "
                          f"{', '.join(DTYPE_CHOICES)}")
    _boolean(cfg, "actor_rollout_ref.model.enable_gradient_checkpointing", True)
    _boolean(cfg, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward", True)
    _boolean(cfg, "actor_rollout_ref.actor.use_torch_compile", False)
    _boolean(cfg, "actor_rollout_ref.model.share_prefix", True)
    packing = cfg_get(cfg, "actor_rollout_ref.model.tree_packing", "auto")
    if not (isinstance(packing, bool) or packing == "auto"):
        raise ConfigError(f"actor_rollout_ref.model.tree_packing must be true, false or auto, got {packing!r}")
    attention = cfg_get(cfg, "actor_rollout_ref.model.attn_implementation", "sdpa")
    device_type = "cuda" if device == "cuda" else resolve_device_type(device)  # (cuda without a GPU: checked later)
    if resolve_tree_packing(packing, device_type) and attention not in ("sdpa", "eager"):
        raise ConfigError(f"actor_rollout_ref.model.tree_packing needs a kernel that takes a tree attention mask: "
                          f"set actor_rollout_ref.model.attn_implementation=sdpa (or eager), not {attention!r}, "
                          f"or actor_rollout_ref.model.tree_packing=false")
    lora_rank = cfg_get(cfg, "actor_rollout_ref.model.lora_rank", 0)
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ConfigError(f"actor_rollout_ref.model.lora_rank must be an integer >= 0 (0: no LoRA), got {lora_rank!r}")
    if lora_rank:
        _number_in(cfg, "actor_rollout_ref.model.lora_alpha", 16, 0.0, 1e9, low_open=True)
        targets = cfg_get(cfg, "actor_rollout_ref.model.target_modules", "all-linear")
        if not (isinstance(targets, str) or (list(targets) and all(isinstance(t, str) for t in targets))):
            raise ConfigError(f"actor_rollout_ref.model.target_modules must be all-linear or a list of module "
                              f"names, got {targets!r}")
    strategy = cfg_get(cfg, "actor_rollout_ref.actor.strategy", "fsdp2")
    if strategy != "fsdp2":
        raise ConfigError(f"actor_rollout_ref.actor.strategy={strategy!r}: only fsdp2 is supported "
                          f"(FSDP1 gives wrong gradients on CPU/gloo)")
    _positive_int(cfg, "trainer.nnodes", 1)
    _positive_int(cfg, "trainer.n_gpus_per_node", 1)
    ws = world_size(cfg)
    n = rollout_n(cfg)
    train_bs = _positive_int(cfg, "data.train_batch_size", 1)
    _positive_int(cfg, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 8)
    _positive_int(cfg, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 8)
    for section, flag, budget in (("actor", "use_dynamic_bsz", "ppo_max_token_len_per_gpu"),
                                  ("rollout", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu"),
                                  ("ref", "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")):
        _boolean(cfg, f"actor_rollout_ref.{section}.{flag}", False)
        _positive_int(cfg, f"actor_rollout_ref.{section}.{budget}", 16384)
    if (train_bs * n) % ws:
        raise ConfigError(f"data.train_batch_size * rollout.n = {train_bs} * {n} = {train_bs * n} trajectories "
                          f"do not split over {ws} training ranks (trainer.nnodes * trainer.n_gpus_per_node); "
                          f"make it a multiple of {ws}")
    _validate_batch_split(cfg, "actor_rollout_ref.actor")

    _validate_optimizer(cfg, "actor_rollout_ref.actor")

    prompt_len = cfg_get(cfg, "data.max_prompt_length", 1024)
    if not isinstance(prompt_len, int) or prompt_len < 1:
        raise ConfigError(f"data.max_prompt_length must be a positive integer, got {prompt_len!r}")
    truncation = cfg_get(cfg, "data.truncation", "error")
    if truncation not in ("error", "left", "right"):
        raise ConfigError(f"data.truncation={truncation!r} is not valid; choose one of: error, left, right")

    mode = str(cfg_get(cfg, "trainer.resume_mode", "auto"))
    if mode == "resume_path" and not cfg_get(cfg, "trainer.resume_from_path"):
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N dir)")
    if mode not in ("auto", "disable", "resume_path") and not Path(mode).is_dir():
        raise ConfigError(f"trainer.resume_mode={mode!r} is neither auto, disable nor an existing checkpoint "
                          f"directory (global_step_N)")
    for key in ("max_actor_ckpt_to_keep", "max_critic_ckpt_to_keep"):
        keep = cfg_get(cfg, f"trainer.{key}")
        if keep is not None and (not isinstance(keep, int) or keep < 1):
            raise ConfigError(f"trainer.{key} must be null (keep all) or >= 1, got {keep!r}")
    contents = list(cfg_get(cfg, "actor_rollout_ref.actor.checkpoint.save_contents", ["model", "optimizer", "extra"]))
    bad = [c for c in contents if c not in SAVE_CONTENTS]
    if bad or "model" not in contents:
        raise ConfigError(f"actor_rollout_ref.actor.checkpoint.save_contents={contents!r}: must include 'model' "
                          f"and use only {', '.join(SAVE_CONTENTS)}")
