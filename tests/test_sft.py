"""Cold-start SFT: demonstrations and their loss mask, the masked and shared-prefix losses, the streamed first
epoch, bf16 and the time limit. The trained model's protocol quality (real vLLM and tools) is checked on the vLLM
rollout tests' engine (tests/rollout/test_vllm_rollout.py)."""

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from arpo.data.sft_demonstrations import Segment, build_demonstration, tokenize_demonstration
from arpo.protocol import RESULT_CLOSE, RESULT_OPEN
from tools.base import BaseTool


class RecordingTool(BaseTool):
    def __init__(self, name: str, reply: str):
        self.name = name
        self.reply = reply
        self.calls: list[str] = []
        super().__init__()

    def default_schema(self):
        return {"type": "function", "function": {"name": self.name, "description": "",
                                                 "parameters": {"type": "object", "properties": {}}}}

    def call_text(self, content: str) -> str:
        self.calls.append(content)
        return self.reply


PLAN = [{"tool": "search", "content": "Trivex founded", "finding": "Trivex was founded in 1987."},
        {"tool": "python", "content": "print(2024 - 1987)", "finding": "2024 - 1987 = 37."}]


def _tools():
    return {"search": RecordingTool("search", "Page 1: Trivex: Trivex was founded in 1987."),
            "python": RecordingTool("python", "37")}


def test_gold_demonstration_runs_every_planned_call_in_order():
    tools = _tools()
    segs, mode = build_demonstration("How many years?", "37", PLAN, tools, random.Random(0), 0.0, 0.0)
    assert mode == "gold"
    assert tools["search"].calls == ["Trivex founded"] and tools["python"].calls == ["print(2024 - 1987)"]
    text = "".join(s.text for s in segs)
    assert text.startswith("<think> I will search. </think> <search> Trivex founded </search> <result>\n")
    assert "</result> <think> I will compute this with python. </think> <python> print(2024 - 1987) </python>" in text
    assert text.endswith("<think> I have the answer. </think> <answer> The final answer is \\boxed{ 37 } </answer>")
    assert [s.is_model for s in segs] == [True, False, True, False, True]


def test_verbose_think_restates_queries_and_findings():
    segs, mode = build_demonstration("How many years?", "37", PLAN, _tools(), random.Random(0), 0.0, 0.0,
                                     verbose_think=True)
    text = "".join(s.text for s in segs)
    assert text.startswith("<think> I need the Trivex founded. </think> <search> Trivex founded </search> <result>\n")
    assert "<think> Trivex was founded in 1987. I will compute this with python. </think>" in text
    assert text.endswith("<think> 2024 - 1987 = 37. </think> <answer> The final answer is \\boxed{ 37 } </answer>")


def test_skip_demonstration_omits_the_last_call_and_guesses_wrong():
    tools = _tools()
    segs, mode = build_demonstration("How many years?", "37", PLAN, tools, random.Random(0), 1.0, 0.0)
    assert mode == "skip"
    assert tools["python"].calls == [] and len(tools["search"].calls) == 1
    assert "\\boxed{37}" not in "".join(s.text for s in segs)


def test_wrong_tool_demonstration_calls_the_other_tool():
    tools = _tools()
    segs, mode = build_demonstration("How many years?", "37", PLAN, tools, random.Random(0), 0.0, 1.0)
    assert mode == "wrong_tool"
    assert tools["python"].calls == ['print("Trivex founded")'] and tools["search"].calls == []
    tools = _tools()
    build_demonstration("What is 2024 - 1987?", "37", PLAN[1:], tools, random.Random(0), 0.0, 1.0)
    assert tools["search"].calls == ["2024 - 1987"] and tools["python"].calls == []


