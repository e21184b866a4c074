"""DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``; here ``reward.overlong_buffer``).

A response longer than ``max_response_length - len`` loses ``penalty_factor`` per ``len`` tokens of excess,
linearly, reaching ``-penalty_factor`` at the length cap; shorter responses are untouched. Lengths count every
response token with attention (tool results included), as verl's DAPO reward manager does: the cap the
penalty anticipates is the one the rollout truncates at.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from arpo.config import section_values


@dataclass(frozen=True)
class OverlongBuffer:
    """``reward.overlong_buffer`` with the run's ``data.max_response_length``."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    max_response_length: int = 0

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None, max_response_length: int | None) -> "OverlongBuffer":
        values = section_values(section, "reward.overlong_buffer", {"enable", "len", "penalty_factor"})
        buf = cls(**values, max_response_length=int(max_response_length or 0))
        if buf.enable:
            if isinstance(buf.len, bool) or not isinstance(buf.len, int) or not 0 < buf.len <= buf.max_response_length:
                raise ValueError(f"reward.overlong_buffer.len must be an integer in 1..data.max_response_length "
                                 f"({buf.max_response_length}), got {buf.len!r}")
            if not buf.penalty_factor >= 0:
                raise ValueError(f"reward.overlong_buffer.penalty_factor must be >= 0, got {buf.penalty_factor!r}")
        return buf

    def penalty(self, response_lengths: torch.Tensor) -> torch.Tensor:
        """verl's ``min(-(length - (max_len - len)) / len * penalty_factor, 0)`` per row (zeros when off)."""
        if not self.enable:
            return torch.zeros(response_lengths.shape, dtype=torch.float32)
        exceed = response_lengths.to(torch.float64) - (self.max_response_length - self.len)
        return torch.clamp(-exceed / self.len * self.penalty_factor, max=0.0).to(torch.float32)
