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

from typing import TYPE_CHECKING

import torch

from arpo.batch import DataBatch
from arpo.trainer.tree_packing import pack_micro_batch, unique_token_count

if TYPE_CHECKING:
    from arpo.trainer.fsdp_worker import ActorWorker


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


def forward_tokens(worker: "ActorWorker", micro: DataBatch) -> tuple[int, int]:
    """(token positions ``worker``'s forward runs for ``micro``, real tokens among them): a packed tree runs its
    unique tokens, all real; else rows x width, the width being the longest row's tokens in the fast (left-aligned)
    layout and the batch's full width in the exact one, of which the tokens of rows not marked ``is_pad`` are real.
    A shared system prompt (``share_prefix``) is counted once per row."""
    if worker.packs_trees(micro) and (group := pack_micro_batch(micro)) is not None:
        return group.unique_tokens, group.unique_tokens
    attn = micro["attention_mask"]
    width = int(row_tokens(attn).max()) if worker.settings.fast_layout else attn.shape[1]
    real = attn if "is_pad" not in micro.tensors else attn[micro["is_pad"] == 0]
    return len(micro) * width, int(real.sum())


def update_padding(workers: list["ActorWorker"], shares: list[DataBatch]) -> dict[str, float]:
    """The micro-batches the update runs on each rank's share (``workers[r]`` is rank r, without a model: only its
    config and layout are read), cut as :func:`arpo.trainer.actor_update.ppo_update` cuts them, one epoch: their
    count per rank (dummy ones included), the token positions they run and how many of those are padding (pad
    columns, pad rows, a rank's dummy micro-batches: no real row's token)."""
    from arpo.trainer.actor_update import mini_batch_indices

    p = workers[0].cfg.policy
    max_tokens = int(p.ppo_max_token_len_per_gpu) if p.use_dynamic_bsz else None
    per_rank = []  # per rank, per mini-batch: (the mini-batch, its micro-batches)
    for worker, share in zip(workers, shares):
        mini_rows = int(share.meta.get("mini_batch_rows_per_rank",
                                       max(1, worker.cfg.mini_batch_rows // worker.world_size)))
        minis = [share.index(rows) for rows in mini_batch_indices(share, mini_rows)]
        per_rank.append([(mb, [mb.index(m) for m in worker.micro_batches(mb, int(p.ppo_micro_batch_size_per_gpu),
                                                                         max_tokens)]) for mb in minis])
    run = real = 0
    counts = [0] * len(workers)
    for m in range(len(per_rank[0])):
        most = max(len(r[m][1]) for r in per_rank)  # every rank runs as many forwards as the busiest
        for rank, (worker, minis) in enumerate(zip(workers, per_rank)):
            mb, micros = minis[m]
            counts[rank] += most
            for micro in micros:
                r, t = forward_tokens(worker, micro)
                run, real = run + r, real + t
            run += (most - len(micros)) * forward_tokens(worker, worker.dummy_micro_batch(mb))[0]
    return {"micro_batches_per_rank": counts, "tokens_run": run, "padding_tokens": run - real,
            "padding_fraction": round((run - real) / max(run, 1), 4)}
