"""Attention over a packed tree that computes only what the tree mask allows.

A packed group (:mod:`arpo.trainer.tree_packing`) is the prompt, then each row's own tokens. With a dense tree
mask, SDPA computes every query against every key of the sequence and throws most of it away: on a 2-core CPU the
masked attention was 45% of a packed update of SmolLM2's trees (torch.profiler), more than all the matmuls. Here
each *segment* — the prompt, or one row's own tokens — attends to its keys only: the prompt causally to
itself, a row's tokens to its context (the prompt and the ancestors' tokens it shares) and causally to
themselves. The work is the sum over rows of (own tokens x path length) instead of (group tokens)².

It is an attention implementation of transformers (``attn_implementation`` :data:`TREE_SDPA`): a model set to
it runs plain SDPA unless the forward passes ``tree_segments``, so every other forward (padded rows, lone rows,
the engine) is unchanged. The segments travel as a forward keyword, which gradient checkpointing keeps for the
recompute.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

import torch

logger = logging.getLogger(__name__)

TREE_SDPA = "arpo_tree_sdpa"


@dataclass
class TreeSegment:
    """Queries ``start:end`` of the packed sequence and the packed indices of the keys they attend to."""

    start: int
    end: int
    #: the context's keys then the segment's own (None: the segment attends causally to itself only)
    keys: torch.Tensor | None = None
    #: (queries, keys) bool: the whole context, then causal within the segment (None with ``keys``)
    mask: torch.Tensor | None = None

    def to(self, device: torch.device) -> "TreeSegment":
        if self.keys is None:
            return self
        return TreeSegment(self.start, self.end, self.keys.to(device), self.mask.to(device))


def tree_segments(prompt_len: int, own: list[tuple[int, int]], context: list[list[int]]) -> list[TreeSegment]:
    """The segments of a packed group: the prompt ``0:prompt_len``, then each row's own tokens ``own[r]`` (a
    range of packed indices) with ``context[r]``, the packed indices its first own token sees before itself
    (ascending: the prompt, then the shared tokens of its ancestors). Rows without own tokens are skipped; the
    segments must tile the sequence."""
    segments = [TreeSegment(0, prompt_len)]
    for (start, end), ctx in sorted(zip(own, context)):
        if end <= start:
            continue
        n = end - start
        keys = torch.tensor(list(ctx) + list(range(start, end)), dtype=torch.long)
        mask = torch.cat([torch.ones(n, len(ctx), dtype=torch.bool), torch.ones(n, n, dtype=torch.bool).tril()], 1)
        segments.append(TreeSegment(start, end, keys, mask))
    for before, after in zip(segments, segments[1:]):
        if before.end != after.start:
            raise ValueError(f"tree segments do not tile the packed sequence: {before.end} then {after.start}")
    return segments


@torch.compiler.disable  # segments differ per batch: traced, each batch's loop would be a new graph
def tree_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        tree_segments: list[TreeSegment] | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, segment by segment when ``tree_segments`` is given (batch of one packed
    group; ``attention_mask`` is then ignored). Returns (batch, queries, heads, head_dim) as SDPA does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree_segments is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"tree attention takes one packed group per forward (batch {query.shape[0]})")
    out = []
    for seg in tree_segments:
        q = query[:, :, seg.start:seg.end]
        if seg.keys is None:
            k, v, mask = key[:, :, seg.start:seg.end], value[:, :, seg.start:seg.end], None
        else:
            k, v, mask = key.index_select(2, seg.keys), value.index_select(2, seg.keys), seg.mask[None, None]
        out.append(sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)[0])
    return torch.cat(out, dim=1), None


def use_tree_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA model to :data:`TREE_SDPA` (registered with transformers on first use); True if it now
    uses it. Other implementations (eager, flash) are left as they are: packed forwards then use the dense
    mask."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == TREE_SDPA:
        return True
    if current != "sdpa":
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:  # a transformers without pluggable attention: the dense mask still works
        logger.warning("tree attention unavailable (%s); packed trees use the dense mask", err)
        return False
    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)
    model.set_attn_implementation(TREE_SDPA)
    return model.config._attn_implementation == TREE_SDPA
