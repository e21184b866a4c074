"""Metric profiles end to end on saved samples: re-scoring without generation, the summary, and the tables that
show both profiles side by side (real graders on real response texts; no engine)."""

from __future__ import annotations

import csv
import json

import pytest

from arpo.config import ConfigError, load_config
from arpo.evaluation.evaluate import RUN_FILE, evaluate
from arpo.evaluation.records import SampleWriter, load_run_samples
from arpo.evaluation.rescore import main as rescore_main
from arpo.tables import main as tables_main

# (benchmark, data_source, ground truth, boxed answer) -> strict / arpo accuracy
SAMPLES = [
    ("bamboogle", ["1827"], "The answer is 1827."),  # strict F1 0.5, released F1 0 (punctuation kept)
    ("bamboogle", ["1827"], "1827"),                 # 1 / 1
    ("math500", "18", "18.0"),                        # math-verify 1, string equivalence 0
    ("math500", "\\frac{1}{2}", "\\frac{1}{2}"),      # 1 / 1
]
REWARD = {"custom_reward_function": {"path": None, "name": "compute_score", "reward_kwargs": {}},
          "math_mode": "equiv", "qa_metric": "f1", "deep_research_tool_bonus": 0.1, "deep_research_variant": "fixed"}


def write_eval_run(root, method="grpo", seed=0, stale=True):
    """A finished run as python -m arpo.eval leaves it; ``stale``: metrics of an older grader, no arpo profile."""
    run_dir = root / method / f"seed{seed}"
    run_dir.mkdir(parents=True)
    (run_dir / RUN_FILE).write_text(json.dumps({
        "method": method, "seed": seed, "model_path": "m", "num_runs": 1, "pass_threshold": 1.0,
        "metric_profile": "arpo", "reward": REWARD, "require_format": False}))
    counts: dict[str, int] = {}
    with SampleWriter(run_dir) as w:
        for bench, gt, answer in SAMPLES:
            index = counts[bench] = counts.get(bench, -1) + 1
            w.write({"benchmark": bench, "index": index, "run": 0, "data_source": bench, "question": f"q{index}",
                     "ground_truth": gt, "response": f"<think>t</think><answer>\\boxed{{{answer}}}</answer>",
                     "metrics": {"acc": 0.0} if stale else {}, "tool_calls": {"total": 0}, "tool_call_records": []})
    return run_dir


def _cells(table_md: str) -> dict[str, str]:
    """Header -> cell of the grpo row of a Markdown table."""
    lines = table_md.splitlines()
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    row = next(line for line in lines if line.startswith("| grpo"))
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))


def test_rescore_grades_both_profiles_from_saved_samples(tmp_path, capsys):
    run_dir = write_eval_run(tmp_path)
    [summary] = rescore_main(["--runs", str(tmp_path)])
    assert summary["metric_profile"] == "arpo" and summary["changed"] == {"bamboogle": 2, "math500": 2}
    acc = {b: {p: s["acc_by_profile"][p]["mean"] for p in ("arpo", "strict")}
           for b, s in summary["benchmarks"].items()}
    assert acc == {"bamboogle": {"arpo": 0.5, "strict": 0.75}, "math500": {"arpo": 0.5, "strict": 1.0}}
    assert summary["benchmarks"]["math500"]["math_equal"]["mean"] == 0.5  # the arpo profile's own metrics
    records = load_run_samples(run_dir)["bamboogle"]
    assert records[0]["task"] == "qa" and records[0]["metrics_arpo"]["prediction"] == "The answer is 1827."
    assert records[0]["metrics"]["f1"] == 0.5 and records[0]["metrics_arpo"]["f1"] == 0.0
    assert "bamboogle    acc arpo 50.0  strict 75.0" in capsys.readouterr().out
    # idempotent, and the summary can be switched to the other profile
    [again] = rescore_main(["--runs", str(run_dir), "--profile", "strict"])
    assert again["changed"] == {"bamboogle": 0, "math500": 0} and again["benchmarks"]["math500"]["acc"]["mean"] == 1.0
    assert json.loads((run_dir / RUN_FILE).read_text())["metric_profile"] == "strict"


