"""Where TRL's GRPOTrainer and our actor compute the same loss, they give the same loss and gradients on one batch.

TRL (requirements-bench.txt) is the reference implementation most GRPO results are reported with, so its loss is
an independent check of ours: TRL's ``compute_loss`` on a hand-built batch (left-padded prompts of different
lengths, right-padded responses, a 1-token one among them, advantages of both signs, old log-probs off by up to
±0.4 so some ratios clip) against ``compute_logprobs_and_entropy`` + ``compute_policy_loss`` on the same tensors,
each side on its own float32 copy of the tiny model.

Why the pairs are the same math, on one micro-batch with no gradient accumulation, one process, beta = 0 and no
fully masked row (TRL counts such a row in its row means; our seq modes count only rows with a loss token):

* both clip the token ratio to [1 - eps, 1 + eps] and take the pessimistic term; our dual clip (cap -A·3 for A < 0)
  is the only extra, and the batch keeps every ratio below 3, so it never acts;
* "grpo" averages each row's masked token mean over rows: "seq-mean-token-mean";
* "bnpo" divides the masked sum by the batch's loss tokens: "token-mean";
* "dapo" divides by ``num_items_in_batch / num_processes · gradient_accumulation_steps / steps_per_generation``,
  where ``num_items_in_batch`` (read from the inputs, not ``compute_loss``'s argument of that name) counts the
  loss tokens of the whole generation batch on all ranks: with one process and steps_per_generation =
  gradient_accumulation_steps = 1, the batch's token count, so "token-mean" again (with steps_per_generation
  larger than the accumulation window, TRL divides by the window's *average* token count, not its own);
* "dr_grpo" divides the masked sum by rows · ``max_completion_length``: "seq-mean-token-sum-norm" with
  ``loss_scale_factor`` = max_completion_length.

TRL does not pass position ids, so its left-padded rows start at the padding count where ours (verl's layout)
start at 0; rotary attention depends only on position differences, which is why the log-probs agree to float
rounding, and that is asserted first.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

_vllm_level = os.environ.get("VLLM_LOGGING_LEVEL")
pytest.importorskip("trl", reason="TRL is the bench stack's (requirements-bench.txt: make install-bench)")

from datasets import Dataset  # noqa: E402  (after the skip: trl and datasets come together)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

with warnings.catch_warnings():
    # TRL 1.16 states vLLM <= 0.31 (its vLLM client and generation, unused here; the project runs 0.32), and its
    # import compiles a function, which loads torch's inductor and its deprecated torch.jit.script_method uses
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions", category=UserWarning)
    warnings.filterwarnings("ignore", message=".*torch.jit.script_method", category=DeprecationWarning)
    from trl import GRPOConfig, GRPOTrainer  # noqa: E402
# Importing trl sets VLLM_LOGGING_LEVEL=ERROR for the whole process (trl/_compat.py). This module is imported
# when the suite is collected, so every later in-process vLLM engine, and every run the pytest worker starts,
# would log errors only.
if _vllm_level is None:
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
else:
    os.environ["VLLM_LOGGING_LEVEL"] = _vllm_level

from arpo.trainer.core_algos import compute_policy_loss  # noqa: E402
from arpo.trainer.logprobs import compute_logprobs_and_entropy  # noqa: E402

PROMPT_LENGTHS = (3, 7, 5, 1, 6, 4)
RESPONSE_LENGTHS = (5, 1, 3, 4, 2, 5)  # one 1-token response
ADVANTAGES = (1.0, -0.5, 0.7, -1.2, 0.3, -0.8)
NUM_GENERATIONS = 3  # 2 prompts x 3 completions = the 6 rows
CLIP, CLIP_C = 0.2, 3.0
NOISE = 0.4  # old log-probs = the model's ± up to this: ratios in [e^-0.4, e^0.4] = [0.67, 1.49]

#: TRL loss_type -> our (loss_agg_mode, extra agg_loss arguments), given the response width R
PAIRS = {
    "grpo": ("seq-mean-token-mean", lambda r: {}),
    "bnpo": ("token-mean", lambda r: {}),
    "dapo": ("token-mean", lambda r: {}),
    "dr_grpo": ("seq-mean-token-sum-norm", lambda r: {"loss_scale_factor": float(r)}),
}


def make_batch(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """TRL's input layout: left-padded ``prompt_ids``/``prompt_mask``, right-padded ``completion_ids``/
    ``completion_mask`` (random ids, special tokens 0-2 avoided), ``advantages`` (B,)."""
    gen = torch.Generator().manual_seed(seed)
    b, p, r = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    batch = {"prompt_ids": torch.zeros(b, p, dtype=torch.long), "prompt_mask": torch.zeros(b, p, dtype=torch.long),
             "completion_ids": torch.zeros(b, r, dtype=torch.long),
             "completion_mask": torch.zeros(b, r, dtype=torch.long)}
    for i, (pl, rl) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        batch["prompt_ids"][i, p - pl:] = torch.randint(3, vocab_size, (pl,), generator=gen)
        batch["prompt_mask"][i, p - pl:] = 1
        batch["completion_ids"][i, :rl] = torch.randint(3, vocab_size, (rl,), generator=gen)
        batch["completion_mask"][i, :rl] = 1
    batch["advantages"] = torch.tensor(ADVANTAGES)
    return batch


def verl_layout(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, position_ids)``: prompts ‖ responses, positions as verl counts them."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


def load_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()


def make_trainer(model_dir: Path, loss_type: str, max_completion_length: int, output_dir: Path) -> GRPOTrainer:
    args = GRPOConfig(
        output_dir=str(output_dir), use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        logging_strategy="no", disable_tqdm=True, gradient_checkpointing=False, beta=0.0, loss_type=loss_type,
        per_device_train_batch_size=len(PROMPT_LENGTHS), num_generations=NUM_GENERATIONS,
        max_completion_length=max_completion_length, temperature=1.0, epsilon=CLIP,
    )
    trainer = GRPOTrainer(
        model=load_model(model_dir), reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args, train_dataset=Dataset.from_dict({"prompt": ["a question", "another question"]}),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which does not run here
    trainer.model.train()
    return trainer


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter's gradient, in name order, as one vector (each parameter must have one)."""
    named = sorted(model.named_parameters())
    missing = [name for name, p in named if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    return torch.cat([p.grad.reshape(-1) for _, p in named])


@pytest.mark.parametrize("loss_type", list(PAIRS))
def test_trl_grpo_loss_and_gradients_equal_ours(loss_type, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    ours_mode, agg_kwargs = PAIRS[loss_type]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    batch = make_batch(len(tokenizer))
    input_ids, attention_mask, position_ids = verl_layout(batch)
    mask = batch["completion_mask"]
    width = mask.shape[1]
    trainer = make_trainer(tiny_model_dir, loss_type, width, tmp_path)

    ours = load_model(tiny_model_dir)
    logp, _ = compute_logprobs_and_entropy(ours, input_ids, attention_mask, position_ids, width)
    with torch.no_grad():
        trl_logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, width)
    assert (logp - trl_logp).abs().mul(mask).max() <= 1e-5

    noise = (torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 2 - 1) * NOISE
    old = (logp.detach() + noise) * mask
    advantages = batch["advantages"][:, None].expand_as(logp)
    loss, clipfrac, _, dual_clipfrac = compute_policy_loss(old, logp, advantages, mask, cliprange=CLIP,
                                                           clip_ratio_c=CLIP_C, loss_agg_mode=ours_mode,
                                                           **agg_kwargs(width))
    ratio = (logp.detach() - old).exp()[mask.bool()]
    assert clipfrac > 0 and ((ratio < 1 - CLIP) | (ratio > 1 + CLIP)).any()  # the clip acts on some tokens...
    assert dual_clipfrac == 0 and ratio.max() < CLIP_C  # ...the dual clip on none: TRL has no such cap
    loss.backward()

    inputs = {**batch, "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    trl_loss = trainer.compute_loss(trainer.model, inputs)
    trl_loss.backward()

    torch.testing.assert_close(trl_loss.detach(), loss.detach(), rtol=1e-5, atol=0)
    grad, trl_grad = flat_grad(ours), flat_grad(trainer.model)
    assert grad.norm() > 0
    assert (trl_grad - grad).norm() / grad.norm() <= 1e-5
