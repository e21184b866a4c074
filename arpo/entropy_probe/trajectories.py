"""Trajectories the entropy probe reads: which tokens the model wrote and where each tool result ends.

Four sources, each read into :class:`Trajectory` (token ids of the whole sequence, a mask of the model-written
tokens, the tool results' positions):

* rollout dumps (``rl/rollouts/step_*.jsonl`` of a training run, ``experiments/dump_rollout_entropy.py``): rows
  of :func:`arpo.analysis.rollout_rows`. They keep the fork tree, the tool calls' response positions, the
  per-token entropy the rollout measured (the policy's own samples, at its sampling settings) and the token ids,
  so a model can also re-score them teacher-forced (dumps written before the ids were kept: recorded entropy only);
* evaluation records (``<run>/samples/<benchmark>.jsonl`` of ``python -m arpo.eval``): prompt and response text;
* SFT trajectories in OpenAI ``messages`` form (``assistant`` and ``tool`` roles) or ShareGPT form
  (``conversations`` with ``from``/``value``; ``gpt`` and ``tool``/``observation``/``function``).

Text is tokenised piece by piece (prompt, each model span, each result), as the rollout appends them, and the tag
protocol (:class:`arpo.protocol.ToolProtocol`: search and python's tags unless the run's tools are given) says which
pieces are results and which tool a result answers.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from arpo.protocol import DEFAULT_PROTOCOL, RESULT_CLOSE, RESULT_OPEN, THINK_CLOSE, ToolProtocol, format_tool_result

#: a tool result as the rollout appends it (format_tool_result: leading space, newlines around the text)
_RESULT_RE = re.compile(r"\s?" + re.escape(RESULT_OPEN) + r".*?" + re.escape(RESULT_CLOSE), re.S)
_ASSISTANT_ROLES = {"assistant", "gpt"}
_TOOL_ROLES = {"tool", "observation", "function", "ipython"}
_ROLE_NAMES = {"human": "user", "user": "user", "system": "system", "gpt": "assistant", "assistant": "assistant"}


@dataclass
class ToolResult:
    """One tool result: the tool (its call's tag), where the call starts and where the result starts and ends
    (positions in :attr:`Trajectory.ids`; ``end`` is the first position after the result)."""

    tool: str
    call_start: int
    start: int
    end: int


@dataclass
class Trajectory:
    """One sequence to probe. ``ids`` is None for a rollout row, which carries ``recorded`` entropy instead.
    ``own_from``: the first position that is this trajectory's own (a fork shares what precedes it with its
    parent); only results ending there or later, and control points there or later, are counted."""

    name: str
    model_mask: list[bool]
    results: list[ToolResult]
    ids: list[int] | None = None
    think_end: int | None = None
    recorded: list[float] | None = None
    own_from: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _tool_of(model_text: str, protocol: ToolProtocol) -> tuple[str, int | None]:
    """The tool whose close tag ends ``model_text`` last, and the character where its open tag starts."""
    best, at = "unknown", -1
    for name, (open_tag, close_tag) in protocol.pairs().items():
        close = model_text.rfind(close_tag)
        if close > at:
            best, at = name, close
    if best == "unknown":
        return best, None
    start = model_text.rfind(protocol.pair(best)[0], 0, at)
    return best, start if start >= 0 else None


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _token_at(offsets: list[tuple[int, int]], char: int) -> int:
    """Index of the first token whose span ends after ``char`` (the token holding it)."""
    for i, (_, end) in enumerate(offsets):
        if end > char:
            return i
    return len(offsets)


def from_pieces(name: str, tokenizer, prompt_ids: list[int], pieces: Iterable[tuple[str, str]],
                meta: dict[str, Any] | None = None, protocol: ToolProtocol = DEFAULT_PROTOCOL) -> Trajectory:
    """A trajectory from the prompt's ids and the response's pieces, ``("model", text)`` or ``("result", text)``
    (a result's full text, tags included). Each piece is tokenised on its own, as the rollout appends them;
    ``protocol``'s tags tell which tool each result answers."""
    ids, mask, results = list(prompt_ids), [False] * len(prompt_ids), []
    think_end, last_model = None, None  # last_model: (text, first position, offsets) of the latest model piece
    for kind, text in pieces:
        if not text:
            continue
        piece_ids, offsets = _encode(tokenizer, text)
        first = len(ids)
        if kind == "model":
            close = text.find(THINK_CLOSE)
            if think_end is None and close >= 0:
                think_end = first + _token_at(offsets, close + len(THINK_CLOSE) - 1) + 1
            last_model = (text, first, offsets)
        elif kind == "result":
            tool, call_start = "unknown", first
            if last_model is not None:
                tool, char = _tool_of(last_model[0], protocol)
                if char is not None:
                    call_start = last_model[1] + _token_at(last_model[2], char)
            results.append(ToolResult(tool, call_start, first, first + len(piece_ids)))
        else:
            raise ValueError(f"{name}: piece kind {kind!r} is neither 'model' nor 'result'")
        ids.extend(piece_ids)
        mask.extend([kind == "model"] * len(piece_ids))
    return Trajectory(name, mask, results, ids=ids, think_end=think_end, meta=meta or {})


def split_response(response: str) -> list[tuple[str, str]]:
    """A response text cut into model spans and tool results by the tag protocol."""
    pieces, pos = [], 0
    for m in _RESULT_RE.finditer(response):
        pieces += [("model", response[pos:m.start()]), ("result", m.group(0))]
        pos = m.end()
    return pieces + [("model", response[pos:])]


def _chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def from_messages(name: str, tokenizer, messages: list[dict[str, Any]],
                  protocol: ToolProtocol = DEFAULT_PROTOCOL) -> Trajectory:
    """OpenAI ``messages`` (or ShareGPT turns already renamed): the turns before the first assistant turn are the
    prompt (the chat template with the generation prompt), then assistant turns are model text and tool turns
    results (``content`` wrapped by :func:`arpo.protocol.format_tool_result` unless it already holds the tags)."""
    roles = [m.get("role") for m in messages]
    if not any(r in _ASSISTANT_ROLES for r in roles):
        raise ValueError(f"{name}: no assistant turn; a trajectory needs the model's own text "
                         f"(roles found: {sorted(set(map(str, roles)))})")
    first = next(i for i, r in enumerate(roles) if r in _ASSISTANT_ROLES)
    prompt = [{"role": _ROLE_NAMES.get(m["role"], m["role"]), "content": m["content"]} for m in messages[:first]]
    pieces: list[tuple[str, str]] = []
    for m in messages[first:]:
        text = str(m.get("content") or "")
        if m["role"] in _ASSISTANT_ROLES:
            pieces += split_response(text)
        elif m["role"] in _TOOL_ROLES:
            pieces.append(("result", text if RESULT_OPEN in text else format_tool_result(text)))
        else:
            raise ValueError(f"{name}: role {m['role']!r} after the first assistant turn; use 'assistant' or 'tool'")
    return from_pieces(name, tokenizer, _chat_prompt_ids(tokenizer, prompt), pieces, protocol=protocol)


def _think_end(tokenizer, response_ids: list[int]) -> int | None:
    """The response position right after the first ``</think>``: the shortest prefix whose text holds it (a
    prefix's text only grows, so a binary search over decodes finds it)."""
    if THINK_CLOSE not in tokenizer.decode(response_ids):
        return None
    lo, hi = 1, len(response_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_CLOSE in tokenizer.decode(response_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def from_rollout_row(name: str, row: dict[str, Any], tokenizer=None) -> Trajectory | None:
    """A rollout dump row: its recorded entropy and, where the row keeps its token ids, the ids (prompt then
    response) that a model can re-score teacher-forced; None for a row with neither. A fork's tokens before its
    ``branch_pos`` are its parent's: its events start there (the window before a fork's first result is the
    parent's, shared). With ``tokenizer`` and ids, the first ``</think>`` is found for its control."""
    entropy = row.get("token_entropy")
    has_ids = "prompt_ids" in row and "response_ids" in row
    if entropy is None and not has_ids:
        return None
    # positions are response positions in the row, sequence positions (prompt first) in a Trajectory with ids
    offset = len(row["prompt_ids"]) if has_ids else 0
    recorded = None if entropy is None else [math.nan] * offset + [math.nan if v is None else float(v)
                                                                  for v in entropy]
    if has_ids:
        mask = [False] * offset + [bool(m) for m in row["response_mask"]]
    else:
        mask = [not math.isnan(v) for v in recorded]
    own_from = offset + (int(row.get("branch_pos") or 0) if int(row.get("parent_index", -1)) >= 0 else 0)
    results = []
    for call in sorted(row.get("tool_calls") or [], key=lambda c: int(c["start"])):
        start, end = offset + int(call["start"]), offset + int(call["end"])
        # the call's own tokens are not marked in the row: the model tokens before the result stand for them
        results.append(ToolResult(str(call["tool"]), start, start, end))
    ids = [int(i) for i in row["prompt_ids"]] + [int(i) for i in row["response_ids"]] if has_ids else None
    think = _think_end(tokenizer, [int(i) for i in row["response_ids"]]) if has_ids and tokenizer is not None else None
    return Trajectory(name, mask, results, ids=ids, recorded=recorded, own_from=own_from,
                      think_end=None if think is None else offset + think, meta={"data_source": row.get("data_source")})


def _format_of(row: dict[str, Any]) -> str:
    if "tool_calls" in row and ("token_entropy" in row or "response_ids" in row):
        return "rollout"
    if "response" in row and "prompt" in row:
        return "eval"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    return "unknown"


def read_trajectories(path: str | Path, tokenizer=None, limit: int | None = None,
                      protocol: ToolProtocol = DEFAULT_PROTOCOL) -> list[Trajectory]:
    """Every trajectory of one JSONL file (or every ``*.jsonl`` of a folder, e.g. an eval run's ``samples/``),
    its format told by the first row's fields. ``tokenizer`` is needed for every format but rollout dumps;
    ``protocol``: the run's tool tags (rollout dumps name their tools themselves)."""
    path = Path(path)
    files = sorted(path.rglob("*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"{path}: no .jsonl files; give a trajectory file or a folder of them")
    out: list[Trajectory] = []
    for file in files:
        with file.open() as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for i, row in enumerate(rows):
            if limit is not None and len(out) >= limit:
                return out
            name, fmt = f"{file.stem}:{i}", _format_of(row)
            if fmt not in ("rollout", "unknown") and tokenizer is None:
                raise ValueError(f"{file}: {fmt} trajectories are text; give --model so that they can be tokenised")
            if fmt == "rollout":
                traj = from_rollout_row(name, row, tokenizer)
            elif fmt == "eval":
                prompt_ids = _encode(tokenizer, str(row["prompt"]))[0]
                traj = from_pieces(name, tokenizer, prompt_ids, split_response(str(row["response"])),
                                   meta={"data_source": row.get("data_source"), "benchmark": row.get("benchmark")},
                                   protocol=protocol)
            elif fmt == "messages":
                traj = from_messages(name, tokenizer, row["messages"], protocol)
            elif fmt == "sharegpt":
                turns = [{"role": t.get("from"), "content": t.get("value")} for t in row["conversations"]]
                traj = from_messages(name, tokenizer, turns, protocol)
            else:
                raise ValueError(f"{file}:{i + 1}: unknown trajectory format (fields {sorted(row)[:8]}); give rollout "
                                 f"rows (token_entropy, tool_calls), eval records (prompt, response), 'messages' or "
                                 f"'conversations'")
            if traj is not None:
                out.append(traj)
    return out
