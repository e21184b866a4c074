"""Rollout correction: the rollout's recorded log-probs, the truncated importance weights and the mismatch metrics
(verl 0.9's algorithm.rollout_correction), and their start-up checks."""

from __future__ import annotations

import math

import pytest
import torch

from arpo.trainer.core_algos import compute_policy_loss
from arpo.trainer.rollout_correction import mismatch_sums, rollout_is_weights


def test_token_and_sequence_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -9.0]])
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.1, -0.3, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # last column: a tool result
    token = rollout_is_weights(old, rollout, mask, "token", threshold=1.5)
    assert torch.allclose(token, torch.tensor([[1.5, math.exp(-1.0), 0.0], [math.exp(-0.1), 1.0, 0.0]]))
    seq = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.0)
    # row 0: exp(0.5 - 1.0); row 1: exp(-0.1 + 0); the tool column adds nothing
    assert torch.allclose(seq, torch.tensor([[math.exp(-0.5)] * 2 + [0.0], [math.exp(-0.1)] * 2 + [0.0]]))
    far = rollout_is_weights(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1), "token", 1e12)
    assert far.item() == pytest.approx(math.exp(20.0))  # log-ratios bounded at ±20, as verl bounds them
    with pytest.raises(ValueError, match="rollout_is='turn'"):
        rollout_is_weights(old, rollout, mask, "turn", 2.0)
    poisoned = rollout.clone()
    poisoned[:, 2] = -math.inf  # off the mask: must not reach the row's weights
    assert torch.equal(rollout_is_weights(old, poisoned, mask, "sequence", 2.0), seq)
    assert torch.equal(rollout_is_weights(old, poisoned, mask, "token", 1.5), token)


def test_weights_scale_each_tokens_policy_loss_before_aggregation():
    torch.manual_seed(0)
    old, logp = torch.randn(3, 5) * 0.1 - 1, torch.randn(3, 5) * 0.1 - 1
    adv, mask = torch.randn(3, 5), (torch.rand(3, 5) > 0.3).float()
    weights = torch.rand(3, 5) * mask
    plain = compute_policy_loss(old, logp, adv, mask, cliprange=0.2)[0]
    assert compute_policy_loss(old, logp, adv, mask, cliprange=0.2, rollout_is_weights=mask)[0] == pytest.approx(
        plain.item())
    ratio = torch.exp(logp - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
    expected = (per_token * weights * mask).sum() / mask.sum()
    weighted = compute_policy_loss(old, logp, adv, mask, cliprange=0.2, rollout_is_weights=weights)[0]
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-6)


def test_mismatch_sums_by_hand():
    old = torch.tensor([[-1.0, -2.0, -7.0]])
    rollout = torch.tensor([[-1.5, -1.0, 0.0]])
    sums, maxima = mismatch_sums(old, rollout, torch.tensor([[1, 1, 0]]))
    d = [0.5, -1.0]  # old - rollout on the two model tokens
    assert sums == pytest.approx([-sum(d), sum(math.exp(x) - x - 1 for x in d),
                                  abs(math.exp(-1.5) - math.exp(-1.0)) + abs(math.exp(-1.0) - math.exp(-2.0))])
    assert maxima == pytest.approx([math.exp(0.5), abs(math.exp(-1.0) - math.exp(-2.0))])
    assert mismatch_sums(old, rollout, torch.zeros(1, 3)) == ([0.0, 0.0, 0.0], [0.0, 0.0])


def test_the_batch_rollout_records_each_sampled_tokens_log_prob_and_forks_inherit_them():
    from tests.rollout.rollout_helpers import rollout

    cfg = {"n": 6, "initial_rollouts": 2, "branching.branch_probability": 1.0, "tools.call_limit": 2,
           "sampling.max_response_length": 200, "calculate_log_probs": True}
    batch, _, _ = rollout(cfg, n_prompts=2)
    lp, mask = batch["rollout_log_probs"], batch["response_mask"].bool()
    assert (lp[mask] < 0).all() and not lp[~mask].any()  # every model token has one; tool results and pads 0
    assert (batch.non_tensors["parent_index"] >= 0).any()
    for i, (parent, pos) in enumerate(zip(batch.non_tensors["parent_index"], batch.non_tensors["branch_pos"])):
        if parent >= 0:
            assert torch.equal(lp[i, :pos], lp[parent, :pos])
    plain, _, _ = rollout({**cfg, "calculate_log_probs": False}, n_prompts=2)
    assert "rollout_log_probs" not in plain.tensors
    assert torch.equal(plain["responses"], batch["responses"])  # recording them changes no token


def test_recorded_log_probs_are_the_trainers_for_the_same_model(tiny_model_dir):
    """A real engine (HF, fp32) against the trainer's forward on the collated batch: the mismatch is rounding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arpo.engine.hf_engine import HFEngine
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.trainer.logprobs import compute_logprobs_and_entropy
    from tests.rollout.fake_tools import FakePython, FakeSearch

    engine = HFEngine({"model_path": tiny_model_dir, "name": "hf", "dtype": "float32"})
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    gen = ARPORollout(engine, tok, {"n": 2, "initial_rollouts": 2, "sampling.max_response_length": 24,
                                    "calculate_log_probs": True}, tools=[FakeSearch(), FakePython()])
    try:
        batch = gen.generate([tok("What is 2 + 3?")["input_ids"]], seed=0)
    finally:
        gen.close()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        trainer, _ = compute_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"],
                                                  batch["position_ids"], batch["responses"].shape[1], pack=False)
    mask = batch["response_mask"].bool()
    assert mask.sum() > 10
    assert torch.allclose(batch["rollout_log_probs"][mask], trainer[mask], atol=1e-4)
    sums, maxima = mismatch_sums(trainer, batch["rollout_log_probs"], mask)
    assert abs(sums[0]) / int(mask.sum()) < 1e-5 and maxima[0] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("overrides, expect", [
    (["algorithm.rollout_correction.rollout_is=token"], "set actor_rollout_ref.rollout.calculate_log_probs=true"),
    (["algorithm.rollout_correction.rollout_is=turn"], "rollout_correction.rollout_is='turn' is not valid"),
    (["actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
      "algorithm.rollout_correction.rollout_is_threshold=0"], "rollout_is_threshold must be a number > 0"),
    (["actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.temperature=0.7"],
     "logprobs_mode=processed_logprobs"),
    (["actor_rollout_ref.rollout.arpo.calculate_log_probs=true"], "set actor_rollout_ref.rollout.calculate_log_probs"),
])
def test_bad_rollout_correction_config_is_one_line_naming_the_key(tiny_model_dir, synthetic_dir, overrides, expect):
    from tests.test_main_arpo import start_up_config_error

    assert expect in start_up_config_error(tiny_model_dir, synthetic_dir, *overrides)
