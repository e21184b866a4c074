"""The worked examples under examples/ (docs/extending.md), each run through the real code path it extends."""

from __future__ import annotations

import pytest

from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.policies import POLICY_REGISTRY, Arpo, get_policy_class, make_policy
from examples.margin_policy import MarginArpo, top_margin
from tests.rollout.rollout_helpers import rows, rollout

MARGIN = "examples.margin_policy:MarginArpo"
# rule and timing paper: fork iff the uncertainty after a tool result exceeds the root's (deterministic)
CFG = {"n": 6, "initial_rollouts": 2, "branching.rule": "paper", "branching.timing": "paper",
       "sampling.max_response_length": 256}


def test_builtin_policies_are_registered_and_config_strings_select_classes():
    assert {"arpo", "aepo", "tree_grpo"} <= set(POLICY_REGISTRY)
    cfg = ARPORolloutConfig.from_dict({"policy": MARGIN})
    assert type(make_policy(cfg)) is MarginArpo and issubclass(MarginArpo, Arpo)
    assert get_policy_class("arpo") is Arpo
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.arpo\.policy='nope': use one of \('arpo', 'aepo', 'tree_grpo'\)"):
        ARPORolloutConfig.from_dict({"policy": "nope"})
    with pytest.raises(ValueError, match=r"policy='examples.margin_policy:Missing': cannot import"):
        ARPORolloutConfig.from_dict({"policy": "examples.margin_policy:Missing"})


def test_margin_policy_forks_in_a_real_rollout():
    assert top_margin({1: -0.1, 2: -3.0}) == pytest.approx(0.9048 - 0.0498, abs=1e-3)
    calls = []
    original = MarginArpo.window_uncertainty

    def counted(self, tree, lps):
        calls.append(len(lps))
        return original(self, tree, lps)

    MarginArpo.window_uncertainty = counted
    try:
        batch, _, _ = rollout({**CFG, "policy": MARGIN}, n_prompts=2, seed=1)
    finally:
        MarginArpo.window_uncertainty = original
    rs = rows(batch)
    assert calls, "the rollout never asked the example policy for its measure"
    assert sum(r["kind"] == "branch" for r in rs) > 0
    deltas = [c["delta_entropy"] for r in rs for c in r["calls"] if c["delta_entropy"] is not None]
    assert deltas and max(deltas) > 0
    # the same rollout with ARPO's entropy measure records other ΔH values: the example changed the measure
    arpo_batch, _, _ = rollout({**CFG, "policy": "arpo"}, n_prompts=2, seed=1)
    arpo_deltas = [c["delta_entropy"] for r in rows(arpo_batch) for c in r["calls"] if c["delta_entropy"] is not None]
    assert arpo_deltas[:1] != deltas[:1]


def test_register_decorator_routes_a_data_source():
    from reward_fns import registry

    reg_before = dict(registry.REGISTRY.exact)
    try:
        @registry.register("examples_bench")
        def score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return float(solution_str == ground_truth)

        assert registry.default_compute_score("examples_bench", "4", "4") == 1.0
    finally:
        registry.REGISTRY.exact = reg_before


@pytest.mark.slow  # one real update of the tiny model in this process (~15 s on 2 busy cores)
def test_length_penalty_reward_is_used_in_a_training_step(tiny_model_dir, synthetic_dir):
    """The trainer's own step (real FSDP2 update on one in-process rank, real rewards and weight push; scripted
    engine) with the example named by verl's custom_reward_function keys: its diagnostics reach the step's
    metrics, and every metric of the step has an entry in the docs' metrics glossary (the same step serves both
    checks: one training step fewer in the suite)."""
    from arpo.reference.metrics_glossary import unknown_metrics
    from tests.trainer.train_step_helpers import one_train_step

    metrics, _ = one_train_step(tiny_model_dir, synthetic_dir, [
        "custom_reward_function.path=examples/length_penalty_reward.py", "custom_reward_function.name=compute_score",
        "+custom_reward_function.reward_kwargs.max_chars=1", "+custom_reward_function.reward_kwargs.penalty_per_char=0.01"])
    assert "actor/pg_loss" in metrics
    assert metrics["reward/length_penalty/mean"] > 0
    assert metrics["critic/score/mean"] == pytest.approx(
        metrics["reward/base_score/mean"] - metrics["reward/length_penalty/mean"], abs=1e-5)
    assert "timing_s/step" in metrics and "critic/score/mean" in metrics
    assert not unknown_metrics(metrics), f"add these to arpo/reference/metrics_glossary.py: {unknown_metrics(metrics)}"


