"""Tree packing: one forward over a group's packed tree gives every row's response log-probs, and the
gradients of the soft and hard PPO losses, of the unpacked forward (Qwen2 and Llama, random trees)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arpo.trainer.core_algos import compute_policy_loss
from arpo.trainer.hard_advantage import compute_hard_advantage
from arpo.trainer.tree_attention import TREE_SDPA, use_tree_attention
from arpo.trainer.tree_packing import pack_group, packed_response_logprobs

VOCAB = 97


def small_model(kind: str, attention: str = "dense") -> torch.nn.Module:
    """``attention``: "tree" switches the model to segment-by-segment tree attention (the actor's), "dense"
    leaves SDPA, which then takes the tree as a dense mask."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**common))
    assert model.config._attn_implementation == "sdpa"
    if attention == "tree":
        assert use_tree_attention(model) and model.config._attn_implementation == TREE_SDPA
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


@pytest.mark.parametrize("attention", ["dense", "tree"])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("seed", range(4))
def test_packed_logprobs_equal_the_unpacked_forward(kind, seed, attention):
    model = small_model(kind, attention)
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


@pytest.mark.parametrize("seed", range(20))
def test_tree_segments_attend_exactly_what_the_dense_mask_allows(seed):
    prompt, responses, parent, branch_pos = random_tree(200 + seed, rows=8)
    group = pack_group(prompt, responses, parent, branch_pos)
    seen = torch.zeros_like(group.allowed)
    for seg in group.segments:
        for q in range(seg.start, seg.end):
            if seg.keys is None:  # the prompt: causal over itself
                seen[q, seg.start: q + 1] = True
            else:
                seen[q, seg.keys[seg.mask[q - seg.start]]] = True
    assert torch.equal(seen, group.allowed)
    assert [s.start for s in group.segments[1:]] == [s.end for s in group.segments[:-1]]
    pairs = sum((s.end - s.start) * (len(s.keys) if s.keys is not None else s.end - s.start) for s in group.segments)
    assert pairs <= group.unique_tokens ** 2  # what SDPA computes: never more than the dense mask's tokens²


@pytest.mark.parametrize("attention", ["dense", "tree"])
@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("seed", range(3))
def test_soft_and_hard_loss_gradients_equal_the_unpacked_ones(mode, seed, attention):
    model = small_model("qwen2", attention)
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


# -- the actor's packed layout: micro-batches of one tree, trees dealt whole to ranks ----------------------------

def tree_micro(groups: int = 1, rows: int = 6, seed: int = 0):
    from arpo.trainer.tree_packing import tree_columns
    from tests.trainer.workers_helpers import tree_batch

    batch = tree_batch(groups, rows, seed, vocab=VOCAB)
    batch.tensors.update(tree_columns(batch))
    return batch


def padded_forward(model, batch, **kwargs):
    from arpo.trainer.logprobs import compute_logprobs_and_entropy

    return compute_logprobs_and_entropy(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"],
                                        batch["responses"].shape[1], pack=False, **kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_a_collated_tree_packs_to_the_padded_forwards_log_probs_and_entropy(seed):
    from arpo.trainer.tree_packing import pack_micro_batch, packed_logprobs_and_entropy, unique_token_count

    model = small_model("llama")
    micro = tree_micro(seed=seed)
    group = pack_micro_batch(micro)
    width = micro["responses"].shape[1]
    assert group is not None
    assert group.unique_tokens == unique_token_count(micro, list(range(len(micro)))) < int(micro["attention_mask"].sum())
    with torch.no_grad():
        lp, ent = packed_logprobs_and_entropy(model, group, width, calc_entropy=True, chunk_size=5)
        ref_lp, ref_ent = padded_forward(model, micro, calc_entropy=True)
        # only loss positions through the head: tool results (and padding) come back 0
        masked, _ = packed_logprobs_and_entropy(model, group, width, head_mask=micro["response_mask"])
    attended = micro["attention_mask"][:, -width:].bool()
    assert torch.allclose(lp[attended], ref_lp[attended], atol=1e-5, rtol=0)
    assert torch.allclose(ent[attended], ref_ent[attended], atol=1e-5, rtol=0)
    assert not lp[~attended].any() and not ent[~attended].any()
    loss_pos = micro["response_mask"].bool()
    assert torch.allclose(masked[loss_pos], ref_lp[loss_pos], atol=1e-5, rtol=0) and not masked[~loss_pos].any()


def test_rows_whose_parent_is_absent_or_not_a_prefix_pack_as_roots_with_the_same_result(caplog):
    from arpo.trainer.tree_packing import pack_micro_batch, packed_logprobs_and_entropy

    model = small_model("qwen2")
    batch = tree_micro(rows=6, seed=7)
    children = [i for i in range(len(batch)) if int(batch["tree_parent"][i]) >= 0]
    micro = batch.index([i for i in range(len(batch)) if i != int(batch["tree_parent"][children[-1]])])
    broken = tree_micro(rows=6, seed=7)
    broken.tensors["tree_branch_pos"] = broken["tree_branch_pos"] + 2  # claims more than it shares
    for case in (micro, broken):
        group = pack_micro_batch(case)
        with torch.no_grad():
            lp, _ = packed_logprobs_and_entropy(model, group, case["responses"].shape[1])
            ref, _ = padded_forward(model, case)
        assert torch.allclose(lp, ref, atol=1e-5, rtol=0)
    assert "packed as a root" in caplog.text


def test_trees_are_dealt_whole_to_ranks_balanced_by_packed_tokens_and_gathered_back_in_order():
    from arpo.trainer.tree_packing import tree_micro_batches, unique_token_count
    from arpo.trainer.worker_group import gather_rows, split_trees_for_ranks

    batch = tree_micro(groups=7, rows=4, seed=3)
    shares = split_trees_for_ranks(batch, world_size=3, mini_batch_rows=16)  # mini-batches of 4 and 3 groups
    seen = []
    for share in shares:
        for mb in share["mini_batch_id"].unique().tolist():
            rows = share["row_index"][(share["mini_batch_id"] == mb) & (share["is_pad"] == 0)].tolist()
            seen.extend(rows)
    assert sorted(seen) == list(range(len(batch)))
    for tree in batch["tree_id"].unique().tolist():  # each tree on exactly one rank
        holders = {r for r, s in enumerate(shares) if ((s["tree_id"] == tree) & (s["is_pad"] == 0)).any()}
        assert len(holders) == 1
    for mb, rows in ((0, range(16)), (1, range(16, 28))):
        mini = batch.index(list(rows))
        sizes = [unique_token_count(mini, t.tolist()) for t in tree_micro_batches(mini)]
        subs = [s.index((s["mini_batch_id"] == mb).nonzero()[:, 0]) for s in shares]
        loads = [sum(unique_token_count(sub, t.tolist()) for t in tree_micro_batches(sub)) for sub in subs]
        assert sum(loads) == sum(sizes) and max(loads) - min(loads) <= max(sizes)
    values = [{"v": s["row_index"].float()[:, None] * 10} for s in shares]
    back = gather_rows(values, [s["is_pad"] for s in shares], [s["row_index"] for s in shares])
    assert torch.equal(back["v"][:, 0], torch.arange(len(batch)).float() * 10)
    # one tree over two ranks: the rank without a tree gets a pad row, and so still joins every collective
    lone = split_trees_for_ranks(tree_micro(groups=1, rows=3), world_size=2)
    assert [int(s["is_pad"].sum()) for s in lone] == [0, 1] and len(lone[1]) == 1


def test_step_metrics_report_the_packed_token_ratio():
    from arpo.trainer.metrics import compute_data_metrics
    from tests.trainer.workers_helpers import tree_batch

    batch = tree_batch(3, 4, seed=11)
    attn, width = batch["attention_mask"], batch["responses"].shape[1]
    prompt_len = attn[:, :-width].sum(1)
    resp_len = attn[:, -width:].sum(1)
    parent, branch_pos = batch.non_tensors["parent_index"], batch.non_tensors["branch_pos"]
    packed = sum(int(prompt_len[rows[0]]) for rows in (range(g * 4, g * 4 + 4) for g in range(3)))
    packed += sum(int(resp_len[i]) - (int(branch_pos[i]) if parent[i] >= 0 else 0) for i in range(len(batch)))
    ratio = compute_data_metrics(batch)["perf/packed_token_ratio"]
    assert ratio == pytest.approx(packed / int(attn.sum())) and ratio < 0.8


def test_a_micro_batch_is_one_tree_and_a_tree_over_the_token_cap_runs_in_runs_of_rows(monkeypatch):
    import arpo.trainer.fsdp_worker as fsdp_worker
    import arpo.trainer.micro_batches as micro_batches

    cfg = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"dtype": "float32", "tree_packing": True}}}
    worker = fsdp_worker.ActorWorker(cfg)
    batch = tree_micro(groups=3, rows=4, seed=2)
    batch.tensors["is_pad"] = torch.zeros(len(batch), dtype=torch.long)
    batch.tensors["is_pad"][-1] = 1
    micros = worker.micro_batches(batch, micro_size=3)
    assert [m.tolist() for m in micros] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]  # the pad row runs nowhere
    monkeypatch.setattr(micro_batches, "MAX_PACKED_TOKENS", 10)
    assert [m.tolist() for m in worker.micro_batches(batch, micro_size=3)] == [[0, 1, 2], [3], [4, 5, 6], [7],
                                                                               [8, 9, 10]]
    worker.tree_packing = False
    assert len(worker.micro_batches(batch, micro_size=3)) == 4


