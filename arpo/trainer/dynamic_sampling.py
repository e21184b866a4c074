"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): drop the prompt groups whose trajectories all
score the same, which carry no group-relative advantage, and generate more until the step has
``data.train_batch_size`` informative groups or ``max_num_gen_batches`` generation rounds ran.

At the cap verl raises; here the step trains on the groups it kept (none kept: the step skips its update), so a
run on a task that is too easy or too hard still progresses and says so in ``train/*`` metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from arpo.batch import DataBatch, concat_padded, select_rows
from arpo.config import section_values

#: what "the same" is measured on: the accuracy, the raw reward score, or the summed token-level reward (which
#: includes shaping such as DAPO's overlong penalty). verl's seq_final_reward (after a KL penalty in the
#: reward) equals seq_reward here, since groups are filtered before the reference pass.
METRICS = ("acc", "score", "seq_reward", "seq_final_reward")


@dataclass(frozen=True)
class FilterGroupsConfig:
    """``algorithm.filter_groups`` (configs/algorithm.yaml)."""

    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 10

    def validate(self, use_kl_in_reward: bool = False) -> "FilterGroupsConfig":
        if self.metric not in METRICS:
            raise ValueError(f"algorithm.filter_groups.metric={self.metric!r} is not valid; choose one of: "
                             f"{', '.join(METRICS)}")
        if self.metric == "seq_final_reward" and use_kl_in_reward:
            raise ValueError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: "
                             "groups are filtered before the KL penalty exists; use seq_reward")
        if isinstance(self.max_num_gen_batches, bool) or not isinstance(self.max_num_gen_batches, int) \
                or self.max_num_gen_batches < 0:
            raise ValueError(f"algorithm.filter_groups.max_num_gen_batches must be an integer >= 0 (0: no cap), "
                             f"got {self.max_num_gen_batches!r}")
        return self


def filter_groups_config(cfg: Any) -> FilterGroupsConfig:
    """The validated ``algorithm.filter_groups`` section of a root config (defaults where absent)."""
    algo = cfg.get("algorithm") if isinstance(cfg, Mapping) or hasattr(cfg, "get") else None
    section = algo.get("filter_groups") if algo is not None else None
    fg = FilterGroupsConfig(**section_values(section, "algorithm.filter_groups",
                                             {f.name for f in fields(FilterGroupsConfig)}))
    return fg.validate(bool(algo.get("use_kl_in_reward", False)) if algo is not None else False)


def sequence_metric(batch: DataBatch, metric: str) -> np.ndarray:
    """One value per row of a scored batch for ``metric`` (see METRICS)."""
    if metric == "acc":
        return np.asarray(batch.non_tensors["reward_acc"], dtype=float)
    if metric == "score":
        return np.asarray(batch.non_tensors["reward_score"], dtype=float)
    return batch.tensors["token_level_scores"].sum(-1).double().numpy()


def informative_rows(batch: DataBatch, metric: str) -> tuple[np.ndarray, int, int]:
    """Rows of the groups whose ``metric`` varies (a group of one row is kept, as verl keeps it), and the
    numbers of groups kept and dropped."""
    values = sequence_metric(batch, metric)
    uids = np.asarray(batch.non_tensors["uid"])
    keep = np.zeros(len(uids), dtype=bool)
    kept = dropped = 0
    for uid in dict.fromkeys(uids):
        rows = uids == uid
        if rows.sum() == 1 or np.std(values[rows]) > 0:
            keep |= rows
            kept += 1
        else:
            dropped += 1
    return np.flatnonzero(keep), kept, dropped


class GroupCollector:
    """Collects informative groups over generation rounds until ``target`` groups are in hand."""

    def __init__(self, config: FilterGroupsConfig, target: int, pad_token_id: int):
        self.config = config
        self.target = target
        self.pad_token_id = pad_token_id
        self.parts: list[DataBatch] = []
        self.rounds = self.kept = self.dropped = 0

    def add(self, batch: DataBatch) -> None:
        rows, kept, dropped = informative_rows(batch, self.config.metric)
        self.rounds += 1
        self.kept += kept
        self.dropped += dropped
        if len(rows):
            self.parts.append(select_rows(batch, rows))

    @property
    def done(self) -> bool:
        cap = self.config.max_num_gen_batches
        return self.kept >= self.target or (cap > 0 and self.rounds >= cap)

    def batch(self) -> DataBatch | None:
        """The first ``target`` kept groups as one batch (None when no group was kept)."""
        if not self.parts:
            return None
        batch = concat_padded(self.parts, self.pad_token_id)
        uids = np.asarray(batch.non_tensors["uid"])
        first = list(dict.fromkeys(uids))[: self.target]
        return select_rows(batch, np.flatnonzero(np.isin(uids, first)))

    def metrics(self) -> dict[str, float]:
        return {"train/num_gen_batches": float(self.rounds), "train/num_groups_kept": float(min(self.kept, self.target)),
                "train/num_groups_dropped": float(self.dropped),
                "train/num_groups_surplus": float(max(self.kept - self.target, 0))}
