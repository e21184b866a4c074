"""arpo.trainer.core_algos against verl 0.9.1's own outputs, to 1e-6.

The expected values were written by verl 0.9.1 itself (tests/trainer/fixtures/make_verl_core_algos_fixtures.py,
which documents the command); verl is not imported here, so CI needs no verl. Cases: every advantage estimator
(fully masked rows, tool gaps, rewards on masked-out positions, groups of one, equal scores, string and int
labels), the masked statistics, agg_loss in every mode with and without global normalisers (values and
gradients), a 2-rank x 2-micro-batch split with the counts verl's actor passes, the PPO loss, every KL
estimator with its "+" straight-through form (values and gradients), the entropy loss, the adaptive KL
controller, GAE (the outcome inputs with random values, masked positions included, for three gamma / lam)
and the critic's clipped value loss in every mode, with and without global normalisers, for two clip ranges
(loss, clip fraction and gradient). The value loss's 2-rank split is checked against one process here.
Rollout correction (arpo.trainer.rollout_correction): the TIS weights at token and sequence level for thresholds
2.0 and 1.5 on log-ratios ~1e-3, ±1, ±30 (past SAFETY_BOUND per token) and rows whose summed log-ratio passes
±20, with tool gaps, a fully masked row and far-apart values off the mask, with verl's rollout_is_mean (and at
token level its rollout_is_max, the truncated weights' maximum); and the mismatch metrics the update logs from
mismatch_sums against verl's compute_offpolicy_metrics (kl, k3_kl) and debug metrics
(training/rollout_probs_diff_mean / _max). DAPO's overlong shaping is checked in tests/rewards/test_overlong.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arpo.trainer import core_algos as ca
from arpo.trainer.rollout_correction import SAFETY_BOUND, mismatch_sums, rollout_is_weights

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())
INPUTS = FIXTURES["inputs"]
TOL = 1e-6


def tensor(spec: dict) -> torch.Tensor:
    return torch.tensor(spec["data"], dtype=getattr(torch, spec["dtype"]))


def assert_matches(actual, expected, what: str = "") -> None:
    expected = tensor(expected) if isinstance(expected, dict) else torch.as_tensor(expected, dtype=torch.float64)
    actual = torch.as_tensor(actual).detach()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), atol=TOL, rtol=0,
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


def test_fixtures_come_from_verl_091_and_cover_the_edge_cases():
    assert FIXTURES["verl_version"] == "0.9.1"
    mask = tensor(INPUTS["outcome"]["response_mask"])
    rewards = tensor(INPUTS["outcome"]["token_level_rewards"])
    labels = INPUTS["outcome"]["index"]
    assert (mask.sum(-1) == 0).sum() == 2                         # fully masked rows
    assert ((rewards != 0) & (mask == 0)).any()                   # rewards off the mask
    assert sorted(labels.count(u) for u in set(labels)) == [1, 1, 2, 3, 4, 5]  # two groups of one
    assert (tensor(INPUTS["loss"]["loss_mask"]).sum(-1) == 0).any()
    assert {e["empty_row"] for e in FIXTURES["dp_split"]} == {False, True}
    assert (tensor(INPUTS["value_loss"]["response_mask"]).sum(-1) == 0).any()
    for clip in {c["cliprange_value"] for c in FIXTURES["value_loss"]}:  # each clip range binds on some tokens
        assert all(0 < c["vf_clipfrac"] < 1 for c in FIXTURES["value_loss"] if c["cliprange_value"] == clip)


@pytest.mark.parametrize("case", FIXTURES["advantages"],
                         ids=lambda c: f"{c['estimator']}-{c['index']}-{'-'.join(map(str, c['kwargs'].values()))}")
def test_advantage_estimators(case):
    inp = INPUTS["outcome"]
    call = {"token_level_rewards": tensor(inp["token_level_rewards"]), "response_mask": tensor(inp["response_mask"])}
    if case["index"] == "str":
        call["index"] = np.array(inp["index"], dtype=object)
    elif case["index"] == "int":
        call["index"] = np.array(INPUTS["int_index"])
    if "gamma" in case["kwargs"]:
        call["config"] = SimpleNamespace(gamma=case["kwargs"]["gamma"])  # verl reads gamma from its AlgoConfig
    else:
        call.update(case["kwargs"])
    adv, ret = ca.get_adv_estimator_fn(case["estimator"])(**call)
    assert_matches(adv, case["advantages"], "advantages")
    assert_matches(ret, case["returns"], "returns")


@pytest.mark.parametrize("case", FIXTURES["masked"], ids=lambda c: f"{c['fn']}-{c['kwargs']}")
def test_masked_statistics(case):
    values, mask = tensor(INPUTS["masked"]["values"]), tensor(INPUTS["masked"]["mask"])
    assert_matches(getattr(ca, case["fn"])(values, mask, **case["kwargs"]), case["result"], case["fn"])


@pytest.mark.parametrize("case", FIXTURES["agg_loss"], ids=lambda c: f"{c['mode']}-{sorted(c['kwargs'])}")
def test_agg_loss_value_and_gradient(case):
    loss_mat = tensor(INPUTS["loss"]["loss_mat"]).requires_grad_(True)
    value = ca.agg_loss(loss_mat, tensor(INPUTS["loss"]["loss_mask"]), case["mode"], **case["kwargs"])
    (grad,) = torch.autograd.grad(value, loss_mat)
    assert_matches(value, case["value"], "value")
    assert_matches(grad, case["grad"], "grad")


@pytest.mark.parametrize("case", FIXTURES["dp_split"], ids=lambda c: f"{c['mode']}-empty_row={c['empty_row']}")
def test_data_parallel_split(case):
    """Per-micro-batch losses with verl's global counts; their FSDP average is one process's loss."""
    inputs = case.get("inputs", INPUTS["loss"])
    loss_mat, mask = tensor(inputs["loss_mat"]), tensor(inputs["loss_mask"])
    ranks = [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]
    per_micro = [[ca.agg_loss(loss_mat[s], mask[s], case["mode"], **case["info"]) for s in rank] for rank in ranks]
    assert_matches(torch.stack([torch.stack(r) for r in per_micro]), case["per_micro"], "per micro-batch")
    fsdp_mean = sum(sum(r) for r in per_micro) / 2
    assert_matches(fsdp_mean, case["fsdp_mean"], "FSDP mean")
    single = ca.agg_loss(loss_mat, mask, case["mode"], batch_num_tokens=case["info"]["batch_num_tokens"],
                         global_batch_size=case["info"]["global_batch_size"])
    assert_matches(single, case["single_global"], "one process, global counts")
    assert_matches(fsdp_mean, single, "FSDP mean vs one process")
    local = ca.agg_loss(loss_mat, mask, case["mode"])
    assert_matches(local, case["single_local"], "one process, own counts")
    # A fully masked row counts in verl's global_batch_size but not in one process's own row count.
    if case["empty_row"] and case["mode"].startswith("seq-"):
        assert abs(float(local) - float(single)) > 1e-3
    else:
        assert_matches(local, single, "own counts = global counts")


@pytest.mark.parametrize("case", FIXTURES["policy_loss"], ids=lambda c: c["mode"])
def test_policy_loss(case):
    p = INPUTS["policy"]
    log_prob = tensor(p["log_prob"]).requires_grad_(True)
    pg_loss, clipfrac, ppo_kl, lower = ca.compute_policy_loss(
        tensor(p["old_log_prob"]), log_prob, tensor(p["advantages"]), tensor(INPUTS["loss"]["loss_mask"]),
        cliprange=0.2, cliprange_low=0.2, cliprange_high=0.28, clip_ratio_c=3.0, loss_agg_mode=case["mode"])
    (grad,) = torch.autograd.grad(pg_loss, log_prob)
    for name, value in (("pg_loss", pg_loss), ("pg_clipfrac", clipfrac), ("ppo_kl", ppo_kl),
                        ("pg_clipfrac_lower", lower)):
        assert_matches(value, case[name], name)
    assert_matches(grad, case["grad"], "grad")


@pytest.mark.parametrize("case", FIXTURES["kl_penalty"], ids=lambda c: c["name"])
def test_kl_penalty_value_and_gradients(case):
    k = INPUTS["kl"]
    logprob, ref = tensor(k["logprob"]).requires_grad_(True), tensor(k["ref_logprob"]).requires_grad_(True)
    value = ca.kl_penalty(logprob, ref, case["name"])
    g_lp, g_ref = torch.autograd.grad((value * tensor(k["weights"])).sum(), (logprob, ref))
    assert_matches(value, case["value"], "value")
    assert_matches(g_lp, case["grad_logprob"], "d/d logprob")
    assert_matches(g_ref, case["grad_ref_logprob"], "d/d ref_logprob")


@pytest.mark.parametrize("case", FIXTURES["entropy"], ids=lambda c: c["mode"])
def test_entropy_loss(case):
    e = INPUTS["entropy"]
    assert_matches(ca.compute_entropy_loss(tensor(e["logits"]), tensor(e["response_mask"]), case["mode"]),
                   case["value"], "entropy loss")


def test_adaptive_kl_controller():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    for step in FIXTURES["adaptive_kl"]:
        ctrl.update(step["current_kl"], step["n_steps"])
        assert ctrl.value == pytest.approx(step["value"], abs=1e-12)


@pytest.mark.parametrize("case", FIXTURES["gae"], ids=lambda c: f"gamma={c['gamma']}-lam={c['lam']}")
def test_gae_advantage_return(case):
    inp = INPUTS["outcome"]
    adv, ret = ca.get_adv_estimator_fn("gae")(
        token_level_rewards=tensor(inp["token_level_rewards"]), values=tensor(INPUTS["gae_values"]),
        response_mask=tensor(inp["response_mask"]), gamma=case["gamma"], lam=case["lam"])
    assert_matches(adv, case["advantages"], "advantages")
    assert_matches(ret, case["returns"], "returns")


def _value_loss(mode: str, cliprange_value: float, rows: slice = slice(None), **kwargs):
    v = INPUTS["value_loss"]
    vpreds = tensor(v["vpreds"]).requires_grad_(True)
    vf_loss, vf_clipfrac = ca.compute_value_loss(vpreds[rows], tensor(v["returns"])[rows], tensor(v["values"])[rows],
                                                 tensor(v["response_mask"])[rows], cliprange_value,
                                                 loss_agg_mode=mode, **kwargs)
    (grad,) = torch.autograd.grad(vf_loss, vpreds)
    return vf_loss, vf_clipfrac, grad


@pytest.mark.parametrize("case", FIXTURES["value_loss"],
                         ids=lambda c: f"{c['mode']}-{sorted(c['kwargs'])}-clip={c['cliprange_value']}")
def test_value_loss(case):
    vf_loss, vf_clipfrac, grad = _value_loss(case["mode"], case["cliprange_value"], **case["kwargs"])
    assert_matches(vf_loss, case["vf_loss"], "vf_loss")
    assert_matches(vf_clipfrac, case["vf_clipfrac"], "vf_clipfrac")
    assert_matches(grad, case["grad"], "grad")


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_value_loss_data_parallel_split(mode):
    """2 ranks x 2 micro-batches with the mini-batch's global counts: each rank backpropagates the sum of its
    micro-batch losses, FSDP averages the gradients; loss and gradient equal one process's with the same counts."""
    mask = tensor(INPUTS["value_loss"]["response_mask"])
    info = {"dp_size": 2, "batch_num_tokens": int(mask.sum()), "global_batch_size": mask.shape[0]}
    ranks = [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]]  # row 5 (fully masked) is on rank 1
    parts = [[_value_loss(mode, 0.2, s, **info) for s in rank] for rank in ranks]
    fsdp_loss = sum(loss for rank in parts for loss, _, _ in rank) / 2
    fsdp_grad = sum(grad for rank in parts for _, _, grad in rank) / 2
    single_loss, _, single_grad = _value_loss(mode, 0.2, batch_num_tokens=info["batch_num_tokens"],
                                              global_batch_size=info["global_batch_size"])
    assert_matches(fsdp_loss, single_loss.detach(), "FSDP mean vs one process")
    assert_matches(fsdp_grad, single_grad, "FSDP gradient vs one process")


