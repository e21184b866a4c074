"""Reward for the synthetic tool-use benchmark (``data_source`` ``synthetic/<kind>``: ``search``, ``python``,
``both``, ``chain``, ``compare``, ``chain_math``; the ground truth is one string). Grading depends only on the
answer's type, never on the kind: numbers (``python``, ``both``, ``compare``, ``chain_math``) numerically, names
(``search``, ``chain``) by exact match, so a distractor's near-identical name ("Trivex Labs" for "Trivex") is wrong.

Same format gate as ARPO's reward (:mod:`reward_fns.gate`: −1 for bad format). Then:

- a numeric ground truth (``42``, ``-3.5``, ``1,234``, ``3/4``, ``1e-3``, ``12%``) is compared numerically:
  correct when ``|pred − gold| ≤ max(abs_tol, rel_tol·|gold|)``; a non-numeric prediction is wrong; a whole-number
  ground truth also needs the prediction to round to it, since the relative tolerance alone would pass a nearby
  integer of a large answer (``120120001`` for ``120120000``);
- any other ground truth (an entity name) by SQuAD-normalised exact match, or token F1 with
  ``entity_metric="f1"``.

``acc`` is that verdict; ``em``/``f1`` are always the string metrics, for comparison with QA tables.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from arpo.protocol import DEFAULT_PROTOCOL, ToolProtocol
from reward_fns import qa
from reward_fns.gate import score_with_gate

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(text: str) -> float | None:
    """The value of a plain number (thousands commas, ``a/b``, a trailing ``%`` or leading ``$`` allowed)."""
    s = str(text).strip().strip("$").replace("\\$", "").strip()
    if s.endswith("\\%") or s.endswith("%"):
        s = s.rstrip("%").rstrip("\\").strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if "/" in s:
        num, _, den = s.partition("/")
        if _NUMBER.fullmatch(num.strip()) and _NUMBER.fullmatch(den.strip()) and float(den) != 0:
            return float(Fraction(num.strip()) / Fraction(den.strip()))
        return None
    return float(s) if _NUMBER.fullmatch(s) else None


def grade(
    prediction: str,
    ground_truth: str,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    entity_metric: str = "em",
) -> dict[str, float]:
    """``acc`` (numeric closeness or entity EM/F1), plus string ``em`` and ``f1``."""
    if entity_metric not in ("em", "f1"):
        raise ValueError(f"synthetic entity_metric must be 'em' or 'f1', got {entity_metric!r}")
    em, f1 = qa.exact_match(prediction, ground_truth), qa.f1_score(prediction, ground_truth)
    gold = parse_number(ground_truth)
    if gold is not None:
        pred = parse_number(prediction)
        acc = float(pred is not None and abs(pred - gold) <= max(abs_tol, rel_tol * abs(gold))
                    and (not gold.is_integer() or round(pred) == gold))
    else:
        acc = em if entity_metric == "em" else f1
    return {"acc": acc, "em": em, "f1": f1}


def _best(grades: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(g[k] for g in grades) for k in grades[0]}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    entity_metric: str = "em",
    tool_bonus: float = 0.0,
    require_format: bool = True,
    protocol: ToolProtocol = DEFAULT_PROTOCOL,
) -> dict[str, Any]:
    """Synthetic-benchmark reward: −1 on bad format, else 1/0 numeric or entity correctness.
    ``protocol``: the run's tool tags for the format gate (the registry passes them)."""
    answers = qa.as_answer_list(ground_truth)
    return score_with_gate(
        solution_str,
        lambda pred: _best([grade(pred, a, rel_tol, abs_tol, entity_metric) for a in answers]),
        extra_info=extra_info,
        tool_bonus=tool_bonus,
        require_format=require_format,
        protocol=protocol,
    )
