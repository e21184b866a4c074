"""The ARPO format gate and tool bonus shared by the agentic rewards (deep_research, qa, math, synthetic).

A response is well formed when, reading its tags in order:

- ``<think>…</think>`` blocks are balanced, never nested, and there is at least one;
- every tool call (``<search>``, ``<python>``, or the tags of the loaded tools' :class:`~arpo.protocol.ToolProtocol`
  when one is given) is closed and followed, with only whitespace between, by a ``<result>…</result>`` block
  (the rollout appends `` <result>\\n…\\n</result>`` right after the call);
- there is exactly one ``<answer>…</answer>``, outside any ``<think>``, with no other tag inside, and
  it holds a ``\\boxed{…}`` with balanced braces.

With a protocol in the ``hermes`` format (``actor_rollout_ref.rollout.arpo.tools.format: hermes``) a tool call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (valid JSON, a string name, an object of arguments)
followed by its ``<tool_response>…</tool_response>``, with only whitespace and chat-template markup (``<|im_end|>``,
``<|im_start|>``, the role name ``user``, which remain when special tokens are skipped) between them; a
``<tool_response>`` without a call before it is the model's own tool output. The ARPO tags ``<search>``… are then
plain text. A call of a tool name that is not loaded is well formed (the rollout answered it with an error
text) but counts for no tool.

Tool results are external text, so tags inside a ``<result>`` (``<tool_response>``) block are not read as the
model's tags.
The text graded is the response only: a chat template that ends the *prompt* with ``<think>`` leaves the
response starting inside a think block, which fails the gate here as in the official code.

Deliberate differences from the official ARPO reward (``verl/utils/reward_score/deep_research.py``),
each of which the official check lets through or gets wrong:

1. it counts tags anywhere, including inside tool results (a web page quoting ``<think>`` breaks it);
2. it only checks that *some* ``<result>`` comes later, not that the call's own result follows it;
3. a ``<result>`` the model wrote itself (no call before it — a hallucinated tool output) passes;
4. ``</think><think>`` nesting/order is not checked, only counts;
5. ``\\boxed{`` plus any ``}`` in the answer passes, even with unbalanced braces;
6. the +0.1 bonus is granted when the strings ``</search>`` and ``</python>`` merely occur in the text;
   here it needs at least one real call of each tool that got a result (non-empty query and result;
   when ``extra_info["tool_calls"]`` carries the rollout's record, calls marked ``error`` do not count);
7. an answer in the ``\\boxed <text>`` form (a space, no braces) is graded there as the text up to the first
   ``$`` (and wins over a later ``\\boxed{}``); here only a complete ``\\boxed{…}`` is an answer;
8. an empty list of ground truths scores 0 there; here it raises (a dataset fault, not a wrong answer).

``reward.deep_research_variant: released`` (:mod:`reward_fns.released_reward`) reproduces the released reward
exactly, all eight included, for runs that must match it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from arpo.protocol import DEFAULT_PROTOCOL, HERMES_CALL_CLOSE, HERMES_CALL_OPEN, RESERVED_TAGS, RESULT_CLOSE, \
    RESULT_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN, ToolProtocol, extract_answer, extract_boxed

#: Score for a badly formatted response (ARPO's).
BAD_FORMAT_SCORE = -1.0


#: what a chat template writes between a hermes call and its tool response (the turn change), special tokens
#: kept or skipped
_TURN_MARKUP = re.compile(r"(?:\s|<\|[A-Za-z_]+\|>|\b(?:user|tool|ipython)\b)*")


@lru_cache(maxsize=16)
def _patterns(protocol: ToolProtocol) -> tuple[re.Pattern, re.Pattern | None]:
    """Every tag the gate reads, and a tool call followed by its result (None without tools)."""
    if protocol.format == "hermes":
        tag_re = re.compile(r"<(/?)(" + "|".join(map(re.escape, (*RESERVED_TAGS, "tool_call", "tool_response")))
                            + r")>")
        lenient = re.compile(re.escape(HERMES_CALL_OPEN) + r"(.*?)" + re.escape(HERMES_CALL_CLOSE)
                             + _TURN_MARKUP.pattern + re.escape(TOOL_RESPONSE_OPEN) + r"(.*?)"
                             + re.escape(TOOL_RESPONSE_CLOSE), re.S)
        return tag_re, lenient
    tool_tags = list(protocol.tags.values())
    tag_re = re.compile(r"<(/?)(" + "|".join(map(re.escape, (*RESERVED_TAGS, *tool_tags))) + r")>")
    lenient = re.compile(
        r"<(" + "|".join(map(re.escape, tool_tags)) + r")>(.*?)</\1>\s*" + re.escape(RESULT_OPEN) + r"(.*?)"
        + re.escape(RESULT_CLOSE),
        re.S,
    ) if tool_tags else None
    return tag_re, lenient


@dataclass(frozen=True)
class ToolUse:
    """One tool call in the text together with the result the rollout appended (``tool``: the tool's name)."""

    tool: str
    query: str
    result: str


@dataclass(frozen=True)
class FormatCheck:
    """Outcome of :func:`check_format`: ``answer`` is the boxed content when ``ok``."""

    ok: bool
    reason: str
    answer: str | None = None
    tool_uses: tuple[ToolUse, ...] = ()


def check_format(text: str, protocol: ToolProtocol = DEFAULT_PROTOCOL) -> FormatCheck:
    """Validate an ARPO response (see the module docstring for the rules) whose tool calls use ``protocol``'s
    tags; never raises."""

    def bad(reason: str) -> FormatCheck:
        return FormatCheck(False, reason)

    tag_re = _patterns(protocol)[0]
    uses: list[ToolUse] = []
    in_think = False
    n_think = 0
    answer_start: int | None = None
    answer_body: str | None = None
    pos = 0
    while (m := tag_re.search(text, pos)) is not None:
        closing, name = m.group(1) == "/", m.group(2)
        pos = m.end()
        if answer_start is not None and not (closing and name == "answer"):
            return bad(f"<{m.group(1)}{name}> inside <answer>")
        if name == "think":
            if closing and not in_think:
                return bad("</think> without an open <think>")
            if not closing and in_think:
                return bad("nested <think>")
            in_think = not closing
            n_think += not closing
        elif name == "answer":
            if closing:
                if answer_start is None:
                    return bad("</answer> without <answer>")
                answer_body, answer_start = text[answer_start: m.start()], None
            else:
                if answer_body is not None:
                    return bad("more than one <answer>")
                if in_think:
                    return bad("<answer> inside an open <think>")
                answer_start = m.end()
        elif name in ("result", "tool_response"):
            return bad(f"</{name}> without <{name}>" if closing
                       else f"<{name}> without a tool call before it (the model wrote its own tool output)")
        elif name == "tool_call":
            if closing:
                return bad("</tool_call> without <tool_call>")
            use = _hermes_use(text, m.end(), tag_re)
            if isinstance(use, str):
                return bad(use)
            uses.append(use[0])
            pos = use[1]
        else:
            if closing:
                return bad(f"</{name}> without <{name}>")
            tool = protocol.tool_of_tag(name)
            close_tag = protocol.pair(tool)[1]
            end = text.find(close_tag, m.end())
            if end < 0:
                return bad(f"<{name}> call is never closed")
            query = text[m.end(): end]
            if tag_re.search(query):
                return bad(f"tag inside a <{name}> call")
            after_call = end + len(close_tag)
            rest = text[after_call:]
            if not rest.lstrip().startswith(RESULT_OPEN):
                return bad(f"<{name}> call is not followed by its <result>")
            result_start = after_call + (len(rest) - len(rest.lstrip())) + len(RESULT_OPEN)
            result_end = text.find(RESULT_CLOSE, result_start)
            if result_end < 0:
                return bad("<result> is never closed")
            uses.append(ToolUse(tool, query.strip(), text[result_start:result_end].strip()))
            pos = result_end + len(RESULT_CLOSE)
    if answer_start is not None:
        return bad("<answer> is never closed")
    if in_think:
        return bad("<think> is never closed")
    if n_think == 0:
        return bad("no <think> block")
    if answer_body is None:
        return bad("no <answer> block")
    boxed = extract_boxed(answer_body)
    if boxed is None:
        return bad("<answer> has no complete \\boxed{}")
    return FormatCheck(True, "ok", boxed, tuple(uses))


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(tool name, its arguments as JSON text, "" when none) of a hermes call's body; None when it is not a JSON
    object with a string name and an object of arguments (the rollout's parser's rules)."""
    try:
        obj = json.loads(body)
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args) if args else ""


def _hermes_use(text: str, start: int, tag_re: re.Pattern) -> tuple[ToolUse, int] | str:
    """The hermes call whose body starts at ``start`` and its tool response, with where the response ends; or
    the reason it is not well formed."""
    end = text.find(HERMES_CALL_CLOSE, start)
    if end < 0:
        return "<tool_call> call is never closed"
    body = text[start:end]
    if tag_re.search(body):
        return "tag inside a <tool_call> call"
    call = _hermes_call(body)
    if call is None:
        return "<tool_call> is not a JSON object with a string name and object arguments"
    after_call = _TURN_MARKUP.match(text, end + len(HERMES_CALL_CLOSE)).end()
    if not text.startswith(TOOL_RESPONSE_OPEN, after_call):
        return "<tool_call> call is not followed by its <tool_response>"
    result_start = after_call + len(TOOL_RESPONSE_OPEN)
    result_end = text.find(TOOL_RESPONSE_CLOSE, result_start)
    if result_end < 0:
        return "<tool_response> is never closed"
    return ToolUse(call[0], call[1], text[result_start:result_end].strip()), result_end + len(TOOL_RESPONSE_CLOSE)


def lenient_tool_uses(text: str, protocol: ToolProtocol = DEFAULT_PROTOCOL) -> tuple[ToolUse, ...]:
    """Tool calls immediately followed by a result, found without requiring the whole text to be valid."""
    lenient = _patterns(protocol)[1]
    if lenient is None:
        return ()
    if protocol.format == "hermes":
        return tuple(ToolUse(*call, m.group(2).strip()) for m in lenient.finditer(text)
                     if (call := _hermes_call(m.group(1))) is not None)
    return tuple(ToolUse(protocol.tool_of_tag(m.group(1)), m.group(2).strip(), m.group(3).strip())
                 for m in lenient.finditer(text))


def count_real_tool_calls(uses: tuple[ToolUse, ...], extra_info: dict[str, Any] | None = None,
                          protocol: ToolProtocol = DEFAULT_PROTOCOL) -> dict[str, int]:
    """Per tool of ``protocol``, the calls that really ran: the rollout's record when given, else calls with
    query and result."""
    counts = {name: 0 for name in protocol.names}
    record = (extra_info or {}).get("tool_calls")
    if record is not None:
        for call in record:
            name = call.get("tool") if isinstance(call, dict) else None
            if name in counts and not call.get("error", False):
                counts[name] += 1
        return counts
    for use in uses:
        if use.query and use.result and use.tool in counts:  # a hermes call may name a tool that is not loaded
            counts[use.tool] += 1
    return counts


def score_with_gate(
    solution_str: str,
    grade: Callable[[str], dict[str, float]],
    extra_info: dict[str, Any] | None = None,
    tool_bonus: float = 0.0,
    require_format: bool = True,
    bad_format_score: float = BAD_FORMAT_SCORE,
    score_key: str = "acc",
    protocol: ToolProtocol = DEFAULT_PROTOCOL,
) -> dict[str, Any]:
    """Gate, grade, bonus: the shape every agentic reward here shares.

    ``grade(answer)`` returns ``acc``, ``em`` and ``f1``; the score is the one named by ``score_key``.
    Bad format scores ``bad_format_score`` with all metrics 0 unless ``require_format`` is False (then
    the last boxed answer is graded anyway — useful for evaluation). ``tool_bonus`` is added when
    that metric is > 0 and every tool of ``protocol`` really ran (by default: search and python, ARPO's).
    """
    check = check_format(solution_str, protocol)
    answer = check.answer if check.ok else (None if require_format else extract_answer(solution_str))
    uses = check.tool_uses if check.ok else lenient_tool_uses(solution_str, protocol)
    counts = count_real_tool_calls(uses, extra_info, protocol)
    result: dict[str, Any] = {
        "score": 0.0, "acc": 0.0, "em": 0.0, "f1": 0.0, "format_ok": float(check.ok),
        "format_reason": check.reason, "answer": answer or "", "num_search": counts.get("search", 0),
        "num_python": counts.get("python", 0), "tool_bonus": 0.0,
    }
    if not check.ok and require_format:
        result["score"] = float(bad_format_score)
        return result
    if answer is not None:
        result.update({k: float(v) for k, v in grade(answer).items()})
    correctness = result[score_key]
    bonus = tool_bonus if correctness > 0 and all(counts.get(t, 0) > 0 for t in protocol.names) else 0.0
    result["tool_bonus"] = float(bonus)
    result["score"] = correctness + bonus
    return result


#: Keys every built-in reward returns (so batch diagnostics line up across data sources).
RESULT_KEYS = ("score", "acc", "em", "f1", "format_ok", "format_reason", "answer", "num_search", "num_python",
               "tool_bonus")
