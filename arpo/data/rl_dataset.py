"""RL prompts from verl-format parquet or plain JSONL, and a dataloader that resumes at the exact batch it stopped at.

Rows (verl's format): ``prompt`` (chat messages), ``data_source``, ``reward_model`` ({ground_truth, style}),
``extra_info``, optionally ``ability`` and ``agent_name``. Each prompt is rendered with the tokenizer's chat
template (generation prompt appended) and tokenized once at load; prompts longer than
``data.max_prompt_length`` are dropped (``filter_overlong_prompts``) or truncated / rejected per
``data.truncation``.

A ``.jsonl`` file (one JSON object a line) is mapped to these columns by :func:`jsonl_rows`: ``prompt`` (chat
messages or a string) or ``question`` (a string) becomes the user message (``system``, optional, a system message
before it), ``answer`` the ``reward_model`` ground truth; ``data_source`` defaults to the file's stem (``gsm8k.jsonl``
→ ``gsm8k``, which picks the reward); other keys are kept as columns. ``examples/jsonl_dataset/`` is an example.

A batch is a list of row dicts: ``raw_prompt_ids`` (token ids), ``raw_prompt`` (messages), ``index`` (row in
the filtered dataset) and every other dataset column (``data_source``, ``reward_model``, ``extra_info`` …).
The order of epoch ``e`` is a permutation seeded by ``(data.seed, e)``, so the loader's whole state is
``(epoch, batch_index)`` and :meth:`StatefulPromptLoader.load_state_dict` replays the exact next batch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from arpo.data.jsonl import json_lines

logger = logging.getLogger(__name__)

TRUNCATIONS = ("error", "left", "right")


def to_python(value: Any) -> Any:
    """Parquet values (numpy arrays of dicts, numpy scalars) as plain Python lists, dicts and scalars."""
    if isinstance(value, np.ndarray):
        return [to_python(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: to_python(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def jsonl_rows(path: Path, prompt_key: str = "prompt") -> list[dict[str, Any]]:
    """The rows of a JSONL file in verl's layout (module docstring); a line without a prompt or an answer is one
    error naming the file, line and the keys it has."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, raw in json_lines(f, path, "a .jsonl data file has one object a line"):
            where = f"{path}:{n}"
            if not isinstance(raw, dict):
                raise ValueError(f"{where}: not a JSON object; a .jsonl data file has one object a line")
            row = dict(raw)
            prompt = row.pop(prompt_key, None)
            question = row.pop("question", None)
            system = row.pop("system", None)
            answer = row.pop("answer", None)
            if prompt is None and question is None:
                raise ValueError(f"{where}: no {prompt_key!r} (chat messages or text) or 'question' key; keys: "
                                 f"{sorted(raw)}")
            if "reward_model" not in row and answer is None:
                raise ValueError(f"{where}: no 'answer' (or verl's 'reward_model') key; keys: {sorted(raw)}")
            text = prompt if prompt is not None else question
            messages = text if isinstance(text, list) else [{"role": "user", "content": str(text)}]
            if system is not None and not isinstance(text, list):
                messages = [{"role": "system", "content": str(system)}, *messages]
            row[prompt_key] = messages
            row.setdefault("data_source", path.stem)
            row.setdefault("reward_model", {"ground_truth": answer, "style": "rule"})
            extra = dict(row.get("extra_info") or {})
            extra.setdefault("index", len(rows))
            if question is not None or isinstance(prompt, str):
                extra.setdefault("question", str(question if question is not None else prompt))
            row["extra_info"] = extra
            rows.append(row)
    return rows


def read_data_file(path: Path, prompt_key: str = "prompt") -> Any:
    """One data file as a DataFrame: verl-format parquet, or JSONL mapped to that layout."""
    import pandas as pd

    if path.suffix == ".jsonl":
        return pd.DataFrame(jsonl_rows(path, prompt_key))
    return pd.read_parquet(path)


