"""Token-budget micro-batches (verl's ``use_dynamic_bsz`` with ``ppo_max_token_len_per_gpu`` and
``log_prob_max_token_len_per_gpu``): rows packed up to a number of tokens instead of a number of rows.

ARPO trees mix 40-token and 400-token responses, so a fixed row count either wastes a forward on a few short
rows or runs out of memory on long ones. Rows are sorted longest first and packed greedily while the
micro-batch's *padded* size, its rows times its longest row's tokens (prompt + response, what the left-aligned
forward of :func:`arpo.trainer.logprobs.compute_logprobs_and_entropy` runs), stays within the budget; a row longer
than the budget runs alone. verl counts unpadded tokens because it runs without padding; counting the padded
size bounds the memory our padded forward takes, and sorting keeps the padding small, so the two differ little.

The loss needs nothing else: every micro-batch's loss is divided by the mini-batch's global token and row counts
(:func:`arpo.trainer.actor_update.global_batch_info`), so the gradient does not depend on how rows are grouped
(tests/trainer/test_dynamic_batching.py checks it to 1e-6 in float32). Ranks may get different numbers of
micro-batches; the update equalises them as for trees (``ActorWorker.micro_batch_count``).
"""

from __future__ import annotations

import torch


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
