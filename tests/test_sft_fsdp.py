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
from tests.trainer.workers_helpers import one_process_group  # noqa: F401  (a fixture)

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


def reference_loss(model, input_ids, attention_mask, labels, shared_prefix=0):
    """The single-process loss: the decoder (the prefix once, its cache repeated), the head on trained positions."""
    if shared_prefix:
        cache = model.model(input_ids=input_ids[:1, :shared_prefix], use_cache=True).past_key_values
        cache.batch_repeat_interleave(input_ids.shape[0])
        hidden = model.model(input_ids=input_ids[:, shared_prefix:], attention_mask=attention_mask,
                             past_key_values=cache, use_cache=True).last_hidden_state
        labels = labels[:, shared_prefix:]
    else:
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    return torch.nn.functional.cross_entropy(model.lm_head(hidden[:, :-1][keep]).float(), targets[keep])


def reference_sft(model, examples, *, epochs, batch_size, lr, warmup_ratio, weight_decay, grad_clip, seed, pad_id,
                  max_steps=0, share_prompt_prefix=True):
    """The single-process SFT loop that the worker path replaced (plain model, fused AdamW, warm-up x cosine)."""
    from arpo.data.sft_batches import shuffled_batches

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
        for input_ids, attn, labels, prefix in shuffled_batches(examples, batch_size, rng, pad_id,
                                                                share_prompt_prefix):
            loss = reference_loss(model, input_ids, attn, labels, prefix)
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


def _norm(tensors: dict) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def test_one_rank_reproduces_the_single_process_loop(tiny_model_dir, tmp_path, one_process_group):  # noqa: F811
    from arpo.sft import train_sft, worker_config
    from arpo.trainer.worker_group import LocalWorkerGroup

    cfg = _cfg(tmp_path, tiny_model_dir, MESSAGES)
    examples, pad_id = _examples(cfg, tiny_model_dir)
    s = cfg.sft
    hp = dict(epochs=s.epochs, batch_size=s.batch_size, seed=s.seed, pad_id=pad_id, max_steps=s.max_steps)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref_losses = reference_sft(reference, examples, lr=s.lr, warmup_ratio=s.warmup_ratio,
                               weight_decay=s.weight_decay, grad_clip=s.grad_clip, **hp)
    group = LocalWorkerGroup(worker_config(s, tiny_model_dir, s.max_steps), role="sft")
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


class BatchSpy:
    """Records the global batches the driver hands to the ranks (wraps ``WorkerGroup.sft_step``)."""

    def __init__(self, monkeypatch):
        from arpo.trainer.worker_group import WorkerGroup

        self.batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = WorkerGroup.sft_step
        spy = self

        def sft_step(group, input_ids, attention_mask, labels, shared_prefix=0):
            spy.batches.append((input_ids.clone(), attention_mask.clone(), labels.clone()))
            return real(group, input_ids, attention_mask, labels, shared_prefix)

        monkeypatch.setattr(WorkerGroup, "sft_step", sft_step)


def expected_rows(cfg, tok, train_file, fmt) -> dict[tuple[int, ...], list[int]]:
    """Each trajectory's token ids -> its labels, built here from the file's turns: the prompt and every tool result
    -100, every assistant token and the closing EOS its own id."""
    rows = {}
    for t in load_trajectories(train_file, fmt, CallTargets.from_tools(cfg.tools)):
        prompt = tok.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
        ids, labels = list(prompt), [-100] * len(prompt)
        for seg in t.segments:
            seg_ids = tok.encode(seg.text, add_special_tokens=False)
            ids += seg_ids
            labels += seg_ids if seg.is_model else [-100] * len(seg_ids)
        rows[tuple(ids + [tok.eos_token_id])] = labels + [tok.eos_token_id]
    return rows


