"""Math rewards: answer equivalence (math-verify, with a sympy fallback) and ARPO's token-F1 variant.

**ARPO scores math with token F1.** Its training reward (:mod:`reward_fns.deep_research`) grades every
answer by SQuAD token F1, which mis-grades expressions both ways:

- ``0.5`` against ``\\frac{1}{2}`` normalises to ``05`` vs ``frac12`` → F1 0 for a correct answer;
- ``\\left( 3, \\frac{\\pi}{3} \\right)`` against ``\\left( 3, \\frac{\\pi}{2} \\right)`` shares 3 of 4
  tokens (``left 3 fracpi3 right``) → F1 0.75 for a wrong answer.

``mode="equiv"`` (default) grades by mathematical equivalence instead; ``mode="f1"`` reproduces ARPO.
Every result carries both verdicts — ``acc`` is always equivalence, ``f1`` is always token F1, and
``score`` uses the one ``mode`` names — so a run can report how often F1 disagreed.

Equivalence: identical strings after light clean-up; else math-verify (``parse``/``verify``, the
reference parser, handles sets, intervals, equations, units, percentages, base subscripts); else, when
math-verify is not installed or cannot parse, a small LaTeX → sympy converter compares
``simplify(a − b) == 0`` or numeric closeness. GSM8K ground truths (a worked solution ending in
``#### 18``) are reduced to the number after the last ``####``.

math-verify's time limits use ``signal.alarm``, which only works in a process's main thread; in other
threads they are switched off (a thread-pool reward manager therefore runs without per-answer limits).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

from arpo.protocol import DEFAULT_PROTOCOL, ToolProtocol
from reward_fns import qa
from reward_fns.gate import score_with_gate

logger = logging.getLogger(__name__)

MATH_MODES = ("equiv", "f1")

try:
    import math_verify
except ImportError:  # the sympy fallback still works
    math_verify = None


def _drop_timeout_disabled_warning(record: logging.LogRecord) -> bool:
    # math-verify warns when called without a time limit; off-main-thread that is expected and documented
    return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_drop_timeout_disabled_warning)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    """Raise _Timeout after ``seconds`` (main thread only; elsewhere no limit)."""
    if not seconds or not _in_main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def gsm8k_final_answer(ground_truth: str) -> str:
    """The number after the last ``####`` of a GSM8K solution (the string itself if there is none)."""
    if "####" not in ground_truth:
        return ground_truth
    return ground_truth.rsplit("####", 1)[1].strip().replace(",", "")


_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\{([^{}]*)\}")
_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")


