"""Hand-computed checks of every function in arpo.trainer.core_algos (expected numbers derived in comments)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arpo.batch import DataBatch
from arpo.trainer import core_algos as ca

ATOL = 1e-5


def close(actual, expected, atol=ATOL):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ------------------------------------------------------------------------------------------ advantages

def _rewards_and_mask():
    # Scores 1, 0, 1 (group "a") and 5 (group "b", alone). Row 0 splits its reward over two tokens to check
    # that the score is the SUM of token rewards. Row 1 has a masked-out middle token.
    rewards = torch.tensor([[0.5, 0.0, 0.5],
                            [0.0, 0.0, 0.0],
                            [0.0, 0.0, 1.0],
                            [0.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1],
                         [1, 0, 1],
                         [1, 1, 1],
                         [1, 1, 0]])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    return rewards, mask, index


def test_grpo_normalised_by_unbiased_std():
    rewards, mask, index = _rewards_and_mask()
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, index)
    # group a: mean 2/3; unbiased var = ((1/3)² + (2/3)² + (1/3)²) / 2 = 1/3; std = 0.5773503
    # A = (1 − 2/3)/(0.5773503 + 1e-6) = 0.5773493 ; (0 − 2/3)/(0.5773513) = −1.1546986
    # group b (one row): mean 0, std 1 → 5 / (1 + 1e-6) = 4.999995
    a1, a0, single = 0.5773493, -1.1546986, 4.999995
    expected = torch.tensor([[a1, a1, a1], [a0, 0.0, a0], [a1, a1, a1], [single, single, 0.0]])
    close(adv, expected)
    assert torch.equal(adv, ret)


def test_grpo_without_std_is_score_minus_mean():
    rewards, mask, index = _rewards_and_mask()
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    # 1 − 2/3 = 1/3, 0 − 2/3 = −2/3; single row: 5 − 0
    close(adv[:, 0], [1 / 3, -2 / 3, 1 / 3, 5.0])
    close(adv[1], [-2 / 3, 0.0, -2 / 3])


def test_grpo_epsilon_and_equal_scores():
    # Equal scores → std 0 → advantage 0/(0 + eps) = 0, never NaN.
    adv, _ = ca.compute_grpo_outcome_advantage(torch.ones(3, 2), torch.ones(3, 2), np.array([7, 7, 7]))
    close(adv, torch.zeros(3, 2))
    # Integer group ids and a custom epsilon: scores 0 and 2 → mean 1, std sqrt(2) → ±1/(1.4142136 + 0.1)
    adv, _ = ca.compute_grpo_outcome_advantage(torch.tensor([[0.0], [2.0]]), torch.ones(2, 1),
                                               np.array([3, 3]), epsilon=0.1)
    close(adv[:, 0], [-1 / (math.sqrt(2) + 0.1), 1 / (math.sqrt(2) + 0.1)])


def test_tree_grpo_adds_intra_tree_to_inter_tree_grpo():
    # one prompt, two trees: scores 1, 0, 1 (tree 0) and 0, 0, 1 (tree 1)
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0], [0.0], [1.0]])
    index, trees = np.array(["p"] * 6, dtype=object), [0, 0, 0, 1, 1, 1]
    adv, ret = ca.compute_tree_grpo_outcome_advantage(rewards, torch.ones(6, 1), index, tree_index=trees)
    # inter: mean 1/2, unbiased std sqrt(6·0.25/5) = 0.5477226 → ±0.5/(0.5477226 + 1e-6) = ±0.9128692
    # intra: each tree's mean is 2/3 or 1/3 with std 0.5773503 → +0.5773493 / −1.1546986 (as in GRPO above)
    inter, hi, lo = 0.9128692, 0.5773493, -1.1546986
    close(adv[:, 0], [inter + hi, -inter + lo, inter + hi, -inter - hi, -inter - hi, inter - lo])
    assert torch.equal(adv, ret)
    with pytest.raises(ValueError, match="policy=tree_grpo"):
        ca.compute_tree_grpo_outcome_advantage(rewards, torch.ones(6, 1), index)


def test_grpo_vectorized_equals_loop_form():
    rewards, mask, index = _rewards_and_mask()
    for norm in (True, False):
        loop, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        vec, ret = ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
        close(vec, loop)
        assert torch.equal(vec, ret)
    # Labels given as a list, a tensor of ints, or mixed types group the same way.
    ids = torch.tensor([4, 4, 4, 9])
    close(ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, ids)[0],
          ca.compute_grpo_outcome_advantage(rewards, mask, index)[0])
    close(ca.compute_grpo_vectorized_outcome_advantage(rewards, mask, np.array(["a", "a", "a", 1], dtype=object))[0],
          ca.compute_grpo_outcome_advantage(rewards, mask, index)[0])


def test_rloo_leave_one_out():
    rewards, mask, index = _rewards_and_mask()
    adv, ret = ca.compute_rloo_outcome_advantage(rewards, mask, index)
    # row 0: 1 − mean(0, 1) = 0.5; row 1: 0 − mean(1, 1) = −1; row 2 = 0.5; lone row keeps its score 5.
    expected = torch.tensor([[0.5, 0.5, 0.5], [-1.0, 0.0, -1.0], [0.5, 0.5, 0.5], [5.0, 5.0, 0.0]])
    close(adv, expected)
    assert torch.equal(adv, ret)
    # The vectorized form: the same leave-one-out values, but 0 for the lone row (verl's rloo_vectorized).
    vec, _ = ca.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    expected[3] = 0.0
    close(vec, expected)


def test_reinforce_plus_plus_baseline():
    rewards, mask, index = _rewards_and_mask()
    adv, ret = ca.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index)
    # score − group mean: 1/3, −2/3, 1/3 (group a), 5 (alone, mean 0), on each row's 3, 2, 3, 2 masked tokens.
    # The 10 masked values: mean (3·1/3 − 2·2/3 + 3·1/3 + 2·5)/10 = 10.6667/10 = 1.0666667;
    # unbiased var = Σ(v − mean)² / 9 = (6·0.5377778 + 2·3.0044444 + 2·15.4711111)/9 = 4.4641975 → std 2.1128648
    m, sd = 1.0666667, 2.1128648
    hi, lo, single = (1 / 3 - m) / sd, (-2 / 3 - m) / sd, (5 - m) / sd
    close(adv, [[hi, hi, hi], [lo, 0.0, lo], [hi, hi, hi], [single, single, 0.0]])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_discounted_and_whitened():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, returns = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    # returns: row 0: t2 = 1, t1 = 0.5·1, t0 = 0.5·0.5 → [0.25, 0.5, 1]; row 1: [0.5·2, 2, 0] = [1, 2, 0]
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # masked values 0.25, 0.5, 1, 1, 2: mean 0.95; squared deviations .49 .2025 .0025 .0025 1.1025 = 1.8;
    # unbiased var 1.8/4 = 0.45; std 0.6708204 → (−0.7, −0.45, 0.05, 0.05, 1.05)/0.6708204
    close(adv, [[-1.0434984, -0.6708204, 0.0745356], [0.0745356, 1.5652476, 0.0]])


def test_reinforce_plus_plus_passes_return_through_tool_tokens():
    # One row, position 1 is a tool result (mask 0); reward 1 on the last token, γ = 0.5.
    # t3 = 1; t2 = 0.5; t1 (tool) carries 0.5 undiscounted but reports 0; t0 = 0.5·0.5 = 0.25 (verl 0.9.1 too).
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    adv, returns = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    close(returns[0], [0.25, 0.0, 0.5, 1.0])
    assert (adv[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()
    # A reward on a masked-out position is not counted (as verl); gamma can come from verl's config object.
    rewards[0, 1] = 7.0
    _, again = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=SimpleNamespace(gamma=0.5))
    close(again, returns)


def test_masked_var():
    values, mask = torch.tensor([[1.0, 3.0, 9.0], [5.0, 0.0, 100.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    # 1, 3, 5: mean 3, Σ(v − 3)² = 8 → biased 8/3, unbiased 4 (the masked-out 9, 0 and 100 ignored)
    close(ca.masked_var(values, mask), 4.0)
    close(ca.masked_var(values, mask, unbiased=False), 8 / 3)
    with pytest.raises(ValueError, match="at least 2"):
        ca.masked_var(values, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    # A NaN outside the mask does not leak into the sum.
    close(ca.masked_sum(torch.tensor([1.0, float("nan")]), torch.tensor([1, 0])), 1.0)


def test_masked_whiten_needs_two_tokens():
    with pytest.raises(ValueError, match="at least 2"):
        ca.masked_whiten(torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 0]]))
    # values 1, 3 → mean 2, unbiased var 2 → ±1/sqrt(2)
    close(ca.masked_whiten(torch.tensor([[1.0, 3.0, 9.0]]), torch.tensor([[1, 1, 0]]))[0, :2],
          [-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_masked_mean():
    close(ca.masked_mean(torch.tensor([[1.0, 2.0], [3.0, 10.0]]), torch.tensor([[1, 1], [1, 0]])), 2.0)
    close(ca.masked_mean(torch.tensor([[1.0, 2.0], [3.0, 10.0]]), torch.tensor([[1, 1], [0, 0]]), axis=-1),
          [1.5, 0.0])


def test_estimator_registry():
    assert ca.get_adv_estimator_fn("grpo") is ca.compute_grpo_outcome_advantage
    assert ca.get_adv_estimator_fn("rloo") is ca.compute_rloo_outcome_advantage
    assert ca.get_adv_estimator_fn("reinforce_plus_plus") is ca.compute_reinforce_plus_plus_outcome_advantage
    assert ca.get_adv_estimator_fn("grpo_vectorized") is ca.compute_grpo_vectorized_outcome_advantage
    assert ca.get_adv_estimator_fn("rloo_vectorized") is ca.compute_rloo_vectorized_outcome_advantage
    assert (ca.get_adv_estimator_fn("reinforce_plus_plus_baseline")
            is ca.compute_reinforce_plus_plus_baseline_outcome_advantage)
    assert ca.get_adv_estimator_fn("tree_grpo") is ca.compute_tree_grpo_outcome_advantage
    assert ca.get_adv_estimator_fn("gae") is ca.compute_gae_advantage_return
    with pytest.raises(ValueError, match=r"unknown algorithm.adv_estimator 'remax'; valid: gae, grpo, "
                                         r"grpo_vectorized, reinforce_plus_plus, reinforce_plus_plus_baseline, "
                                         r"rloo, rloo_vectorized, tree_grpo"):
        ca.get_adv_estimator_fn("remax")
    # Every estimator accepts the same keyword set (gae also needs the critic's values and lam).
    rewards, mask, index = _rewards_and_mask()
    for name in ca.ADV_ESTIMATOR_REGISTRY:  # (tree_grpo also needs the rows' trees, and says so without them)
        adv, _ = ca.get_adv_estimator_fn(name)(token_level_rewards=rewards, response_mask=mask, index=index,
                                               epsilon=1e-6, norm_adv_by_std_in_grpo=True, gamma=1.0,
                                               tree_index=[0, 0, 1, 0], values=torch.zeros_like(rewards), lam=0.95)
        assert adv.shape == rewards.shape


# ------------------------------------------------------------------------------------------ agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0, 10.0],
                     [4.0, 5.0, 6.0, 11.0],
                     [7.0, 8.0, 9.0, 12.0]])
MASK = torch.tensor([[1, 1, 0, 0],
                     [1, 1, 1, 0],
                     [0, 0, 0, 0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 18 / 5),               # (1+2+4+5+6) / 5 tokens
    ("token-sum", 18.0),                  # no normalisation
    ("seq-mean-token-sum", 9.0),          # row sums 3, 15 over the 2 rows with tokens (empty row 3 not counted)
    ("seq-mean-token-mean", 3.25),        # row means 1.5, 5 (empty row 3 skipped) → 6.5 / 2
    ("seq-mean-token-sum-norm", 2.25),    # seq-mean-token-sum 9 / T = 4
])
def test_agg_loss_modes(mode, expected):
    close(ca.agg_loss(LOSS, MASK, mode), expected)


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 18 / 10 * 2),          # global token count 10, two ranks
    ("token-sum", 36.0),
    ("seq-mean-token-sum", 18 / 6 * 2),   # all 6 rows of the mini-batch count, the empty one too
    ("seq-mean-token-mean", 6.5 / 6 * 2),
    ("seq-mean-token-sum-norm", 18 / 6 * 2 / 16),  # loss_scale_factor replaces T
])
def test_agg_loss_global_normalisers(mode, expected):
    close(ca.agg_loss(LOSS, MASK, mode, dp_size=2, batch_num_tokens=10, global_batch_size=6, loss_scale_factor=16),
          expected)


def test_agg_loss_empty_mask():
    # Local normalisers of an empty mask are 0/0 = NaN, as in verl (a step with no loss token is skipped);
    # with global normalisers an empty micro-batch contributes 0.
    empty = torch.zeros_like(MASK)
    for mode in ca.LOSS_AGG_MODES:
        value = ca.agg_loss(LOSS, empty, mode)
        assert value.item() == 0.0 if mode == "token-sum" else math.isnan(value.item()), mode
        assert ca.agg_loss(LOSS, empty, mode, batch_num_tokens=4, global_batch_size=2).item() == 0.0


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        ca.agg_loss(LOSS, MASK, "mean")


def test_agg_loss_needs_global_count_with_dp():
    with pytest.raises(ValueError, match="batch_num_tokens"):
        ca.agg_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        ca.agg_loss(LOSS, MASK, "seq-mean-token-mean", dp_size=2, batch_num_tokens=5)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        ca.agg_loss(LOSS, MASK, "token-sum", dp_size=0)


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_agg_loss_dp_and_micro_batches_equal_single_process(mode):
    # 8 rows split over 2 ranks × 2 micro-batches of 2 rows, with the counts verl 0.9.1's actor passes
    # (loss tokens and rows of the whole mini-batch). Ranks' gradients are averaged (FSDP) and micro-batches
    # summed, so the target is mean_over_ranks(sum_over_micro(loss)).
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(8, 5, generator=gen, requires_grad=True)
    mask = (torch.rand(8, 5, generator=gen) > 0.4).long()
    mask[3] = 0  # an empty row
    micro = [(slice(0, 2), slice(2, 4)), (slice(4, 6), slice(6, 8))]  # rank 0, rank 1
    tokens = sum(ca.agg_loss_count(mask[s], "token-mean") for rank in micro for s in rank)  # "all-reduced"
    rows = sum(ca.agg_loss_count(mask[s], "seq-mean-token-sum") for rank in micro for s in rank)
    assert (tokens, rows) == (mask.sum(), 8)
    single = ca.agg_loss(loss, mask, mode, batch_num_tokens=tokens, global_batch_size=rows)
    (g_single,) = torch.autograd.grad(single, loss)

    kwargs = {"batch_num_tokens": tokens, "global_batch_size": rows, "dp_size": 2}
    per_rank = [sum(ca.agg_loss(loss[s], mask[s], mode, **kwargs) for s in rank) for rank in micro]
    distributed = sum(per_rank) / 2
    (g_dist,) = torch.autograd.grad(distributed, loss)
    close(distributed, single.detach())
    close(g_dist, g_single)
    if mode.startswith("seq-"):
        # One process without global counts divides by the 7 rows with tokens, not 8.
        close(ca.agg_loss(loss, mask, mode) * 7 / 8, single.detach())


def test_agg_loss_count():
    assert ca.agg_loss_count(MASK, "token-mean").item() == 5
    assert ca.agg_loss_count(MASK, "token-sum").item() == 5
    assert ca.agg_loss_count(MASK, "seq-mean-token-sum").item() == 3
    assert ca.agg_loss_count(MASK, "seq-mean-token-mean").item() == 3  # the empty row counts, as verl's actor
    assert ca.agg_loss_count(MASK, "seq-mean-token-sum-norm").item() == 3


# ------------------------------------------------------------------------------------------ policy loss

def _policy_case():
    # ratios 1.5, 0.5, 5, 0.7 and a masked-out 5th token with absurd values.
    ratios = torch.tensor([[1.5, 0.5, 5.0, 0.7, 10.0]])
    old = torch.full_like(ratios, -2.0)
    logp = old + ratios.log()
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return old, logp, adv, mask


def test_policy_loss_asymmetric_and_dual_clip():
    old, logp, adv, mask = _policy_case()
    pg_loss, clipfrac, ppo_kl, clipfrac_lower = ca.compute_policy_loss(
        old, logp, adv, mask, cliprange=0.2, cliprange_low=0.2, cliprange_high=0.3, clip_ratio_c=3.0)
    # clip range [0.8, 1.3]
    # t0 A=+1 r=1.5: L1 −1.5, L2 −1.3 → −1.3 (clipped)
    # t1 A=+1 r=0.5: L1 −0.5, L2 −0.8 → −0.5
    # t2 A=−1 r=5:   L1 5, L2 1.3 → 5, dual cap −A·3 = 3 → 3 (dual clip active)
    # t3 A=−2 r=0.7: L1 1.4, L2 1.6 → 1.6 (clipped), cap 6
    # token-mean = (−1.3 − 0.5 + 3 + 1.6)/4 = 0.7
    close(pg_loss, 0.7)
    close(clipfrac, 2 / 4)
    close(clipfrac_lower, 1 / 4)
    # ppo_kl = mean(old − logp) = −ln(1.5·0.5·5·0.7)/4 = −ln(2.625)/4
    close(ppo_kl, -math.log(2.625) / 4)


def test_policy_loss_symmetric_default_and_gradient():
    old, logp, adv, mask = _policy_case()
    logp = logp.clone().requires_grad_(True)
    pg_loss, clipfrac, _, _ = ca.compute_policy_loss(old, logp, adv, mask, cliprange=0.2,
                                                    loss_agg_mode="seq-mean-token-sum")
    # clip range [0.8, 1.2]: t0 → −1.2 (clipped); t1 → −0.5; t2 → min(5, 3) = 3; t3 → 1.6 (clipped)
    # seq-mean-token-sum over the single row = −1.2 − 0.5 + 3 + 1.6 = 2.9
    close(pg_loss, 2.9)
    close(clipfrac, 2 / 4)
    pg_loss.backward()
    # Only t1 is unclipped: d(−A·exp(logp − old))/dlogp = −A·ratio = −0.5; clipped tokens have no gradient.
    close(logp.grad, [[0.0, -0.5, 0.0, 0.0, 0.0]])


def test_policy_loss_rejects_bad_clip():
    old, logp, adv, mask = _policy_case()
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ca.compute_policy_loss(old, logp, adv, mask, cliprange=0.2, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="cliprange"):
        ca.compute_policy_loss(old, logp, adv, mask)


# ------------------------------------------------------------------------------------------ KL, entropy

def test_kl_penalty_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # logp − ref = 0.5, −1
    close(ca.kl_penalty(logp, ref, "kl"), [0.5, -1.0])
    close(ca.kl_penalty(logp, ref, "abs"), [0.5, 1.0])
    close(ca.kl_penalty(logp, ref, "mse"), [0.125, 0.5])
    # d = ref − logp = −0.5, 1: e^−0.5 + 0.5 − 1 = 0.1065307; e^1 − 1 − 1 = 0.7182818
    close(ca.kl_penalty(logp, ref, "low_var_kl"), [0.1065307, 0.7182818])
    for alias, name in (("k1", "kl"), ("k2", "mse"), ("k3", "low_var_kl")):
        assert torch.equal(ca.kl_penalty(logp, ref, alias), ca.kl_penalty(logp, ref, name))
    # Clamp: d = 15 → e^15 − 16 ≫ 10 → 10; d = −30 → clamped to −20 → e^−20 + 19 ≈ 19 → 10
    close(ca.kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([15.0, -30.0]), "low_var_kl"), [10.0, 10.0])
    with pytest.raises(ValueError, match="unknown kl penalty 'full'"):
        ca.kl_penalty(logp, ref, "full")


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty_straight_through(name):
    # "name+": the value of name, the gradient of k2 = ½(logp − ref)², i.e. logp − ref = 0.5, −1.
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    value = ca.kl_penalty(logp, ref, name + "+")
    close(value.detach(), ca.kl_penalty(logp.detach(), ref, name))
    (grad,) = torch.autograd.grad(value.sum(), logp)
    close(grad, [0.5, -1.0])
    assert name + "+" in ca.KL_PENALTY_TYPES


def test_kl_loss():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    # low_var_kl of the first two tokens 0.1065307, 0.7182818 → token-mean 0.4124063
    close(ca.compute_kl_loss(logp, ref, mask, "low_var_kl", "token-mean"), 0.4124063)


def test_entropy_loss():
    # token 0: uniform over 2 → ln 2 = 0.6931472; token 1: p = (1/4, 3/4) → 0.25·ln4 + 0.75·ln(4/3) = 0.5623351;
    # token 2 masked. token-mean = (0.6931472 + 0.5623351)/2 = 0.6277412
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)], [5.0, -5.0]]])
    close(ca.compute_entropy_loss(logits, torch.tensor([[1, 1, 0]])), 0.6277412)


def test_fixed_kl_controller():
    ctrl = ca.FixedKLController(kl_coef=0.05)
    ctrl.update(current_kl=10.0, n_steps=100)
    assert ctrl.value == 0.05


def test_adaptive_kl_controller():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.06, n_steps=10)   # error 0.06/0.05 − 1 = 0.2 → ×(1 + 0.2·10/100) = 1.02
    assert ctrl.value == pytest.approx(0.102)
    ctrl.update(current_kl=0.5, n_steps=50)    # error 9 clipped to 0.2 → ×1.1
    assert ctrl.value == pytest.approx(0.1122)
    ctrl.update(current_kl=0.0, n_steps=100)   # error −1 clipped to −0.2 → ×0.8
    assert ctrl.value == pytest.approx(0.08976)
    with pytest.raises(ValueError, match="horizon"):
        ca.AdaptiveKLController(0.1, 0.05, 0)


def test_get_kl_controller():
    assert isinstance(ca.get_kl_controller({"type": "fixed", "kl_coef": 0.1}), ca.FixedKLController)
    ctrl = ca.get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 0.1, "horizon": 10})
    assert isinstance(ctrl, ca.AdaptiveKLController) and ctrl.value == 0.2
    with pytest.raises(ValueError, match="kl_ctrl.type 'pid'"):
        ca.get_kl_controller({"type": "pid", "kl_coef": 0.1})


def _kl_batch():
    return DataBatch(tensors={
        "token_level_scores": torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]),
        "old_log_probs": torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]]),
        "ref_log_prob": torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -2.0]]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    })


def test_apply_kl_penalty_fixed():
    data, metrics = ca.apply_kl_penalty(_kl_batch(), ca.FixedKLController(0.1), kl_penalty="kl")
    # kl = old − ref = [[0.5, 0, −0.5], [0, −1, 0]] (row 1's last token masked out)
    # rewards = scores − 0.1·kl = [[−0.05, 0, 1.05], [0, 0.1, 2]]
    close(data["token_level_rewards"], [[-0.05, 0.0, 1.05], [0.0, 0.1, 2.0]])
    # per-row masked means 0/3 = 0 and −1/2 = −0.5 → batch KL −0.25
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(-0.25)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)


def test_apply_kl_penalty_adaptive_updates_coef():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10)
    _, metrics = ca.apply_kl_penalty(_kl_batch(), ctrl, kl_penalty="kl")
    # error −0.25/0.1 − 1 = −3.5 → clipped −0.2; n_steps = 2 rows → ×(1 − 0.2·2/10) = 0.96
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value == pytest.approx(0.096)
