"""Experiment tracking through one object: wandb (offline by default), a JSONL file, and the console.

Metric names follow verl (``actor/pg_loss``, ``critic/score/mean`` …) so plots and notebooks written for verl
read our logs unchanged. The JSONL file is the source of truth for notebooks and tables; wandb is optional; the
console gets one concise line per step (:func:`arpo.runtime.console.step_line`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

VALID_BACKENDS = ("console", "jsonl", "wandb")


def json_safe(value: Any) -> Any:
    """NaN/inf become null (json.dumps would write the invalid token NaN), numpy scalars plain Python; containers
    are converted element by element."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Tracking:
    """Logs one dict of metrics per step to every configured backend."""

    def __init__(self, project: str, experiment: str, backends: Sequence[str], log_dir: str | Path,
                 config: dict | None = None, wandb_mode: str = "offline"):
        bad = [b for b in backends if b not in VALID_BACKENDS]
        if bad:
            raise ValueError(f"trainer.logger has unknown backend(s) {bad}; use any of {list(VALID_BACKENDS)}")
        self.backends = list(backends)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a") if "jsonl" in self.backends else None
        self._wandb = None
        #: shown as ``step k/total`` on the console once the trainer knows it
        self.total_steps: int | None = None
        if "wandb" in self.backends:
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(project=project, name=experiment, config=config or {}, mode=wandb_mode,
                                     dir=str(self.log_dir), reinit="finish_previous")

    def log(self, data: dict[str, Any], step: int) -> None:
        clean = {k: json_safe(v) for k, v in data.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=step)
        if "console" in self.backends:
            from arpo.runtime.console import step_line, validation_line

            trained = "training/global_step" in clean  # the fit loop's steps (validation-only logs lack it)
            logger.info(step_line(step, clean, self.total_steps) if trained else validation_line(step, clean))

    def finish(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
