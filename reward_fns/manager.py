"""Score a batch of responses in parallel, and place the scores into verl's token-level reward tensor.

Parallelism: ``executor="process"`` runs rewards in a persistent pool of worker processes —
sympy and math-verify hold the GIL, so threads do not speed them up, and math-verify's time limits need
a main thread; ``"thread"`` suits light rewards (time limits are then off); ``"serial"`` (or
``num_workers <= 1``) runs in the calling process. ``"auto"`` (default) decides per batch: serial when every
row routes to a light family of the registry (:data:`~reward_fns.registry.LIGHT_FAMILIES`: string and number
checks, microseconds a row, where starting the pool's spawned processes costs seconds), else the process pool.
The compute_score function must pickle for the process pool: registry snapshots and
:class:`~reward_fns.registry.FileRewardFn` do, lambdas do not.

**A reward function that raises** scores ``error_score`` (default 0.0) for that row, its message goes
into the row's ``error`` diagnostic and a warning is logged; the batch carries on. Why 0 and not the −1
of bad format: an exception is a fault of the grader (an unusual ground truth, a sympy crash), not of
the policy. −1 would push the policy away from whatever answer form tripped the bug, which may be a
correct one; 0 is what any unrewarded answer gets, so the row only loses credit. ``reward/errors`` in
the aggregated metrics shows how many rows this hit.

A worker process that dies (OOM, a native crash) breaks the whole pool: the unfinished chunks are retried
once in a fresh pool; rows still unscored then get ``error_score`` and an ``error``, and if no chunk could
be scored at all the batch raises (usually a spawn script missing its ``if __name__ == "__main__":``).
"""

from __future__ import annotations

import logging
import multiprocessing
import traceback
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from tqdm import tqdm

from reward_fns.overlong import OverlongBuffer
from reward_fns.registry import LIGHT_FAMILIES, RewardFn, RewardRegistry, build_compute_score, config_value

if TYPE_CHECKING:  # torch is imported lazily: reward worker processes never need it
    import torch

logger = logging.getLogger(__name__)

#: One row to score: (data_source, solution_str, ground_truth, extra_info).
RewardItem = tuple[str, str, Any, "dict[str, Any] | None"]

EXECUTORS = ("auto", "process", "thread", "serial")
POSITIONS = ("last_valid", "last_model_token")
_MAX_LOGGED_ERRORS = 5


def score_one(compute_score: RewardFn, item: RewardItem, error_score: float = 0.0) -> dict[str, Any]:
    """Score one row; never raises. Returns a dict with ``score`` (float) and the reward's diagnostics."""
    data_source, solution_str, ground_truth, extra_info = item
    try:
        out = compute_score(data_source, solution_str, ground_truth, extra_info)
        if isinstance(out, dict):
            if "score" not in out:
                raise ValueError(f"reward for data_source={data_source!r} returned a dict without 'score': "
                                 f"keys {sorted(out)}")
            row = dict(out)
            row["score"] = float(row["score"])
        else:
            row = {"score": float(out)}
    except Exception as exc:
        row = {"score": float(error_score), "error": f"{type(exc).__name__}: {exc}",
               "traceback": traceback.format_exc(limit=4)}
    return row


def _score_chunk(compute_score: RewardFn, items: list[RewardItem], error_score: float) -> list[dict[str, Any]]:
    return [score_one(compute_score, item, error_score) for item in items]


@dataclass
class RewardBatchResult:
    """Per-row scores and diagnostics of a batch, and batch-level metrics (``reward/...``)."""

    scores: list[float]
    rows: list[dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)

    def extra_info_lists(self) -> dict[str, list[Any]]:
        """verl's ``reward_extra_info``: key → per-row values (None where a row lacks the key)."""
        keys = sorted({k for row in self.rows for k in row if k != "traceback"})
        return {k: [row.get(k) for row in self.rows] for k in keys}


