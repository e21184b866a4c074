"""ARPO's training reward (``custom_reward_function.name: compute_score`` in the official scripts).

For every response, math and knowledge questions alike:

- bad format (see :mod:`reward_fns.gate`)                     → −1
- good format, token F1 of the boxed answer is 0              →  0
- good format, F1 > 0                                         →  F1
- good format, F1 > 0, and both search and python really ran  →  F1 + 0.1

F1 is SQuAD-normalised token F1 (:mod:`reward_fns.qa`), maximised over the acceptable answers;
yes/no/noanswer earn credit only by matching exactly.

Same scoring rule as the official code, with two faults fixed (both documented in
:mod:`reward_fns.gate`): the format check reads the tags in order instead of counting them, and the
bonus counts tool calls that got a result instead of searching the text for ``</search>``. Math answers
are still graded by token F1 here, as ARPO does; :mod:`reward_fns.math` grades them by equivalence.

``variant="released"`` (``reward.deep_research_variant``) grades exactly as the released code instead, faults
included (:mod:`reward_fns.released_reward`), for runs that must match the official training reward.

Importable as a module and loadable by path (``custom_reward_function.path`` pointing at this file),
so it uses absolute imports only.
"""

from __future__ import annotations

from typing import Any

from arpo.protocol import DEFAULT_PROTOCOL, ToolProtocol
from reward_fns import qa, released_reward
from reward_fns.gate import score_with_gate

#: ARPO's bonus for a correct answer reached with both tools.
MULTI_TOOL_BONUS = 0.1
#: ``fixed``: this module's rule (the released one with its format and bonus faults fixed) | ``released``: as released
VARIANTS = ("fixed", "released")


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    tool_bonus: float = MULTI_TOOL_BONUS,
    variant: str = "fixed",
    protocol: ToolProtocol = DEFAULT_PROTOCOL,
) -> dict[str, Any]:
    """ARPO's reward for one response; returns ``score`` plus diagnostics (see :data:`gate.RESULT_KEYS`).

    ``protocol``: the run's tool tags for the format gate (the registry passes them); the tool bonus then needs a
    call of every loaded tool. ``variant="released"`` ignores it: the released code knows search and python only."""
    if variant == "released":
        return released_reward.compute_score(data_source, solution_str, ground_truth, extra_info, tool_bonus)
    if variant != "fixed":
        raise ValueError(f"deep_research variant must be one of {VARIANTS}, got {variant!r}")
    answers = qa.as_answer_list(ground_truth)
    return score_with_gate(
        solution_str,
        lambda pred: qa.grade(pred, answers, "f1"),
        extra_info=extra_info,
        tool_bonus=tool_bonus,
        protocol=protocol,
    )
