"""The released ARPO evaluation's metrics, reproduced exactly (the ``arpo`` metric profile).

Tables that sit beside the paper's must grade the same outputs the same way. The release
(RUC-NLPIR/ARPO ``evaluation/src``: ``utils.extract_answer``, ``metrics.py``, ``math_equivalence.py``,
``evaluator.py``) grades differently from our ``strict`` profile (SQuAD F1, math-verify); this module
re-implements it, faults included, and ``tests/eval/test_released_metrics.py`` checks it against fixtures made
by running the released functions (``tests/eval/fixtures/make_released_fixtures.py``).

What the released evaluation does, and how it differs from ``strict``:

- the prediction is the last ``\\boxed{}`` inside the last ``<answer>…</answer>`` (``\\text{}`` peeled
  off), else the raw answer text, else the last ``\\boxed{}`` anywhere; when that is empty, the **last five
  lines of the whole output** are graded instead;
- QA normalisation lower-cases, removes articles and collapses spaces but **keeps punctuation**, so
  ``The answer is 1827.`` vs ``1827`` has F1 0; tokens are whitespace tokens; no yes/no special case;
- QA ``acc`` means *the normalised reference is a substring of the normalised prediction* (an empty
  reference is in everything); it is ``substring_acc`` here, because ``acc`` is the headline accuracy;
- a reference given as a string starting with ``[`` is split on commas, quotes kept;
- math equivalence is the Hendrycks MATH string normaliser (no sympy) on lower-cased strings:
  ``18.0`` ≢ ``18``, ``1,000`` ≢ ``1000``, ``\\frac{2}{4}`` ≢ ``\\frac{1}{2}``, ``$18`` ≢ ``18``; a
  normaliser fault (``\\text{ `` twice, a trailing ``\\sqrt`` or ``\\frac``) falls back to raw equality;
- GSM8K's reference is the number after ``####`` with commas removed;
- the headline accuracy of a benchmark is the mean ``math_equal`` (math) or the mean **F1** (QA).
"""

from __future__ import annotations

import re
import string
from typing import Any

from reward_fns.qa import token_f1

#: the released evaluator's task types; math for the math reward family, qa for everything else
TASKS = ("math", "qa")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


