"""python -m arpo.eval without generation: prompts, benchmark loading, run-directory checks, resume bookkeeping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from arpo.config import REPO_ROOT, ConfigError, load_config
from arpo.eval import main
from arpo.evaluation.evaluate import evaluate, load_items
from arpo.evaluation.prompts import system_prompt
from arpo.evaluation.records import SampleWriter
from reward_fns.registry import build_compute_score
from tests.eval.helpers import record


@pytest.fixture()
def data_dir(tmp_path) -> Path:
    rows = {
        "bamboogle": [{"question": f"Who is person {i}?", "answer": [f"Person {i}", "P"]} for i in range(4)],
        "aime25": [{"problem": "Find 1+1.", "answer": 2, "id": "0"}, {"problem": "Find 2+2.", "answer": 4, "id": "1"}],
        "gaia": [{"Question": "What is it?", "answer": "it", "Level": 2}],
        "gsm8k": [{"question": "Two plus two?", "answer": "2 + 2 = 4\n#### 4"}],
    }
    for bench, lines in rows.items():
        (tmp_path / "data" / bench).mkdir(parents=True)
        (tmp_path / "data" / bench / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return tmp_path / "data"


def _cfg(data_dir, tmp_path, *extra):
    return load_config("eval", [f"eval.data_dir={data_dir}", f"eval.run_dir={tmp_path / 'run'}",
                                "eval.method=m", "eval.num_runs=2", *extra])


@pytest.mark.shared_data
def test_code_search_prompt_is_the_training_prompt(shared_data):
    import pandas as pd

    train_prompt = pd.read_parquet(shared_data / "rl" / "valid.parquet").iloc[0]["prompt"][0]["content"]
    # the released parquet has "\x08oxed" (an unescaped \b); everything else must be identical
    assert system_prompt("code_search") == train_prompt.replace("\x08", "\\b")
    assert "<python>" not in system_prompt("search") and "<search>" not in system_prompt("math")
    with pytest.raises(ValueError, match="eval.prompt_type='chat'"):
        system_prompt("chat")


def test_benchmark_rows_and_prompts(data_dir, tmp_path):
    cfg = _cfg(data_dir, tmp_path, "eval.benchmarks=[bamboogle,aime25,gaia,gsm8k]", "eval.max_samples=3",
               "eval.math_prompt_type=math")
    items = load_items(cfg, build_compute_score(cfg))
    by = {}
    for it in items:
        by.setdefault(it.benchmark, []).append(it)
    assert [len(by[b]) for b in ("bamboogle", "aime25", "gaia", "gsm8k")] == [3, 2, 1, 1]
    assert by["aime25"][1].question == "Find 2+2." and by["aime25"][1].ground_truth == 4
    assert by["gaia"][0].meta == {"level": 2} and by["gaia"][0].question == "What is it?"
    assert by["bamboogle"][0].ground_truth == ["Person 0", "P"]
    # math benchmarks get the math prompt, the others prompt_type's (code_search)
    assert by["aime25"][0].messages[0]["content"] == system_prompt("math")
    assert by["gsm8k"][0].messages[0]["content"] == system_prompt("math")
    assert by["bamboogle"][0].messages == [{"role": "system", "content": system_prompt("code_search")},
                                           {"role": "user", "content": "Who is person 0?"}]


def test_tools_prompt_names_the_runs_own_tools(data_dir, tmp_path):
    """eval.prompt_type=tools tells the model about the configured tools (here the unit converter example): each
    tag with what goes inside and its schema's description, and an example call in the tag protocol."""
    from omegaconf import OmegaConf, open_dict

    cfg = _cfg(data_dir, tmp_path, "eval.benchmarks=[bamboogle]", "eval.max_samples=1", "eval.prompt_type=tools")
    with open_dict(cfg):
        cfg.tools = OmegaConf.load(REPO_ROOT / "examples" / "unit_converter_tools.yaml")
    (item,) = load_items(cfg, build_compute_score(cfg))
    prompt = item.messages[0]["content"]
    assert prompt.startswith("You are a helpful assistant") and "<search>" not in prompt
    assert "<convert> input </convert>: Convert a quantity between units: " in prompt
    assert "<convert> input here </convert> <result> convert result here </result>" in prompt
    assert "\\boxed{answer here}" in prompt
    with pytest.raises(ValueError, match="eval.prompt_type=tools"):
        system_prompt("tools")


def test_parquet_rows_keep_their_messages(synthetic_dir, data_dir, tmp_path):
    cfg = _cfg(data_dir, tmp_path, "eval.benchmarks=[]", "eval.max_samples=5",
               f"eval.parquet_files=[{{path: {synthetic_dir / 'test.parquet'}, name: synthetic}}]")
    items = load_items(cfg, build_compute_score(cfg))
    assert len(items) == 5 and {it.benchmark for it in items} == {"synthetic"}
    assert all(it.data_source.startswith("synthetic/") for it in items)
    assert items[0].messages[0]["content"] == system_prompt("synthetic")
    assert items[0].messages[1]["content"] == items[0].question


