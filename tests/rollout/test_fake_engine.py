"""The scripted engine behaves like an engine: determinism, stops, lengths, logprobs, prefix cache."""

from __future__ import annotations

import asyncio

import pytest

from arpo.engine.base import GenerationEngine, SamplingParams
from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, ToyTokenizer
from arpo.protocol import stop_strings

STOPS = tuple(stop_strings())


def gen(engine, prompt, **kw):
    return asyncio.run(engine.generate(prompt, SamplingParams(**kw), "r"))


def test_implements_interface_and_tokenizer_round_trip():
    eng = ScriptedEngine()
    assert isinstance(eng, GenerationEngine)
    tok = eng.tokenizer
    text = "<think> we need </think> <search>capital of France</search> <result>\nDoc: x\n</result>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<search>") == [tok.vocab.index("<search>")]
    split = ToyTokenizer(split_tags=True)
    assert split.decode(split.encode(text)) == text and len(split.encode("</search>")) > 1


def test_deterministic_per_prompt_and_seed():
    eng = ScriptedEngine()
    p = eng.tokenizer.encode("Question: 1?")
    a = gen(eng, p, seed=3, stop=STOPS, logprobs=5)
    b = gen(eng, p, seed=3, stop=STOPS, logprobs=5)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    outs = {tuple(gen(eng, p, seed=s, stop=STOPS).token_ids) for s in range(10)}
    assert len(outs) > 5


def test_stop_strings_kept_and_reported():
    eng = ScriptedEngine(policy=ScriptPolicy(call_prob=1.0, call_decay=0.0, tools=("search",)))
    p = eng.tokenizer.encode("Q")
    out = gen(eng, p, seed=0, stop=STOPS)
    assert out.finish_reason == "stop" and out.stop_reason == "</search>" and out.text.endswith("</search>")
    # without the stop string the policy writes on after the close tag
    out2 = gen(eng, p, seed=0, stop=())
    assert len(out2.token_ids) > len(out.token_ids) and out2.token_ids[: len(out.token_ids)] == out.token_ids


def test_stop_string_spanning_tokens():
    tok = ToyTokenizer(split_tags=True)
    eng = ScriptedEngine(tok, policy=ScriptPolicy(call_prob=1.0, call_decay=0.0, tools=("python",)))
    out = gen(eng, tok.encode("Q"), seed=1, stop=STOPS)
    assert out.stop_reason == "</python>" and out.text.endswith("</python>")


def test_eos_and_length():
    eng = ScriptedEngine(policy=ScriptPolicy(call_prob=0.0))
    tok = eng.tokenizer
    out = gen(eng, tok.encode("Q"), seed=0, stop=STOPS, max_tokens=500)
    assert out.finish_reason == "stop" and out.stop_reason is None and out.token_ids[-1] == tok.eos_token_id
    short = gen(eng, tok.encode("Q"), seed=0, stop=STOPS, max_tokens=4)
    assert short.finish_reason == "length" and short.token_ids == out.token_ids[:4]
    stop_tok = gen(eng, tok.encode("Q"), seed=0, stop_token_ids=(out.token_ids[2],), max_tokens=500)
    assert stop_tok.stop_reason == out.token_ids[2] and len(stop_tok.token_ids) <= 3


def test_logprobs_top_k_include_sampled_and_entropy_jumps_after_result():
    from arpo.rollout.branching import window_entropy

    eng = ScriptedEngine(policy=ScriptPolicy(call_prob=0.0))
    tok = eng.tokenizer
    out = gen(eng, tok.encode("Q"), seed=0, logprobs=10, max_tokens=50)
    assert len(out.logprobs) == len(out.token_ids)
    for tid, lp in zip(out.token_ids, out.logprobs):
        assert tid in lp and len(lp) == 10 and lp[tid] == max(lp.values())
        assert sum(__import__("math").exp(v) for v in lp.values()) < 1.0
    after = gen(eng, tok.encode("Q <search>x</search> <result>\nr\n</result>"), seed=0, logprobs=10)
    v = len(tok)
    assert window_entropy(after.logprobs, 10, v) > 2 * window_entropy(out.logprobs, 10, v)


def test_prefix_cache_and_weight_update():
    eng = ScriptedEngine(block_size=4)
    tok = eng.tokenizer
    p = tok.encode("Question: what is the capital of France and the river?")
    a = gen(eng, p, seed=0, stop=STOPS)
    assert a.num_cached_tokens == 0
    b = gen(eng, p + a.token_ids, seed=1, stop=STOPS)
    assert b.num_cached_tokens == (len(p + a.token_ids) - 1) // 4 * 4
    asyncio.run(eng.update_weights("/nonexistent"))
    c = gen(eng, p, seed=0, stop=STOPS)
    assert c.num_cached_tokens == 0 and eng.weight_version == 1
    asyncio.run(eng.sleep())
    with pytest.raises(RuntimeError, match="asleep"):
        gen(eng, p)
    asyncio.run(eng.wake_up())
    assert gen(eng, p, seed=0).token_ids