# ---- answer extraction -----------------------------------------------------------------------------------
def last_boxed(text: str) -> str:
    """The last ``\\boxed…``/``\\fbox…`` through its matching brace; to the end if unbalanced; "" if none."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return ""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return text[start:]


def _unwrap(boxed: str) -> str:
    """``\\boxed{x}`` -> x, then ``\\text{x}`` -> x; anything else unchanged."""
    if boxed and boxed.startswith("\\boxed{") and boxed.endswith("}"):
        boxed = boxed[len("\\boxed{"):-1]
        if boxed and boxed.startswith("\\text{") and boxed.endswith("}"):
            boxed = boxed[len("\\text{"):-1]
    return boxed


def extract_prediction(output: str) -> str:
    """The answer the released evaluation grades for one output (``utils.extract_answer``)."""
    close = output.rfind("</answer>")
    answer = None
    if close != -1:
        open_ = output[:close].rfind("<answer>")
        if open_ != -1:
            answer = output[open_ + len("<answer>"):close]
    if answer:
        boxed = _unwrap(last_boxed(answer.strip()))
        return boxed if boxed else answer
    return _unwrap(last_boxed(output.strip()))


def graded_prediction(output: str) -> str:
    """The extracted answer, or when it is empty the last five lines of the output (``Evaluator``)."""
    prediction = extract_prediction(output)
    if not prediction and output:
        prediction = "\n".join(output.replace("\n\n", "\n").strip().split("\n")[-5:])
    return prediction


# ---- normalisation and token F1 ----------------------------------------------------------------------------
def normalize(text: Any, remove_articles: bool = False, remove_punctuation: bool = False) -> str:
    """Lower-case and strip; optionally drop articles and punctuation; collapse whitespace."""
    text = (text if isinstance(text, str) else str(text)).lower().strip()
    if remove_articles:
        text = _ARTICLES.sub(" ", text)
    if remove_punctuation:
        text = "".join(ch for ch in text if ch not in string.punctuation)
    return " ".join(text.split())


# ---- math equivalence: the Hendrycks MATH string normaliser ------------------------------------------------
class _NormaliserFault(Exception):
    """The released normaliser raised (an assert or an index error): it then compares the raw strings."""


def _fix_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{2}`` -> ``\\frac{1}{2}``; a one-character tail returns ``s``."""
    head, *tails = s.split("\\frac")
    out = head
    for tail in tails:
        out += "\\frac"
        if not tail:
            raise _NormaliserFault("\\frac at the end")
        if tail[0] == "{":
            out += tail
        elif len(tail) < 2:
            return s
        elif tail[1] != "{":
            out += "{" + tail[0] + "}{" + tail[1] + "}" + tail[2:]
        else:
            out += "{" + tail[0] + "}" + tail[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    """``3/4`` (two plain ints) -> ``\\frac{3}{4}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _remove_right_units(s: str) -> str:
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _NormaliserFault("\\text{ more than once")
    return parts[0]


def _fix_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``."""
    if "\\sqrt" not in s:
        return s
    head, *tails = s.split("\\sqrt")
    out = head
    for tail in tails:
        if not tail:
            raise _NormaliserFault("\\sqrt at the end")
        out += "\\sqrt" + (tail if tail[0] == "{" else "{" + tail[0] + "}" + tail[1:])
    return out


def strip_math(s: str) -> str:
    """The released ``_strip_string`` (raises :class:`_NormaliserFault` where it raised)."""
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> "5"
        s = sides[1]
    s = _fix_fracs(_fix_sqrt(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def math_equiv(a: str, b: str) -> bool:
    """The released ``is_equiv``: normalised strings equal, or raw strings equal where normalising fails."""
    try:
        return strip_math(a) == strip_math(b)
    except _NormaliserFault:
        return a == b


# ---- per-sample metrics -----------------------------------------------------------------------------------
def reference_for(benchmark: str, answer: Any) -> Any:
    """The reference the released data loader passes on: GSM8K keeps the number after ``####`` (a GSM8K answer
    without one stops the released loader; here it is graded as it is)."""
    if "gsm8k" in benchmark.lower() and isinstance(answer, str):
        match = _GSM8K_ANSWER.search(answer)
        return match.group(1).replace(",", "") if match else answer
    return answer


def math_metrics(prediction: str, reference: Any) -> dict[str, float]:
    """``evaluate_math_prediction``: em, substring acc, token F1 and math_equal on lower-cased strings."""
    pred, ref = normalize(prediction), normalize(reference)
    return {"em": float(pred == ref), "substring_acc": float(ref in pred), "f1": token_f1(pred, ref),
            "math_equal": float(math_equiv(pred, ref))}


def qa_references(references: Any) -> list[Any]:
    """A string is one reference unless it starts with ``[``: then it is split on commas, quotes kept."""
    if isinstance(references, str):
        if not references.startswith("["):
            return [references]
        return [part.strip() for part in re.split(r",\s*", references.strip("[]"))]
    return list(references)


def qa_metrics(prediction: str, references: Any) -> dict[str, float]:
    """``evaluate_qa_prediction``: the best em, substring acc, F1 and math_equal over the references."""
    pred = normalize(prediction, remove_articles=True)
    best = {"em": 0.0, "substring_acc": 0.0, "f1": 0.0, "math_equal": 0.0}
    for reference in qa_references(references):
        ref = normalize(reference, remove_articles=True)
        scores = {"em": float(pred == ref), "substring_acc": float(ref in pred), "f1": token_f1(pred, ref),
                  "math_equal": float(math_equiv(pred, ref))}
        best = {k: max(best[k], scores[k]) for k in best}
    return best


def sample_metrics(output: str, answer: Any, task: str, benchmark: str = "") -> dict[str, Any]:
    """Every released metric of one output, plus ``acc``: the sample's share of the headline accuracy
    (math_equal for math, F1 for QA) and ``prediction``: the text that was graded."""
    if task not in TASKS:
        raise ValueError(f"task {task!r}: the released evaluation grades 'math' or 'qa'")
    prediction = graded_prediction(output)
    if not prediction:
        scores = {"em": 0.0, "substring_acc": 0.0, "f1": 0.0, "math_equal": 0.0}
    elif task == "math":
        scores = math_metrics(prediction, reference_for(benchmark, answer))
    else:
        scores = qa_metrics(prediction, answer)
    headline = scores["math_equal"] if task == "math" else scores["f1"]
    return {"acc": headline, **scores, "prediction": prediction}
