"""Per-step training metrics under verl's names, so dashboards and notebooks written for verl read ours.

``perf/packed_token_ratio`` is the batch's tokens once each prompt group's tree is packed over its tokens as rows.
``critic/score`` is the sequence score from the reward functions, ``critic/rewards`` the token-level reward after
any KL-in-reward penalty, ``critic/advantages``, ``critic/returns`` and (with a critic) ``critic/values`` are over
response tokens with mask 1; ``critic/vf_explained_var`` is 1 - var(returns - values) / var(returns).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from arpo.batch import DataBatch
from arpo.trainer.tree_packing import packed_token_counts


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def compute_data_metrics(batch: DataBatch) -> dict[str, float]:
    t = batch.tensors
    mask = t["response_mask"].bool()
    metrics: dict[str, float] = {}
    if "token_level_scores" in t:
        metrics.update(_stats("critic/score", t["token_level_scores"].sum(-1)))
    if "token_level_rewards" in t:
        metrics.update(_stats("critic/rewards", t["token_level_rewards"].sum(-1)))
    if "advantages" in t:
        metrics.update(_stats("critic/advantages", t["advantages"][mask]))
    if "returns" in t:
        metrics.update(_stats("critic/returns", t["returns"][mask]))
    if "values" in t and "returns" in t and mask.sum() > 1:  # PPO with a critic (verl's formulas)
        values, returns = t["values"][mask].float(), t["returns"][mask].float()
        metrics.update(_stats("critic/values", values))
        metrics["critic/vf_explained_var"] = (1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)).item()
    response_len = t["attention_mask"][:, -t["responses"].shape[1]:].sum(-1)
    prompt_len = t["attention_mask"][:, : t["prompts"].shape[1]].sum(-1)
    max_resp = batch.meta.get("max_response_length", t["responses"].shape[1])
    max_prompt = batch.meta.get("max_prompt_length", t["prompts"].shape[1])
    metrics.update(_stats("response_length", response_len))
    metrics["response_length/clip_ratio"] = (response_len >= max_resp).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_len))
    metrics["prompt_length/clip_ratio"] = (prompt_len >= max_prompt).float().mean().item()
    metrics["response_length/model_tokens_mean"] = mask.sum(-1).float().mean().item()
    if "group_index" in batch.non_tensors:  # what tree packing saves the actor (actor_rollout_ref.model.tree_packing)
        packed, total = packed_token_counts(batch)
        metrics["perf/packed_token_ratio"] = packed / max(1, total)
    return metrics


class Timer:
    """Collects ``timing_s/<name>`` for the phases of one step."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, num_tokens: int | None = None) -> dict[str, float]:
        out = {f"timing_s/{k}": v for k, v in self.timings.items()}
        if num_tokens is not None and self.timings.get("step"):
            out["perf/total_num_tokens"] = float(num_tokens)
            out["perf/throughput"] = num_tokens / self.timings["step"]
        return out
