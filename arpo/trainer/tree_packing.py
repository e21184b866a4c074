"""A prompt group's trajectory tree as one sequence: every shared token once (issue 24, shared-prefix training).

In an ARPO group of M trajectories the prompt is shared by all M, and a branch shares its parent's first
``branch_pos`` response tokens. Unpacked, the actor's forward computes those tokens M times. Packed, the
sequence holds the prompt, then each row's own tokens (the ones after its fork point); a tree attention mask
lets every token see exactly the tokens before it in its own trajectory, and its position id is its position
there, so each token's hidden state (and log-prob) is the unpacked one. Per-row log-probs are then gathered
from the packed tokens, so any loss over rows (soft or hard advantage, clipping, KL) is unchanged; gradients of
a shared token sum over the rows sharing it, as they would unpacked.

The mask is dense (tokens x tokens) here: right for the CPU-sized groups this repository trains; FlexAttention
block masks are the way to 30k-token groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from arpo.trainer.logprobs import DEFAULT_CHUNK_SIZE, logprobs_from_logits


@dataclass
class PackedGroup:
    """One group's packed tokens and where each row's response tokens live in them."""

    input_ids: torch.Tensor      # (L,) prompt, then every row's own response tokens
    position_ids: torch.Tensor   # (L,) each token's position in its own trajectory
    allowed: torch.Tensor        # (L, L) bool: query token may attend to key token
    pred_index: torch.Tensor     # (L,) packed index of the token before each token in its trajectory (-1: none)
    row_index: torch.Tensor      # (rows, T) packed index of row r's response token t (-1 past its end)
    prompt_len: int

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
                       pred, row_index, p_len)


def packed_response_logprobs(model: nn.Module, group: PackedGroup, temperature: float = 1.0,
                             chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Log-probs (rows, T) of each row's response tokens from one forward over the packed group (0 past a row's
    end); equal to the unpacked forward's up to float rounding."""
    neg = torch.finfo(torch.float32).min
    mask = torch.zeros(group.allowed.shape, dtype=torch.float32).masked_fill(~group.allowed, neg)
    out = model(input_ids=group.input_ids[None], attention_mask=mask[None, None],
                position_ids=group.position_ids[None], use_cache=False)
    logits = out.logits[0]
    response = torch.arange(group.prompt_len, group.unique_tokens)
    scored = logits[group.pred_index[response]].float() / temperature
    token_logp = logprobs_from_logits(scored, group.input_ids[response], chunk_size)
    # packed response token q is row_index value q; its log-prob sits at q - prompt_len
    safe = (group.row_index - group.prompt_len).clamp(min=0)
    return torch.where(group.row_index >= 0, token_logp[safe], torch.zeros((), dtype=token_logp.dtype))
