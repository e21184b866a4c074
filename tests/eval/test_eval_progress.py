"""The evaluation bar moves while samples generate, and a sample that runs to its benchmark's budget is recorded as
truncated and counted: the real runner and rollout on the scripted engine, with the bar's postfix captured."""

from __future__ import annotations

import asyncio

from arpo.evaluation import progress as progress_module
from arpo.evaluation.benchmarks import EvalItem
from arpo.evaluation.evaluate import print_summary, write_summary
from arpo.evaluation.records import SampleWriter, load_samples, samples_path
from arpo.evaluation.runner import EvalRunner, Grader, SampleSpec
from arpo.rollout.config import ARPORolloutConfig
from arpo.rollout.tool_executor import ToolExecutor
from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
from reward_fns.registry import build_compute_score
from tests.eval.test_runner import AddingPython

LOOP_QUESTION = "Count for ever"
#: the degenerate sample: every turn is another python call, never an answer, until the budget ends it
LOOP_TURN = "<think> once more </think> <python>print(1 + 1)</python>"
ANSWER = "<think> easy </think> <answer> \\boxed{2} </answer>"


class RecordingBar:
    """Stands in for tqdm: keeps (finished samples, postfix) at every postfix update."""

    format_sizeof = staticmethod(progress_module.tqdm.format_sizeof)  # used for counts past 100k
    bars: list["RecordingBar"] = []

    def __init__(self, total, **kwargs):
        self.total, self.n, self.updates, self.closed = total, 0, [], False
        RecordingBar.bars.append(self)

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        self.updates.append((self.n, dict(ordered_dict or kwargs)))

    def update(self, n=1):
        self.n += n

    def refresh(self):
        pass

    def close(self):
        self.closed = True


def _reply(prompt_text: str, request_id: str) -> str:
    return LOOP_TURN if LOOP_QUESTION in prompt_text else ANSWER


def _spec(tok, benchmark: str, index: int, question: str) -> SampleSpec:
    item = EvalItem(benchmark, index, question, "2", "synthetic/python", [{"role": "user", "content": question}])
    return SampleSpec(item, 0, tok.encode(f"question {question} answer:"))


def test_bar_moves_while_a_degenerate_sample_runs_to_its_budget(tmp_path, monkeypatch, capsys):
    RecordingBar.bars.clear()
    monkeypatch.setattr(progress_module, "tqdm", RecordingBar)
    tok = ToyTokenizer()
    executor = ToolExecutor([AddingPython()], max_workers=2, retries=0)
    cfg = ARPORolloutConfig.from_dict({"mode": "single", "n": 1, "tools.call_limit": 100,
                                       "sampling.max_response_length": 600})
    writer = SampleWriter(tmp_path)
    runner = EvalRunner(ScriptedEngine(tok, replies=_reply), tok, executor, cfg, {"python": 100}, (),
                        Grader(build_compute_score(None)), writer, method="m", seed=3, concurrency=3,
                        show_progress=True, response_budgets={"loops": 300})
    specs = [_spec(tok, "loops", 0, LOOP_QUESTION), _spec(tok, "synthetic", 0, "What is 1 + 1?"),
             _spec(tok, "synthetic", 1, "What is 2 + 0?")]
    with writer:
        assert asyncio.run(runner.run(specs)) == 3
    executor.close()

    (bar,) = RecordingBar.bars
    assert bar.closed and bar.n == 3
    # once the two answers are in, the bar's count stands at 2 while the looping sample goes on; the postfix
    # shows it in flight, and its token count grows turn after turn
    alone = [p for n, p in bar.updates if n == 2 and p["in_flight"] == "1"]
    tokens = [int(p["tokens"].replace(",", "")) for p in alone]
    assert len(tokens) >= 8 and all(a < b for a, b in zip(tokens, tokens[1:])), alone
    assert all(set(p) >= {"in_flight", "tokens", "tok/s"} for _, p in bar.updates)
    final = bar.updates[-1][1]
    assert final["in_flight"] == "0" and final["truncated"] == "1" and final["acc"] == f"{2 / 3:.3f}"

    (loop,) = load_samples(samples_path(tmp_path, "loops"))
    assert loop["truncated"] and loop["finish_reason"] == "length"
    assert loop["response_budget"] == 300 and loop["response_tokens"] == 300  # its benchmark's budget, not 600
    assert loop["tool_calls"]["python"] >= 5 and loop["answer"] == ""
    answers = load_samples(samples_path(tmp_path, "synthetic"))
    assert [(r["truncated"], r["response_budget"], r["finish_reason"]) for r in answers] == [(False, 600, "stop")] * 2
    # every token the bar counted is in a record: the bar adds up exactly the responses' model tokens
    assert int(final["tokens"].replace(",", "")) == sum(r["model_tokens"] for r in [loop, *answers])

    meta = {"method": "m", "seed": 3, "model_path": "x", "num_runs": 1, "metric_profile": "strict",
            "pass_threshold": 1.0}
    summary = write_summary(tmp_path, meta, {"loops": 1, "synthetic": 2})
    assert summary["benchmarks"]["loops"]["truncated"] == {"count": 1, "rate": 1.0}
    assert summary["benchmarks"]["synthetic"]["truncated"] == {"count": 0, "rate": 0.0}
    print_summary(summary)
    out = capsys.readouterr().out
    assert "(1 samples, 1 truncated)" in out and "(2 samples)" in out


def test_progress_without_a_bar_still_counts(monkeypatch):
    """eval.show_progress=false: no bar is drawn and no heartbeat runs; the counters still add up."""
    now = [0.0]
    p = progress_module.EvalProgress(2, enabled=False, clock=lambda: now[0])
    asyncio.run(asyncio.wait_for(p.heartbeat(), 1))  # returns at once when disabled
    p.sample_started()
    p.generated(300)
    p.generated(1700)
    now[0] = 4.0
    assert p.postfix() == {"in_flight": "1", "tokens": "2,000", "tok/s": "500"}
    p.sample_finished({"metrics": {"acc": 1.0}, "truncated": True})
    p.generated(250_000)
    assert p.postfix() == {"acc": "1.000", "in_flight": "0", "tokens": "252k", "tok/s": "63,000", "truncated": "1"}
    p.close()