def _rollout_corr_inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = INPUTS[f"rollout_corr_{kind}"]
    return tensor(r["old_log_prob"]), tensor(r["rollout_log_prob"]), tensor(r["response_mask"])


def test_rollout_corr_fixtures_cover_the_edge_cases():
    assert {(c["level"], c["threshold"]) for c in FIXTURES["rollout_corr"]} == {
        (lv, th) for lv in ("token", "sequence") for th in (2.0, 1.5)}
    for kind in ("small", "moderate", "huge", "seq_bound"):
        old, rollout, mask = _rollout_corr_inputs(kind)
        log_ratio = (old - rollout)[mask.bool()]
        assert (mask.sum(-1) == 0).any()                                             # a fully masked row
        assert any((row.diff() > 0).any() for row in mask)                           # tool gaps
        assert ((old - rollout)[mask == 0].abs() >= 50).all()                        # far apart off the mask
        seq_sums = ((old - rollout) * mask).sum(-1)
        if kind == "small":
            assert log_ratio.abs().max() < 1e-2
        if kind == "huge":
            assert log_ratio.abs().max() > SAFETY_BOUND
        if kind == "seq_bound":
            assert log_ratio.abs().max() < SAFETY_BOUND / 4
            assert seq_sums.max() > SAFETY_BOUND and seq_sums.min() < -SAFETY_BOUND


