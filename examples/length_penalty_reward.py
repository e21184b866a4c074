"""A custom reward: the built-in reward of the row's data source, minus a penalty for long responses.

Use it with verl's keys (configs/reward.yaml), no change to the package::

    python -m arpo.main_arpo custom_reward_function.path=examples/length_penalty_reward.py \\
        custom_reward_function.name=compute_score \\
        +custom_reward_function.reward_kwargs.max_chars=400 +custom_reward_function.reward_kwargs.penalty_per_char=0.001

The function is called for every row as ``compute_score(data_source, solution_str, ground_truth, extra_info,
**reward_kwargs)`` and returns a float or a dict with ``score``; the dict's other numeric keys become
per-batch metrics (``reward/<key>/mean``), here ``reward/length_penalty/mean``. Declaring ``protocol`` adds the
run's tool tags to the call; passing them on lets the built-in format gate accept the loaded tools' tags.
"""

from __future__ import annotations

from typing import Any

from arpo.protocol import ToolProtocol
from reward_fns.registry import default_compute_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None,
                  max_chars: int = 400, penalty_per_char: float = 0.001, max_penalty: float = 0.5,
                  protocol: ToolProtocol | None = None, **kwargs: Any) -> dict[str, float]:
    """The data source's own score (reward_fns/registry.py routes it) minus ``penalty_per_char`` per character
    beyond ``max_chars``, at most ``max_penalty``: shorter answers win among equally correct ones."""
    base = default_compute_score(data_source, solution_str, ground_truth, extra_info, protocol=protocol, **kwargs)
    base_score = float(base["score"] if isinstance(base, dict) else base)
    penalty = min(max_penalty, penalty_per_char * max(0, len(solution_str) - max_chars))
    return {"score": base_score - penalty, "base_score": base_score, "length_penalty": penalty}
