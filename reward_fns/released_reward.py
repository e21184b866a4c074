"""ARPO's training reward exactly as released (``reward.deep_research_variant: released``), faults included.

For comparison runs only: :mod:`reward_fns.deep_research` (the default, ``fixed``) is the same rule with the
faults listed in :mod:`reward_fns.gate` fixed. The released ``verl/utils/reward_score/deep_research.py``
(RUC-NLPIR/ARPO a95cd08) differs from ``fixed`` in:

- the format check counts tags (anywhere, tool results included) and checks each call's order against the
  next ``<result>`` found, whoever wrote it; the answer needs ``\\boxed{`` and some ``}``;
- the +0.1 bonus needs only the strings ``</search>`` and ``</python>`` in the response;
- **undocumented until now:** an answer in the ``\\boxed <text>`` form (a space, no braces) is graded as the
  text up to the first ``$``, while ``fixed`` finds no boxed answer and scores −1; when any ``\\boxed `` occurs
  in the answer that form wins over a later ``\\boxed{}``;
- **undocumented until now:** an empty list of ground truths scores 0 there; ``fixed`` raises (a dataset
  error, not a wrong answer).

``tests/rewards/test_released_reward.py`` checks this module against the released function's outputs on every
case of ``tests/eval/fixtures/released_reward.json``.
"""

from __future__ import annotations

import re
from typing import Any

from reward_fns import qa

BAD_FORMAT_SCORE = -1.0
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def _calls_in_order(text: str, tool: str) -> str | None:
    """Each ``<tool>`` must be closed and followed by the next ``<result>…</result>`` (None: fine)."""
    pos = 0
    while (start := text.find(f"<{tool}>", pos)) != -1:
        result = text.find("<result>", start)
        end = text.find(f"</{tool}>", start)
        result_end = text.find("</result>", result)
        if -1 in (result, end, result_end):
            return f"{tool}/result tags are incomplete"
        if not start < end < result < result_end:
            return f"{tool}/result tags are nested in the wrong order"
        pos = result_end
    return None


def format_problem(text: str) -> str | None:
    """The released ``validate_format``: None when the response passes, else the reason."""
    if text.count("<think>") != text.count("</think>"):
        return "<think> </think> not paired"
    if text.count("<think>") == 0:
        return "<think> or </think> not found"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "<answer> or </answer> not found"
    for tool in ("search", "python"):
        problem = _calls_in_order(text, tool)
        if problem:
            return problem
    start, end = text.find("<answer>"), text.find("</answer>")
    if start > end:
        return "<answer> must be before </answer>"
    body = text[start:end]
    if "\\boxed{" not in body or "}" not in body:
        return "answer is missing \\boxed{} format"
    return None


def boxed_answer(answer: str) -> str | None:
    """The graded text: ``\\boxed <text>`` up to ``$`` if that form occurs, else the last complete
    ``\\boxed{…}``'s content; None where the released code raises (no box, unbalanced, ``\\fbox``)."""
    if "\\boxed " in answer:
        return answer.split("\\boxed ")[-1].split("$")[0]
    start = answer.rfind("\\boxed")
    if start < 0:
        return None  # also for \fbox, which the released remove_boxed rejects
    depth = 0
    for i in range(start, len(answer)):
        depth += {"{": 1, "}": -1}.get(answer[i], 0)
        if answer[i] == "}" and depth == 0:
            boxed = answer[start:i + 1]
            return boxed[len("\\boxed{"):-1] if boxed.startswith("\\boxed{") else None
    return None


def released_f1(prediction: str, ground_truth: Any) -> float:
    """Best SQuAD token F1 over the ground truths (yes/no/noanswer exact only); 0 for an empty list."""
    answers = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    return max((qa.f1_score(prediction, a) for a in answers), default=0.0)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None,
                  tool_bonus: float = 0.1) -> dict[str, Any]:
    """The released reward of one response, with this project's result keys (``gate.RESULT_KEYS``)."""
    text = solution_str
    tokenizer = (extra_info or {}).get("tokenizer")
    eos = getattr(tokenizer, "eos_token", None)
    result: dict[str, Any] = {"score": 0.0, "acc": 0.0, "em": 0.0, "f1": 0.0, "format_ok": 0.0,
                              "format_reason": "", "answer": "", "num_search": text.count("</search>"),
                              "num_python": text.count("</python>"), "tool_bonus": 0.0}
    problem = format_problem(text)
    if problem:
        return {**result, "score": BAD_FORMAT_SCORE, "format_reason": problem}
    if eos and text.endswith(eos):
        text = text[:-len(eos)]
    match = _ANSWER.search(text.strip())
    answer = boxed_answer(match.group(1)) if match else None
    if answer is None:
        return {**result, "score": BAD_FORMAT_SCORE, "format_reason": "no gradable \\boxed answer"}
    f1 = released_f1(answer, ground_truth)
    answers = [ground_truth] if isinstance(ground_truth, str) else list(ground_truth)
    em = float(any(qa.exact_match(answer, a) for a in answers))
    bonus = tool_bonus if f1 > 0 and "</search>" in text and "</python>" in text else 0.0
    return {**result, "score": f1 + bonus, "acc": f1, "em": em, "f1": f1, "format_ok": 1.0, "format_reason": "ok",
            "answer": answer, "tool_bonus": bonus}
