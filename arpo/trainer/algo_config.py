"""Start-up checks of the ``algorithm.*`` and ``actor_rollout_ref.actor.*`` loss keys (configs/algorithm.yaml)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from arpo.trainer.core_algos import ADV_ESTIMATOR_REGISTRY, KL_CTRL_TYPES, KL_PENALTY_TYPES, LOSS_AGG_MODES
from arpo.trainer.dynamic_sampling import filter_groups_config
from arpo.trainer.hard_advantage import ADVANTAGE_MODES
from arpo.trainer.logprobs import DEFAULT_CHUNK_SIZE
from arpo.trainer.rollout_correction import ROLLOUT_IS_LEVELS

#: Estimators that give one advantage per trajectory, the only ones hard mode is defined for
#: (reinforce_plus_plus_baseline whitens a per-trajectory score: still one value per row).
OUTCOME_ESTIMATORS = ("grpo", "grpo_vectorized", "rloo", "rloo_vectorized", "reinforce_plus_plus_baseline",
                      "tree_grpo")


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if node is None:
            return default
        node = node.get(part) if isinstance(node, Mapping) or hasattr(node, "get") else getattr(node, part, None)
    return default if node is None else node


def _choice(cfg: Any, key: str, valid: tuple[str, ...] | list[str], default: str) -> str:
    value = _get(cfg, key, default)
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")
    return value


def validate_algorithm_config(cfg: Any) -> None:
    """Raise ValueError (one line naming the key and the valid values) on a bad algorithm / loss setting.

    ``cfg`` is the root config (DictConfig or nested dicts) holding ``algorithm`` and
    ``actor_rollout_ref.actor``; missing keys take the defaults of configs/algorithm.yaml.
    """
    estimator = _choice(cfg, "algorithm.adv_estimator", sorted(ADV_ESTIMATOR_REGISTRY), "grpo")
    mode = _choice(cfg, "algorithm.advantage_mode", ADVANTAGE_MODES, "soft")
    if mode == "hard" and estimator not in OUTCOME_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_mode=hard needs an outcome estimator "
                         f"({', '.join(OUTCOME_ESTIMATORS)}), not algorithm.adv_estimator={estimator!r}")
    if estimator == "tree_grpo" and (_get(cfg, "actor_rollout_ref.rollout.mode", "arpo") == "single"
                                     or _get(cfg, "actor_rollout_ref.rollout.arpo.policy", "arpo") != "tree_grpo"):
        raise ValueError("algorithm.adv_estimator=tree_grpo needs Tree-GRPO's trees: set "
                         "actor_rollout_ref.rollout.arpo.policy=tree_grpo (and rollout.mode arpo or agent_loop)")
    for key in ("algorithm.gamma", "algorithm.lam"):
        value = _get(cfg, key, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"{key} must be a number in [0, 1], got {value!r}")
    filter_groups = filter_groups_config(cfg)
    gen = _get(cfg, "data.gen_batch_size")
    if gen is not None:
        if not filter_groups.enable:
            raise ValueError("data.gen_batch_size is for dynamic sampling: set algorithm.filter_groups.enable=true "
                             "or leave data.gen_batch_size null")
        if isinstance(gen, bool) or not isinstance(gen, int) or gen < 1:
            raise ValueError(f"data.gen_batch_size must be null or an integer >= 1, got {gen!r}")
    level = _get(cfg, "algorithm.rollout_correction.rollout_is")
    if level not in (None, *ROLLOUT_IS_LEVELS):
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} is not valid; choose one of: null, "
                         f"{', '.join(ROLLOUT_IS_LEVELS)}")
    threshold = _get(cfg, "algorithm.rollout_correction.rollout_is_threshold", 2.0)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold must be a number > 0, got {threshold!r}")
    if level is not None and _get(cfg, "actor_rollout_ref.rollout.calculate_log_probs", False) is not True:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level} needs the rollout's log-probs: set "
                         f"actor_rollout_ref.rollout.calculate_log_probs=true")
    _choice(cfg, "algorithm.kl_penalty", KL_PENALTY_TYPES, "kl")
    ctrl = _choice(cfg, "algorithm.kl_ctrl.type", KL_CTRL_TYPES, "fixed")
    if ctrl == "adaptive":
        for key in ("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"):
            if not _get(cfg, key, 0) > 0:
                raise ValueError(f"{key} must be > 0 for algorithm.kl_ctrl.type=adaptive, got {_get(cfg, key)!r}")
    _choice(cfg, "actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES, "token-mean")
    _choice(cfg, "actor_rollout_ref.actor.kl_loss_type", KL_PENALTY_TYPES, "low_var_kl")
    scale = _get(cfg, "actor_rollout_ref.actor.loss_scale_factor")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"actor_rollout_ref.actor.loss_scale_factor must be null or a number > 0, got {scale!r}")

    clip = _get(cfg, "actor_rollout_ref.actor.clip_ratio", 0.2)
    for side in ("low", "high"):
        key = f"actor_rollout_ref.actor.clip_ratio_{side}"
        value = _get(cfg, key, clip)
        if not 0 <= value:
            raise ValueError(f"{key} must be >= 0, got {value!r}")
    low = _get(cfg, "actor_rollout_ref.actor.clip_ratio_low", clip)
    if low >= 1:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_low must be < 1 (ratio floor 1 - low), got {low!r}")
    c = _get(cfg, "actor_rollout_ref.actor.clip_ratio_c", 3.0)
    if not c > 1:
        raise ValueError(f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip cap), got {c!r}")
    for key in ("enable_entropy_balanced_clipping", "enable_entropy_balanced_advantage"):
        if not isinstance(_get(cfg, f"actor_rollout_ref.actor.{key}", False), bool):
            raise ValueError(f"actor_rollout_ref.actor.{key} must be true or false, got "
                             f"{_get(cfg, f'actor_rollout_ref.actor.{key}')!r}")
    alpha = _get(cfg, "actor_rollout_ref.actor.entropy_advantage_alpha", 0.2)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
        raise ValueError(f"actor_rollout_ref.actor.entropy_advantage_alpha must be a number >= 0, got {alpha!r}")
    chunk = _get(cfg, "actor_rollout_ref.actor.logprob_chunk_size", DEFAULT_CHUNK_SIZE)
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"actor_rollout_ref.actor.logprob_chunk_size must be a positive integer, got {chunk!r}")
