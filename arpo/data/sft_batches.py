"""SFT batches: right-padded, of similar length, shuffled by a seeded generator, with the prompt prefix every row
shares (:func:`shared_prompt_prefix`), which the loss runs once per batch (:mod:`arpo.trainer.sft_step`)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch


def _collate(chunk: Sequence[tuple[list[int], list[int]]], pad_id: int, share_prefix: bool):
    """Right-padded (input_ids, attention_mask, labels, shared prefix length) for one batch."""
    length = max(len(ids) for ids, _ in chunk)
    input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
    labels = torch.full((len(chunk), length), -100, dtype=torch.long)
    attn = torch.zeros((len(chunk), length), dtype=torch.long)
    for i, (ids, mask) in enumerate(chunk):
        t = torch.tensor(ids)
        input_ids[i, : len(ids)] = t
        attn[i, : len(ids)] = 1
        lab = t.clone()
        lab[torch.tensor(mask) == 0] = -100
        labels[i, : len(ids)] = lab
    return input_ids, attn, labels, shared_prompt_prefix(chunk) if share_prefix else 0


def _window_chunks(part: list, batch_size: int) -> list:
    """Batches of similar length from one window of examples (a trailing partial batch is dropped)."""
    part = sorted(part, key=lambda ex: len(ex[0]))
    return [part[b: b + batch_size] for b in range(0, len(part) - batch_size + 1, batch_size)]


def _in_random_order(chunks: list, rng: np.random.Generator, pad_id: int, share_prefix: bool):
    """The chunks collated, in an order drawn from ``rng`` (one permutation per call)."""
    for c in rng.permutation(len(chunks)):
        yield _collate(chunks[c], pad_id, share_prefix)


def shuffled_batches(examples: list, batch_size: int, rng: np.random.Generator, pad_id: int, share_prefix: bool = False):
    """Shuffled batches of similar length (less padding): shuffle, sort within windows of 16 batches, then
    shuffle the batch order."""
    order = rng.permutation(len(examples))
    window = batch_size * 16
    chunks = []
    for w in range(0, len(order), window):
        chunks += _window_chunks([examples[i] for i in order[w: w + window]], batch_size)
    yield from _in_random_order(chunks, rng, pad_id, share_prefix)


def streamed_batches(stream: Iterable, batch_size: int, rng: np.random.Generator, pad_id: int,
                    share_prefix: bool = False):
    """First-epoch batches straight from the demonstration stream: examples in arrival (row) order, sorted by
    length and shuffled within windows of 16 batches as each window fills."""
    window = batch_size * 16
    buf: list = []
    for ex in stream:
        buf.append(ex)
        if len(buf) == window:
            chunks, buf = _window_chunks(buf, batch_size), []
            yield from _in_random_order(chunks, rng, pad_id, share_prefix)
    yield from _in_random_order(_window_chunks(buf, batch_size), rng, pad_id, share_prefix)


def shared_prompt_prefix(examples: Sequence[tuple[list[int], list[int]]]) -> int:
    """Length of the token prefix common to every example and untrained in all of them (the system prompt),
    less one so that the position predicting the first differing token stays in the per-row part."""
    first = examples[0][0]
    n = len(first)
    for ids, mask in examples:
        limit = min(n, len(ids))
        i = 0
        while i < limit and ids[i] == first[i]:
            i += 1
        n = min(i, mask.index(1) if 1 in mask else len(mask))
    return max(0, n - 1)
