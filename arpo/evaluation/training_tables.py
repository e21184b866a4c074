"""The ablation table of training runs (``python -m arpo.tables --training-runs DIR``, ``experiments/ablation.py``):
one row per variant, mean ± std over seeds, Welch's t-test against the baseline, and every number in ``runs.csv``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from arpo.evaluation.tables import Cell, write_csv, fmt


@dataclass(frozen=True)
class TrainingColumn:
    """One column of an ablation table: a key of :func:`arpo.analysis.run_summary` (or the driver's record)."""

    key: str
    header: str
    scale: float = 1.0
    digits: int = 3
    #: add Welch's t-test p-value against the baseline after the column
    test: bool = False


TRAINING_COLUMNS = (
    TrainingColumn("val_acc", "Val acc (%)", 100.0, 1, test=True),
    TrainingColumn("val_reward", "Val reward", 1.0, 3, test=True),
    TrainingColumn("train_score", "Train score (last step)", 1.0, 3),
    TrainingColumn("tool_calls_per_traj", "Tool calls / traj", 1.0, 2),
    TrainingColumn("tokens_generated", "Tokens generated", 1.0, 0),
    TrainingColumn("wall_s", "Wall (s)", 1.0, 0),
)


def training_table(summaries: dict[str, list[dict[str, float]]], baseline: str | None = None,
                   note: str = "") -> str:
    """Markdown: one row per variant, mean ± std over seeds of each column (NaN values, i.e. metrics a run did
    not log, left out), and for tested columns Welch's p-value of the variant against ``baseline``."""
    from arpo.evaluation.stats import welch_t_test

    heads = ["Variant", "Seeds"]
    for col in TRAINING_COLUMNS:
        heads += [col.header] + ([f"p ({col.header})"] if col.test and baseline else [])
    lines = ["| " + " | ".join(heads) + " |", "|---|" + "|".join("---:" for _ in heads[1:]) + "|"]
    base = summaries.get(baseline, []) if baseline else []
    for variant, runs in summaries.items():
        row = [variant + (" (baseline)" if variant == baseline else ""), str(len(runs))]
        for col in TRAINING_COLUMNS:
            values = _finite([r.get(col.key, math.nan) for r in runs])
            row.append(fmt(Cell(values), col.scale, col.digits))
            if col.test and baseline:
                p = math.nan if variant == baseline else \
                    welch_t_test(values, _finite([r.get(col.key, math.nan) for r in base]))
                row.append("–" if math.isnan(p) else f"{p:.3g}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines + ["", note, ""] if note else lines + [""])


def training_rows(summaries: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    """One CSV row per (variant, seed): every number behind the ablation table."""
    return [{"variant": v, **{k: ("" if isinstance(x, float) and math.isnan(x) else x) for k, x in r.items()}}
            for v, runs in summaries.items() for r in runs]


def write_training_tables(summaries: dict[str, list[dict[str, float]]], out_dir: str | Path,
                          baseline: str | None = None, header: str = "", note: str = "") -> dict[str, Path]:
    """``table.md`` (``header`` first, e.g. the command and git SHA) and ``runs.csv`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = out / "table.md"
    table.write_text((header + "\n\n" if header else "") + training_table(summaries, baseline, note),
                     encoding="utf-8")
    rows = out / "runs.csv"
    write_csv(rows, training_rows(summaries) or [{"variant": ""}])
    return {"table.md": table, "runs.csv": rows}


def _finite(values: Sequence[float]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]
