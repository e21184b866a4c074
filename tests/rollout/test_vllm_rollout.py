"""The ARPO rollout on the real stack: vLLM on the tiny SFT model, the benchmark's real tools (BM25 search over
the synthetic corpus, the sandboxed Python interpreter). The same invariants as on the scripted engine, plus
what only a real engine shows: the tags stop generation by token id, results are real tool output, branches
hit the prefix cache, and both schedules run."""

from __future__ import annotations

import asyncio
import math

import pandas as pd
import pytest

from arpo.protocol import RESULT_OPEN
from tests.rollout.rollout_helpers import check_invariants, rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_stack(sft_model_dir):
    from transformers import AutoTokenizer

    from arpo.config import load_config
    from arpo.engine.config import EngineConfig
    from arpo.engine.vllm_engine import VLLMEngine
    from tools.registry import load_tools

    data_dir = sft_model_dir.parents[1] / "data" / "synthetic"
    tok = AutoTokenizer.from_pretrained(str(sft_model_dir))
    engine = VLLMEngine(EngineConfig(model_path=str(sft_model_dir), max_model_len=1024))
    tools = load_tools(load_config("sft", [f"synthetic.out_dir={data_dir}"]).tools)
    df = pd.read_parquet(data_dir / "test.parquet")
    # two questions of each kind
    picked = pd.concat([df[df.ability == kind].head(2) for kind in ("search", "python", "both")])
    prompts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)["input_ids"]
               for p in picked.prompt]
    # the engine runs in-process, bound to the loop it first serves on: one loop for the module, closed only
    # after the engine has shut down
    loop = asyncio.new_event_loop()
    yield engine, tok, tools, prompts, loop
    tools.close()

    async def shutdown() -> None:
        engine.shutdown()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in rest:  # the engine's output handler
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    loop.run_until_complete(shutdown())
    loop.close()


def test_arpo_rollout_on_vllm_with_real_tools(real_stack):
    from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig

    engine, tok, tools, prompts, loop = real_stack
    # branch_probability 1: every tool call forks while the budget lasts (the SFT model's entropy is low)
    cfg = {"n": 4, "initial_rollouts": 2, "sampling.max_response_length": 320, "tools.call_limit": 3,
           "entropy.window": 10, "branching.branch_probability": 1.0, "return_entropy": True, "seed": 3}
    batches = {}
    gen = ARPORollout(engine, tok, cfg, tools)
    try:
        for schedule in ("async", "rounds"):
            config = ARPORolloutConfig.from_dict({**cfg, "schedule.mode": schedule})
            batches[schedule] = loop.run_until_complete(gen.agenerate(prompts, seed=7, config=config))
            check_invariants(batches[schedule], config, tok, len(prompts))
    finally:
        gen.close()
    batch = batches["async"]
    m = batch.meta["metrics"]
    assert m["rollout/branches"] > 0 and m["rollout/tool_calls/total"] > 0
    # a branch's first request reuses its parent's cached blocks
    assert m["rollout/prefix_cache/branch_hit_rate"] > 0.5, m
    rs = rows(batch)
    results = {"search": [], "python": []}
    for r in rs:
        for c in r["calls"]:
            results[c["tool"]].append(tok.decode(r["ids"][c["start"]: c["end"]]))
    assert all(text.startswith(f" {RESULT_OPEN}\n") for texts in results.values() for text in texts)
    # real tool output: corpus pages from BM25 search, numbers printed by the sandboxed interpreter
    assert any("Page 1:" in text for text in results["search"]), results["search"][:2]
    assert any(any(ch.isdigit() for ch in text) for text in results["python"]), results["python"][:2]
    assert batches["rounds"].meta["metrics"]["rollout/branches"] > 0
    # entropy was measured from real logprobs: finite and within [0, 1] after normalisation
    ents = [e for r in rs for e in r["entropy"] if not math.isnan(e)]
    assert ents and all(0.0 <= e <= 1.0 + 1e-6 for e in ents)
    # the tags are single tokens of the tiny vocabulary: the engine stopped on their ids, and a call segment
    # ends with the tag token itself
    tag_ids = {tok.encode(t, add_special_tokens=False)[0] for t in ("</search>", "</python>")}
    for r in rs:
        for c in r["calls"]:
            if c["end"] > r["bpos"]:
                assert r["ids"][c["start"] - 1] in tag_ids


@pytest.mark.parametrize("policy", ["aepo", "tree_grpo"])
def test_successor_policies_on_vllm_with_real_tools(real_stack, policy):
    from arpo.rollout.arpo_rollout import ARPORollout, ARPORolloutConfig

    engine, tok, tools, prompts, loop = real_stack
    cfg = ARPORolloutConfig.from_dict({
        "n": 4, "initial_rollouts": 2, "sampling.max_response_length": 320, "tools.call_limit": 3, "entropy.window": 10,
        "branching.branch_probability": 0.0 if policy == "aepo" else 0.5, "return_entropy": True, "seed": 3,
        "policy": policy, "aepo.penalty": 0.5, "aepo.pre_monitoring": policy == "aepo"})
    gen = ARPORollout(engine, tok, cfg, tools)
    try:
        batch = loop.run_until_complete(gen.agenerate(prompts, seed=7))
    finally:
        gen.close()
    check_invariants(batch, cfg, tok, len(prompts))
    rs = rows(batch)
    m = batch.meta["metrics"]
    assert m["rollout/tool_calls/total"] > 0 and m["rollout/branches"] > 0
    if policy == "tree_grpo":  # two trees of two chains per prompt, continued from real tool results
        trees = list(batch["tree_index"])
        assert all(sorted(trees[g * 4:(g + 1) * 4]) == [0, 0, 1, 1] for g in range(len(prompts)))
        assert m["rollout/branch_points"] == 0
    else:  # p 0: every decision asks for a fork (no damping brings clip(·) below 0) while the budget lasts
        assert m["rollout/branch_points"] > 0 and all(r["kind"] in ("initial", "branch", "fill") for r in rs)
        # pre-monitoring: a probe per prompt, then N = int(4·σ(0.5·ΔH)) + 1 roots (2 or 3 for |ΔH| <= 1)
        assert m["rollout/tokens/monitor"] > 0 and 2 <= m["rollout/aepo/initial_rollouts_mean"] <= 3


#: the cold-start SFT's acceptance (arpo.evaluation.protocol_quality): it follows the protocol, and leaves RL room
MIN_FORMAT_RATE = 0.85
MIN_ACCURACY = {"search": 0.0, "python": 0.0, "both": 0.0}


def test_sft_model_follows_the_protocol_but_leaves_headroom(real_stack, sft_model_dir):
    """On this module's engine (the same EngineConfig measure_protocol_quality starts: one vLLM start fewer)."""
    import json

    from arpo.evaluation.protocol_quality import measure_protocol_quality

    engine, _, _, _, loop = real_stack
    data_dir = sft_model_dir.parents[1] / "data" / "synthetic"
    result = measure_protocol_quality(sft_model_dir, data_dir, temperature=1.0, seed=0, engine=engine, loop=loop)
    summary = result["per_kind"]
    print(json.dumps(summary))
    assert set(summary) == {"search", "python", "both"}
    assert result["overall"]["n"] == len(pd.read_parquet(data_dir / "test.parquet"))
    assert result["overall"]["format"] >= MIN_FORMAT_RATE, summary
    for kind, s in summary.items():
        assert s["acc"] >= MIN_ACCURACY[kind], summary
        assert s["acc"] < 0.95, f"SFT should leave RL headroom: {summary}"
