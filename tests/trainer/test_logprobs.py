"""Chunked log-probs / entropy against the naive full-logits computation on a tiny random Qwen2."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from arpo.trainer.logprobs import (compute_logprobs_and_entropy, entropy_from_logits, left_align,
                                   shared_prefix_length,
                                   logprobs_from_logits)

VOCAB = 101


def test_logprobs_and_entropy_from_logits_by_hand():
    # Row 0: logits (0, ln 3) → p = (1/4, 3/4). Row 1: uniform over 2.
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    lp = logprobs_from_logits(logits, torch.tensor([1, 0]), chunk_size=1)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.5)]))
    ent = entropy_from_logits(logits, chunk_size=1)
    # 0.25·ln 4 + 0.75·ln(4/3) = 0.5623351; ln 2 = 0.6931472
    torch.testing.assert_close(ent, torch.tensor([0.5623351, 0.6931472]))


@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_logits_functions_match_naive(chunk_size):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 11, VOCAB, generator=gen) * 4
    labels = torch.randint(0, VOCAB, (3, 11), generator=gen)
    naive_lp = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(logits, -1)
    naive_ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size), naive_lp)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size), naive_ent)
    # bf16 input is upcast to fp32 inside each chunk.
    assert logprobs_from_logits(logits.bfloat16(), labels, chunk_size).dtype == torch.float32


def _tiny_model(tie: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).float().eval()


def _verl_batch():
    """3 rows in verl layout: prompts left-padded to 5, responses right-padded to 6 (pad id 0)."""
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16]]
    responses = [[20, 21, 22, 23, 24, 25], [30, 31], [40, 41, 42, 43]]
    p_len, r_len = 5, 6
    input_ids = torch.zeros(3, p_len + r_len, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, p_len - len(p): p_len] = torch.tensor(p)
        input_ids[i, p_len: p_len + len(r)] = torch.tensor(r)
        attn[i, p_len - len(p): p_len + len(r)] = 1
    position_ids = torch.clamp(torch.cumsum(attn, 1) - 1, min=0)
    return input_ids, attn, position_ids, r_len


def _naive(model, input_ids, attn, position_ids, r_len, temperature):
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids).logits
    logits = logits[:, -r_len - 1: -1].float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, input_ids[:, -r_len:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    valid = attn[:, -r_len:].float()
    return lp * valid, ent * valid


@pytest.mark.parametrize("tie", [False, True])
def test_compute_logprobs_and_entropy_matches_naive_forward_and_grad(tie):
    model = _tiny_model(tie)
    input_ids, attn, position_ids, r_len = _verl_batch()
    valid = attn[:, -r_len:].float()

    # Record every output-head call: no call may project more than chunk_size positions.
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: head_rows.append(o.reshape(-1, o.shape[-1]).shape[0]))
    lp, ent = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=5,
                                           temperature=0.7, calc_entropy=True)
    hook.remove()
    assert head_rows and max(head_rows) <= 5
    assert sum(head_rows) == int(valid.sum())  # padding positions are never projected
    assert isinstance(model.lm_head, torch.nn.Linear)  # the original head is back

    naive_lp, naive_ent = _naive(model, input_ids, attn, position_ids, r_len, temperature=0.7)
    torch.testing.assert_close(lp, naive_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, naive_ent, atol=1e-5, rtol=1e-5)

    # Gradients through the chunked, checkpointed head equal the naive ones.
    weights = torch.linspace(-1, 1, r_len).expand(3, r_len)
    (lp * weights).sum().add((ent * weights).sum() * 0.1).backward()
    chunked_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    naive_lp, naive_ent = _naive(model, input_ids, attn, position_ids, r_len, temperature=0.7)
    (naive_lp * weights).sum().add((naive_ent * weights).sum() * 0.1).backward()
    for got, (name, p) in zip(chunked_grads, model.named_parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_compute_logprobs_without_entropy_and_no_grad():
    model = _tiny_model(False)
    input_ids, attn, position_ids, r_len = _verl_batch()
    with torch.no_grad():
        lp, ent = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=64)
        naive_lp, _ = _naive(model, input_ids, attn, position_ids, r_len, temperature=1.0)
    assert ent is None
    torch.testing.assert_close(lp, naive_lp, atol=1e-5, rtol=1e-5)


def test_compute_logprobs_bad_arguments():
    model = _tiny_model(False)
    input_ids, attn, position_ids, _ = _verl_batch()
    with pytest.raises(ValueError, match="response_length"):
        compute_logprobs_and_entropy(model, input_ids, attn, position_ids, input_ids.shape[1])
    with pytest.raises(ValueError, match="temperature"):
        compute_logprobs_and_entropy(model, input_ids, attn, position_ids, 3, temperature=0.0)


FSDP_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from tests.trainer.test_logprobs import _tiny_model, _verl_batch, _naive
from arpo.trainer.logprobs import compute_logprobs_and_entropy
for tie in (False, True):
    model, ref = _tiny_model(tie), _tiny_model(tie)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids, attn, pos, r = _verl_batch()
    lp, ent = compute_logprobs_and_entropy(model, ids, attn, pos, r, chunk_size=4, calc_entropy=True)
    (lp.sum() + ent.sum()).backward()
    nlp, nent = _naive(ref, ids, attn, pos, r, 1.0)
    (nlp.sum() + nent.sum()).backward()
    torch.testing.assert_close(lp, nlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, nent, atol=1e-5, rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
dist.destroy_process_group()
print("FSDP2-OK", flush=True)
# interpreter teardown can abort in c10d's threads ("terminate called without an active exception", ~1 run in 4
# on a Zen 4 CPU) after everything here passed: end without it
os._exit(0)
"""


