"""configs/algorithm.yaml loads and passes validation; each bad value fails with one line naming the key."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from arpo.trainer.algo_config import validate_algorithm_config

YAML = Path(__file__).resolve().parents[2] / "configs" / "algorithm.yaml"


def _cfg(**overrides):
    cfg = OmegaConf.load(YAML)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def test_shipped_config_is_valid():
    cfg = _cfg()
    validate_algorithm_config(cfg)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.advantage_mode == "soft"
    validate_algorithm_config(OmegaConf.to_container(cfg))  # plain dicts work too
    validate_algorithm_config({})  # every key has a default


@pytest.mark.parametrize("key, value, message", [
    ("algorithm.adv_estimator", "ppo", "algorithm.adv_estimator='ppo' is not valid; choose one of: gae, grpo, "
                                       "grpo_vectorized, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, "
                                       "rloo_vectorized, tree_grpo"),
    ("algorithm.gamma", 1.5, "algorithm.gamma must be a number in [0, 1], got 1.5"),
    ("algorithm.lam", "x", "algorithm.lam must be a number in [0, 1], got 'x'"),
    ("algorithm.adv_estimator", "tree_grpo", "algorithm.adv_estimator=tree_grpo needs Tree-GRPO's trees: set "
                                             "actor_rollout_ref.rollout.arpo.policy=tree_grpo"),
    ("algorithm.advantage_mode", "medium", "algorithm.advantage_mode='medium' is not valid; choose one of: soft, hard"),
    ("actor_rollout_ref.actor.loss_agg_mode", "mean", "actor_rollout_ref.actor.loss_agg_mode='mean' is not valid"),
    ("actor_rollout_ref.actor.kl_loss_type", "full", "actor_rollout_ref.actor.kl_loss_type='full' is not valid"),
    ("actor_rollout_ref.actor.kl_loss_type", "k4+", "kl_loss_type='k4+' is not valid; choose one of: kl, k1, "
                                                   "abs, mse, k2, low_var_kl, k3, kl+, k1+, abs+, mse+, k2+, "
                                                   "low_var_kl+, k3+"),
    ("actor_rollout_ref.actor.loss_agg_mode", "sum", "loss_agg_mode='sum' is not valid; choose one of: token-mean, "
                                                    "token-sum, seq-mean-token-sum, seq-mean-token-mean, "
                                                    "seq-mean-token-sum-norm"),
    ("actor_rollout_ref.actor.loss_scale_factor", 0, "loss_scale_factor must be null or a number > 0, got 0"),
    ("actor_rollout_ref.actor.loss_scale_factor", "T", "loss_scale_factor must be null or a number > 0, got 'T'"),
    ("algorithm.kl_penalty", "k4", "algorithm.kl_penalty='k4' is not valid"),
    ("algorithm.kl_ctrl.type", "pid", "algorithm.kl_ctrl.type='pid' is not valid"),
    ("actor_rollout_ref.actor.clip_ratio_c", 1.0, "clip_ratio_c must be > 1"),
    ("actor_rollout_ref.actor.clip_ratio_low", 1.2, "clip_ratio_low must be < 1"),
    ("actor_rollout_ref.actor.logprob_chunk_size", 0, "logprob_chunk_size must be a positive integer"),
])
def test_bad_values_fail_with_one_line(key, value, message):
    with pytest.raises(ValueError) as err:
        validate_algorithm_config(_cfg(**{key.replace(".", "__"): value}))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key, value", [
    ("algorithm.adv_estimator", "grpo_vectorized"), ("algorithm.adv_estimator", "rloo_vectorized"),
    ("algorithm.adv_estimator", "reinforce_plus_plus_baseline"), ("actor_rollout_ref.actor.loss_agg_mode", "token-sum"),
    ("actor_rollout_ref.actor.kl_loss_type", "k3+"), ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl+"),
    ("algorithm.kl_penalty", "k1+"), ("actor_rollout_ref.actor.loss_scale_factor", 4096),
])
def test_verl_091_values_are_accepted(key, value):
    validate_algorithm_config(_cfg(**{key.replace(".", "__"): value}))
    if key == "algorithm.adv_estimator":  # one advantage per trajectory: hard mode is defined for them
        validate_algorithm_config(_cfg(algorithm__adv_estimator=value, algorithm__advantage_mode="hard"))


def test_gae_is_accepted_in_soft_mode_only():
    validate_algorithm_config(_cfg(algorithm__adv_estimator="gae", algorithm__lam=0.95))
    with pytest.raises(ValueError, match="advantage_mode=hard needs an outcome estimator"):
        validate_algorithm_config(_cfg(algorithm__adv_estimator="gae", algorithm__advantage_mode="hard"))


def test_tree_grpo_estimator_is_accepted_with_tree_grpo_rollouts():
    cfg = _cfg(algorithm__adv_estimator="tree_grpo", algorithm__advantage_mode="hard")
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.arpo.policy", "tree_grpo", force_add=True)
    validate_algorithm_config(cfg)
    OmegaConf.update(cfg, "actor_rollout_ref.rollout.mode", "single", force_add=True)
    with pytest.raises(ValueError, match="needs Tree-GRPO's trees"):
        validate_algorithm_config(cfg)


def test_hard_mode_needs_outcome_estimator_and_adaptive_needs_target():
    with pytest.raises(ValueError, match="advantage_mode=hard needs an outcome estimator"):
        validate_algorithm_config(_cfg(algorithm__advantage_mode="hard", algorithm__adv_estimator="reinforce_plus_plus"))
    validate_algorithm_config(_cfg(algorithm__advantage_mode="hard", algorithm__adv_estimator="rloo"))
    with pytest.raises(ValueError, match="kl_ctrl.horizon must be > 0"):
        validate_algorithm_config(_cfg(algorithm__kl_ctrl__type="adaptive", algorithm__kl_ctrl__horizon=0))