def test_missing_benchmark_and_bad_keys_fail_with_the_key(data_dir, tmp_path):
    with pytest.raises(ConfigError, match="eval.benchmarks: no .*musique/test.jsonl"):
        evaluate(_cfg(data_dir, tmp_path, "eval.benchmarks=[musique]"))
    with pytest.raises(ConfigError, match="eval.prompt_type='chat'"):
        evaluate(_cfg(data_dir, tmp_path, "eval.prompt_type=chat"))
    with pytest.raises(ConfigError, match="unknown config key 'eval.num_run'"):
        load_config("eval", ["eval.num_run=3"])
    from arpo.config import cli_main

    with pytest.raises(SystemExit) as exit_info:  # the CLI: one line on stderr, exit status 2
        cli_main(lambda: main([f"eval.data_dir={data_dir}", "eval.benchmarks=[nope]",
                               f"eval.run_dir={tmp_path / 'cli'}"]))
    assert exit_info.value.code == 2


def _write_done(run_dir, questions, runs=2):
    with SampleWriter(run_dir) as w:
        for i, q in enumerate(questions):
            for r in range(runs):
                rec = record("bamboogle", i, r, float(i == 0))
                rec["question"] = q
                w.write(rec)


def test_finished_run_is_summarised_without_generating(data_dir, tmp_path):
    cfg = _cfg(data_dir, tmp_path, "eval.benchmarks=[bamboogle]", "eval.max_samples=2",
               "actor_rollout_ref.model.path=/nonexistent")  # never loaded: nothing is left to generate
    run_dir = tmp_path / "run"
    _write_done(run_dir, ["Who is person 0?", "Who is person 1?"])
    summary = evaluate(cfg)
    s = summary["benchmarks"]["bamboogle"]
    assert s["complete"] and s["num_samples"] == 4 and s["acc"]["mean"] == pytest.approx(0.5)
    assert json.loads((run_dir / "summary.json").read_text())["benchmarks"]["bamboogle"]["pass@k"]["2"] == 0.5
    assert json.loads((run_dir / "run.json").read_text())["method"] == "m"
    # more questions than are done: now the model is needed
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path=/nonexistent"):
        evaluate(_cfg(data_dir, tmp_path, "eval.benchmarks=[bamboogle]", "eval.max_samples=3",
                      "actor_rollout_ref.model.path=/nonexistent"))


def test_rerun_with_other_settings_or_changed_questions_is_refused(data_dir, tmp_path):
    base = ["eval.benchmarks=[bamboogle]", "eval.max_samples=2", "actor_rollout_ref.model.path=/nonexistent"]
    _write_done(tmp_path / "run", ["Who is person 0?", "Who is person 1?"])
    evaluate(_cfg(data_dir, tmp_path, *base))
    with pytest.raises(ConfigError, match=r"other settings \(sampling"):
        evaluate(_cfg(data_dir, tmp_path, *base, "actor_rollout_ref.rollout.arpo.sampling.temperature=1.0"))
    with pytest.raises(ConfigError, match=r"other settings \(tool_limits"):
        evaluate(_cfg(data_dir, tmp_path, *base, "eval.max_python_calls=3"))
    lines = (data_dir / "bamboogle" / "test.jsonl").read_text().splitlines()
    (data_dir / "bamboogle" / "test.jsonl").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with pytest.raises(ConfigError, match="made for another question"):
        evaluate(_cfg(data_dir, tmp_path, *base))


def test_response_budgets_per_benchmark_and_their_checks(data_dir, tmp_path):
    from arpo.evaluation.evaluate import response_budgets

    names = ["gsm8k", "bamboogle", "gaia", "hle", "synthetic"]
    cfg = load_config("eval", [])
    # Table 1 and any unlisted benchmark: the global budget; deep search: the deep-search recipe's length
    assert response_budgets(cfg, names) == {"gsm8k": 8192, "bamboogle": 8192, "gaia": 10000, "hle": 10000,
                                            "synthetic": 8192}
    # the small-model line of configs/eval.yaml's header (bash expands the braces into four overrides)
    small = load_config("eval", ["actor_rollout_ref.rollout.arpo.sampling.max_response_length=1024",
                                 *[f"eval.max_response_length_per_benchmark.{b}=1024"
                                   for b in ("gaia", "hle", "webwalker", "xbench")]])
    assert set(response_budgets(small, names).values()) == {1024}
    own = load_config("eval", ["eval.max_response_length_per_benchmark.gsm8k=2048",
                               "+eval.max_response_length_per_benchmark.synthetic=512"])
    assert response_budgets(own, names) == {"gsm8k": 2048, "bamboogle": 8192, "gaia": 10000, "hle": 10000,
                                            "synthetic": 512}
    for bad, shown in (("0", "0"), ("many", "'many'"), ("1.5", "1.5"), ("true", "True")):
        with pytest.raises(ConfigError, match=rf"^eval.max_response_length_per_benchmark.gsm8k={shown}: give a "
                                              r"number of response tokens >= 1, or null for actor_rollout_ref"):
            evaluate(_cfg(data_dir, tmp_path, f"eval.max_response_length_per_benchmark.gsm8k={bad}"))
    with pytest.raises(ConfigError, match=r"^eval.max_response_length_per_benchmark=\[1\]: give a mapping"):
        evaluate(_cfg(data_dir, tmp_path, "~eval.max_response_length_per_benchmark",
                      "+eval.max_response_length_per_benchmark=[1]"))