@pytest.mark.slow
def test_compute_logprobs_under_fsdp2(tmp_path):
    # The chunked head runs inside the root module's forward, so FSDP2's parameter gathering (tied
    # embeddings included) works unchanged. Own process: a process group is global state.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # a file rendezvous: a probed-free TCP port can be taken before the process binds it
    proc = subprocess.run([sys.executable, "-c", FSDP_SCRIPT, str(tmp_path / "rendezvous")], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0 and "FSDP2-OK" in proc.stdout, proc.stdout + proc.stderr


def _padded_batch():
    """_verl_batch with 3 extra padding columns on each side that no row uses (as a micro-batch of short
    rows cut from a batch with longer ones)."""
    input_ids, attn, position_ids, r_len = _verl_batch()
    pad = lambda t: torch.nn.functional.pad(t, (3, 3))  # noqa: E731
    return pad(input_ids), pad(attn), pad(position_ids), r_len + 3


def test_left_aligned_rows_without_padding_mask_change_nothing():
    model = _tiny_model(False)
    input_ids, attn, position_ids, r_len = _padded_batch()
    ids, pos, sources = left_align(input_ids, attn, position_ids, r_len)
    lengths = attn.sum(1)
    assert ids.shape[1] == int(lengths.max())  # no column is padding for every row
    for i in range(len(ids)):  # each row's tokens and positions, moved to the left edge, in order
        assert ids[i, : lengths[i]].tolist() == input_ids[i][attn[i].bool()].tolist()
        assert pos[i, : lengths[i]].tolist() == position_ids[i][attn[i].bool()].tolist()
    # Padding positions continue the row's, so HF does not read them as the start of a packed sequence.
    assert bool((pos.diff(dim=1) == 1).all())
    # The column before each response token predicts it.
    first = sources[:, 0]
    assert ids[torch.arange(3), first + 1].tolist() == input_ids[:, -r_len].tolist()

    results = []
    for pack in (False, True):
        model.zero_grad()
        lp, ent = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=4,
                                               calc_entropy=True, pack=pack)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert lp1.shape == lp0.shape == (3, r_len)
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent1, ent0, atol=1e-6, rtol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_left_align_declines_rows_with_holes():
    input_ids, attn, position_ids, r_len = _verl_batch()
    attn = attn.clone()
    attn[0, -r_len + 1] = 0  # a hole inside row 0's response
    assert left_align(input_ids, attn, position_ids, r_len) is None


