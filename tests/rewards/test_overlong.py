"""DAPO's overlong shaping: verl's formula, its place in the token-level reward, and the config checks."""

from __future__ import annotations

import pytest
import torch

from reward_fns.manager import RewardManager, build_token_level_rewards
from reward_fns.overlong import OverlongBuffer

from .test_manager import BOTH, _batch


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
