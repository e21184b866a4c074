"""A prompt group's trajectory tree as one sequence: every shared token once (shared-prefix training).

In an ARPO group of M trajectories the prompt is shared by all M, and a branch shares its parent's first
``branch_pos`` response tokens. Unpacked, the actor's forward computes those tokens M times. Packed, the
sequence holds the prompt, then each row's own tokens (the ones after its fork point); a tree attention mask
lets every token see exactly the tokens before it in its own trajectory, and its position id is its position
there, so each token's hidden state (and log-prob) is the unpacked one. Per-row log-probs are then gathered
from the packed tokens, so any loss over rows (soft or hard advantage, clipping, KL) is unchanged; gradients of
a shared token sum over the rows sharing it, as they would unpacked.

In the actor (``actor_rollout_ref.model.tree_packing``) a micro-batch is one tree: the rows of a rank's share
with the same ``tree_id`` (the prompt group) and the same prompt, packed and run in one forward. A row whose
parent is not in the micro-batch (the tree was split) is packed as a root: less sharing, the same result.

An SDPA model switched to :mod:`arpo.trainer.tree_attention` (the actor does this) attends segment by segment
and never computes a masked-out pair; other models take the dense mask (tokens x tokens, built here either
way: it is the reference the tests compare with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from arpo.batch import DataBatch
from arpo.trainer.logprobs import DEFAULT_CHUNK_SIZE, ChunkedResponseHead, head_swapped
from arpo.trainer.tree_attention import TREE_SDPA, TreeSegment, tree_segments

logger = logging.getLogger(__name__)

#: largest packed tree run as one sequence: its dense mask is tokens² bytes (256 MiB here); a bigger tree is
#: run in micro-batches of rows, each packed on its own (FlexAttention block masks would lift this)
MAX_PACKED_TOKENS = 16384

#: tensor columns the worker group adds for the ranks: group id, row id in the batch, parent's row id, fork point
TREE_COLUMNS = ("tree_id", "tree_row", "tree_parent", "tree_branch_pos")


@dataclass
class PackedGroup:
    """One group's packed tokens and where each row's response tokens live in them."""

    input_ids: torch.Tensor      # (L,) prompt, then every row's own response tokens
    position_ids: torch.Tensor   # (L,) each token's position in its own trajectory
    allowed: torch.Tensor        # (L, L) bool: query token may attend to key token
    pred_index: torch.Tensor     # (L,) packed index of the token before each token in its trajectory (-1: none)
    row_index: torch.Tensor      # (rows, T) packed index of row r's response token t (-1 past its end)
    prompt_len: int
    #: the same tree as attention segments: what :mod:`arpo.trainer.tree_attention` computes instead of the mask
    segments: list[TreeSegment]

    @property
    def unique_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack_group(prompt_ids: list[int], responses: list[list[int]], parent: list[int],
               branch_pos: list[int]) -> PackedGroup:
    """Pack one group: ``parent[r]`` is the group-local row ``r`` forked from (-1: a root), ``branch_pos[r]`` the
    response tokens it copies from that parent (they must be equal: checked)."""
    n, p_len = len(responses), len(prompt_ids)
    if not p_len:
        raise ValueError("pack_group: the prompt is empty")
    tokens, positions, owner = list(prompt_ids), list(range(p_len)), [-1] * p_len
    paths: list[list[int] | None] = [None] * n
    own_range, context = [(0, 0)] * n, [[]] * n  # each row's own packed tokens, and what they see before them

    def path(r: int, seen: tuple[int, ...] = ()) -> list[int]:
        if paths[r] is not None:
            return paths[r]
        if r in seen:
            raise ValueError(f"pack_group: rows {seen + (r,)} form a cycle of parents")
        p, bp = parent[r], branch_pos[r]
        shared: list[int] = []
        if p >= 0:
            if bp > len(responses[p]) or responses[r][:bp] != responses[p][:bp]:
                raise ValueError(f"pack_group: row {r} does not share its first {bp} response tokens with row {p}")
            shared = path(p, seen + (r,))[:bp]
        own = list(range(len(tokens), len(tokens) + len(responses[r]) - len(shared)))
        own_range[r], context[r] = (len(tokens), len(tokens) + len(own)), list(range(p_len)) + shared
        tokens.extend(responses[r][len(shared):])
        positions.extend(range(p_len + len(shared), p_len + len(responses[r])))
        owner.extend([r] * len(own))
        paths[r] = shared + own
        return paths[r]

    for r in range(n):
        path(r)
    size = len(tokens)
    allowed = torch.zeros(size, size, dtype=torch.bool)
    allowed[:p_len, :p_len] = torch.tril(torch.ones(p_len, p_len, dtype=torch.bool))
    pred = torch.full((size,), -1, dtype=torch.long)
    pred[1:p_len] = torch.arange(p_len - 1)
    for r in range(n):
        full = list(range(p_len)) + paths[r]
        for t, q in enumerate(paths[r]):
            if owner[q] == r:  # each packed token's context is its owner's path up to it
                allowed[q, full[: p_len + t + 1]] = True
                pred[q] = full[p_len + t - 1]
    width = max((len(r) for r in responses), default=0)
    row_index = torch.full((n, max(width, 1)), -1, dtype=torch.long)
    for r in range(n):
        row_index[r, : len(paths[r])] = torch.tensor(paths[r], dtype=torch.long)
    return PackedGroup(torch.tensor(tokens, dtype=torch.long), torch.tensor(positions, dtype=torch.long), allowed,
                       pred, row_index, p_len, tree_segments(p_len, own_range, context))


def tree_columns(batch: DataBatch) -> dict[str, torch.Tensor]:
    """:data:`TREE_COLUMNS` from a collated batch's ``group_index`` / ``parent_index`` / ``branch_pos`` (a batch
    without them: every row its own group, a root). Row ids are positions in ``batch``, so they survive any
    reordering and splitting of the rows."""
    n = len(batch)
    nt = batch.non_tensors
    col = lambda key, default: torch.as_tensor(np.asarray(nt[key], dtype=np.int64)) if key in nt else default  # noqa: E731
    return {"tree_id": col("group_index", torch.arange(n)), "tree_row": torch.arange(n),
            "tree_parent": col("parent_index", torch.full((n,), -1, dtype=torch.long)),
            "tree_branch_pos": col("branch_pos", torch.zeros(n, dtype=torch.long))}


def _prompt_key(batch: DataBatch, row: int) -> tuple[int, ...]:
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return tuple(batch["input_ids"][row, :width][batch["attention_mask"][row, :width].bool()].tolist())


def tree_micro_batches(batch: DataBatch) -> list[torch.Tensor]:
    """Row indices of each tree in ``batch`` (rows with the same ``tree_id`` and prompt), pad rows left out, in
    order of first appearance: the packed layout's micro-batches."""
    pads = batch["is_pad"].bool().tolist() if "is_pad" in batch.tensors else [False] * len(batch)
    trees: dict[tuple, list[int]] = {}
    for i, tree in enumerate(batch["tree_id"].tolist()):
        if not pads[i]:
            trees.setdefault((tree, _prompt_key(batch, i)), []).append(i)
    return [torch.tensor(rows, dtype=torch.long) for rows in trees.values()]


