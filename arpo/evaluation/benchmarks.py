"""Benchmark files as evaluation items: ``<data_dir>/<bench>/test.jsonl`` and verl parquet files.

JSONL rows are ``{"question": ..., "answer": ...}`` with the answer a string, a number or a list of
acceptable strings. The released files are not uniform, so the question is read from the first of
``question``, ``problem``, ``Question`` (AIME25 and MATH use ``problem``, GAIA ``Question``); GSM8K's
``#### 42`` solutions are left as they are (the math reward reads the number after ``####``). A row's
``Level`` (GAIA) is kept as ``level`` so tables can split a benchmark by level.

Parquet files are verl rows (``data_source``, ``prompt`` chat messages, ``reward_model.ground_truth``,
``extra_info``), e.g. the synthetic benchmark's test split. Their own messages are used unless
``eval.parquet_prompt`` names a prompt type, which then replaces the system message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from arpo.data.jsonl import json_lines

logger = logging.getLogger(__name__)

QUESTION_KEYS = ("question", "problem", "Question")
#: parquet file stems too generic to name a benchmark; the folder name is used instead
GENERIC_STEMS = {"test", "val", "valid", "validation", "train", "dev"}


@dataclass
class EvalItem:
    """One question of one benchmark, ready to prompt and to grade."""

    benchmark: str
    index: int
    question: str
    ground_truth: Any
    data_source: str
    messages: list[dict[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)


def _question(row: Mapping[str, Any], where: str) -> str:
    for key in QUESTION_KEYS:
        value = row.get(key)
        if isinstance(value, str) and value.strip():
            return value
    raise ValueError(f"{where}: no question; expected one of the keys {list(QUESTION_KEYS)}")


def _plain(value: Any) -> Any:
    """numpy arrays/scalars from parquet into JSON-friendly Python values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load_jsonl_benchmark(path: str | Path, benchmark: str, prompt: str, data_source: str | None = None,
                         limit: int | None = None) -> list[EvalItem]:
    """The first ``limit`` rows of a ``test.jsonl`` file, prompted with the system prompt ``prompt``."""
    path = Path(path)
    items: list[EvalItem] = []
    with path.open(encoding="utf-8") as f:
        # stop at the limit before reading on: a broken line past it is not this call's error
        rows = json_lines(f, path, "a test.jsonl file has one object a line") if limit is None or limit > 0 else ()
        for line_no, row in rows:
            where = f"{path}:{line_no}"
            if "answer" not in row:
                raise ValueError(f"{where}: no 'answer' key (a string or a list of acceptable answers)")
            question = _question(row, where)
            meta = {"level": row["Level"]} if "Level" in row else {}
            items.append(EvalItem(
                benchmark=benchmark, index=len(items), question=question, ground_truth=_plain(row["answer"]),
                data_source=data_source or benchmark,
                messages=[{"role": "system", "content": prompt}, {"role": "user", "content": question}],
                meta=meta,
            ))
            if limit is not None and len(items) >= limit:
                break
    return items


def parquet_benchmark_name(path: str | Path) -> str:
    p = Path(path)
    return p.parent.name if p.stem.lower() in GENERIC_STEMS else p.stem


def load_parquet_benchmark(path: str | Path, benchmark: str, system: str | None = None,
                           data_source: str | None = None, limit: int | None = None) -> list[EvalItem]:
    """verl-format rows: their chat messages (system message replaced by ``system`` when given, e.g.
    :func:`arpo.evaluation.prompts.system_prompt`), their ``data_source`` unless ``data_source`` overrides it,
    ``reward_model.ground_truth``."""
    import pandas as pd

    df = pd.read_parquet(path)
    missing = [c for c in ("prompt", "reward_model") if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a verl parquet file (missing columns {missing})")
    if limit is not None:
        df = df.iloc[:limit]
    items: list[EvalItem] = []
    for i, row in enumerate(df.to_dict("records")):
        messages = [dict(m) for m in _plain(row["prompt"])]
        if system is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": system})
        users = [m["content"] for m in messages if m["role"] == "user"]
        extra = _plain(row.get("extra_info")) or {}
        question = extra.get("question") if isinstance(extra, Mapping) else None
        reward_model = _plain(row["reward_model"])
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError(f"{path} row {i}: reward_model has no ground_truth")
        source = data_source or row.get("data_source")
        if not source:
            raise ValueError(f"{path} row {i}: no data_source column; give one in eval.parquet_files "
                             f"({{path: ..., data_source: qa}})")
        items.append(EvalItem(
            benchmark=benchmark, index=i, question=question or (users[-1] if users else ""),
            ground_truth=reward_model["ground_truth"], data_source=str(source), messages=messages,
            meta={k: extra[k] for k in ("kind", "level") if isinstance(extra, Mapping) and k in extra},
        ))
    return items


def encode_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template the messages with the generation prompt, as the trainer's prompts are built."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]