def aggregate_diagnostics(rows: Sequence[dict[str, Any]], data_sources: Sequence[str]) -> dict[str, float]:
    """Means of every numeric diagnostic, score mean per data source, and the error count."""
    metrics: dict[str, float] = {}
    keys = sorted({k for row in rows for k, v in row.items() if _is_number(v)})
    for key in keys:
        values = [float(row[key]) for row in rows if _is_number(row.get(key))]
        if values:
            metrics[f"reward/{key}/mean"] = float(np.mean(values))
    for source in sorted(set(data_sources)):
        values = [row["score"] for row, s in zip(rows, data_sources) if s == source]
        metrics[f"reward/{source}/score/mean"] = float(np.mean(values))
    metrics["reward/errors"] = float(sum("error" in row for row in rows))
    return metrics


def _is_number(v: Any) -> bool:
    return isinstance(v, (bool, int, float, np.integer, np.floating, np.bool_))


class RewardManager:
    """Scores batches of (data_source, solution_str, ground_truth, extra_info) with one compute_score."""

    def __init__(
        self,
        compute_score: RewardFn | None = None,
        num_workers: int = 4,
        executor: str = "auto",
        error_score: float = 0.0,
        mp_start_method: str = "spawn",
        show_progress: bool = False,
        position: str = "last_valid",
        overlong: OverlongBuffer | None = None,
    ):
        if position not in POSITIONS:
            raise ValueError(f"reward.position must be one of {POSITIONS}, got {position!r}")
        if executor not in EXECUTORS:
            raise ValueError(f"reward.executor must be one of {EXECUTORS}, got {executor!r}")
        if num_workers < 1:
            raise ValueError(f"reward.num_workers must be >= 1, got {num_workers}")
        self.compute_score = compute_score if compute_score is not None else build_compute_score(None)
        self.num_workers = num_workers
        self.executor_kind = "serial" if num_workers == 1 else executor
        self.error_score = float(error_score)
        self.mp_start_method = mp_start_method
        self.show_progress = show_progress
        #: where build_token_level_rewards puts the score (see its docstring)
        self.position = position
        #: DAPO's overlong shaping, added to the score on the reward token (off by default)
        self.overlong = overlong or OverlongBuffer()
        self._pool: Executor | None = None

    @classmethod
    def from_config(cls, config: Any) -> "RewardManager":
        """Build from a config holding ``custom_reward_function`` and ``reward`` (configs/reward.yaml)."""
        options = config_value(config, "reward") or {}

        def opt(key: str, default: Any) -> Any:
            value = config_value(options, key)
            return default if value is None else value

        return cls(build_compute_score(config), num_workers=int(opt("num_workers", 4)),
                   executor=str(opt("executor", "auto")), error_score=float(opt("error_score", 0.0)),
                   mp_start_method=str(opt("mp_start_method", "spawn")),
                   show_progress=bool(opt("show_progress", False)), position=str(opt("position", "last_valid")),
                   overlong=OverlongBuffer.from_config(config_value(options, "overlong_buffer"),
                                                       config_value(config_value(config, "data"), "max_response_length")))

    def _get_pool(self) -> Executor:
        if self._pool is None:
            if self.executor_kind in ("process", "auto"):
                ctx = multiprocessing.get_context(self.mp_start_method)
                self._pool = ProcessPoolExecutor(self.num_workers, mp_context=ctx)
            else:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="reward")
        return self._pool

    def score(self, items: Sequence[RewardItem]) -> RewardBatchResult:
        """Score every row (order kept); rows whose reward raised carry ``error`` and ``error_score``.

        Raises KeyError before scoring anything when a data_source has no registered reward.
        """
        items = [tuple(item) for item in items]
        for i, item in enumerate(items):
            if len(item) != 4:
                raise ValueError(f"reward item {i} has {len(item)} fields; expected "
                                 f"(data_source, solution_str, ground_truth, extra_info)")
        families = None
        if isinstance(self.compute_score, RewardRegistry):
            # an unrouted data_source is a configuration error: fail the batch, don't score it 0 silently
            families = {self.compute_score.lookup(source).family for source in {str(item[0]) for item in items}}
        if self._executor_for(families) == "serial" or len(items) <= 1:
            rows = [score_one(self.compute_score, item, self.error_score)
                    for item in tqdm(items, desc="rewards", disable=not self.show_progress)]
        else:
            rows = self._score_parallel(items)
        data_sources = [str(item[0]) for item in items]
        self._log_errors(rows, data_sources)
        return RewardBatchResult([row["score"] for row in rows], rows, aggregate_diagnostics(rows, data_sources))

    def _executor_for(self, families: set[str] | None) -> str:
        """The executor for a batch whose rows route to the registry's ``families`` (None: not the registry):
        ``auto`` is serial when they are all light."""
        if self.executor_kind != "auto":
            return self.executor_kind
        return "serial" if families is not None and families <= LIGHT_FAMILIES else "process"

    def _score_parallel(self, items: list[RewardItem]) -> list[dict[str, Any]]:
        # a few chunks per worker: balances uneven rows without paying IPC per row
        n_chunks = min(len(items), self.num_workers * 4)
        bounds = np.linspace(0, len(items), n_chunks + 1).astype(int)
        chunks = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        results: list[list[dict[str, Any]] | None] = [None] * len(chunks)
        with tqdm(total=len(items), desc="rewards", disable=not self.show_progress) as bar:
            for _attempt in range(2):  # a dead worker breaks the whole pool: retry its chunks once in a new one
                todo = [i for i, r in enumerate(results) if r is None]
                if not todo:
                    break
                pool = self._get_pool()
                futures = {i: pool.submit(_score_chunk, self.compute_score, chunks[i], self.error_score) for i in todo}
                broken = False
                for i, future in futures.items():
                    try:
                        results[i] = future.result()
                    except BrokenProcessPool:  # a worker died (OOM, a crash in a native library)
                        broken = True
                        continue
                    except Exception as exc:  # e.g. compute_score or a result that does not pickle
                        results[i] = [{"score": self.error_score, "error": f"{type(exc).__name__}: {exc}"}
                                      for _ in chunks[i]]
                    bar.update(len(chunks[i]))
                if broken:
                    self.close()
        dead = [i for i, r in enumerate(results) if r is None]
        if len(dead) == len(chunks):
            raise RuntimeError(
                "every reward worker process died, twice. With mp_start_method=spawn a script must start "
                "training under `if __name__ == '__main__':`; otherwise check memory, or set "
                "reward.executor=thread / reward.num_workers=1 to score in this process")
        rows: list[dict[str, Any]] = []
        for i, chunk in enumerate(chunks):
            rows.extend(results[i] if results[i] is not None
                        else [{"score": self.error_score, "error": "reward worker process died"} for _ in chunk])
        return rows

    def _log_errors(self, rows: list[dict[str, Any]], data_sources: list[str]) -> None:
        errors = [(i, row) for i, row in enumerate(rows) if "error" in row]
        for i, row in errors[:_MAX_LOGGED_ERRORS]:
            logger.warning("reward for row %d (data_source=%r) failed, scored %s: %s\n%s", i, data_sources[i],
                           row["score"], row["error"], row.get("traceback", ""))
        if len(errors) > _MAX_LOGGED_ERRORS:
            logger.warning("%d more reward rows failed in this batch", len(errors) - _MAX_LOGGED_ERRORS)

    def close(self) -> None:
        """Shut the worker pool down (a later call to score starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def decode_response_texts(batch: Any, tokenizer: Any) -> list[str]:
    """Each row's response text for the reward functions: the valid (attention 1) response tokens, special
    tokens skipped, as verl decodes them."""
    responses = batch["responses"]
    prompt_len = batch["prompts"].shape[1]
    valid_len = batch["attention_mask"][:, prompt_len: prompt_len + responses.shape[1]].sum(dim=1)
    return [tokenizer.decode(responses[i, : int(valid_len[i])].tolist(), skip_special_tokens=True)
            for i in range(responses.shape[0])]


def build_token_level_rewards(
    batch: Any,
    response_texts: Sequence[str] | None,
    manager: RewardManager,
    tokenizer: Any = None,
    data_source_key: str = "data_source",
    position: str | None = None,
) -> tuple["torch.Tensor", RewardBatchResult]:
    """verl's reward tensor for an :class:`arpo.batch.DataBatch`: zeros shaped like ``responses`` with each
    row's score on one token.

    ``position="last_valid"`` (verl's NaiveRewardManager) puts it on the last response token with
    attention 1; ``"last_model_token"`` on the last token with ``response_mask`` 1 (differs only when a
    response ends inside a tool result, e.g. truncated). An empty response gets its score on column 0
    so group statistics (GRPO sums each row) still see it; no token of that row is trained anyway.

    Ground truths come from ``reward_model["ground_truth"]``, data sources from ``data_source_key``,
    ``extra_info`` from the dataset column, with the row's own ``tool_calls`` record added (dataset
    extra_info is per prompt; tool use is per response). ``response_texts`` are the decoded responses;
    pass None and a ``tokenizer`` to decode here (skipping special tokens, as verl does).
    ``position`` defaults to the manager's.
    """
    position = position or manager.position
    import torch

    if position not in POSITIONS:
        raise ValueError(f"reward position must be one of {POSITIONS}, got {position!r}")
    responses = batch["responses"]
    n, r_len = responses.shape
    prompt_len = batch["prompts"].shape[1]
    response_attention = batch["attention_mask"][:, prompt_len: prompt_len + r_len]
    valid_len = response_attention.sum(dim=1)
    if response_texts is None:
        if tokenizer is None:
            raise ValueError("build_token_level_rewards needs response_texts or a tokenizer to decode responses")
        response_texts = decode_response_texts(batch, tokenizer)
    if len(response_texts) != n:
        raise ValueError(f"{len(response_texts)} response texts for a batch of {n} rows")
    for key in (data_source_key, "reward_model"):
        if key not in batch.non_tensors:
            raise KeyError(f"batch has no non-tensor column {key!r}; collate with group_fields={{{key!r}: ...}}")
    extra_col = batch.non_tensors.get("extra_info")
    tool_col = batch.non_tensors.get("tool_calls")
    items: list[RewardItem] = []
    for i in range(n):
        extra = dict(extra_col[i]) if extra_col is not None and extra_col[i] is not None else {}
        if tool_col is not None and tool_col[i] is not None:
            extra["tool_calls"] = list(tool_col[i])
        reward_model = batch.non_tensors["reward_model"][i]
        if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
            raise ValueError(f"row {i}: reward_model must be a dict with 'ground_truth', got {reward_model!r}")
        items.append((str(batch.non_tensors[data_source_key][i]), response_texts[i], reward_model["ground_truth"],
                      extra or None))
    result = manager.score(items)
    rewards = torch.zeros((n, r_len), dtype=torch.float32)
    mask = batch.tensors.get("response_mask") if position == "last_model_token" else None
    shaped = list(result.scores)
    if manager.overlong.enable:
        penalty = manager.overlong.penalty(valid_len)
        shaped = [s + float(p) for s, p in zip(shaped, penalty)]
        result.metrics["reward/overlong/fraction"] = float((penalty < 0).float().mean())
        result.metrics["reward/overlong/penalty_mean"] = float(penalty.mean())
    for i, score in enumerate(shaped):
        col = int(valid_len[i]) - 1
        if mask is not None:
            model_cols = torch.nonzero(mask[i, : max(col + 1, 0)]).flatten()
            if len(model_cols):
                col = int(model_cols[-1])
        rewards[i, max(col, 0)] = score
    return rewards, result