class RLDataset:
    """The prompts of one or more parquet / JSONL files, chat-templated and tokenized (see the module docstring)."""

    def __init__(self, files: str | Sequence[str], tokenizer: Any, max_prompt_length: int,
                 prompt_key: str = "prompt", filter_overlong_prompts: bool = True, truncation: str = "error",
                 apply_chat_template_kwargs: dict | None = None):
        import pandas as pd

        if truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={truncation!r} is not valid; choose one of: {', '.join(TRUNCATIONS)}")
        paths = [Path(f) for f in ([files] if isinstance(files, (str, Path)) else files)]
        if not paths:
            raise ValueError("no data files given: set data.train_files / data.val_files to parquet or .jsonl paths")
        frames = []
        for p in paths:
            if not p.exists():
                from arpo.data.release import missing_file_hint

                raise FileNotFoundError(f"data file {p} does not exist{missing_file_hint(p)}: check data.train_files "
                                        f"/ data.val_files")
            frames.append(read_data_file(p, prompt_key))
        df = pd.concat(frames, ignore_index=True)
        if prompt_key not in df.columns:
            raise ValueError(f"{[str(p) for p in paths]} have no column {prompt_key!r} (data.prompt_key); "
                             f"columns: {list(df.columns)}")
        self.columns = [c for c in df.columns if c != prompt_key]
        messages = [to_python(m) for m in df[prompt_key]]
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False,
                                               **(apply_chat_template_kwargs or {})) for m in messages]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

        self.rows: list[dict[str, Any]] = []
        dropped = 0
        for i, (m, tok) in enumerate(zip(messages, ids)):
            if len(tok) > max_prompt_length:
                if filter_overlong_prompts:
                    dropped += 1
                    continue
                if truncation == "error":
                    raise ValueError(f"row {i} of {[str(p) for p in paths]}: prompt has {len(tok)} tokens > "
                                     f"data.max_prompt_length={max_prompt_length}; raise it, or set "
                                     f"data.filter_overlong_prompts=true or data.truncation=left|right")
                tok = tok[-max_prompt_length:] if truncation == "left" else tok[:max_prompt_length]
            row = {c: to_python(df[c].iat[i]) for c in self.columns}
            row["raw_prompt"] = m
            row["raw_prompt_ids"] = list(tok)
            row["index"] = len(self.rows)
            self.rows.append(row)
        if dropped:
            logger.info("dropped %d of %d prompts longer than data.max_prompt_length=%d", dropped, len(df),
                        max_prompt_length)
        if not self.rows:
            raise ValueError(f"no prompts left in {[str(p) for p in paths]} after filtering to "
                             f"data.max_prompt_length={max_prompt_length}")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.rows[i]

    def select(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at ``indices`` (shallow copies, so a consumer may add keys)."""
        return [dict(self.rows[i]) for i in indices]


class StatefulPromptLoader:
    """Batches of ``batch_size`` prompts, epoch after epoch, with an exact ``state_dict`` /
    ``load_state_dict``. Iterating yields the rest of the current epoch, then moves to the next."""

    def __init__(self, dataset: RLDataset, batch_size: int, shuffle: bool = True, seed: int = 1,
                 drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({len(dataset)} "
                             f"prompts after filtering); lower it or add data")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_index = 0  # next batch within the epoch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return len(self)

    def all_rows(self) -> list[dict[str, Any]]:
        """Every row in dataset order (validation)."""
        return self.dataset.select(range(len(self.dataset)))

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _batch(self, order: np.ndarray, b: int) -> list[dict[str, Any]]:
        return self.dataset.select(order[b * self.batch_size:(b + 1) * self.batch_size].tolist())

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        order = self._order(self.epoch)
        while self.batch_index < len(self):
            b = self.batch_index
            # Advance before yielding: a checkpoint taken while the consumer holds batch b resumes at b + 1.
            self.batch_index += 1
            yield self._batch(order, b)
        self.epoch += 1
        self.batch_index = 0

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch, moving to the next epoch when this one is used up."""
        if self.batch_index >= len(self):
            self.epoch += 1
            self.batch_index = 0
        b = self.batch_index
        self.batch_index += 1
        return self._batch(self._order(self.epoch), b)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "num_prompts": len(self.dataset),
                "batch_size": self.batch_size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        changed = [k for k in ("num_prompts", "batch_size", "seed", "shuffle") if state.get(k) != mine[k]]
        if changed:
            raise ValueError("cannot resume the dataloader: " + ", ".join(
                f"{k} was {state.get(k)!r}, now {mine[k]!r}" for k in changed)
                + " (resume with the same data files and data.* settings, or set trainer.resume_mode=disable)")
        self.epoch = int(state["epoch"])
        self.batch_index = int(state["batch_index"])


def create_rl_dataloaders(cfg: Any, tokenizer: Any, tool_schemas: list[dict] | None = None
                          ) -> tuple[StatefulPromptLoader, StatefulPromptLoader | None]:
    """Train and validation loaders from the ``data.*`` keys (configs/trainer/data.yaml). ``tool_schemas``: the
    tools' OpenAI schemas, rendered into every prompt by the chat template (its tools block), for hermes calls."""
    from arpo.trainer.actor_config import cfg_get

    def files(key: str) -> list[str]:
        value = cfg_get(cfg, key)
        if value is None:
            return []
        return [str(value)] if isinstance(value, (str, Path)) else [str(v) for v in value]

    common = dict(max_prompt_length=int(cfg_get(cfg, "data.max_prompt_length", 1024)),
                  prompt_key=cfg_get(cfg, "data.prompt_key", "prompt"),
                  filter_overlong_prompts=bool(cfg_get(cfg, "data.filter_overlong_prompts", True)),
                  truncation=cfg_get(cfg, "data.truncation", "error"),
                  apply_chat_template_kwargs=dict(cfg_get(cfg, "data.apply_chat_template_kwargs", {}) or {}))
    if tool_schemas:
        common["apply_chat_template_kwargs"]["tools"] = list(tool_schemas)
    train_files = files("data.train_files")
    if not train_files:
        raise ValueError("data.train_files is not set: give one or more verl-format parquet or .jsonl files")
    train = StatefulPromptLoader(RLDataset(train_files, tokenizer, **common),
                                 batch_size=int(cfg_get(cfg, "data.gen_batch_size", None)
                                                or cfg_get(cfg, "data.train_batch_size", 1)),
                                 shuffle=bool(cfg_get(cfg, "data.shuffle", True)), seed=int(cfg_get(cfg, "data.seed", 1)),
                                 drop_last=True)
    val = None
    val_files = files("data.val_files")
    if val_files:
        val_ds = RLDataset(val_files, tokenizer, **common)
        val = StatefulPromptLoader(val_ds, batch_size=int(cfg_get(cfg, "data.val_batch_size", None) or len(val_ds)),
                                   shuffle=False, drop_last=False)
    return train, val