def test_a_benchmark_with_samples_keeps_its_response_budget(data_dir, tmp_path):
    base = ["eval.benchmarks=[bamboogle]", "eval.max_samples=2", "actor_rollout_ref.model.path=/nonexistent"]
    run_dir = tmp_path / "run"
    _write_done(run_dir, ["Who is person 0?", "Who is person 1?"])
    evaluate(_cfg(data_dir, tmp_path, *base))
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["response_budgets"] == {"bamboogle": 8192}
    with pytest.raises(ConfigError, match=r"other settings \(response_budgets.bamboogle \(set by "
                                          r"eval.max_response_length_per_benchmark.bamboogle or .*\): 8192 there, "
                                          r"2048 now\)"):
        evaluate(_cfg(data_dir, tmp_path, *base, "eval.max_response_length_per_benchmark.bamboogle=2048"))
    # another benchmark's budget does not touch bamboogle's samples
    evaluate(_cfg(data_dir, tmp_path, *base, "eval.max_response_length_per_benchmark.gaia=2048"))
    # a run.json written before per-benchmark budgets: its samples had the global budget
    meta = json.loads((run_dir / "run.json").read_text())
    del meta["response_budgets"]
    (run_dir / "run.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"response_budgets.bamboogle .* 8192 there, 2048 now"):
        evaluate(_cfg(data_dir, tmp_path, *base, "eval.max_response_length_per_benchmark.bamboogle=2048"))
    evaluate(_cfg(data_dir, tmp_path, *base))
    assert json.loads((run_dir / "run.json").read_text())["response_budgets"] == {"bamboogle": 8192}
    # gaia has no samples here yet: it takes any budget (generation then needs the model), and run.json keeps both
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path=/nonexistent"):
        evaluate(_cfg(data_dir, tmp_path, "eval.benchmarks=[gaia]", "actor_rollout_ref.model.path=/nonexistent",
                      "eval.max_response_length_per_benchmark.gaia=4096"))
    assert json.loads((run_dir / "run.json").read_text())["response_budgets"] == {"bamboogle": 8192, "gaia": 4096}


def test_a_hub_model_id_is_fetched_into_the_hub_cache_and_recorded_by_id(data_dir, tmp_path, monkeypatch):
    """``actor_rollout_ref.model.path=owner/name`` as transformers and vLLM take it: the run records the ID and the
    revision (not a cache path) and is named after the model."""
    import huggingface_hub.constants as hub

    commit = "c" * 40
    snapshot = tmp_path / "hub" / "models--dongguanting--Qwen2.5-7B-ARPO" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # the cache is the Hub here: no network in tests
    run_dir = tmp_path / "out" / "Qwen2.5-7B-ARPO" / "seed0"
    _write_done(run_dir, ["Who is person 0?"])
    summary = evaluate(load_config("eval", [f"eval.data_dir={data_dir}", f"eval.output_dir={tmp_path / 'out'}",
                                            "eval.benchmarks=[bamboogle]", "eval.max_samples=1", "eval.num_runs=2",
                                            "actor_rollout_ref.model.path=dongguanting/Qwen2.5-7B-ARPO"]))
    assert summary["model_path"] == f"dongguanting/Qwen2.5-7B-ARPO@{commit}" and summary["method"] == "Qwen2.5-7B-ARPO"
    assert json.loads((run_dir / "run.json").read_text())["model_path"] == f"dongguanting/Qwen2.5-7B-ARPO@{commit}"
    with pytest.raises(ConfigError, match=r"model.path=nobody/no-such-model: not fetched from the Hugging Face Hub"):
        evaluate(load_config("eval", [f"eval.data_dir={data_dir}", f"eval.run_dir={tmp_path / 'x'}",
                                      "eval.benchmarks=[bamboogle]", "actor_rollout_ref.model.path=nobody/no-such-model"]))
