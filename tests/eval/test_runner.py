"""The evaluation runner on the real rollout with a scripted engine: per-tool limits, grading, records."""

from __future__ import annotations

import asyncio

import pytest

from arpo.testing.scripted_engine import ScriptedEngine, ScriptPolicy, ToyTokenizer
from arpo.evaluation.benchmarks import EvalItem
from arpo.evaluation.records import SampleWriter, load_samples, samples_path
from arpo.evaluation.runner import EvalRunner, Grader, SampleSpec
from arpo.evaluation.tool_limits import REFUSAL_REPEAT, TrajectoryToolLimits
from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.tool_executor import ToolExecutor
from reward_fns.registry import build_compute_score
from tools.base import BaseTool


def _schema(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}


class AddingPython(BaseTool):
    """Evaluates the scripted engine's ``print(a + b)`` programs (and counts its calls)."""

    name = "python"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def default_schema(self) -> dict:
        return _schema("python")

    def call_text(self, content: str) -> str:
        self.calls += 1
        a, b = content.strip()[len("print("):-1].split("+")
        return str(int(a) + int(b))


class EchoSearch(BaseTool):
    name = "search"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def default_schema(self) -> dict:
        return _schema("search")

    def call_text(self, content: str) -> str:
        self.calls += 1
        return f"Page 1: about {content}"


def _runner(tmp_path, tools, policy, limits, max_total, concurrency=4):
    tok = ToyTokenizer()
    engine = ScriptedEngine(tok, policy)
    executor = ToolExecutor(tools, max_workers=4, retries=0)
    cfg = ARPORolloutConfig.from_dict({"mode": "single", "n": 1, "tools.call_limit": max_total,
                                       "sampling.max_response_length": 600, "sampling.temperature": 0.6,
                                       "sampling.top_p": 0.95, "sampling.top_k": 20,
                                       "sampling.repetition_penalty": 1.1})
    grader = Grader(build_compute_score(None), require_format=False)
    writer = SampleWriter(tmp_path)
    runner = EvalRunner(engine, tok, executor, cfg, limits, ("search",), grader, writer, method="m", seed=7,
                        concurrency=concurrency, show_progress=False)
    return runner, tok, writer, executor


def _specs(tok, n_questions, runs, benchmark="synthetic"):
    items = [EvalItem(benchmark, i, f"What is {i} + {i}?", str(2 * i), "synthetic/python",
                      [{"role": "user", "content": f"What is {i} + {i}?"}]) for i in range(n_questions)]
    return [SampleSpec(it, r, tok.encode(f"question {it.question} answer:")) for it in items for r in range(runs)]


def test_python_limit_refuses_then_total_limit_ends(tmp_path):
    python = AddingPython()
    runner, tok, writer, executor = _runner(
        tmp_path, [python], ScriptPolicy(tools=("python",), call_prob=1.0, call_decay=0.0),
        limits={"python": 2, "search": 10}, max_total=4)
    with writer:
        written = asyncio.run(runner.run(_specs(tok, 3, 2)))
    executor.close()
    assert written == 6
    records = load_samples(samples_path(tmp_path, "synthetic"))
    assert len(records) == 6 and {(r["index"], r["run"]) for r in records} == {(i, r) for i in range(3) for r in range(2)}
    assert python.calls == 6 * 2  # the tool ran only up to its limit in every sample
    for r in records:
        assert r["tool_calls"] == {"total": 2, "search": 0, "python": 2, "refused": 2}
        assert r["finish_reason"] == "tool_limit"  # the 5th call hits max_total_calls
        assert [c["error"] for c in r["tool_call_records"]] == [False, False, True, True]
        assert r["response"].count("may be called at most 2 times") == 2
        assert r["method"] == "m" and r["run_seed"] == 7 and r["session"] == runner.session
        assert set(r["metrics"]) == {"score", "acc", "em", "f1", "format_ok"}
    # each (question, run) has its own seed, identical for identical inputs
    assert len({r["seed"] for r in records}) == 6
    assert records[0]["seed"] == runner.sample_seed(EvalItem("synthetic", 0, "", "", "", []), 0)


