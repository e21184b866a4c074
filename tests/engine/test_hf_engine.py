"""HFEngine: vLLM-compatible sampling, stopping and logprobs on the real tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from arpo.engine.base import GenerationEngine, SamplingParams
from arpo.engine.hf_engine import HFEngine, process_logits, top_logprobs
from arpo.engine.weights import save_weights_for_engine
from arpo.protocol import stop_strings
from tests.engine.helpers import LESSONS, REFERENCE_DTYPE, encode, reference_logprobs

STOPS = tuple(stop_strings())  # ("</search>", "</python>")


# ------------------------------------------------------------------ logits processing (pure functions)

def test_process_logits_temperature_topk_topp_penalty():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    assert torch.allclose(process_logits(logits, SamplingParams(temperature=0.5), None), logits / 0.5)

    kept = torch.isfinite(process_logits(logits, SamplingParams(top_k=2), None))
    assert kept.tolist() == [True, True, False, False, False]

    probs = torch.softmax(logits, -1)  # ≈ [0.61, 0.22, 0.14, 0.03, 0.004]
    p = float(probs[0] + probs[1]) - 1e-4  # the two best reach p; the third is not needed
    kept = torch.isfinite(process_logits(logits, SamplingParams(top_p=p), None))
    assert kept.tolist() == [True, True, False, False, False]
    kept = torch.isfinite(process_logits(logits, SamplingParams(top_p=1e-6), None))
    assert kept.tolist() == [True, False, False, False, False]  # the best token always stays

    pen = process_logits(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([0, 3, 3]))
    assert pen.tolist() == pytest.approx([1.0, 1.0, 0.5, -2.0, -3.0])


def test_top_logprobs_always_holds_the_sampled_token():
    lp = torch.log_softmax(torch.tensor([3.0, 2.0, 1.0, 0.0]), -1)
    out = top_logprobs(lp, 2, sampled=3)
    assert set(out) == {0, 1, 3}
    assert out[3] == pytest.approx(float(lp[3]))
    assert set(top_logprobs(lp, 2, sampled=0)) == {0, 1}


# ------------------------------------------------------------------ the engine on the tiny model

@pytest.fixture(scope="module")
def taught(taught_model_dir):
    return HFEngine({"model_path": taught_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE})


def test_is_a_generation_engine(taught):
    assert isinstance(taught, GenerationEngine)


@pytest.mark.parametrize("prompt", list(LESSONS))
def test_stop_strings_end_on_the_tool_tag(run, taught, taught_model_dir, prompt):
    ids = encode(taught_model_dir, prompt)
    out = run(taught.generate(ids, SamplingParams(temperature=0, max_tokens=40, stop=STOPS), "r"))
    expected_tag = "</search>" if "<search>" in LESSONS[prompt] else "</python>"
    assert out.finish_reason == "stop"
    assert out.stop_reason == expected_tag
    assert out.text.endswith(expected_tag)
    assert out.text == LESSONS[prompt]
    assert taught.tokenizer.decode(out.token_ids) == out.text


def test_eos_and_length(run, taught, taught_model_dir):
    prompt = next(iter(LESSONS))
    ids = encode(taught_model_dir, prompt)
    out = run(taught.generate(ids, SamplingParams(temperature=0, max_tokens=60), "eos"))
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids[-1] in taught.eos_token_ids
    assert out.text == LESSONS[prompt] + taught.tokenizer.decode(out.token_ids[-1:])  # EOS text kept, as vLLM
    short = run(taught.generate(ids, SamplingParams(temperature=0, max_tokens=3), "len"))
    assert (short.finish_reason, len(short.token_ids)) == ("length", 3)
    stop_tok = out.token_ids[2]
    by_id = run(taught.generate(ids, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(stop_tok,)), "id"))
    assert (by_id.finish_reason, by_id.stop_reason, by_id.token_ids) == ("stop", stop_tok, out.token_ids[:3])


def test_max_tokens_clipped_to_max_model_len(run, taught_model_dir):
    engine = HFEngine({"model_path": taught_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE, "max_model_len": 20})
    out = run(engine.generate(list(range(10, 25)), SamplingParams(temperature=1.0, max_tokens=50, seed=0), "r"))
    ended_on_eos = out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids
    assert len(out.token_ids) <= 5 and (ended_on_eos or (out.finish_reason, len(out.token_ids)) == ("length", 5))
    full = run(engine.generate(list(range(10, 30)), SamplingParams(max_tokens=5), "full"))
    assert (full.finish_reason, full.token_ids) == ("length", [])


def test_logprobs_match_teacher_forcing(run, taught, taught_model_dir):
    ids = encode(taught_model_dir, "the river is in the city of")
    out = run(taught.generate(ids, SamplingParams(temperature=1.0, max_tokens=24, logprobs=5, seed=7), "lp"))
    ref = reference_logprobs(taught_model_dir, ids, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for pos, (tok, step) in enumerate(zip(out.token_ids, out.logprobs)):
        assert tok in step and len(step) in (5, 6)
        for tid, lp in step.items():
            assert lp == pytest.approx(float(ref[pos, tid]), abs=1e-4)
        # raw mode: the top-5 are the 5 most likely tokens of the unprocessed distribution
        assert set(torch.topk(ref[pos], 5).indices.tolist()) <= set(step)


def test_processed_logprobs_are_the_sampled_distribution(run, taught_model_dir):
    engine = HFEngine({"model_path": taught_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE,
                       "logprobs_mode": "processed_logprobs"})
    ids = encode(taught_model_dir, "the river")
    out = run(engine.generate(ids, SamplingParams(temperature=0.7, top_k=3, max_tokens=8, logprobs=3, seed=1), "p"))
    for step in out.logprobs:
        assert len(step) == 3
        assert math.fsum(math.exp(v) for v in step.values()) == pytest.approx(1.0, abs=1e-5)


def test_seed_reproducible_alone_or_batched(run, tiny_model_dir):
    import asyncio

    engine = HFEngine({"model_path": tiny_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE})
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=123)
    alone = run(engine.generate([5, 6, 7], sp, "a"))

    async def batched():
        return await asyncio.gather(engine.generate([5, 6, 7], sp, "b0"),
                                    engine.generate(list(range(30, 60)), sp.with_(seed=9), "b1"),
                                    engine.generate([5, 6, 7], sp.with_(seed=124), "b2"))

    same, other, different_seed = run(batched())
    assert same.token_ids == alone.token_ids
    assert different_seed.token_ids != alone.token_ids
    assert len(other.token_ids) == 16


def test_update_weights_changes_outputs(run, tiny_model_dir, taught_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = HFEngine({"model_path": tiny_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE})
    prompt = next(iter(LESSONS))
    ids = encode(tiny_model_dir, prompt)
    sp = SamplingParams(temperature=0, max_tokens=40, stop=STOPS)
    before = run(engine.generate(ids, sp, "before"))
    assert before.text != LESSONS[prompt]
    save_weights_for_engine(AutoModelForCausalLM.from_pretrained(taught_model_dir), tmp_path)
    run(engine.update_weights(str(tmp_path)))
    after = run(engine.generate(ids, sp, "after"))
    assert after.text == LESSONS[prompt] and after.stop_reason == "</search>"


def test_bucketed_update_waits_for_the_batch_and_loads_every_weight(run, tiny_model_dir, taught_model_dir):
    """The trainer's path into the HF engine: small buckets in its dtype; generation waits for the whole update; a
    bucket naming a weight the model lacks, or an update that leaves one out, is an error."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from arpo.engine.weights import state_dict_buckets

    engine = HFEngine({"model_path": tiny_model_dir, "name": "hf", "dtype": REFERENCE_DTYPE})
    prompt = next(iter(LESSONS))
    ids = encode(tiny_model_dir, prompt)
    sp = SamplingParams(temperature=0, max_tokens=40, stop=STOPS)
    taught = AutoModelForCausalLM.from_pretrained(taught_model_dir, dtype=torch.float32).state_dict()

    async def update_while_generating():
        dtype = getattr(torch, await engine.begin_weight_update())
        waiting = asyncio.ensure_future(engine.generate(ids, sp, "during"))
        buckets = list(state_dict_buckets(taught, dtype, 32 * 1024))
        for bucket in buckets:
            await engine.load_weight_bucket(bucket)
            await asyncio.sleep(0)
            assert not waiting.done()  # no forward on half-loaded weights
        await engine.finish_weight_update()
        return len(buckets), await waiting

    n_buckets, during = run(update_while_generating())
    assert n_buckets > 3
    assert during.text == LESSONS[prompt] and during.stop_reason == "</search>"  # generated with the new weights
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight

    bad = next(state_dict_buckets({"model.no_such.weight": torch.ones(2)}, torch.float32, 1024))
    run(engine.begin_weight_update())
    with pytest.raises(ValueError, match="model.no_such.weight"):
        run(engine.load_weight_bucket(bad))
    with pytest.raises(ValueError, match="left .* weights out"):
        run(engine.finish_weight_update())
    assert run(engine.generate(ids, sp, "after")).text == LESSONS[prompt]  # the model was released
