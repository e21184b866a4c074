"""Benchmark of the algorithm layer; prints one JSON object.

    python experiments/bench_algos.py [--groups 128 --group-size 16 --response-length 4096]
                                      [--adv-prompts 64 --adv-group-size 8] [--parts group_advantages,...]
    python experiments/bench_algos.py --parts gae,value_loss --adv-prompts 4 --adv-group-size 4 \
        --response-length 64 --repeats 1                                          # smoke: the critic's parts
    python experiments/bench_algos.py --parts hard_advantage,group_advantages --groups 4 --group-size 4 \\
        --response-length 64 --adv-prompts 4 --adv-group-size 4 --repeats 1     # smoke: seconds

* hard advantage on random ARPO-like trees (every group a root plus forks), in ms per batch;
* chunked response log-probs + entropy with a 151,936-token vocabulary vs the naive full-logits path
  (time and the size of the largest logits tensor each path creates);
* the group advantage estimators, loop forms (grpo, rloo: one group at a time) against the vectorized
  forms (grpo_vectorized, rloo_vectorized: scatter-adds), on --adv-prompts x --adv-group-size rows of
  --response-length tokens with uid labels, in ms per call (median of --repeats), with the largest
  difference between the two forms' advantages;
* the critic's side on the same --adv-prompts x --adv-group-size rows of --response-length tokens, with
  tool-result gaps in the mask: GAE (a Python loop over the positions) and the clipped value loss, forward
  and forward + backward, in ms per call (median of --repeats).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from arpo.trainer import core_algos
from arpo.trainer.hard_advantage import compute_hard_advantage
from arpo.trainer.logprobs import compute_logprobs_and_entropy


def random_tree_batch(groups: int, group_size: int, t_len: int, seed: int = 0):
    rng = random.Random(seed)
    parent, branch_pos, index = [], [], []
    for g in range(groups):
        first = len(parent)
        for k in range(group_size):
            p = rng.randrange(first, first + k) if k else -1
            parent.append(p)
            branch_pos.append(rng.randrange(0, t_len) if k else 0)
            index.append(f"uid-{g}")
    b = len(parent)
    return (torch.randn(b), torch.ones(b, t_len), np.array(index, dtype=object), np.array(parent),
            np.array(branch_pos))


def bench_hard(groups: int, group_size: int, t_len: int, repeats: int = 3) -> dict:
    args = random_tree_batch(groups, group_size, t_len)
    compute_hard_advantage(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        compute_hard_advantage(*args)
    return {"rows": groups * group_size, "response_length": t_len,
            "ms_per_batch": round((time.perf_counter() - start) / repeats * 1000, 1)}


def bench_logprobs(batch: int, prompt: int, response: int, chunk: int, vocab: int = 151936) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # seconds to import: only for this part

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=prompt + response)).eval()
    ids = torch.randint(0, vocab, (batch, prompt + response))
    attn = torch.ones_like(ids)
    pos = torch.arange(prompt + response).expand(batch, -1)
    with torch.no_grad():
        start = time.perf_counter()
        compute_logprobs_and_entropy(model, ids, attn, pos, response, chunk_size=chunk, calc_entropy=True)
        chunked_s = time.perf_counter() - start
        start = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -response - 1:-1]
        logp = torch.log_softmax(logits.float(), -1)
        logp.gather(-1, ids[:, -response:].unsqueeze(-1))
        (-(logp.exp() * logp).sum(-1))
        naive_s = time.perf_counter() - start
    return {"batch": batch, "prompt": prompt, "response": response, "vocab": vocab, "chunk_size": chunk,
            "chunked_s": round(chunked_s, 3), "naive_s": round(naive_s, 3),
            "largest_logits_mb_chunked": round(chunk * vocab * 4 / 2**20, 1),
            "largest_logits_mb_naive": round(batch * (prompt + response) * vocab * 4 / 2**20, 1)}


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(float(np.median(times)) * 1000, 2)


def bench_group_advantages(prompts: int, group_size: int, t_len: int, repeats: int = 5, seed: int = 0) -> dict:
    """Loop vs vectorized GRPO / RLOO on a batch shaped like a training step: ``prompts`` groups of
    ``group_size`` rows (adjacent, as the rollout emits them), binary outcome on each row's last token."""
    gen = torch.Generator().manual_seed(seed)
    rows = prompts * group_size
    lengths = torch.randint(t_len // 8, t_len + 1, (rows,), generator=gen)
    mask = (torch.arange(t_len).unsqueeze(0) < lengths.unsqueeze(1)).float()
    rewards = torch.zeros(rows, t_len)
    rewards[torch.arange(rows), lengths - 1] = (torch.rand(rows, generator=gen) > 0.5).float()
    index = np.array([f"uid-{p}" for p in range(prompts) for _ in range(group_size)], dtype=object)
    result: dict = {"rows": rows, "prompts": prompts, "group_size": group_size, "response_length": t_len,
                    "repeats": repeats}
    for loop_name, vec_name in (("grpo", "grpo_vectorized"), ("rloo", "rloo_vectorized")):
        loop_fn, vec_fn = core_algos.get_adv_estimator_fn(loop_name), core_algos.get_adv_estimator_fn(vec_name)
        kwargs = {"token_level_rewards": rewards, "response_mask": mask, "index": index}
        loop_ms = _median_ms(lambda: loop_fn(**kwargs), repeats)
        vec_ms = _median_ms(lambda: vec_fn(**kwargs), repeats)
        diff = float((loop_fn(**kwargs)[0] - vec_fn(**kwargs)[0]).abs().max())
        # The part the two forms differ in: the same call on one position per row (scores only).
        scalar = {"token_level_rewards": rewards.sum(dim=-1, keepdim=True), "response_mask": torch.ones(rows, 1),
                  "index": index}
        loop_stats_ms = _median_ms(lambda: loop_fn(**scalar), repeats)
        vec_stats_ms = _median_ms(lambda: vec_fn(**scalar), repeats)
        result[loop_name] = {"loop_ms": loop_ms, "vectorized_ms": vec_ms,
                             "speedup": round(loop_ms / vec_ms, 2) if vec_ms else None,
                             "group_stats_loop_ms": loop_stats_ms, "group_stats_vectorized_ms": vec_stats_ms,
                             "group_stats_speedup": round(loop_stats_ms / vec_stats_ms, 1) if vec_stats_ms else None,
                             "max_abs_diff": diff}
    # What both forms share: the (rows, T) reward sum and the broadcast over the mask (on CPU most of the time).
    result["shared_broadcast_ms"] = _median_ms(lambda: rewards.sum(dim=-1).unsqueeze(-1) * mask, repeats)
    return result


def critic_batch(rows: int, t_len: int, seed: int = 0) -> dict:
    """Rewards on each row's last token, random values / returns / predictions and a mask of responses of
    random length, each with up to two tool results (mask 0) of t_len/64 to t_len/16 tokens in it."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t_len // 8, t_len + 1, (rows,), generator=gen)
    pos = torch.arange(t_len).unsqueeze(0)
    mask = (pos < lengths.unsqueeze(1)).float()
    for _ in range(2):
        start = (torch.rand(rows, 1, generator=gen) * (lengths.unsqueeze(1) - 1)).long()
        width = torch.randint(max(1, t_len // 64), max(2, t_len // 16) + 1, (rows, 1), generator=gen)
        mask[(pos >= start) & (pos < start + width)] = 0
    last = torch.where(mask.bool(), pos, -1).amax(dim=1).clamp_min(0)
    rewards = torch.zeros(rows, t_len)
    rewards[torch.arange(rows), last] = (torch.rand(rows, generator=gen) > 0.5).float()
    values = torch.randn(rows, t_len, generator=gen)
    returns = values + torch.randn(rows, t_len, generator=gen) * 0.8
    vpreds = returns + torch.randn(rows, t_len, generator=gen) * 0.3
    return {"rewards": rewards, "mask": mask, "values": values, "returns": returns, "vpreds": vpreds}


def bench_gae(prompts: int, group_size: int, t_len: int, repeats: int = 5) -> dict:
    """GAE (gamma 1, lam 0.95) on a (rows, T) batch with tool gaps: one backward pass over T positions."""
    b = critic_batch(prompts * group_size, t_len)
    fn = core_algos.get_adv_estimator_fn("gae")
    ms = _median_ms(lambda: fn(token_level_rewards=b["rewards"], values=b["values"], response_mask=b["mask"],
                               gamma=1.0, lam=0.95), repeats)
    return {"rows": prompts * group_size, "response_length": t_len, "mask_fraction": round(float(b["mask"].mean()), 3),
            "repeats": repeats, "ms": ms}


def bench_value_loss(prompts: int, group_size: int, t_len: int, repeats: int = 5) -> dict:
    """The clipped value loss (token-mean, cliprange_value 0.2) on a (rows, T) batch: forward, forward + backward."""
    b = critic_batch(prompts * group_size, t_len)
    vpreds = b["vpreds"].clone().requires_grad_(True)

    def forward():
        return core_algos.compute_value_loss(vpreds, b["returns"], b["values"], b["mask"], 0.2)

    def forward_backward():
        vf_loss, _ = forward()
        vf_loss.backward()
        vpreds.grad = None

    with torch.no_grad():
        forward_ms = _median_ms(forward, repeats)
    _, clipfrac = forward()
    return {"rows": prompts * group_size, "response_length": t_len, "repeats": repeats, "forward_ms": forward_ms,
            "forward_backward_ms": _median_ms(forward_backward, repeats), "vf_clipfrac": round(float(clipfrac), 3)}


PARTS = ("hard_advantage", "logprobs", "group_advantages", "gae", "value_loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--adv-prompts", type=int, default=64, help="group_advantages: prompts (groups)")
    parser.add_argument("--adv-group-size", type=int, default=8, help="group_advantages: rows per prompt")
    parser.add_argument("--repeats", type=int, default=5,
                        help="group_advantages, gae, value_loss: timed calls per form")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    result: dict = {}
    if "hard_advantage" in parts:
        result["hard_advantage"] = bench_hard(args.groups, args.group_size, args.response_length)
    if "logprobs" in parts:
        result["logprobs"] = bench_logprobs(batch=4, prompt=64, response=448, chunk=args.chunk_size)
    if "group_advantages" in parts:
        result["group_advantages"] = bench_group_advantages(args.adv_prompts, args.adv_group_size,
                                                            args.response_length, repeats=args.repeats)
    if "gae" in parts:
        result["gae"] = bench_gae(args.adv_prompts, args.adv_group_size, args.response_length, args.repeats)
    if "value_loss" in parts:
        result["value_loss"] = bench_value_loss(args.adv_prompts, args.adv_group_size, args.response_length,
                                                args.repeats)
    result["torch_threads"] = torch.get_num_threads()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
