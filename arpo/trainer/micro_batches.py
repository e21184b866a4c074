"""How a rank's share of a batch is cut: PPO mini-batches, then the micro-batches each forward runs.

A micro-batch is ``ppo_micro_batch_size_per_gpu`` rows, or with dynamic batch size (verl's ``use_dynamic_bsz``
with ``ppo_max_token_len_per_gpu`` and ``log_prob_max_token_len_per_gpu``) rows packed up to a number of tokens.
ARPO trees mix 40-token and 400-token responses, so a fixed row count either wastes a forward on a few short rows
or runs out of memory on long ones. Rows are sorted longest first and packed greedily while the micro-batch's
*padded* size, its rows times its longest row's tokens (prompt + response, what the left-aligned forward of
:func:`arpo.trainer.logprobs.compute_logprobs_and_entropy` runs), stays within the budget; a row longer than the
budget runs alone. verl counts unpadded tokens because it runs without padding; counting the padded size bounds
the memory our padded forward takes, and sorting keeps the padding small, so the two differ little. The loss needs
nothing else: every micro-batch's loss is divided by the mini-batch's global token and row counts
(:func:`arpo.trainer.actor_update.global_batch_info`), so the gradient does not depend on how rows are grouped
(tests/trainer/test_dynamic_batching.py checks it to 1e-6 in float32). Ranks may get different numbers of
micro-batches; the update equalises them with :func:`dummy_micro_batch` forwards.
"""

from __future__ import annotations

import torch

from arpo.batch import DataBatch
from arpo.trainer.tree_packing import MAX_PACKED_TOKENS, tree_micro_batches, unique_token_count


def split_rows(n: int, size: int) -> list[slice]:
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


def micro_batch_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row order that puts rows of similar length in the same micro-batch (longest first).

    Each micro-batch runs only as wide as its longest row (:func:`arpo.trainer.logprobs.left_align`), so
    grouping by length removes most padding compute. Sums over micro-batches depend on the order only
    through rounding."""
    return torch.argsort(attention_mask.sum(dim=1), descending=True, stable=True)


def mini_batch_indices(batch: DataBatch, mini_rows: int) -> list[torch.Tensor]:
    """Row indices of each PPO mini-batch of this rank's share: by ``mini_batch_id`` when the worker group dealt
    whole trees (shares of uneven size), else consecutive runs of ``mini_rows`` rows."""
    if "mini_batch_id" in batch.tensors:
        ids = batch["mini_batch_id"]
        return [(ids == i).nonzero()[:, 0] for i in torch.unique(ids).tolist()]
    return [torch.arange(len(batch))[sl] for sl in split_rows(len(batch), mini_rows)]


def row_tokens(attention_mask: torch.Tensor) -> torch.Tensor:
    """Real tokens (prompt + response) of each row."""
    return attention_mask.sum(dim=1)


def pack_by_tokens(rows: torch.Tensor, lengths: torch.Tensor, max_tokens: int) -> list[torch.Tensor]:
    """``rows`` (indices) grouped into micro-batches of at most ``max_tokens`` padded tokens, longest rows first.

    ``lengths[i]`` is the token count of ``rows[i]``. Greedy over the rows sorted by length (descending, stable):
    a micro-batch takes the next row while (its rows + 1) x its first (longest) row's length fits the budget; a
    row longer than the budget is a micro-batch of its own."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(rows) == 0:
        return []
    order = torch.argsort(lengths, descending=True, stable=True)
    rows, widths = rows[order], lengths[order].tolist()
    micros, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or (i - start + 1) * max(int(widths[start]), 1) > max_tokens:
            micros.append(rows[start:i])
            start = i
    return micros


def plan_micro_batches(batch: DataBatch, micro_size: int, max_tokens: int | None = None, *, pack_trees: bool,
                       fast_layout: bool) -> list[torch.Tensor]:
    """Row indices of each micro-batch: one tree each when packing trees (pad rows left out; a tree over
    MAX_PACKED_TOKENS in runs of ``micro_size`` rows; one-row trees, which share nothing, together in runs of
    ``micro_size`` rows after the trees), else ``micro_size`` rows (of similar length in the fast layout).
    ``max_tokens`` (dynamic batch size): rows packed up to that many padded tokens instead of ``micro_size``
    rows; a tree stays whole up to min(MAX_PACKED_TOKENS, max_tokens) packed tokens, a bigger one and the
    one-row trees are packed by the budget."""
    def runs(rows: torch.Tensor) -> list[torch.Tensor]:
        if max_tokens is not None:
            return pack_by_tokens(rows, row_tokens(batch["attention_mask"][rows]), max_tokens)
        return [rows[sl] for sl in split_rows(len(rows), micro_size)]

    if pack_trees:
        cap = MAX_PACKED_TOKENS if max_tokens is None else min(MAX_PACKED_TOKENS, max_tokens)
        trees = tree_micro_batches(batch)
        micros = [m for rows in trees if len(rows) > 1
                  for m in ([rows] if unique_token_count(batch, rows.tolist()) <= cap else runs(rows))]
        # one forward per lone row would leave a GPU idle; their micro-batch runs padded (pack_micro_batch
        # declines rows with different prompts)
        lone = torch.cat([rows for rows in trees if len(rows) == 1] or [torch.zeros(0, dtype=torch.long)])
        if fast_layout:
            lone = lone[micro_batch_order(batch["attention_mask"][lone])]
        return micros + runs(lone)
    order = micro_batch_order(batch["attention_mask"]) if fast_layout else torch.arange(len(batch))
    return runs(order)


def dummy_micro_batch(batch: DataBatch) -> DataBatch:
    """The first row cut to its prompt and first response token: a forward (and a zero-loss backward) that joins
    the other ranks' collectives and changes nothing."""
    d = batch.index([0])
    width = d["responses"].shape[1]
    attn = d["attention_mask"].clone()
    attn[0, -width:] = 0
    attn[0, -width] = 1
    return DataBatch({**d.tensors, "attention_mask": attn, "response_mask": attn[:, -width:].clone(),
                      "position_ids": torch.clamp(torch.cumsum(attn, dim=1) - 1, min=0)}, {}, dict(d.meta))
