"""Engine test helpers.

``teach_tool_calls`` overfits a copy of the tiny model on a few tool-calling lines, so generations reliably hit
the ARPO stop tags (a freshly initialised model almost never emits ``</search>``); ``reference_logprobs`` is the
teacher-forced float32 reference both backends are checked against.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

#: Engines checked against the float32 reference run in float32 too: dtype "auto" is bfloat16 on CUDA, whose logprobs
#: differ from float32 by ~1e-2 and whose greedy choices may differ from the lessons (seen on an H100).
REFERENCE_DTYPE = "float32"

#: prompt -> continuation the taught model produces greedily (tags are single tokens in the tiny tokenizer).
LESSONS = {
    "Question: where is the river? Plan:": "<think> look it up </think><search> river city </search>",
    "Question: what is 12 times 7? Plan:": "<think> compute it </think><python> print(12*7) </python>",
}


def teach_tool_calls(base_dir: str | Path, out_dir: str | Path, steps: int = 80, seed: int = 0,
                     lr: float = 1e-3) -> Path:
    """Fine-tune ``base_dir`` on :data:`LESSONS` and save model + tokenizer to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.train()
    rows = []
    for prompt, answer in LESSONS.items():
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append((p, a))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # One thread: on a shared, oversubscribed CPU two OpenMP threads made these small matmuls ~8x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _train(model, opt, rows, steps)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (Path(base_dir) / name).exists():
            shutil.copy(Path(base_dir) / name, out / name)
    return out


def _train(model, opt, rows, steps: int) -> None:
    for _ in range(steps):
        loss = 0.0
        for p, a in rows:
            ids = torch.tensor([p + a])
            labels = torch.tensor([[-100] * len(p) + a])
            loss = loss + model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def reference_logprobs(model_dir: str | Path, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """Teacher-forced float32 log-softmax at each response position, shape [len(response_ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    start = len(prompt_ids) - 1
    return torch.log_softmax(logits[start: start + len(response_ids)], dim=-1)


def encode(model_dir: str | Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"]
