"""The entropy probe: does ARPO's premise -- token entropy rises right after a tool result -- hold for a model?

:func:`probe` runs a model teacher-forced over trajectories with tool calls (:mod:`.trajectories`), measures the
next-token entropy of every model-written token (:mod:`.scoring`; the top-k one with the rollout's own code),
aligns it around each tool result and around control points, and returns the curves and the premise statistic
with bootstrap intervals over trajectories (:mod:`.stats`). ``python -m arpo.entropy_probe --help``; the study
and how to read it: docs/premise.md.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Sequence

from arpo.entropy_probe.scoring import load_model, score_trajectories
from arpo.entropy_probe.stats import measure, plot, summarise
from arpo.entropy_probe.trajectories import Trajectory, read_trajectories

logger = logging.getLogger(__name__)
__all__ = ["probe", "read_trajectories", "load_model", "score_trajectories", "summarise", "plot", "Trajectory"]


def probe(trajectories: Sequence[Trajectory], model=None, vocab_size: int | None = None, topk: int = 10,
          window: int = 20, reduction: str = "mean", before: int = 20, after: int = 50, seed: int = 0,
          batch_tokens: int = 4096, max_length: int | None = None, resamples: int = 2000,
          show_progress: bool = True) -> dict[str, Any]:
    """Curves and premise statistic of ``trajectories`` as ``model`` sees them teacher-forced (``model`` None:
    their recorded rollout entropy, already normalised). ``vocab_size``: the |V| that normalises entropy (the rollout's
    ``entropy.vocab_size``, else its tokenizer's length); ``topk``, ``window``, ``reduction``: the rollout's
    ``actor_rollout_ref.rollout.arpo.entropy`` keys. Offsets ``-before … after-1``."""
    if model is not None and vocab_size is None:
        raise ValueError("vocab_size is needed to normalise entropy by log|V| (the tokenizer's length)")
    if not trajectories:
        raise ValueError("no trajectories to probe")
    start = time.perf_counter()
    scores = score_trajectories(model, trajectories, vocab_size, topk, batch_tokens, max_length, show_progress) \
        if model is not None else [None] * len(trajectories)
    score_s = time.perf_counter() - start
    measured = [measure(t, s, window, seed) for t, s in zip(trajectories, scores)]
    summary = summarise(measured, window, vocab_size, reduction, list(range(-before, after)), seed, resamples)
    tokens = sum(len(t.ids) for t in trajectories) if model is not None else 0
    summary["settings"] = {"topk": topk, "window": window, "reduction": reduction, "vocab_size": vocab_size,
                           "seed": seed, "teacher_forced": model is not None, "resamples": resamples}
    summary["timing"] = {"score_s": round(score_s, 3), "tokens_scored": tokens,
                         "s_per_1000_tokens": round(1000 * score_s / tokens, 4) if tokens else math.nan}
    logger.info("probed %d trajectories (%d model tokens) in %.1f s", len(trajectories), summary["model_tokens"],
                time.perf_counter() - start)
    return summary
