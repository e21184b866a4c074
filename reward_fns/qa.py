"""Question-answering metrics: exact match and token F1 with SQuAD-style normalisation.

Normalisation (SQuAD v1.1's): lower-case, drop punctuation, drop the articles a/an/the, collapse
whitespace. F1 is computed over whitespace tokens of the normalised strings. Answers that normalise to
``yes``, ``no`` or ``noanswer`` get F1 only by matching exactly (as in HotpotQA's official scorer and
ARPO's reward): "no" must not earn partial credit against "yes, definitely no".

A ground truth may be one string or several acceptable strings (the shared eval files store lists,
parquet loads them as numpy arrays); every metric takes the maximum over them.

:func:`compute_score` is the reward (verl signature): the ARPO format gate of
:mod:`reward_fns.gate`, then EM or F1 of the boxed answer. It adds no tool bonus by default, so it
suits evaluation; :mod:`reward_fns.deep_research` is ARPO's training reward.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Iterable

from arpo.protocol import DEFAULT_PROTOCOL, ToolProtocol
from reward_fns.gate import score_with_gate

#: Answers that must match exactly to earn any F1.
EXACT_ONLY_ANSWERS = frozenset({"yes", "no", "noanswer"})

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def as_answer_list(ground_truth: Any) -> list[str]:
    """The acceptable answers as strings: accepts a string, a number, or any iterable of them.

    Raises ValueError naming the problem when there is no usable answer, because a silent empty list
    would grade every response 0.
    """
    if ground_truth is None:
        raise ValueError("ground_truth is None; the dataset's reward_model.ground_truth must hold the answer")
    if isinstance(ground_truth, (str, int, float)):
        answers = [str(ground_truth)]
    elif isinstance(ground_truth, dict) and "target" in ground_truth:
        return as_answer_list(ground_truth["target"])
    elif isinstance(ground_truth, Iterable):
        answers = [str(a) for a in ground_truth if a is not None]
    else:
        answers = [str(ground_truth)]
    if not answers:
        raise ValueError("ground_truth is an empty list; give at least one acceptable answer")
    return answers


def exact_match(prediction: str | None, ground_truth: Any) -> float:
    """1.0 when the normalised prediction equals any normalised ground truth, else 0.0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gt) for gt in as_answer_list(ground_truth)))


def _token_f1(pred: str, gold: str) -> float:
    if (pred in EXACT_ONLY_ANSWERS or gold in EXACT_ONLY_ANSWERS) and pred != gold:
        return 0.0
    return token_f1(pred, gold)


def token_f1(pred: str, gold: str) -> float:
    """F1 over the whitespace tokens of two already normalised strings (no yes/no rule)."""
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, ground_truth: Any) -> float:
    """Best token F1 of the prediction against any ground truth (yes/no/noanswer exact only)."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return max(_token_f1(pred, normalize_answer(gt)) for gt in as_answer_list(ground_truth))


def grade(prediction: str, ground_truth: Any, metric: str = "f1") -> dict[str, float]:
    """EM and F1 of one extracted answer; ``acc`` is the one named by ``metric`` (``f1`` or ``em``)."""
    if metric not in ("f1", "em"):
        raise ValueError(f"qa metric must be 'f1' or 'em', got {metric!r}")
    em, f1 = exact_match(prediction, ground_truth), f1_score(prediction, ground_truth)
    return {"acc": f1 if metric == "f1" else em, "em": em, "f1": f1}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    metric: str = "f1",
    tool_bonus: float = 0.0,
    require_format: bool = True,
    protocol: ToolProtocol = DEFAULT_PROTOCOL,
) -> dict[str, Any]:
    """QA reward: −1 on bad format, else EM or F1 (``metric``) of the boxed answer (+``tool_bonus``).
    ``protocol``: the run's tool tags for the format gate (the registry passes them)."""
    answers = as_answer_list(ground_truth)
    return score_with_gate(
        solution_str,
        lambda pred: grade(pred, answers, metric),
        extra_info=extra_info,
        tool_bonus=tool_bonus,
        require_format=require_format,
        protocol=protocol,
    )
