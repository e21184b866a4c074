"""Teacher-forced next-token entropy of every model-written token of a trajectory.

Two measurements per token, both divided by ``log|V|`` as the rollout divides them:

* ``full``: the entropy of the whole next-token distribution;
* ``topk``: the rollout's own quantity -- :func:`arpo.rollout.branching.token_entropy` over the top-``k``
  logprobs plus the written token's (vLLM's layout, built by :func:`arpo.engine.hf_engine.top_logprobs`), so
  the windows the probe reports are the ones :func:`arpo.rollout.branching.window_entropy` gives the rollout.

Logprobs are taken from the raw logits (vLLM's default ``raw_logprobs`` mode, what the rollout reads).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from arpo.engine.hf_engine import top_logprobs
from arpo.entropy_probe.trajectories import Trajectory
from arpo.rollout.branching import token_entropy

logger = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Scores:
    """Per position of a trajectory (NaN where not model-written): normalised full and top-k entropy, and the
    top-k logprob dicts of the model-written positions (what :func:`window_entropy` takes)."""

    full: list[float]
    topk: list[float]
    topk_logprobs: dict[int, dict[int, float]]


def load_model(path: str, dtype: str = "fp32", device: str = "cpu"):
    """An HF causal LM and its tokenizer, in eval mode on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    return model, tokenizer


@torch.no_grad()
def score_trajectories(model, trajectories: Sequence[Trajectory], vocab_size: int, topk: int = 10,
                       batch_tokens: int = 4096, max_length: int | None = None,
                       show_progress: bool = True) -> list[Scores]:
    """Run ``model`` teacher-forced over each trajectory (batches of about ``batch_tokens`` padded tokens, the
    longest first) and return one :class:`Scores` per trajectory, in order. ``vocab_size`` is the |V| of the
    normalisation (the rollout's: ``entropy.vocab_size`` or the tokenizer's length)."""
    from tqdm import tqdm

    log_v = math.log(vocab_size)
    device = next(model.parameters()).device
    out: list[Scores | None] = [None] * len(trajectories)
    order = sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i].ids or []))
    batches, current = [], []
    for i in order:
        if trajectories[i].ids is None:
            raise ValueError(f"{trajectories[i].name}: no token ids to score (a rollout dump row); analyse its "
                             f"recorded entropy instead (no --model)")
        longest = len(trajectories[current[0]].ids) if current else len(trajectories[i].ids)
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    bar = tqdm(total=sum(len(t.ids) for t in trajectories), unit="tok", desc="teacher-forced entropy",
               disable=not show_progress)
    for batch in batches:
        seqs = [trajectories[i].ids[:max_length] for i in batch]
        width = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attention = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            input_ids[r, :len(s)] = torch.tensor(s)
            attention[r, :len(s)] = 1
        predict = _next_token_logits(model, input_ids.to(device), attention.to(device))
        for r, i in enumerate(batch):
            out[i] = _row_scores(predict, r, seqs[r], trajectories[i].model_mask, topk, log_v)
            bar.update(len(trajectories[i].ids))
    bar.close()
    return out  # type: ignore[return-value]


def _next_token_logits(model, input_ids: torch.Tensor, attention: torch.Tensor):
    """A function ``(row, positions) -> logits`` there. The output head runs on the scored positions only when
    the model exposes its decoder and head (most HF causal LMs): a quarter of the tokens are the model's, and the
    full ``[batch, length, |V|]`` logits are most of the memory."""
    head, decoder = model.get_output_embeddings(), getattr(model, "get_decoder", lambda: None)()
    if head is None or decoder is None or getattr(model.config, "final_logit_softcapping", None):
        logits = model(input_ids=input_ids, attention_mask=attention).logits
        return lambda row, positions: logits[row, positions]
    hidden = decoder(input_ids=input_ids, attention_mask=attention).last_hidden_state
    return lambda row, positions: head(hidden[row, positions])


def _row_scores(predict, row: int, ids: list[int], mask: list[bool], topk: int, log_v: float) -> Scores:
    n = len(mask)
    full, topk_h = [math.nan] * n, [math.nan] * n
    dicts: dict[int, dict[int, float]] = {}
    positions = [t for t in range(1, len(ids)) if mask[t]]  # token t is predicted from position t - 1
    if not positions:
        return Scores(full, topk_h, dicts)
    logprobs = torch.log_softmax(predict(row, [t - 1 for t in positions]).float(), dim=-1)
    full_h = -(logprobs.exp() * logprobs).nan_to_num().sum(-1) / log_v
    for row, t in enumerate(positions):
        dicts[t] = top_logprobs(logprobs[row], topk, ids[t])
        full[t] = float(full_h[row])
        topk_h[t] = token_entropy(dicts[t]) / log_v
    return Scores(full, topk_h, dicts)