def test_samples_are_graded_with_the_registry(tmp_path):
    runner, tok, writer, executor = _runner(
        tmp_path, [AddingPython()], ScriptPolicy(tools=("python",), call_prob=0.0), limits={}, max_total=4)
    specs = _specs(tok, 20, 1)
    with writer:
        asyncio.run(runner.run(specs))
    executor.close()
    records = load_samples(samples_path(tmp_path, "synthetic"))
    assert len(records) == 20
    for r in records:
        # the scripted policy answers \boxed{<0..99>} right away; acc is exactly "answer == ground truth"
        assert r["finish_reason"] == "stop" and r["tool_calls"]["total"] == 0
        assert r["answer"] != "" and r["metrics"]["acc"] == float(int(r["answer"]) == int(r["ground_truth"]))
        assert r["metrics"]["format_ok"] == 1.0
        # the arpo profile grades the same text as the released evaluation (QA F1 of the boxed answer)
        assert r["task"] == "qa" and r["metrics_arpo"]["prediction"] == r["answer"]
        assert r["metrics_arpo"]["acc"] == float(r["answer"] == str(r["ground_truth"]))


def test_repeated_search_query_is_refused_without_running():
    search = EchoSearch()
    executor = ToolExecutor([search], retries=0)
    limits = TrajectoryToolLimits(executor, {"search": 3}, refuse_repeated=("search",))
    out = asyncio.run(limits.arun_many([("search", "capital of Zorvia"), ("search", " capital of Zorvia ")]))
    assert out[0].ok and out[0].text == "Page 1: about capital of Zorvia"
    assert not out[1].ok and out[1].text == REFUSAL_REPEAT and out[1].error == "refused"
    out = asyncio.run(limits.arun_many([("search", "b"), ("search", "c"), ("search", "d")]))
    assert [r.ok for r in out] == [True, True, False]  # the 4th distinct query is past the limit of 3
    assert "at most 3 times" in out[2].text
    assert search.calls == 3 and limits.executed["search"] == 3 and limits.refused["search"] == 2
    executor.close()


def test_hermes_calls_pass_the_limits_by_their_arguments():
    """With ``tools.format: hermes`` a call's content is its arguments: the repeat check reads them in a fixed order,
    and the rollout resolves function names through the wrapped executor's tools."""
    search = EchoSearch()
    executor = ToolExecutor([search], retries=0)
    limits = TrajectoryToolLimits(executor, {"search": 3}, refuse_repeated=("search",))
    assert limits.tools is executor.tools
    out = asyncio.run(limits.arun_many([("search", {"x": "capital of Zorvia"}), ("search", {"x": "capital of Zorvia"}),
                                        ("search", {"x": "b"})]))
    assert [r.ok for r in out] == [True, False, True] and out[1].text == REFUSAL_REPEAT
    assert out[0].text == "Page 1: about capital of Zorvia" and search.calls == 2
    executor.close()


def test_a_failing_engine_stops_the_run_and_writes_nothing_partial(tmp_path):
    class Broken(ScriptedEngine):
        async def generate(self, prompt_ids, sampling_params, request_id):
            raise RuntimeError("engine died")

    runner, tok, writer, executor = _runner(tmp_path, [AddingPython()], ScriptPolicy(), {}, 4)
    runner.engine = Broken(tok)
    with writer, pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(runner.run(_specs(tok, 3, 1)))
    executor.close()
    assert load_samples(samples_path(tmp_path, "synthetic")) == []


def test_grader_passes_require_format_only_to_registry_rewards_that_take_it():
    text = "<answer> \\boxed{Paris} </answer>"  # no <think>: fails the ARPO format check
    registry = Grader(build_compute_score(None), require_format=False)
    qa = registry.grade("bamboogle", text, ["Paris"], {})
    assert qa["format_ok"] == 0.0 and qa["acc"] == 1.0 and "error" not in qa  # graded anyway, as ARPO's eval
    strict = Grader(build_compute_score(None), require_format=True).grade("bamboogle", text, ["Paris"], {})
    assert strict["acc"] == 0.0 and strict["score"] == -1.0
    dr = registry.grade("DR_grpo_mix", text, "Paris", {})  # deep_research: ARPO's training reward, strict
    assert "error" not in dr and dr["score"] == -1.0

    def custom(data_source, solution_str, ground_truth, extra_info):  # verl's four arguments, nothing else
        return float("Paris" in solution_str)

    assert Grader(custom, require_format=False).grade("anything", text, "Paris", {}) == {"score": 1.0}