def test_one_row_trees_share_micro_batches_of_the_micro_size_and_run_padded():
    """A tree of one row shares nothing: one forward each would leave a GPU idle (32 one-row forwards took 13 s
    of update on an H100), so lone rows run together, ``micro_size`` at a time, in the padded layout."""
    from arpo.trainer.fsdp_worker import ActorWorker
    from arpo.trainer.tree_packing import pack_micro_batch

    cfg = {"trainer": {"device": "cpu"}, "actor_rollout_ref": {"model": {"dtype": "float32", "tree_packing": True}}}
    worker = ActorWorker(cfg)
    lone = tree_micro(groups=5, rows=1, seed=3)
    micros = worker.micro_batches(lone, micro_size=2)
    assert [m.tolist() for m in micros] == [[0, 1], [2, 3], [4]]
    assert pack_micro_batch(lone.index(micros[0])) is None  # different prompts: the padded forward runs it
    trees = tree_micro(groups=2, rows=3, seed=3)
    assert [m.tolist() for m in worker.micro_batches(trees, micro_size=2)] == [[0, 1, 2], [3, 4, 5]]


def test_tree_packing_auto_is_on_for_cpu_and_off_for_cuda():
    from arpo.trainer.worker_config import WorkerConfig

    packs = lambda cfg, device, role="actor": WorkerConfig.from_config(cfg, role).model.packs_trees(device)  # noqa: E731
    cfg = {"actor_rollout_ref": {"model": {"tree_packing": "auto"}}}
    assert packs(cfg, "cpu") and not packs(cfg, "cuda")
    assert packs({}, "cpu") and not packs({}, "cuda")  # auto is the default
    cfg["actor_rollout_ref"]["model"]["tree_packing"] = True
    assert packs(cfg, "cuda") and not packs(cfg, "cpu", role="critic")  # the critic's value head runs padded


def test_packed_tree_under_bf16_autocast_matches_the_fast_layouts_padded_forward():
    """The low-precision layout (CPU bf16 autocast, fp32 head, only loss positions through the head): the packed
    forward and the left-aligned padded one agree to bf16 rounding."""
    from arpo.trainer.tree_packing import pack_micro_batch, packed_logprobs_and_entropy

    model = small_model("qwen2")
    micro = tree_micro(seed=4)
    width = micro["responses"].shape[1]
    loss_pos = micro["response_mask"].bool()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        packed, _ = packed_logprobs_and_entropy(model, pack_micro_batch(micro), width,
                                                head_mask=micro["response_mask"])
        from arpo.trainer.logprobs import compute_logprobs_and_entropy
        padded, _ = compute_logprobs_and_entropy(model, micro["input_ids"], micro["attention_mask"],
                                                 micro["position_ids"], width, pack=True,
                                                 head_mask=micro["response_mask"])
    assert torch.allclose(packed[loss_pos], padded[loss_pos], atol=5e-2, rtol=0)
    assert not packed[~loss_pos].any()
