"""Benchmark of tree packing (arpo/trainer/tree_packing.py) on real ARPO trees; prints one JSON object.

    python experiments/bench_tree_packing.py [--rollouts experiments/results/smollm2_advantage/rollouts/arpo_soft.jsonl]
        [--prompt-len 200] [--groups 4] [--layers 2] [--repeats 3]
    python experiments/bench_tree_packing.py --groups 1 --layers 1 --repeats 1       # smoke: seconds

* unique / total tokens over every group of the rollout dump (a dump row has its tree: ``parent_index``,
  ``branch_pos``, ``response_length``; the prompt, not recorded there, counts ``--prompt-len`` tokens per row);
* the forward + backward time of the response log-probs for ``--groups`` of those trees, packed (one sequence
  per group, tree attention mask) vs unpacked (the group's rows padded into one batch, as the actor runs them),
  on a SmolLM2-135M-shaped model cut to ``--layers`` decoder layers (random weights: the cost does not depend on
  them), with the largest log-prob difference between the two.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from arpo.trainer.tree_packing import pack_group, packed_response_logprobs

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ROLLOUTS = REPO / "experiments" / "results" / "smollm2_advantage" / "rollouts" / "arpo_soft.jsonl"


def load_trees(path: Path) -> list[list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        groups[row["group"]].append(row)
    return [sorted(rows, key=lambda r: r["row"]) for _, rows in sorted(groups.items())]


def tree_tokens(rows: list[dict], prompt_len: int, vocab: int, seed: int):
    """Random token ids on a dumped tree's shape: branches copy their parent's first branch_pos tokens."""
    rng = random.Random(seed)
    first = rows[0]["row"]
    parent = [r["parent_index"] - first if r["parent_index"] >= 0 else -1 for r in rows]
    branch_pos = [r["branch_pos"] if p >= 0 else 0 for r, p in zip(rows, parent)]
    responses: list[list[int] | None] = [None] * len(rows)

    def make(i: int) -> list[int]:
        if responses[i] is None:
            shared = make(parent[i])[: branch_pos[i]] if parent[i] >= 0 else []
            responses[i] = shared + [rng.randrange(vocab) for _ in range(rows[i]["response_length"] - len(shared))]
        return responses[i]

    for i in range(len(rows)):
        make(i)
    return [rng.randrange(vocab) for _ in range(prompt_len)], responses, parent, branch_pos


def unpacked_logprobs(model, prompt: list[int], responses: list[list[int]]) -> torch.Tensor:
    """The actor's layout: rows right-padded into one batch, each row's prompt + response."""
    width = max(len(r) for r in responses)
    ids = torch.zeros(len(responses), len(prompt) + width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(responses):
        ids[i, : len(prompt) + len(r)] = torch.tensor(prompt + r)
        attn[i, : len(prompt) + len(r)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits[:, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None])[..., 0]
    return logp * attn[:, len(prompt):]


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        out.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=Path, default=DEFAULT_ROLLOUTS)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--groups", type=int, default=4, help="groups timed (the token counts use every group)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    trees = load_trees(args.rollouts)
    total = unique = 0
    for rows in trees:
        total += sum(args.prompt_len + r["response_length"] for r in rows)
        unique += args.prompt_len + sum(r["response_length"] - (r["branch_pos"] if r["parent_index"] >= 0 else 0)
                                        for r in rows)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).float()
    timings = []
    for g, rows in enumerate(trees[: args.groups]):
        prompt, responses, parent, branch_pos = tree_tokens(rows, args.prompt_len, config.vocab_size, seed=g)
        group = pack_group(prompt, responses, parent, branch_pos)
        t_packed, packed = timed(lambda: packed_response_logprobs(model, group), args.repeats)
        t_unpacked, ref = timed(lambda: unpacked_logprobs(model, prompt, responses), args.repeats)
        width = min(packed.shape[1], ref.shape[1])
        timings.append({"rows": len(rows), "unique_tokens": group.unique_tokens,
                        "total_tokens": sum(len(prompt) + len(r) for r in responses),
                        "packed_s": round(t_packed, 3), "unpacked_s": round(t_unpacked, 3),
                        "max_abs_logprob_diff": float((packed[:, :width] - ref[:, :width]).abs().max())})
    print(json.dumps({
        "rollouts": str(args.rollouts), "groups": len(trees), "prompt_len": args.prompt_len,
        "unique_over_total_tokens": round(unique / total, 4),
        "model": f"SmolLM2-135M shape, {args.layers} layers, fp32, random weights",
        "threads": torch.get_num_threads(), "timed_groups": timings,
        "speedup_median": round(statistics.median(t["unpacked_s"] / t["packed_s"] for t in timings), 2)
        if timings else None,
    }))


if __name__ == "__main__":
    main()