def test_tables_use_the_arpo_profile_by_default_and_show_both(tmp_path):
    write_eval_run(tmp_path / "eval", stale=False)
    rescore_main(["--runs", str(tmp_path / "eval")])
    out = tmp_path / "tables"
    tables_main(["--runs", str(tmp_path / "eval"), "--out", str(out)])
    table1 = (out / "table1.md").read_text()
    assert _cells(table1)["MATH500"] == "50.0" and _cells(table1)["Bamboogle"] == "50.0"
    assert "Metric profile arpo" in table1
    tables_main(["--runs", str(tmp_path / "eval"), "--out", str(out / "strict"), "--profile", "strict"])
    strict = (out / "strict" / "table1.md").read_text()
    assert _cells(strict)["MATH500"] == "100.0" and _cells(strict)["Bamboogle"] == "75.0"
    assert "Metric profile strict" in strict
    with open(out / "profiles.csv", newline="") as f:
        diff = {r["benchmark"]: float(r["strict_minus_arpo"]) for r in csv.DictReader(f)}
    assert diff == pytest.approx({"bamboogle": 0.25, "math500": 0.5})
    assert "| grpo | MATH500 | 50.0 | 100.0 | +50.0 | 2 |" in (out / "profiles.md").read_text()


def test_runs_without_the_arpo_profile_are_graded_on_the_fly(tmp_path):
    write_eval_run(tmp_path / "eval", stale=True)  # written before the profile existed: no metrics_arpo
    out = tmp_path / "tables"
    tables_main(["--runs", str(tmp_path / "eval"), "--out", str(out)])
    assert "| grpo | Bamboogle | 50.0 | 0.0 | -50.0 | 2 |" in (out / "profiles.md").read_text()


def test_metric_profile_is_validated_and_recorded(tmp_path):
    data = tmp_path / "data" / "bamboogle"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text(json.dumps({"question": "q0", "answer": ["1827"]}) + "\n")
    base = [f"eval.data_dir={tmp_path / 'data'}", f"eval.run_dir={tmp_path / 'run'}", "eval.method=m",
            "eval.num_runs=1", "eval.benchmarks=[bamboogle]", "actor_rollout_ref.model.path=/nonexistent"]
    with pytest.raises(ConfigError, match="eval.metric_profile='paper': choose one of"):
        evaluate(load_config("eval", [*base, "eval.metric_profile=paper"]))
    with SampleWriter(tmp_path / "run") as w:  # finished already: summarised without the model
        w.write({"benchmark": "bamboogle", "index": 0, "run": 0, "question": "q0", "data_source": "bamboogle",
                 "ground_truth": ["1827"], "response": "<answer>\\boxed{1827.}</answer>",
                 "metrics": {"acc": 1.0}, "tool_calls": {"total": 0}})
    summary = evaluate(load_config("eval", base))
    assert summary["metric_profile"] == "arpo" and json.loads((tmp_path / "run" / RUN_FILE).read_text())[
        "metric_profile"] == "arpo"
    s = summary["benchmarks"]["bamboogle"]
    assert s["acc"]["mean"] == 0.0 and s["acc_by_profile"]["strict"]["mean"] == 1.0


def test_evaluation_and_rescore_grade_with_the_run_s_tool_tags(tmp_path):
    """A <convert> call is well formed when the run loads the unit converter: the evaluation's config reaches the
    format gate, and rescore reads the tools recorded in run.json (strict profile, format required)."""
    from omegaconf import OmegaConf

    from arpo.evaluation.rescore import grader_for
    from reward_fns.registry import build_compute_score

    converter = OmegaConf.load("examples/unit_converter_tools.yaml").tools
    cfg = load_config("eval", [])
    cfg.tools = converter
    assert build_compute_score(cfg).protocol.tags == {"unit_converter": "convert"}
    response = ("<think>miles</think><convert>3 km to mi</convert> <result>\n3 km = 1.864 mi\n</result>"
                "<think>done</think><answer>\\boxed{1.864}</answer>")
    meta = {"reward": REWARD, "require_format": True, "tools": OmegaConf.to_container(converter)}
    graded = grader_for(meta).grade("synthetic/python", response, "1.864", {})
    assert graded["format_ok"] == 1.0 and graded["score"] == 1.0
    assert grader_for({**meta, "tools": None}).grade("synthetic/python", response, "1.864", {})["score"] == -1.0
