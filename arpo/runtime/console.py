"""What a run prints: a header, one line per RL step and a closing summary.

Every metric goes to JSONL, wandb and the run's log file; the console gets only what a researcher scans while a run
is going — the config that differs from the defaults, then per step reward, accuracy, tool use, branching, entropy
and time — so a whole run fits on one screen.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

#: (label, metric, format) of the per-step line; a metric missing from a step is left out of its line.
STEP_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("reward", "critic/score/mean", "{:.3f}"),
    ("acc", "reward/acc/mean", "{:.3f}"),
    ("tools/traj", "rollout/tool_calls/in_trajectory_mean", "{:.2f}"),
    ("branches", "rollout/branches", "{:.0f}"),
    ("dH", "rollout/entropy/delta_mean", "{:+.4f}"),
    ("pg_loss", "actor/pg_loss", "{:+.4f}"),
    ("vf_loss", "critic/vf_loss", "{:.4f}"),                  # PPO with a critic (algorithm.adv_estimator=gae)
    ("groups kept", "train/num_groups_kept", "{:.0f}"),       # dynamic sampling (algorithm.filter_groups)
    ("gen rounds", "train/num_gen_batches", "{:.0f}"),
    ("val_acc", "val-core/all/acc/mean", "{:.3f}"),
    ("val_reward", "val-core/all/reward/mean", "{:.3f}"),
)
STEP_TIME = "timing_s/step"


def _shown(value: Any) -> bool:
    return isinstance(value, (int, float)) and not (isinstance(value, float) and not math.isfinite(value))


def _fields(metrics: Mapping[str, Any], prefix: str = "") -> list[str]:
    return [f"{label} {fmt.format(metrics[key])}" for label, key, fmt in STEP_FIELDS
            if key.startswith(prefix) and _shown(metrics.get(key))]


def step_line(step: int, metrics: Mapping[str, Any], total: int | None = None) -> str:
    """``step 3/8 | reward 0.412 | acc 0.375 | tools/traj 1.95 | branches 14 | dH +0.0021 | 94 s``."""
    parts = [f"step {step}/{total}" if total else f"step {step}"] + _fields(metrics)
    if _shown(metrics.get(STEP_TIME)):
        parts.append(f"{metrics[STEP_TIME]:.0f} s")
    return " | ".join(parts)


def validation_line(step: int, metrics: Mapping[str, Any]) -> str:
    """The validation before training (step 0) in the same shape as a step line."""
    return " | ".join([f"validation at step {step}"] + _fields(metrics, prefix="val-"))


def _flat(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    tree = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else None
        if items is not None and node:
            for k, v in items:
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(tree, "")
    return out


def config_diff(cfg: DictConfig | Mapping[str, Any], defaults: DictConfig | Mapping[str, Any]) -> list[str]:
    """``key=value (default: old)`` for every leaf of ``cfg`` that differs from ``defaults``, sorted by key.

    A value that only follows another change (``trainer.default_local_dir`` under a new ``trainer.output_dir``,
    a corpus path under a new data folder) is counted in a last line instead of listed."""
    new, old = _flat(cfg), _flat(defaults)
    changed = {k: v for k, v in new.items() if k not in old or v != old[k]}
    moves = [(old[k], v) for k, v in changed.items() if isinstance(v, str) and isinstance(old.get(k), str) and old[k]]

    def derived(k: str) -> bool:
        before, after = old.get(k), changed[k]
        return isinstance(after, str) and isinstance(before, str) and any(
            src != before and src in before and before.replace(src, dst) == after for src, dst in moves)

    shown = [k for k in sorted(changed) if not derived(k)]
    lines = [f"{k}={new[k]!r} (default: {old[k]!r})" if k in old else f"{k}={new[k]!r} (added)" for k in shown]
    if len(shown) < len(changed):
        lines.append(f"(+{len(changed) - len(shown)} values that follow from these, e.g. paths under a new folder)")
    return lines


def run_header(title: str, fields: Mapping[str, Any], sections: Mapping[str, list[str]] | None = None,
               max_items: int = 30, more_at: Any = None) -> str:
    """A block of lines opening a run: ``title``, ``name  value`` fields, then each titled list (a config diff,
    overrides), cut at ``max_items`` with a pointer to where the rest is (``more_at``)."""
    width = max((len(k) for k in fields), default=0)
    lines = [f"== {title} =="] + [f"  {k.ljust(width)}  {v}" for k, v in fields.items()]
    for name, items in (sections or {}).items():
        lines.append(f"  {name}:" + ("" if items else " none"))
        lines += [f"    {item}" for item in items[:max_items]]
        if len(items) > max_items:
            lines.append(f"    ... {len(items) - max_items} more" + (f": see {more_at}" if more_at else ""))
    return "\n".join(lines)