def test_head_mask_projects_only_the_loss_positions():
    model = _tiny_model(True)
    input_ids, attn, position_ids, r_len = _verl_batch()
    loss_mask = attn[:, -r_len:].clone()
    loss_mask[:, 1::2] = 0  # e.g. tool-result tokens: in the sequence, but no loss
    weights = torch.linspace(-1, 1, r_len).expand(3, r_len) * loss_mask
    grads = []
    for head_mask in (None, loss_mask):
        model.zero_grad()
        lp, _ = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=4,
                                             head_mask=head_mask)
        (lp * weights).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if head_mask is None:
            full = lp.detach()
    torch.testing.assert_close(lp.detach(), full * loss_mask, atol=1e-6, rtol=1e-6)
    assert not lp.detach()[loss_mask == 0].any()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_entropy_as_a_metric_has_the_same_values_and_no_gradient():
    model = _tiny_model(False)
    input_ids, attn, position_ids, r_len = _verl_batch()
    lp, ent = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=4,
                                           calc_entropy=True, entropy_grad=False)
    _, ent_grad = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=4,
                                               calc_entropy=True, entropy_grad=True)
    torch.testing.assert_close(ent, ent_grad.detach(), atol=1e-6, rtol=1e-6)
    ent.sum().backward()  # the output shares a graph with the log-probs, but no gradient reaches the weights
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_bf16_autocast_log_probs_agree_with_fp32():
    """CPU bf16 autocast (the decoder's matmuls and attention in bf16, the head in fp32) against fp32.

    bf16 keeps 8 significant bits: one rounding moves a value by up to u = 2^-8 of itself, so rounding the
    logits alone could move a log-prob by ~u·max|logit|. With the head in fp32 only the hidden states carry
    rounding; the tolerance allows two such roundings, and the fp32 head must beat a bf16 one."""
    model = _tiny_model(True)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # logits up to ~12, log-probs near -8: as peaked as a trained model's
    input_ids, attn, position_ids, r_len = _verl_batch()
    valid = attn[:, -r_len:].bool()
    with torch.no_grad():
        max_logit = float(model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids).logits.abs().max())
        lp32, ent32 = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, calc_entropy=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            lp16, ent16 = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, calc_entropy=True)
            lp_bf16_head, _ = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len,
                                                           head_fp32=False)
    assert lp16.dtype == torch.float32
    u = 2.0 ** -8
    err = float((lp16 - lp32)[valid].abs().max())
    assert 0 < err <= 2 * u * max_logit  # > 0: autocast did compute in bf16
    assert float((ent16 - ent32)[valid].abs().max()) <= 2 * u * max_logit
    assert err < float((lp_bf16_head - lp32)[valid].abs().max())