def test_loss_mask_is_zero_exactly_on_prompt_and_tool_results(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    segs = [Segment("<think> a </think> <search> q </search>", True),
            Segment(f" {RESULT_OPEN}\nPage 1: x\n{RESULT_CLOSE}", False),
            Segment(" <answer> \\boxed{x} </answer>", True)]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    ids, mask = tokenize_demonstration(tok, msgs, segs)
    prompt_len = len(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert mask[:prompt_len] == [0] * prompt_len
    seg_lens = [len(tok.encode(s.text, add_special_tokens=False)) for s in segs]
    expect = [1] * seg_lens[0] + [0] * seg_lens[1] + [1] * seg_lens[2] + [1]  # + EOS, trained on
    assert mask[prompt_len:] == expect
    assert ids[-1] == tok.eos_token_id
    # the masked span decodes to exactly the tool result text
    result = [i for i, m in zip(ids[prompt_len:], mask[prompt_len:]) if m == 0]
    assert tok.decode(result) == segs[1].text


# Measured with the default config (tiny_model defaults, sft.max_steps=900 x batch 4, short thoughts, streamed
# demonstrations; temperature 1.0, 128 test questions, protocol_quality seeds 0-4): format overall
# 0.95/0.92/0.88/0.94/0.91 (mean 0.92; search 0.88, both 0.93, python 0.96 on average); accuracy 0-0.016 overall
# (a 'both' or 'python' question now and then, search never): the tiny model learns the tag protocol but hardly to
# copy entities or numbers. The test runs seed 0 (0.95); thresholds keep a margin below the lowest seed.
def test_masked_lm_loss_equals_the_full_logits_loss():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arpo.trainer.sft_step import masked_lm_loss

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 64, (3, 12))
    attn = torch.ones_like(ids)
    attn[0, 9:] = 0
    labels = ids.clone()
    labels[:, :5] = -100
    labels[0, 9:] = -100
    labels[2, 7:9] = -100
    expected = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    got = masked_lm_loss(model, ids, attn, labels)
    assert torch.allclose(got, expected, atol=1e-6)


def test_shared_prompt_prefix_gives_the_same_loss_and_gradients():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arpo.data.sft_batches import shared_prompt_prefix
    from arpo.trainer.sft_step import masked_lm_loss

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    system = torch.randint(0, 64, (7,)).tolist()
    examples = []
    for n in (6, 9, 4):  # prompt = shared system part + one own token; then n - 1 trained tokens
        ids = system + torch.randint(0, 64, (n,)).tolist()
        examples.append((ids, [0] * 8 + [1] * (len(ids) - 8)))
    prefix = shared_prompt_prefix(examples)
    assert prefix == 6  # the common 7 tokens less the one whose position predicts the first own token
    width = max(len(ids) for ids, _ in examples)
    ids = torch.zeros(3, width, dtype=torch.long)
    attn, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for r, (row, mask) in enumerate(examples):
        t = torch.tensor(row)
        ids[r, : len(row)], attn[r, : len(row)] = t, 1
        labels[r, : len(row)] = t.masked_fill(torch.tensor(mask) == 0, -100)
    plain = masked_lm_loss(model, ids, attn, labels)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shared = masked_lm_loss(model, ids, attn, labels, shared_prefix=prefix)
    shared.backward()
    assert torch.allclose(plain, shared, atol=1e-6)
    for g, p in zip(plain_grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)


def sft_group(model_dir, total: int, **sft):
    """One SFT rank in this process (:class:`~arpo.trainer.sft_step.SFTWorker`) on ``model_dir``, its schedule over
    ``total`` steps; ``sft`` overrides the ``sft.*`` keys it reads. Shut it down after use."""
    from arpo.sft import worker_config
    from arpo.trainer.worker_group import LocalWorkerGroup

    s = {"num_ranks": 1, "num_threads": 1, "dtype": "float32", "device": "cpu", "seed": 0, "lr": 1e-3,
         "weight_decay": 0.0, "warmup_ratio": 0.1, "grad_clip": 1.0, **sft}
    return LocalWorkerGroup(worker_config(s, model_dir, total), role="sft")


def _saved(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def _train(model_dir, examples, *, epochs, batch_size, max_steps=0, num_examples=None, sft=None, **kwargs):
    """``train_sft`` on one in-process rank of ``model_dir``; returns (summary, final parameters)."""
    from arpo.data.sft_demonstrations import DemonstrationStream
    from arpo.sft import plan_steps, train_sft

    n = num_examples if isinstance(examples, DemonstrationStream) else len(examples)
    group = sft_group(model_dir, plan_steps(n, batch_size, epochs, max_steps)[1], **(sft or {}))
    try:
        summary = train_sft(group, examples, epochs=epochs, batch_size=batch_size, seed=0, pad_id=0,
                            max_steps=max_steps, num_examples=num_examples, **kwargs)
        return summary, group.full_parameters()
    finally:
        group.shutdown()


def test_streamed_first_epoch_trains_on_every_demonstration_then_reuses_them(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arpo.data.sft_demonstrations import DemonstrationStream

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    system = [5, 6, 7, 8]
    demos = []
    for i in range(26):
        ids = system + [10 + i % 7] + [20 + (i + j) % 30 for j in range(3 + i % 5)]
        demos.append(((ids, [0] * 5 + [1] * (len(ids) - 5)), "gold"))
    demos.append((([1] * 50, [0] * 49 + [1]), "skip"))  # too long: dropped and counted
    seen = []

    def produce():
        for d in demos:
            seen.append(d)
            yield d

    stream = DemonstrationStream(produce(), max_length=40)
    summary, _ = _train(_saved(model, tmp_path / "m"), stream, epochs=2, batch_size=4, max_minutes=5,
                        num_examples=len(demos))
    assert len(seen) == len(demos) and stream.done
    assert stream.modes == {"gold": 26, "skip": 0, "wrong_tool": 0, "too_long": 1}
    assert len(stream.examples) == 26
    # 26 kept rows: 6 full batches per epoch (the partial one dropped); the schedule planned 27 // 4 * 2 = 12
    assert summary["steps"] == 12 and summary["planned_steps"] == 12
    assert summary["mean_shared_prefix"] >= len(system) - 1


def test_stream_stops_pulling_demonstrations_when_max_steps_is_reached(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arpo.data.sft_demonstrations import DemonstrationStream

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    pulled = []

    def produce():
        for i in range(1000):
            pulled.append(i)
            yield ([1, 2, 3, 4 + i % 9, 5], [0, 0, 1, 1, 1]), "gold"

    summary, _ = _train(_saved(model, tmp_path / "m"), DemonstrationStream(produce(), max_length=40), epochs=1,
                        batch_size=2, max_minutes=5, max_steps=3, num_examples=1000)
    assert summary["steps"] == 3
    assert len(pulled) <= 2 * 16  # one window of 16 batches, not the whole stream


def test_bfloat16_sft_keeps_fp32_weights_and_follows_the_fp32_run(tmp_path):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model_dir = _saved(Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2)), tmp_path / "m")
    examples = [([1, 2, 3] + [10 + (i + j) % 20 for j in range(8)], [0, 0, 0] + [1] * 8) for i in range(32)]

    def run(dtype: str):
        return _train(model_dir, examples, epochs=8, batch_size=4, max_minutes=5,
                      sft={"lr": 3e-3, "dtype": dtype})

    fp32, _ = run("float32")
    bf16, bf16_params = run("bfloat16")
    assert bf16["compute_dtype"] == "bfloat16" and fp32["compute_dtype"] == "float32"
    assert all(p.dtype == torch.float32 for p in bf16_params.values())  # master weights stay fp32
    assert bf16["final_loss"] < 1.0  # it learned the sequences (log 64 = 4.2 at the start)
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.25


def test_time_limit_is_off_by_default_and_reported_when_it_stops_the_run(tmp_path):
    from omegaconf import OmegaConf
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from arpo.config import config_dir
    from arpo.pipeline import final_summary

    assert OmegaConf.load(config_dir() / "sft.yaml").sft.max_minutes is None
    examples = [([1, 2, 3] + [10 + (i + j) % 20 for j in range(6)], [0, 0, 0] + [1] * 6) for i in range(16)]
    model_dir = _saved(Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=4,
                                                    num_key_value_heads=2)), tmp_path / "m")

    def run(**limit):
        return _train(model_dir, examples, epochs=2, batch_size=4, **limit)[0]

    full = run()
    assert full["steps"] == full["planned_steps"] == 8 and not full["stopped_early"] and full["stop_reason"] is None
    assert len(full["losses"]) == 8
    cut = run(max_minutes=1e-9)  # over the limit after the first step
    assert cut["steps"] == 1 and cut["stopped_early"]
    assert cut["stop_reason"] == "sft.max_minutes=1e-09 (wall clock) after 1 of 8 steps"
    closing = final_summary({"stage_timings_s": {}, "wall_s": 1.0, "sft": cut}, Path("out"))
    assert "SFT stopped by its time limit (sft.max_minutes=1e-09" in closing
    assert "time limit" not in final_summary({"stage_timings_s": {}, "wall_s": 1.0, "sft": full}, Path("out"))