def check_masks(spy: BatchSpy, expected: dict, tok) -> None:
    """Every row the ranks trained on: its labels equal the expected ones token by token; the trained text is
    assistant text (no <result> inside), the masked text after the prompt is tool results only."""
    seen = set()
    for input_ids, attn, labels in spy.batches:
        for ids, mask, lab in zip(input_ids.tolist(), attn.tolist(), labels.tolist()):
            n = sum(mask)
            key = tuple(ids[:n])
            assert key in expected, "a row that is no trajectory of the file"
            assert lab[:n] == expected[key]
            assert all(x == -100 for x in lab[n:])  # padding carries no loss
            trained = tok.decode([x for x in lab[:n] if x != -100])
            assert "<result>" not in trained and "</answer>" in trained
            seen.add(key)
    assert seen == set(expected)  # every trajectory was trained on
    some = next(iter(expected))
    masked_tail = [i for i, x in zip(some, expected[some]) if x == -100]
    assert any(tok.decode(masked_tail).count(tag) for tag in ("<result>",))


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def test_sft_from_a_messages_file_on_two_ranks_equals_one_rank(tiny_model_dir, tmp_path, ray_cluster,  # noqa: F811
                                                               monkeypatch, one_process_group):  # noqa: F811
    from arpo.sft import run_sft

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spy = BatchSpy(monkeypatch)
    # The same rows per forward (one row on each of 2 ranks; micro-batches of one row on 1 rank). Kernels sum in an
    # order set by the thread count and the buffers, so losses and gradients agree to rounding, not to the bit, and
    # Adam (g / sqrt(v)) turns a rounding-sized gradient into a weight step of full size where v is tiny: the largest
    # single weight difference says little (1e-5 with one thread here, 3e-7 with two). What a wrong row, mask or
    # reduction would change is the update as a whole, so the test compares the two updates' norms; the one-rank run
    # uses one thread against the ranks' own so the thread count differs as it does on a loaded machine.
    lr = "sft.lr=1e-3"
    two = run_sft(_cfg(tmp_path / "two", tiny_model_dir, MESSAGES, "sft.num_ranks=2", lr))
    cfg = _cfg(tmp_path / "one", tiny_model_dir, MESSAGES, "sft.micro_batch_size_per_gpu=1", lr)
    check_masks(spy, expected_rows(cfg, tok, MESSAGES, "messages"), tok)
    n_batches = len(spy.batches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = run_sft(cfg)
    finally:
        torch.set_num_threads(threads)
    assert [b[2].tolist() for b in spy.batches[n_batches:]] == [b[2].tolist() for b in spy.batches[:n_batches]]
    base, w_two, w_one = _weights(tiny_model_dir), _weights(two), _weights(one)
    between = _norm({k: w_two[k].float() - w_one[k].float() for k in base})
    update = _norm({k: w_one[k].float() - base[k].float() for k in base})
    print(f"|w_2ranks - w_1rank| / |w_1rank - w_0| = {between / update:.3g} (max |dweight| "
          f"{_max_diff(w_two, w_one):.3g})")
    assert between <= 1e-2 * update  # a dropped row or a wrong per-rank token weighting moves it by 1e-1 and more
    s1, s2 = (json.loads((p / "sft_summary.json").read_text()) for p in (one, two))
    assert s2["steps"] == s1["steps"] == 6 and np.allclose(s2["losses"], s1["losses"], atol=1e-6)
    assert s2["demos"] == {"messages": 4, "too_long": 0}
    assert (tmp_path / "two" / "sft-checkpoints" / "global_step_6" / "actor" / "contents.json").exists()
    assert AutoTokenizer.from_pretrained(two).chat_template == tok.chat_template


def test_sft_from_a_sharegpt_jsonl_on_two_ranks(tiny_model_dir, tmp_path, ray_cluster, monkeypatch):  # noqa: F811
    from arpo.sft import run_sft

    train_file = tmp_path / "sharegpt.jsonl"
    train_file.write_text("".join(json.dumps(row) + "\n" for row in json.loads(SHAREGPT.read_text())))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    spy = BatchSpy(monkeypatch)
    cfg = _cfg(tmp_path, tiny_model_dir, train_file, "sft.num_ranks=2", "sft.max_steps=4")
    out = run_sft(cfg)
    check_masks(spy, expected_rows(cfg, tok, train_file, "sharegpt"), tok)
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["demos"] == {"sharegpt": 4, "too_long": 0} and summary["steps"] == 4
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert _max_diff({n: p.detach() for n, p in loaded.named_parameters()},
                     {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(
                         tiny_model_dir).named_parameters()}) > 0  # trained


def test_bad_sft_keys_stop_the_run_before_the_model_loads(tmp_path):
    from arpo.config import ConfigError
    from arpo.sft import run_sft

    for key, message in (("sft.num_ranks=0", "sft.num_ranks=0 is not valid"),
                         ("sft.num_ranks=3", "sft.batch_size=2 does not split over sft.num_ranks=3"),
                         ("sft.save_freq=-1", "sft.save_freq=-1 is not valid"),
                         ("sft.resume_mode=resume_path", "sft.resume_mode='resume_path' is not valid"),
                         ("sft.micro_batch_size_per_gpu=0", "sft.micro_batch_size_per_gpu=0 is not valid"),
                         ("sft.device=tpu", "sft.device='tpu' is not valid")):
        with pytest.raises(ConfigError, match=message):
            run_sft(_cfg(tmp_path, tmp_path / "no-model", MESSAGES, key))
    assert not (tmp_path / "sft-checkpoints").exists()


def test_sft_killed_by_sigkill_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path, monkeypatch,
                                                                     one_process_group):  # noqa: F811
    """``python -m arpo.sft`` killed (SIGKILL) after its step-2 checkpoint, started again: it trains the remaining
    steps only and ends with the uninterrupted run's weights; ``sft.resume_mode=disable`` starts afresh."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from arpo.sft import run_sft

    steps = ["sft.max_steps=12", "sft.save_freq=2"]
    whole = run_sft(_cfg(tmp_path / "whole", tiny_model_dir, MESSAGES, *steps))
    cfg = _cfg(tmp_path / "killed", tiny_model_dir, MESSAGES, *steps)
    tracker = tmp_path / "killed" / "sft-checkpoints" / "latest_checkpointed_iteration.txt"
    args = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"sft.train_file={MESSAGES}",
            f"sft.out_dir={tmp_path / 'killed' / 'sft'}", "sft.batch_size=2", "sft.epochs=20", "sft.lr=3e-3",
            "sft.device=cpu", *steps]
    proc = subprocess.Popen([sys.executable, "-m", "arpo.sft", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        deadline = time.time() + 240
        while not (tracker.exists() and tracker.read_text() == "2") and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (tmp_path / "killed" / "sft" / "model.safetensors").exists()  # nothing exported
    done = int(tracker.read_text())
    spy = BatchSpy(monkeypatch)
    resumed = run_sft(cfg)
    assert len(spy.batches) == 12 - done  # the remaining steps only
    diff = _max_diff(_weights(resumed), _weights(whole))
    print(f"max |dweight| resumed after SIGKILL at step {done} vs uninterrupted: {diff:.3g}")
    assert diff <= 1e-6
    a, b = (json.loads((p / "sft_summary.json").read_text()) for p in (whole, resumed))
    assert b["steps"] == a["steps"] == 12 and np.allclose(b["losses"], a["losses"], atol=1e-6)
    spy.batches.clear()
    run_sft(_cfg(tmp_path / "killed", tiny_model_dir, MESSAGES, *steps, "sft.resume_mode=disable"))
    assert len(spy.batches) == 12