def test_jsonl_dataset_loads_through_the_real_dataset_class(tiny_model_dir):
    from transformers import AutoTokenizer

    from arpo.data.rl_dataset import RLDataset, StatefulPromptLoader
    from reward_fns.registry import default_compute_score

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ds = RLDataset(["examples/jsonl_dataset/gsm8k.jsonl"], tok, max_prompt_length=512)
    assert len(ds) == 4
    first, system, chat = ds[0], ds[2], ds[3]
    assert first["raw_prompt"] == [{"role": "user", "content": first["extra_info"]["question"]}]
    assert first["data_source"] == "gsm8k" and first["reward_model"] == {"ground_truth": "72", "style": "rule"}
    assert first["extra_info"]["question"] in tok.decode(first["raw_prompt_ids"])  # chat-templated and tokenized
    assert system["raw_prompt"][0]["role"] == "system" and chat["data_source"] == "math"
    # the mapped row routes to a real reward, and batches come out of the real loader
    answer = "<think>48 + 24</think>\n<answer>\\boxed{72}</answer>"
    gt = first["reward_model"]["ground_truth"]
    assert default_compute_score(first["data_source"], answer, gt, first["extra_info"])["score"] == 1.0
    assert len(StatefulPromptLoader(ds, batch_size=2).next_batch()) == 2


def test_jsonl_row_without_an_answer_is_one_error_naming_the_line(tmp_path):
    from arpo.data.rl_dataset import jsonl_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a?", "answer": "1"}\n{"question": "b?"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no 'answer'"):
        jsonl_rows(bad)


def test_unit_converter_tool_is_called_through_the_tool_registry():
    import asyncio

    from tools.registry import load_tools

    reg = load_tools("examples/unit_converter_tools.yaml")
    try:
        assert reg.names == ["unit_converter"] and reg.tags == ["convert"]
        assert reg.schemas()[0]["function"]["name"] == "convert_units"
        # the agent loop's path: function name and argument dict; the YAML's config rounds to 3 places
        assert reg.call("convert_units", {"value": 3, "from_unit": "km", "to_unit": "mi"}) == "3 km = 1.864 mi"
        assert reg.call("convert_units", {"value": 1, "from_unit": "kg", "to_unit": "s"}).startswith("Error: cannot")
        # a tag call with text, as the rollout's executor makes it
        assert asyncio.run(reg.acall("unit_converter", "90 min to h")) == "90 min = 1.5 h"
    finally:
        reg.close()


def test_unit_converter_tool_is_called_on_the_arpo_rollout_path():
    """The model writes <convert>…</convert> beside search and python: the engine is told to stop on its close tag,
    the rollout runs the tool and appends its result (masked), and the run's reward, configured with the same tools,
    accepts it."""
    from omegaconf import OmegaConf

    from arpo.protocol import RESULT_OPEN
    from arpo.rollout.arpo_rollout import ARPORollout
    from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
    from reward_fns.gate import check_format
    from reward_fns.registry import build_compute_score
    from tests.rollout.fake_tools import FakePython, FakeSearch
    from tools.registry import load_tools

    call = "<think> I need miles </think> <convert>3 km to mi</convert>"
    final = "<think> done </think> <answer> \\boxed{1.864} </answer>"
    engine = ScriptedEngine(ToyTokenizer(), replies=lambda context, _: final if RESULT_OPEN in context else call)
    reg = load_tools("examples/unit_converter_tools.yaml")
    gen = ARPORollout(engine, engine.tokenizer, {"n": 2, "initial_rollouts": 2, "sampling.max_response_length": 200},
                      tools=[FakeSearch(), FakePython(), *reg.values()])
    try:
        batch = gen.generate([engine.tokenizer.encode("How many miles is 3 km?")], seed=0)
    finally:
        gen.close()
        reg.close()
    assert gen.protocol.tags == {"search": "search", "python": "python", "unit_converter": "convert"}
    # the reward as training builds it from the run's tool entries (none of them started)
    entries = [{"class_name": f"tests.rollout.fake_tools.{cls}"} for cls in ("FakeSearch", "FakePython")]
    reward = build_compute_score({"tools": [*entries, *OmegaConf.load("examples/unit_converter_tools.yaml").tools]})
    assert reward.protocol == gen.protocol
    assert set(engine.requests[0].sampling_params.stop) >= {"</search>", "</python>", "</convert>"}
    tok = engine.tokenizer
    for r in rows(batch):
        text = tok.decode(r["ids"], skip_special_tokens=True)
        assert text == f"{call} <result>\n3 km = 1.864 mi\n</result>{final}"
        (record,) = r["calls"]
        assert record["tool"] == "unit_converter" and not record["error"]
        # the result's tokens are the tool's, not the policy's: masked out of the loss
        assert tok.decode(r["ids"][record["start"]: record["end"]]) == " <result>\n3 km = 1.864 mi\n</result>"
        assert set(r["mask"][record["start"]: record["end"]]) == {0} and r["finish"] == "stop"
        # the format gate reads the new tag only when given the run's tools, which the run's reward does
        assert not check_format(text).ok
        scored = reward("synthetic/python", text, "1.864", {"tool_calls": r["calls"]})
        assert scored["format_ok"] == 1.0 and scored["score"] == 1.0
