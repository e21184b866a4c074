"""A rank's optimizer and learning-rate schedule from verl's ``optim`` keys (the actor's and the critic's)."""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch


def lr_lambda(step: int, warmup_steps: int, total_steps: int, style: str, min_lr_ratio: float,
              num_cycles: float) -> float:
    """LR multiplier at scheduler step ``step``: linear warmup, then constant or cosine decay to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / max(1, warmup_steps)
    if style == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * min(1.0, progress)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * cosine


def build_optimizer(params: Iterable[torch.nn.Parameter], o: Any, run_total_steps: int,
                    key: str) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its schedule from the ``optim`` section ``o`` (config path ``key``, for errors);
    ``run_total_steps`` stands in when ``o.total_training_steps`` is unset (the trainer sets it)."""
    optimizer = torch.optim.AdamW(list(params), lr=float(o.lr), betas=tuple(float(b) for b in o.betas),
                                  weight_decay=float(o.weight_decay), eps=float(o.eps))
    total = int(o.total_training_steps) if o.total_training_steps > 0 else run_total_steps
    warmup = (int(o.lr_warmup_steps) if o.lr_warmup_steps >= 0
              else int(float(o.lr_warmup_steps_ratio) * max(total, 0)))
    if o.warmup_style == "cosine" and total <= 0:
        raise ValueError(f"{key}.warmup_style=cosine needs {key}.total_training_steps > 0 (the trainer sets it)")
    style, min_lr_ratio, cycles = o.warmup_style, float(o.min_lr_ratio), float(o.num_cycles)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_lambda(s, warmup, total, style, min_lr_ratio, cycles))
    return optimizer, scheduler
