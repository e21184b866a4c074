"""Tree packing (issue 24): one forward over a group's packed tree gives every row's response log-probs, and the
gradients of the soft and hard PPO losses, of the unpacked forward (Qwen2 and Llama, random trees)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arpo.trainer.core_algos import compute_policy_loss
from arpo.trainer.hard_advantage import compute_hard_advantage
from arpo.trainer.tree_packing import pack_group, packed_response_logprobs

VOCAB = 97


def small_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    return model.float().eval()


def random_tree(seed: int, rows: int = 6) -> tuple[list[int], list[list[int]], list[int], list[int]]:
    """Roots and branches in any row order (a child may come before its parent), forks anywhere from 0 to the
    parent's full length, responses of different lengths."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 7))]
    order = list(range(rows))
    rng.shuffle(order)  # order[k] is the row made k-th; parents are made first
    responses: list[list[int]] = [[] for _ in range(rows)]
    parent, branch_pos = [-1] * rows, [0] * rows
    for k, r in enumerate(order):
        if k and rng.random() < 0.7:
            p = order[rng.randrange(k)]
            parent[r], branch_pos[r] = p, rng.randint(0, len(responses[p]))
            responses[r] = responses[p][: branch_pos[r]]
        responses[r] = responses[r] + [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 9))]
    return prompt, responses, parent, branch_pos


def unpacked_logprobs(model, prompt, responses) -> torch.Tensor:
    width = max(1, max(len(r) for r in responses))
    out = torch.zeros(len(responses), width)
    for i, resp in enumerate(responses):
        if not resp:
            continue
        ids = torch.tensor([prompt + resp])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
        out[i, : len(resp)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(resp)[:, None])[:, 0]
    return out


def response_mask(responses, width) -> torch.Tensor:
    return torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("seed", range(4))
def test_packed_logprobs_equal_the_unpacked_forward(kind, seed):
    model = small_model(kind)
    prompt, responses, parent, branch_pos = random_tree(seed)
    group = pack_group(prompt, responses, parent, branch_pos)
    expect_unique = len(prompt) + sum(len(r) - (branch_pos[i] if parent[i] >= 0 else 0)
                                      for i, r in enumerate(responses))
    assert group.unique_tokens == expect_unique < len(prompt) * len(responses) + sum(map(len, responses))
    with torch.no_grad():
        packed = packed_response_logprobs(model, group)
        ref = unpacked_logprobs(model, prompt, responses)
    mask = response_mask(responses, ref.shape[1]).bool()
    assert torch.allclose(packed[mask], ref[mask], atol=1e-5, rtol=0)
    assert not packed[~mask].any()


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("seed", range(3))
def test_soft_and_hard_loss_gradients_equal_the_unpacked_ones(mode, seed):
    model = small_model("qwen2")
    prompt, responses, parent, branch_pos = random_tree(100 + seed)
    group = pack_group(prompt, responses, parent, branch_pos)
    width = group.row_index.shape[1]
    mask = response_mask(responses, width)
    rng = np.random.default_rng(seed)
    adv_rows = torch.tensor(rng.normal(size=len(responses)), dtype=torch.float32)
    if mode == "soft":
        advantages = adv_rows[:, None] * mask
    else:
        advantages = compute_hard_advantage(adv_rows, mask, np.zeros(len(responses)), np.asarray(parent),
                                            np.asarray(branch_pos))
    with torch.no_grad():  # a rollout policy a little off the current one, so clipping is active somewhere
        old = unpacked_logprobs(model, prompt, responses) + torch.tensor(rng.normal(0, 0.3, mask.shape),
                                                                          dtype=torch.float32) * mask

    def grads(logprob_fn):
        model.zero_grad()
        loss = compute_policy_loss(old, logprob_fn(), advantages, mask, cliprange=0.2)[0]
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_p, g_packed = grads(lambda: packed_response_logprobs(model, group))
    loss_u, g_unpacked = grads(lambda: unpacked_logprobs(model, prompt, responses))
    assert loss_p == pytest.approx(loss_u.item(), abs=1e-6)
    for a, b in zip(g_packed, g_unpacked):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item() + 1e-8)


def test_rows_that_do_not_share_their_fork_prefix_are_refused():
    with pytest.raises(ValueError, match="does not share its first 2 response tokens with row 0"):
        pack_group([1, 2], [[5, 6, 7], [5, 9, 8]], [-1, 0], [0, 2])
    with pytest.raises(ValueError, match="cycle"):
        pack_group([1], [[5], [5]], [1, 0], [1, 1])
