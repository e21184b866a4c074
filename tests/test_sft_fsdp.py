"""SFT on the trainer's FSDP2 workers (arpo/trainer/sft_step.py): the same updates as one process, on 1 or 2 ranks,
from messages and ShareGPT files with the loss mask checked token by token, and resume after a kill."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo.config import load_config
from arpo.data.sft_dataset import CallTargets, iter_trajectory_examples, load_trajectories
from tests.trainer.workers_helpers import one_process_group, ray_cluster  # noqa: F401  (fixtures)

FIXTURES = Path(__file__).parent / "fixtures" / "sft"
MESSAGES = FIXTURES / "messages.jsonl"
SHAREGPT = FIXTURES / "sharegpt_arpo.json"


def _cfg(tmp_path, model_dir, train_file, *extra):
    return load_config("sft", [f"actor_rollout_ref.model.path={model_dir}", f"sft.train_file={train_file}",
                               f"sft.out_dir={tmp_path / 'sft'}", "sft.batch_size=2", "sft.epochs=20",
                               "sft.max_steps=6", "sft.lr=3e-3", "sft.device=cpu", *extra])


def _examples(cfg, model_dir, copies: int = 3):
    tok = AutoTokenizer.from_pretrained(model_dir)
    trajectories = load_trajectories(MESSAGES, "messages", CallTargets.from_tools(cfg.tools)) * copies
    return [ex for ex, _ in iter_trajectory_examples(trajectories, tok)], tok.pad_token_id


def reference_sft(model, examples, *, epochs, batch_size, lr, warmup_ratio, weight_decay, grad_clip, seed, pad_id,
                  max_steps=0, share_prompt_prefix=True):
    """The single-process SFT loop that the worker path replaced (plain model, fused AdamW, warm-up x cosine)."""
    from arpo.sft import _batches, masked_lm_loss

    rng = np.random.default_rng(seed)
    total = max(1, len(examples) // batch_size * epochs)
    total = min(total, max_steps) if max_steps else total
    warmup = max(1, int(total * warmup_ratio))
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    model.train()
    losses = []
    while len(losses) < total:
        for input_ids, attn, labels, prefix in _batches(examples, batch_size, rng, pad_id, share_prompt_prefix):
            loss = masked_lm_loss(model, input_ids, attn, labels, prefix)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            optim.step()
            sched.step()
            losses.append(loss.item())
            if len(losses) >= total:
                break
    return losses


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_one_rank_reproduces_the_single_process_loop(tiny_model_dir, tmp_path, one_process_group):  # noqa: F811
    from arpo.sft import train_sft, train_sft_single_process, worker_config
    from arpo.trainer.worker_group import LocalWorkerGroup

    cfg = _cfg(tmp_path, tiny_model_dir, MESSAGES)
    examples, pad_id = _examples(cfg, tiny_model_dir)
    s = cfg.sft
    hp = dict(epochs=s.epochs, batch_size=s.batch_size, seed=s.seed, pad_id=pad_id, max_steps=s.max_steps)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref_losses = reference_sft(reference, examples, lr=s.lr, warmup_ratio=s.warmup_ratio,
                               weight_decay=s.weight_decay, grad_clip=s.grad_clip, **hp)
    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    old_summary = train_sft_single_process(old, examples, lr=s.lr, warmup_ratio=s.warmup_ratio,
                                           weight_decay=s.weight_decay, grad_clip=s.grad_clip, **hp)
    assert _max_diff({n: p.detach() for n, p in old.named_parameters()},
                     {n: p.detach() for n, p in reference.named_parameters()}) == 0.0
    assert old_summary["losses"] == [round(x, 6) for x in ref_losses]

    group = LocalWorkerGroup(worker_config(cfg, tiny_model_dir, s.max_steps), role="sft")
    try:
        summary = train_sft(group, examples, **hp)
        params = group.full_parameters()
    finally:
        group.shutdown()
    diff = _max_diff(params, {n: p.detach() for n, p in reference.named_parameters()})
    print(f"max |dweight| worker path vs single-process loop: {diff:.3g}")
    assert diff <= 1e-6
    assert summary["steps"] == len(ref_losses) == 6 and summary["mean_shared_prefix"] > 0
    assert np.allclose(summary["losses"], ref_losses, atol=1e-5)
