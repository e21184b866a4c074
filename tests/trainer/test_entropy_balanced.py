"""AEPO's entropy-balanced policy optimization (arXiv 2510.14545; the released AEPO code): the gradient-keeping
upper clip and the entropy-aware advantage, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from arpo.trainer.core_algos import compute_entropy_balanced_advantage, compute_policy_loss


def test_tokens_above_the_upper_clip_keep_a_rescaled_gradient_and_the_loss_value_is_unchanged():
    # token 0: A > 0, ratio above 1 + eps_high (clipped: vanilla has no gradient there)
    # token 1: A > 0, ratio inside the range; token 2: A < 0, ratio below 1 - eps_low (clipped both ways)
    old = torch.tensor([[-2.0, -1.0, -1.0]])
    adv = torch.tensor([[1.5, 0.5, -2.0]])
    mask = torch.ones(1, 3)
    eps_low, eps_high = 0.2, 0.28
    shift = torch.tensor([[0.5, 0.1, -0.5]])  # log-ratio of each token

    def loss_and_grad(balanced: bool):
        logp = (old + shift).clone().requires_grad_(True)
        loss = compute_policy_loss(old, logp, adv, mask, cliprange_low=eps_low, cliprange_high=eps_high,
                                   entropy_balanced_clipping=balanced)[0]
        loss.backward()
        return loss.item(), logp.grad[0].tolist()

    vanilla_loss, vanilla_grad = loss_and_grad(False)
    balanced_loss, balanced_grad = loss_and_grad(True)
    assert balanced_loss == pytest.approx(vanilla_loss)
    r1 = math.exp(0.1)
    # token-mean over 3 tokens: d(-A r)/dlogp = -A r for an unclipped token; the balanced clip -A (1 + eps_high)
    assert vanilla_grad == pytest.approx([0.0, -0.5 * r1 / 3, 0.0])
    assert balanced_grad == pytest.approx([-1.5 * (1 + eps_high) / 3, -0.5 * r1 / 3, 0.0])


def test_entropy_aware_advantage_by_hand():
    adv = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    entropy = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.7, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    values = [0.1, 0.5, 0.9, 0.3, 0.7]
    mean = sum(values) / 5
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 4)
    out = compute_entropy_balanced_advantage(adv, entropy, mask, alpha=0.2)
    expect = [[1 + 0.2 * (h - mean) / std for h in (0.1, 0.5, 0.9)] + [0.0],
              [-(1 + 0.2 * (h - mean) / std) for h in (0.3, 0.7)] + [0.0, 0.0]]
    assert torch.allclose(out, torch.tensor(expect))
    flat = compute_entropy_balanced_advantage(adv, torch.ones(2, 4), mask)  # equal entropies: std 0 counts as 1
    assert torch.allclose(flat, adv * mask)
    assert torch.equal(compute_entropy_balanced_advantage(adv, entropy, mask, alpha=0.0), adv * mask)


def test_the_aepo_preset_turns_both_on_and_the_update_gets_the_entropies(tiny_model_dir, synthetic_dir):
    from arpo.config import load_config
    from arpo.main_arpo import validate_config
    from arpo.trainer.actor_config import needs_old_log_prob_pass
    from tests.test_main_arpo import start_up_config_error

    base = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"synthetic.out_dir={synthetic_dir}"]
    cfg = load_config("arpo_trainer", [*base, "preset=aepo"])
    validate_config(cfg)
    actor = cfg.actor_rollout_ref.actor
    assert actor.enable_entropy_balanced_clipping and actor.enable_entropy_balanced_advantage
    assert needs_old_log_prob_pass(cfg) and not needs_old_log_prob_pass(load_config("arpo_trainer", base))
    for override, expect in (("actor_rollout_ref.actor.entropy_advantage_alpha=-1", "entropy_advantage_alpha"),
                             ("actor_rollout_ref.actor.enable_entropy_balanced_clipping=maybe",
                              "enable_entropy_balanced_clipping must be true or false")):
        assert expect in start_up_config_error(tiny_model_dir, synthetic_dir, override)