def unique_token_count(batch: DataBatch, rows: list[int]) -> int:
    """Tokens of ``rows`` (one tree) once packed: the longest prompt, then each row's response after its fork
    from a parent among ``rows``."""
    width = batch["responses"].shape[1]
    attn = batch["attention_mask"]
    present = {int(batch["tree_row"][i]) for i in rows}
    total = max(int(attn[i, :-width].sum()) for i in rows)
    for i in rows:
        shared = int(batch["tree_branch_pos"][i]) if int(batch["tree_parent"][i]) in present else 0
        total += max(0, int(attn[i, -width:].sum()) - shared)
    return total


def packed_token_counts(batch: DataBatch) -> tuple[int, int]:
    """(tokens once every prompt group's tree is packed, tokens of the rows as they are) of a collated batch."""
    trees = DataBatch({**batch.tensors, **tree_columns(batch)}, {}, {})
    packed = sum(unique_token_count(trees, t.tolist()) for t in tree_micro_batches(trees))
    return packed, int(batch["attention_mask"].sum())


def pack_micro_batch(micro: DataBatch) -> PackedGroup | None:
    """The rows of ``micro`` (one tree, one prompt) packed, or None when they are not in the collated layout
    the packing assumes (a row's tokens not contiguous, positions not counting from 0)."""
    width = micro["responses"].shape[1]
    attn, pos = micro["attention_mask"].bool(), micro["position_ids"]
    prompt = _prompt_key(micro, 0)
    row_of = {int(r): i for i, r in enumerate(micro["tree_row"].tolist())}
    responses, parent, branch_pos = [], [], []
    for i in range(len(micro)):
        real = attn[i].nonzero()[:, 0]
        n_resp = int(attn[i, -width:].sum())
        if (real.numel() and int(real[-1] - real[0]) + 1 != real.numel()) or _prompt_key(micro, i) != prompt \
                or not torch.equal(pos[i, real], torch.arange(real.numel())) or (n_resp and not attn[i, -width]):
            return None
        responses.append(micro["responses"][i, :n_resp].tolist())
    for i in range(len(micro)):
        p = row_of.get(int(micro["tree_parent"][i]), -1)
        bp = int(micro["tree_branch_pos"][i]) if p >= 0 else 0
        if p >= 0 and (bp > len(responses[p]) or responses[i][:bp] != responses[p][:bp]):
            logger.warning("tree packing: row %d does not share its first %d tokens with its parent; packed as "
                           "a root", int(micro["tree_row"][i]), bp)
            p, bp = -1, 0
        parent.append(p)
        branch_pos.append(bp)
    return pack_group(list(prompt), responses, parent, branch_pos)


