"""What the update's micro-batches cost: the token positions each forward runs and how many of them are padding
(pad columns, pad rows, a rank's dummy micro-batches), for the layout benchmark and the dynamic-batching tests.
How a share is cut into micro-batches is :mod:`arpo.trainer.micro_batches`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from arpo.batch import DataBatch
from arpo.trainer.micro_batches import dummy_micro_batch, mini_batch_indices, row_tokens
from arpo.trainer.tree_packing import pack_micro_batch

if TYPE_CHECKING:
    from arpo.trainer.fsdp_worker import ActorWorker


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
            run += (most - len(micros)) * forward_tokens(worker, dummy_micro_batch(mb))[0]
    return {"micro_batches_per_rank": counts, "tokens_run": run, "padding_tokens": run - real,
            "padding_fraction": round((run - real) / max(run, 1), 4)}
