"""DAPO's overlong shaping: verl's formula, its place in the token-level reward, and the config checks.

The parity cases compare with the reward tensors verl 0.9.1's DAPO reward managers wrote themselves
(tests/trainer/fixtures/make_verl_core_algos_fixtures.py, "overlong"), for a compute_score of 0.0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from arpo.batch import Trajectory, collate_trajectories
from reward_fns.manager import RewardManager, build_token_level_rewards
from reward_fns.overlong import OverlongBuffer

from .test_manager import BOTH, _batch

VERL = json.loads((Path(__file__).parents[1] / "trainer" / "fixtures" / "verl_core_algos.json").read_text())


def test_penalty_is_linear_over_the_buffer_and_zero_before_it():
    # verl's DAPO reward manager: min(-(length - (max_len - buffer)) / buffer * factor, 0), by hand
    buf = OverlongBuffer(enable=True, len=20, penalty_factor=1.0, max_response_length=100)
    lengths = torch.tensor([0, 50, 80, 81, 90, 100])
    assert buf.penalty(lengths).tolist() == pytest.approx([0, 0, 0, -0.05, -0.5, -1.0])
    half = OverlongBuffer(enable=True, len=20, penalty_factor=0.5, max_response_length=100)
    assert half.penalty(torch.tensor([90])).tolist() == pytest.approx([-0.25])
    assert not OverlongBuffer(len=20, max_response_length=100).penalty(lengths).any()  # off


def test_shaped_reward_lands_on_the_reward_token_and_is_logged():
    batch = _batch([[], []])  # 3 rows: 4 response tokens, 4 (the last 2 a tool result), 0
    overlong = OverlongBuffer(enable=True, len=2, penalty_factor=0.5, max_response_length=4)
    with RewardManager(executor="serial") as plain, RewardManager(executor="serial", overlong=overlong) as shaped:
        base, _ = build_token_level_rewards(batch, [BOTH, BOTH, ""], plain)
        rewards, result = build_token_level_rewards(batch, [BOTH, BOTH, ""], shaped)
    # tool-result tokens count toward the length, as verl counts every attended response token
    assert (rewards - base).sum(-1).tolist() == pytest.approx([-0.5, -0.5, 0.0])
    assert torch.equal(rewards != 0, base != 0)
    assert result.scores == pytest.approx(base.sum(-1).tolist())  # the raw scores stay unshaped
    assert result.metrics["reward/overlong/fraction"] == pytest.approx(2 / 3)
    assert result.metrics["reward/overlong/penalty_mean"] == pytest.approx(-1 / 3)


@pytest.mark.parametrize("section, message", [
    ({"enable": True, "len": 0}, "reward.overlong_buffer.len"),
    ({"enable": True, "len": 500}, "reward.overlong_buffer.len"),
    ({"enable": True, "len": 10, "penalty_factor": -1}, "penalty_factor"),
    ({"enable": True, "length": 10}, "reward.overlong_buffer.length"),
])
def test_bad_overlong_config_names_the_key(section, message):
    with pytest.raises(ValueError, match=message):
        OverlongBuffer.from_config(section, max_response_length=384)


def test_manager_reads_the_section_and_the_response_cap():
    cfg = {"reward": {"executor": "serial", "overlong_buffer": {"enable": True, "len": 16, "penalty_factor": 2.0}},
           "data": {"max_response_length": 64}}
    with RewardManager.from_config(cfg) as manager:
        assert manager.overlong == OverlongBuffer(enable=True, len=16, penalty_factor=2.0, max_response_length=64)


def _zero_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0


def _verl_overlong_batch():
    """The fixture's rows: response lengths around the buffer, tool results at 5..9 in rows of 12+ tokens, the
    last row cut at the cap inside a tool result."""
    inp = VERL["inputs"]["overlong"]
    masks = inp["response_mask"]["data"]
    trajs = [Trajectory(group=0, prompt_ids=prompt, response_ids=list(range(10, 10 + length)),
                        response_mask=masks[i][:length])
             for i, (prompt, length) in enumerate(zip(inp["prompt_ids"], inp["lengths"]))]
    return collate_trajectories(trajs, pad_token_id=0, group_uids=["q0"], group_fields={
        "data_source": ["dapo_math"], "reward_model": [{"ground_truth": "42", "style": "rule"}]})


def test_verl_overlong_fixture_covers_the_buffer():
    lengths = VERL["inputs"]["overlong"]["lengths"]
    for case in VERL["overlong"]:
        start = case["max_resp_len"] - case["len"]
        assert (start == 0 or min(lengths) < start) and start in lengths and case["max_resp_len"] in lengths
        assert any(start < n < case["max_resp_len"] for n in lengths)
    assert VERL["inputs"]["overlong"]["response_mask"]["data"][-1][-1] == 0  # ends inside a tool result


@pytest.mark.parametrize("case", VERL["overlong"],
                         ids=lambda c: f"max={c['max_resp_len']}-len={c['len']}-factor={c['penalty_factor']}")
def test_penalty_and_its_token_match_verl_dapo_reward_manager(case):
    buf = OverlongBuffer(enable=True, len=case["len"], penalty_factor=case["penalty_factor"],
                         max_response_length=case["max_resp_len"])
    lengths = torch.tensor(VERL["inputs"]["overlong"]["lengths"])
    torch.testing.assert_close(buf.penalty(lengths), torch.tensor(case["penalties"]), atol=1e-6, rtol=0)
    batch = _verl_overlong_batch()
    expected = torch.tensor(case["reward_tensor"]["data"], dtype=torch.float32)
    with RewardManager(_zero_score, executor="serial", overlong=buf) as manager:
        rewards, _ = build_token_level_rewards(batch, [""] * len(lengths), manager)
        # reward.position=last_model_token (ours only) moves a row's reward off a trailing tool result
        moved, _ = build_token_level_rewards(batch, [""] * len(lengths), manager, position="last_model_token")
    torch.testing.assert_close(rewards, expected, atol=1e-6, rtol=0)  # default last_valid: verl's token
    torch.testing.assert_close(moved.sum(-1), expected.sum(-1), atol=1e-6, rtol=0)
    assert not torch.equal(moved[-1], expected[-1])