@pytest.mark.parametrize("case", FIXTURES["rollout_corr"],
                         ids=lambda c: f"{c['inputs']}-{c['level']}-threshold={c['threshold']}")
def test_rollout_is_weights(case):
    """verl's compute_rollout_correction_weights(old - rollout, mask, level, threshold) weights (TIS)."""
    old, rollout, mask = _rollout_corr_inputs(case["inputs"])
    weights = rollout_is_weights(old, rollout, mask, case["level"], case["threshold"])
    assert_matches(weights, case["weights"], "rollout_is_weights")
    # rollout_corr/rollout_is_mean: the update's Σ weights / token count
    assert_matches(weights.sum() / mask.sum(), case["rollout_is_mean"], "rollout_is_mean")
    if case["level"] == "token":
        # verl's rollout_is_max is the truncated weights' maximum; our rollout_corr/ratio_max is the untruncated
        # ratio's (mismatch_sums), so they agree once truncated. (verl's sequence-level rollout_is_max is
        # exp(max row sum of log-ratios, fully masked rows included), which we do not log.)
        _, maxima = mismatch_sums(old, rollout, mask)
        assert_matches(min(maxima[0], case["threshold"]), case["rollout_is_max"], "rollout_is_max")


@pytest.mark.parametrize("case", FIXTURES["rollout_mismatch"], ids=lambda c: c["inputs"])
def test_rollout_mismatch_metrics(case):
    """The update's rollout_corr/kl, rollout_corr/k3_kl and training/rollout_probs_diff_mean (token sums of
    mismatch_sums over the token count) and training/rollout_probs_diff_max, on one mini-batch, against verl's
    compute_offpolicy_metrics and calculate_debug_metrics."""
    old, rollout, mask = _rollout_corr_inputs(case["inputs"])
    sums, maxima = mismatch_sums(old, rollout, mask)
    n_tokens = float(mask.sum())
    assert_matches(sums[0] / n_tokens, case["kl"], "rollout_corr/kl")
    assert_matches(sums[2] / n_tokens, case["probs_diff_mean"], "training/rollout_probs_diff_mean")
    assert_matches(maxima[1], case["probs_diff_max"], "training/rollout_probs_diff_max")
    k3 = sums[1] / n_tokens
    if case["inputs"] == "huge":
        # A definitional difference: we clamp the log-ratio to ±SAFETY_BOUND before k3 = exp(r) - r - 1,
        # verl's compute_offpolicy_metrics does not (its k3_kl has exp(30) tokens in its mean).
        assert case["k3_kl"] > 1e3 * k3
    else:
        # verl sums in fp32 (a k3_kl of 20 is off by ~1e-6 there); ours in fp64
        assert k3 == pytest.approx(case["k3_kl"], rel=TOL, abs=TOL), "rollout_corr/k3_kl"