def _shared_prefix_batch(system_len: int = 20):
    """4 rows in verl layout that all begin with the same ``system_len`` tokens (a system prompt), then
    their own question and response of different lengths."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, VOCAB, (system_len,), generator=g).tolist()
    prompts = [system + torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 6, 4, 5)]
    responses = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (9, 4, 7, 2)]
    p_len, r_len = max(map(len, prompts)), max(map(len, responses))
    input_ids = torch.zeros(4, p_len + r_len, dtype=torch.long)
    attn = torch.zeros_like(input_ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, p_len - len(p): p_len] = torch.tensor(p)
        input_ids[i, p_len: p_len + len(r)] = torch.tensor(r)
        attn[i, p_len - len(p): p_len + len(r)] = 1
    return input_ids, attn, torch.clamp(torch.cumsum(attn, 1) - 1, min=0), r_len


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_runs_once_with_the_same_log_probs_and_gradients(checkpointing):
    model = _tiny_model(True)
    input_ids, attn, position_ids, r_len = _shared_prefix_batch()
    ids, _, sources = left_align(input_ids, attn, position_ids, r_len)
    valid = attn[:, -r_len:].bool()
    assert shared_prefix_length(ids, sources, valid) == 20
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    weights = torch.linspace(-1, 1, r_len).expand(4, r_len)
    results, decoder_tokens = [], []
    hook = model.model.layers[0].register_forward_hook(
        lambda m, args, out: decoder_tokens.append(args[0].shape[0] * args[0].shape[1]))
    for share in (False, True):
        model.zero_grad()
        decoder_tokens.clear()
        lp, ent = compute_logprobs_and_entropy(model, input_ids, attn, position_ids, r_len, chunk_size=4,
                                               calc_entropy=True, share_prefix=share)
        (lp * weights).sum().add(0.1 * (ent * weights).sum()).backward()
        results.append((lp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]))
        if share:  # the prefix once (one row) and each row's rest, in the forward (and once more, replayed)
            assert decoder_tokens[:2] == [20, 4 * (ids.shape[1] - 20)]
        else:
            assert decoder_tokens[0] == 4 * ids.shape[1]
    hook.remove()
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert all(not hasattr(m, "_can_checkpoint_with_cache") or not m._can_checkpoint_with_cache
               for m in model.modules())
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    for a, (name, _), b in zip(g1, model.named_parameters(), g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_shared_prefix_needs_a_common_unscored_start():
    input_ids, attn, position_ids, r_len = _shared_prefix_batch(system_len=20)
    ids, _, sources = left_align(input_ids, attn, position_ids, r_len)
    valid = attn[:, -r_len:].bool()
    assert shared_prefix_length(ids[:1], sources[:1], valid[:1]) == 0  # one row: nothing to share
    short_ids, short_sources = ids.clone(), sources.clone()
    short_ids[2, 10] += 1  # rows part after 10 tokens: below MIN_SHARED_PREFIX
    assert shared_prefix_length(short_ids, sources, valid) == 0
    # a scored token inside the common start: the prefix stops at the hidden state that predicts it
    short_sources[0, 0] = 17
    assert shared_prefix_length(ids, short_sources, valid) == 17


FSDP_SHARED_PREFIX_SCRIPT = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
rendezvous, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + rendezvous, rank=rank, world_size=2)
from tests.trainer.test_logprobs import _tiny_model, _shared_prefix_batch
from arpo.trainer.logprobs import compute_logprobs_and_entropy
model, ref = _tiny_model(True), _tiny_model(True)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.train()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
ids, attn, pos, r = _shared_prefix_batch()
for step in range(2):  # twice: FSDP2's per-forward backward hooks must reset between steps
    model.zero_grad()
    ref.zero_grad()
    lp, ent = compute_logprobs_and_entropy(model, ids, attn, pos, r, chunk_size=4, calc_entropy=True,
                                           share_prefix=True)
    (lp.sum() + 0.1 * ent.sum()).backward()
    nlp, nent = compute_logprobs_and_entropy(ref, ids, attn, pos, r, chunk_size=4, calc_entropy=True, pack=False)
    (nlp.sum() + 0.1 * nent.sum()).backward()
    torch.testing.assert_close(lp, nlp, atol=1e-5, rtol=1e-5)
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # both ranks ran the same rows: the average is one process's
        torch.testing.assert_close(p.grad.full_tensor(), grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)
dist.destroy_process_group()
print("FSDP2-SHARED-OK", flush=True)
# interpreter teardown can abort in c10d's threads ("terminate called without an active exception", ~1 run in 4
# on a Zen 4 CPU) after everything here passed: end without it
os._exit(0)
"""


@pytest.mark.slow
def test_shared_prefix_under_two_rank_fsdp2_with_checkpointing(tmp_path):
    # The prefix pass is a second forward of every FSDP2 module before one backward (two pre/post-backward
    # intervals per module): the gradients must still be one process's.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    rendezvous = str(tmp_path / "rendezvous")
    procs = [subprocess.Popen([sys.executable, "-c", FSDP_SHARED_PREFIX_SCRIPT, rendezvous, str(rank)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "FSDP2-SHARED-OK" in out, out[-3000:]