def _attention_mask(model: nn.Module, allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The tree mask as the model's attention takes a 4-D mask: boolean for sdpa, additive otherwise."""
    if getattr(model.config, "_attn_implementation", "sdpa") == "sdpa":
        return allowed[None, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def packed_logprobs_and_entropy(model: nn.Module, group: PackedGroup, response_length: int,
                                head_mask: torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                                temperature: float = 1.0, calc_entropy: bool = False, entropy_grad: bool = True,
                                head_fp32: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`arpo.trainer.logprobs.compute_logprobs_and_entropy` for one packed group: (log-probs, entropy or
    None), (rows, ``response_length``) each, from one forward. A packed token shared by several rows is
    projected to the vocabulary once; ``head_mask`` (rows, ``response_length``) limits that projection to
    tokens some row needs (0 elsewhere)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head; pass a causal LM (e.g. Qwen2ForCausalLM)")
    dev = next(model.parameters()).device
    rows, width = group.row_index.shape
    if width > response_length:
        raise ValueError(f"a packed row has {width} response tokens, more than response_length={response_length}")
    row_index = group.row_index.to(dev)
    in_row = row_index >= 0
    if head_mask is not None:
        in_row = in_row & head_mask[:, :width].bool().to(dev)
    response = torch.arange(group.prompt_len, group.unique_tokens, device=dev)
    slot = (row_index - group.prompt_len).clamp(min=0)
    needed = torch.zeros(response.numel(), dtype=torch.bool, device=dev)
    needed[slot[in_row]] = True
    ids = group.input_ids.to(dev)
    chunked = ChunkedResponseHead(head, ids[response][None], needed[None], group.pred_index.to(dev)[response][None],
                                  chunk_size, temperature, calc_entropy, entropy_grad, head_fp32)
    if getattr(model.config, "_attn_implementation", None) == TREE_SDPA:  # each segment against its own keys
        attention = {"tree_segments": [seg.to(dev) for seg in group.segments]}
    else:
        attention = {"attention_mask": _attention_mask(model, group.allowed.to(dev), torch.float32)}
    with head_swapped(model, chunked):
        out = model(input_ids=ids[None], position_ids=group.position_ids.to(dev)[None], use_cache=False,
                    **attention)
    packed = (out.logits if hasattr(out, "logits") else out[0])[0]  # (response tokens, [log-prob, entropy])
    per_row = torch.where(in_row[..., None], packed[slot], torch.zeros((), dtype=packed.dtype, device=dev))
    per_row = torch.nn.functional.pad(per_row, (0, 0, 0, response_length - width))
    return per_row[..., 0], (per_row[..., 1] if calc_entropy else None)


def packed_response_logprobs(model: nn.Module, group: PackedGroup, temperature: float = 1.0,
                             chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Log-probs (rows, T) of each row's response tokens from one forward over the packed group (0 past a row's
    end); equal to the unpacked forward's up to float rounding."""
    width = group.row_index.shape[1]
    return packed_logprobs_and_entropy(model, group, width, chunk_size=chunk_size, temperature=temperature)[0]
