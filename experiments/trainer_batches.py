"""The batches the trainer benchmarks time (experiments/bench_trainer.py): random rows shaped like a rollout,
windows of real text, the trees of a rollout dump, and responses sampled from the model itself, each with random
advantages on its model tokens."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from arpo.batch import Trajectory, collate_trajectories


def length_range(text: str) -> tuple[int, int]:
    """``"400"`` → (400, 400); ``"300-500"`` → (300, 500): each row draws its length uniformly from it."""
    low, _, high = text.partition("-")
    lo, hi = int(low), int(high or low)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def make_batch(rows: int, prompt_len: tuple[int, int], response_len: tuple[int, int], vocab: int, seed: int,
               system: int = 0):
    """Random rows shaped like a rollout: prompt (its first ``system`` tokens the same in every row, as a
    system prompt), model tokens, a tool result, model tokens."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    system_ids = torch.randint(5, vocab, (system,), generator=g).tolist()
    trajs = []
    for i in range(rows):
        p, r = draw(*prompt_len), draw(*response_len)
        prompt = system_ids + torch.randint(5, vocab, (max(0, p - system),), generator=g).tolist()
        t = Trajectory(group=i // 2, prompt_ids=prompt)
        third = r // 3
        t.append(torch.randint(5, vocab, (third,), generator=g).tolist(), True)
        t.append(torch.randint(5, vocab, (third,), generator=g).tolist(), False)  # a tool result
        t.append(torch.randint(5, vocab, (r - 2 * third,), generator=g).tolist(), True)
        trajs.append(t)
    batch = collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{i}" for i in range((rows + 1) // 2)])
    width = batch["responses"].shape[1]
    adv = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    batch.tensors["advantages"] = adv * batch["response_mask"]
    return batch


def text_batch(model: Path, text_file: Path, rows: int, prompt_len: tuple[int, int],
               response_len: tuple[int, int], seed: int):
    """Like :func:`make_batch`, but prompts and responses are consecutive windows of real text: random
    tokens give log-probs near -15 and flat distributions, unlike anything a policy samples."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model))(text_file.read_text())["input_ids"]
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(rows):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        r = int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g))
        start = int(torch.randint(0, max(1, len(ids) - p - r), (1,), generator=g))
        window = ids[start: start + p + r]
        t = Trajectory(group=i // 2, prompt_ids=window[:p])
        t.append(window[p:], True)
        trajs.append(t)
    batch = collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{i}" for i in range((rows + 1) // 2)])
    width = batch["responses"].shape[1]
    batch.tensors["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, width) * batch["response_mask"]
    return batch


def tree_dump_batch(path: Path, rows: int, prompt_len: int, vocab: int, seed: int):
    """The first whole groups (at least ``rows`` rows) of a rollout dump, on their recorded trees: forks, response
    lengths and tool-result positions (a token without entropy); token ids random, a ``prompt_len``-token
    prompt per group (dumps do not record prompts)."""
    from experiments.bench_tree_packing import load_trees, tree_tokens

    trajs, group_size = [], 0
    for g, tree in enumerate(load_trees(path)):
        if len(trajs) >= rows:
            break
        prompt, responses, parent, branch_pos = tree_tokens(tree, prompt_len, vocab, seed=seed + g)
        first, group_size = len(trajs), max(group_size, len(tree))
        for row, response, p, bp in zip(tree, responses, parent, branch_pos):
            t = Trajectory(group=g, prompt_ids=prompt, parent=first + p if p >= 0 else -1, branch_pos=bp)
            t.response_ids = response
            t.response_mask = [0 if e is None else 1 for e in row["token_entropy"]][: len(response)]
            trajs.append(t)
    batch = collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{i}" for i in range(trajs[-1].group + 1)])
    width = batch["responses"].shape[1]
    g = torch.Generator().manual_seed(seed)
    batch.tensors["advantages"] = torch.randn(len(batch), 1, generator=g).expand(-1, width) * batch["response_mask"]
    batch.meta["group_size"] = group_size
    return batch


def token_counts(batch) -> dict:
    """Total tokens of the batch's rows, and the tokens once each group's tree is packed."""
    from arpo.trainer.tree_packing import packed_token_counts

    packed, total = packed_token_counts(batch)
    return {"total_tokens": total, "packed_tokens": packed, "packed_over_total": round(packed / total, 4)}


def sampled_batch(model, batch, response_len: int, seed: int):
    """``batch``'s prompts with responses sampled from ``model`` (temperature 1): on-policy tokens, mostly
    likely ones, which is what a rollout hands the trainer (text windows are far less likely)."""
    torch.manual_seed(seed)
    trajs = []
    for i in range(len(batch)):
        prompt = batch["prompts"][i][batch["attention_mask"][i, : batch["prompts"].shape[1]].bool()]
        with torch.no_grad():
            out = model.generate(prompt.unsqueeze(0), attention_mask=torch.ones_like(prompt).unsqueeze(0),
                                 do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=response_len,
                                 min_new_tokens=response_len, pad_token_id=0)
        t = Trajectory(group=i // 2, prompt_ids=prompt.tolist())
        t.append(out[0, len(prompt):].tolist(), True)
        trajs.append(t)
    sampled = collate_trajectories(trajs, pad_token_id=0, group_uids=[f"g{i}" for i in range((len(batch) + 1) // 2)])
    width = sampled["responses"].shape[1]
    g = torch.Generator().manual_seed(seed)
    sampled.tensors["advantages"] = torch.randn(len(batch), 1, generator=g).expand(-1, width) * sampled["response_mask"]
    return sampled
