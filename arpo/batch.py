"""The batch that flows from rollout to rewards to the trainer (verl's DataProto, trimmed to what we use).

Both rollout paths (the ARPO rollout and the agent loop) produce a list of :class:`Trajectory` and call
:func:`collate_trajectories`, so the trainer never cares which path made a batch.

Row layout (verl's): ``prompts`` left-padded to the longest prompt, ``responses`` right-padded to the longest
response, ``input_ids = prompts ‖ responses``, ``attention_mask`` 1 on real tokens, ``position_ids`` the
cumulative sum of the attention mask minus one (0 on left padding), ``response_mask`` 1 on model-generated
tokens and 0 on tool-result and pad tokens.

The trajectory tree: ``parent_index`` (row of the trajectory this one branched from, -1 for a root) and
``branch_pos`` (how many response tokens it shares with its parent). Rows of one prompt share a ``uid``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np
import torch


@dataclass
class Trajectory:
    """One response to one prompt, possibly forked from another trajectory of the same group."""

    group: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    #: 1 for model tokens, 0 for tool-result tokens; same length as response_ids.
    response_mask: list[int] = field(default_factory=list)
    #: index (in the final list of trajectories) of the parent; -1 for a root trajectory.
    parent: int = -1
    #: number of leading response tokens shared with the parent (the fork point).
    branch_pos: int = 0
    #: per response token entropy (normalised) where requested; NaN on tool tokens.
    token_entropy: list[float] | None = None
    #: the rollout engine's log-prob of each response token (0 on tool results), where recorded
    rollout_log_probs: list[float] | None = None
    #: [{"tool": name, "start": response pos of the call's result, "end": ..., "error": bool}]
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = ""
    #: extra per-trajectory values that become non-tensor columns (e.g. num_turns).
    extra: dict[str, Any] = field(default_factory=dict)

    def append(self, token_ids: list[int], model_generated: bool, entropy: list[float] | None = None,
               log_probs: list[float] | None = None) -> None:
        self.response_ids.extend(token_ids)
        self.response_mask.extend([1 if model_generated else 0] * len(token_ids))
        if self.token_entropy is not None:
            self.token_entropy.extend(entropy if entropy is not None else [float("nan")] * len(token_ids))
        if self.rollout_log_probs is not None:
            self.rollout_log_probs.extend(log_probs if log_probs is not None else [0.0] * len(token_ids))


@dataclass
class DataBatch:
    """Tensors of equal first dimension, numpy object columns of the same length, and free-form meta."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for a in self.non_tensors.values():
            return len(a)
        return 0

    def __getitem__(self, key: str):
        return self.tensors[key] if key in self.tensors else self.non_tensors[key]

    def index(self, idx: torch.Tensor | np.ndarray | list[int] | slice) -> "DataBatch":
        if isinstance(idx, slice):
            np_idx: Any = idx
            t_idx: Any = idx
        else:
            np_idx = np.asarray(idx, dtype=np.int64)
            t_idx = torch.as_tensor(np_idx)
        return DataBatch(
            {k: v[t_idx] for k, v in self.tensors.items()},
            {k: v[np_idx] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def chunk(self, n_chunks: int) -> list["DataBatch"]:
        size = len(self)
        if size % n_chunks:
            raise ValueError(f"batch of {size} rows does not split into {n_chunks} equal chunks")
        step = size // n_chunks
        return [self.index(slice(i * step, (i + 1) * step)) for i in range(n_chunks)]

    def union(self, other: "DataBatch") -> "DataBatch":
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        return DataBatch({**self.tensors, **other.tensors}, {**self.non_tensors, **other.non_tensors},
                         {**self.meta, **other.meta})

    @staticmethod
    def concat(batches: Iterable["DataBatch"]) -> "DataBatch":
        batches = list(batches)
        if not batches:
            return DataBatch()
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in batches[0].tensors}
        non_tensors = {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in batches[0].non_tensors}
        return DataBatch(tensors, non_tensors, dict(batches[0].meta))


def _object_column(values: list[Any]) -> np.ndarray:
    col = np.empty(len(values), dtype=object)
    col[:] = values
    return col


def collate_trajectories(
    trajectories: list[Trajectory],
    pad_token_id: int,
    group_uids: list[str],
    group_fields: dict[str, list[Any]] | None = None,
    max_response_length: int | None = None,
) -> DataBatch:
    """Pad trajectories into a :class:`DataBatch` (see the module docstring for the layout).

    ``group_uids[g]`` names prompt group ``g``; ``group_fields`` holds per-prompt dataset columns
    (``data_source``, ``reward_model`` …) that are repeated onto every row of the group.
    Responses longer than ``max_response_length`` are truncated (their mask with them).
    """
    if not trajectories:
        raise ValueError("no trajectories to collate")
    responses = [t.response_ids[:max_response_length] if max_response_length else t.response_ids
                 for t in trajectories]
    masks = [t.response_mask[: len(r)] for t, r in zip(trajectories, responses)]
    p_len = max(len(t.prompt_ids) for t in trajectories)
    r_len = max(1, max(len(r) for r in responses))
    n = len(trajectories)
    prompts = torch.full((n, p_len), pad_token_id, dtype=torch.long)
    resp = torch.full((n, r_len), pad_token_id, dtype=torch.long)
    resp_mask = torch.zeros((n, r_len), dtype=torch.long)
    attn = torch.zeros((n, p_len + r_len), dtype=torch.long)
    for i, (t, r, m) in enumerate(zip(trajectories, responses, masks)):
        lp = len(t.prompt_ids)
        prompts[i, p_len - lp:] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attn[i, p_len - lp: p_len] = 1
        if r:
            resp[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            resp_mask[i, : len(r)] = torch.tensor(m, dtype=torch.long)
            attn[i, p_len: p_len + len(r)] = 1
    position_ids = torch.clamp(torch.cumsum(attn, dim=1) - 1, min=0)
    tensors = {
        "prompts": prompts,
        "responses": resp,
        "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": attn,
        "position_ids": position_ids,
        "response_mask": resp_mask,
    }
    if all(t.rollout_log_probs is not None for t in trajectories):
        # verl's column: the rollout engine's log-prob of every response token, 0 on tool results and padding
        rollout_lp = torch.zeros((n, r_len), dtype=torch.float32)
        for i, (t, r) in enumerate(zip(trajectories, responses)):
            if r:
                rollout_lp[i, : len(r)] = torch.tensor(t.rollout_log_probs[: len(r)], dtype=torch.float32)
        tensors["rollout_log_probs"] = rollout_lp * resp_mask
    non_tensors: dict[str, np.ndarray] = {
        "uid": _object_column([group_uids[t.group] for t in trajectories]),
        "group_index": np.array([t.group for t in trajectories], dtype=np.int64),
        "parent_index": np.array([t.parent for t in trajectories], dtype=np.int64),
        "branch_pos": np.array([min(t.branch_pos, r_len) for t in trajectories], dtype=np.int64),
        "finish_reason": _object_column([t.finish_reason for t in trajectories]),
        "tool_calls": _object_column([t.tool_calls for t in trajectories]),
    }
    if any(t.token_entropy is not None for t in trajectories):
        non_tensors["token_entropy"] = _object_column([t.token_entropy for t in trajectories])
    extra_keys = sorted({k for t in trajectories for k in t.extra})
    for k in extra_keys:
        non_tensors[k] = _object_column([t.extra.get(k) for t in trajectories])
    for k, per_group in (group_fields or {}).items():
        non_tensors[k] = _object_column([per_group[t.group] for t in trajectories])
    return DataBatch(tensors, non_tensors, {})


#: tensor columns laid out as (rows, prompt width), left-padded, and as (rows, prompt + response width)
_PROMPT_COLUMNS = ("prompts",)
_FULL_COLUMNS = ("input_ids", "attention_mask", "position_ids")
#: columns whose padding is the pad token (all other columns pad with 0)
_ID_COLUMNS = ("prompts", "responses", "input_ids")


def select_rows(batch: DataBatch, rows: np.ndarray | list[int]) -> DataBatch:
    """Rows ``rows`` of a collated batch, with ``parent_index`` renumbered to the new row order.
    Whole groups must be selected: a selected branch whose parent is left out is an error."""
    rows = np.asarray(rows, dtype=np.int64)
    out = batch.index(rows)
    if "parent_index" in out.non_tensors:
        new_row = np.full(len(batch), -1, dtype=np.int64)
        new_row[rows] = np.arange(len(rows))
        parent = out.non_tensors["parent_index"]
        renumbered = np.where(parent >= 0, new_row[np.maximum(parent, 0)], -1)
        if ((parent >= 0) & (renumbered < 0)).any():
            raise ValueError("select_rows: a selected trajectory's parent was not selected; select whole groups")
        out.non_tensors["parent_index"] = renumbered
    return out


def concat_padded(batches: list[DataBatch], pad_token_id: int) -> DataBatch:
    """Collated batches (e.g. several generation rounds) as one: re-padded to the widest prompt and response,
    ``parent_index`` and ``group_index`` offset so every tree and group stays itself. Meta of the first."""
    if len(batches) == 1:
        return batches[0]
    p_len = max(b.tensors["prompts"].shape[1] for b in batches)
    r_len = max(b.tensors["responses"].shape[1] for b in batches)
    padded = []
    row_offset = group_offset = 0
    for b in batches:
        bp, br = b.tensors["prompts"].shape[1], b.tensors["responses"].shape[1]
        tensors = {}
        for key, t in b.tensors.items():
            value = pad_token_id if key in _ID_COLUMNS else 0
            if key in _PROMPT_COLUMNS:
                t = torch.nn.functional.pad(t, (p_len - bp, 0), value=value)
            elif key in _FULL_COLUMNS:
                t = torch.nn.functional.pad(t, (p_len - bp, r_len - br), value=value)
            elif t.dim() >= 2:
                t = torch.nn.functional.pad(t, (0, r_len - br), value=value)
            tensors[key] = t
        if "attention_mask" in tensors and "position_ids" in tensors:
            tensors["position_ids"] = torch.clamp(torch.cumsum(tensors["attention_mask"], dim=1) - 1, min=0)
        non_tensors = dict(b.non_tensors)
        if "parent_index" in non_tensors:
            parent = non_tensors["parent_index"]
            non_tensors["parent_index"] = np.where(parent >= 0, parent + row_offset, -1)
        if "group_index" in non_tensors:
            non_tensors["group_index"] = non_tensors["group_index"] + group_offset
            group_offset = int(non_tensors["group_index"].max()) + 1 if len(b) else group_offset
        if "branch_pos" in non_tensors:
            non_tensors["branch_pos"] = np.minimum(non_tensors["branch_pos"], r_len)
        padded.append(DataBatch(tensors, non_tensors, b.meta))
        row_offset += len(b)
    return DataBatch.concat(padded)