def _clean(answer: str) -> str:
    """Cosmetic clean-up that never changes a value: delimiters, sizing, spacing, a trailing period."""
    s = str(answer).strip().strip("$").strip()
    s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = _SPACES.sub("", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = "".join(s.split())
    return s.rstrip(".")


# ---- math-verify -------------------------------------------------------------------------------------


def math_verify_equiv(prediction: str, ground_truth: str, timeout_s: float | None = 5.0) -> bool | None:
    """math-verify's verdict, or None when it is not installed or parses nothing from either side."""
    if math_verify is None:
        return None
    seconds = int(max(1, round(timeout_s))) if timeout_s and _in_main_thread() else None
    try:
        gold = math_verify.parse(f"${ground_truth}$", parsing_timeout=seconds)
        pred = math_verify.parse(f"${prediction}$", parsing_timeout=seconds)
        if not gold or not pred:
            return None
        return bool(math_verify.verify(gold, pred, timeout_seconds=seconds))
    except Exception as exc:  # math-verify raises on exotic input; the fallback gets a chance
        logger.debug("math-verify failed on %r vs %r: %s", prediction, ground_truth, exc)
        return None


# ---- sympy fallback ----------------------------------------------------------------------------------

_TRANSFORMS = standard_transformations + (implicit_multiplication_application, convert_xor)
_SYMBOLS = {r"\pi": " pi ", r"\infty": " oo ", r"\cdot": "*", r"\times": "*", r"\div": "/", r"\ln": " log ",
            r"\log": " log ", r"\sin": " sin ", r"\cos": " cos ", r"\tan": " tan ", "^\\circ": "",
            "^{\\circ}": "", "\\%": "", "%": "", "\\$": ""}


def _brace_arg(s: str, i: int) -> tuple[str, int]:
    """The argument starting at ``s[i]`` (a balanced ``{…}`` group or one character) and the index after it."""
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1: j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_sympy_str(latex: str) -> str:
    """Rewrite the LaTeX most answers use (fractions, roots, powers, π) as sympy input text."""
    s = _clean(latex)
    out: list[str] = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _brace_arg(s, i + 5)
            den, i = _brace_arg(s, i)
            out.append(f"(({latex_to_sympy_str(num)})/({latex_to_sympy_str(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            index = "2"
            if i < len(s) and s[i] == "[":
                close = s.index("]", i)
                index, i = s[i + 1: close], close + 1
            radicand, i = _brace_arg(s, i)
            out.append(f"(({latex_to_sympy_str(radicand)})**(1/({index})))")
        else:
            out.append(s[i])
            i += 1
    text = "".join(out)
    for k, v in _SYMBOLS.items():
        text = text.replace(k, v)
    return text.replace("{", "(").replace("}", ")").replace("\\", "")


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _unwrap(s: str) -> tuple[str, str]:
    """Outer brackets (so ``[1,2)`` and ``(1,2]`` stay different) and the text inside them."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        return s[0] + s[-1], s[1:-1]
    return "", s


def _to_sympy(latex: str) -> sympy.Expr:
    text = latex_to_sympy_str(latex)
    if "=" in text:  # "x=5" → 5: the value is what is asked for
        text = text.rsplit("=", 1)[1]
    return parse_expr(text, transformations=_TRANSFORMS, evaluate=True)


def _values_equal(a: sympy.Expr, b: sympy.Expr, rel_tol: float) -> bool:
    try:
        if sympy.simplify(a - b) == 0:
            return True
    except Exception:
        pass
    try:
        x, y = complex(sympy.N(a)), complex(sympy.N(b))
    except (TypeError, ValueError):
        return False
    return abs(x - y) <= rel_tol * max(1.0, abs(x), abs(y))


def sympy_equiv(prediction: str, ground_truth: str, timeout_s: float | None = 5.0, rel_tol: float = 1e-6) -> bool:
    """Equivalence by the built-in LaTeX → sympy converter; tuples compare element by element."""
    pred_brackets, pred_inner = _unwrap(_clean(prediction))
    gold_brackets, gold_inner = _unwrap(_clean(ground_truth))
    pred_parts, gold_parts = _split_top_level(pred_inner), _split_top_level(gold_inner)
    if len(pred_parts) != len(gold_parts) or (len(gold_parts) > 1 and pred_brackets != gold_brackets):
        return False
    try:
        with _time_limit(timeout_s):
            return all(_values_equal(_to_sympy(p), _to_sympy(g), rel_tol) for p, g in zip(pred_parts, gold_parts))
    except _Timeout:
        logger.warning("sympy comparison timed out after %ss: %r vs %r", timeout_s, prediction, ground_truth)
        return False
    except Exception:  # unparsable text is simply not equal
        return False


# ---- public API --------------------------------------------------------------------------------------


def is_equiv(prediction: str | None, ground_truth: str, timeout_s: float | None = 5.0, backend: str = "auto") -> bool:
    """Whether ``prediction`` equals ``ground_truth`` mathematically.

    ``backend``: ``auto`` (math-verify, falling back to sympy when it is missing or parses nothing),
    ``math_verify`` or ``sympy``.
    """
    if backend not in ("auto", "math_verify", "sympy"):
        raise ValueError(f"math backend must be auto, math_verify or sympy, got {backend!r}")
    if prediction is None:
        return False
    ground_truth = gsm8k_final_answer(str(ground_truth))
    if _clean(prediction) == _clean(ground_truth):
        return True
    if backend in ("auto", "math_verify"):
        verdict = math_verify_equiv(prediction, ground_truth, timeout_s)
        if verdict is not None or backend == "math_verify":
            return bool(verdict)
    return sympy_equiv(prediction, ground_truth, timeout_s)


def grade(prediction: str, ground_truth: Any, timeout_s: float | None = 5.0, backend: str = "auto") -> dict[str, float]:
    """``acc``: equivalence; ``em``: identical after clean-up; ``f1``: ARPO's token F1. Max over answers."""
    answers = [gsm8k_final_answer(a) for a in qa.as_answer_list(ground_truth)]
    return {
        "acc": float(any(is_equiv(prediction, a, timeout_s, backend) for a in answers)),
        "em": float(any(_clean(prediction) == _clean(a) for a in answers)),
        "f1": qa.f1_score(prediction, answers),
    }


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    mode: str = "equiv",
    tool_bonus: float = 0.0,
    require_format: bool = True,
    timeout_s: float | None = 5.0,
    backend: str = "auto",
    protocol: ToolProtocol = DEFAULT_PROTOCOL,
) -> dict[str, Any]:
    """Math reward: −1 on bad format, else equivalence (``mode="equiv"``) or token F1 (``mode="f1"``).
    ``protocol``: the run's tool tags for the format gate (the registry passes them)."""
    if mode not in MATH_MODES:
        raise ValueError(f"math mode must be one of {MATH_MODES}, got {mode!r} (reward.math_mode)")
    answers = qa.as_answer_list(ground_truth)
    return score_with_gate(
        solution_str,
        lambda pred: grade(pred, answers, timeout_s, backend),
        extra_info=extra_info,
        tool_bonus=tool_bonus,
        require_format=require_format,
        score_key="acc" if mode == "equiv" else "f1",
        protocol=protocol,
    )
