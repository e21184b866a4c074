"""arpo.tables on hand-made evaluation outputs: mean ± std over seeds, missing cells, averages, LaTeX, CSV."""

from __future__ import annotations

import csv
import json
import math

import pytest

from arpo.tables import main as tables_main
from arpo.evaluation.tables import make_tables
from tests.eval.helpers import write_run


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture()
def runs(tmp_path):
    root = tmp_path / "eval"
    # grpo: two seeds; seed 0 bamboogle per-run means 0.5 and 0.5, seed 1 0.75 / 0.75 -> 62.5 ± 17.7
    write_run(root, "grpo", 0, {"bamboogle": [[1, 0, 1, 0], [0, 1, 0, 1]], "math500": [[1, 1], [1, 0]]}, tools=2)
    write_run(root, "grpo", 1, {"bamboogle": [[1, 1, 1, 0], [1, 1, 0, 1]], "math500": [[0, 0], [0, 0]]}, tools=4)
    # arpo: one seed, every Table 1 knowledge benchmark -> a knowledge average exists; no math500
    write_run(root, "arpo", 0, {b: [[1, 0]] for b in ("hotpotqa", "2wiki", "musique", "bamboogle")}
              | {"gaia": [[1, 1, 0, 0]], "synthetic": [[1, 1, 1, 0]]}, tools=1)
    return root


def test_cells_are_mean_and_std_over_seeds(runs, tmp_path):
    out = tmp_path / "tables"
    make_tables([str(runs)], out)
    md = (out / "table1.md").read_text()
    grpo = next(line for line in md.splitlines() if line.startswith("| grpo"))
    cells = [c.strip() for c in grpo.strip("|").split("|")]
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    row = dict(zip(header, cells))
    # bamboogle: seed values 0.5 and 0.75 -> mean 62.5, sample std 17.68
    assert row["Bamboogle"] == f"62.5 ± {100 * math.sqrt(2 * 0.125 ** 2):.1f}"
    # math500: seed 0 runs 1.0 and 0.5 -> 0.75; seed 1 -> 0.0
    assert row["MATH500"] == f"37.5 ± {100 * math.sqrt(2 * 0.375 ** 2):.1f}"
    assert row["AIME24"] == "–" and row["Math avg."] == "–" and row["Avg."] == "–"
    # tools per question: mean over the method's benchmarks in the table, then over seeds (2 and 4)
    assert row["Tools/q"] == f"3.00 ± {math.sqrt(2):.2f}"


def test_averages_only_over_complete_groups(runs, tmp_path):
    out = tmp_path / "tables"
    make_tables([str(runs / "*" / "seed*")], out, methods=["arpo", "grpo"])
    rows = {r["method"]: r for r in _csv(out / "table1.csv")}
    assert [r["method"] for r in _csv(out / "table1.csv")] == ["arpo", "grpo"]
    assert float(rows["arpo"]["Knowledge avg. mean"]) == pytest.approx(50.0)
    assert rows["arpo"]["Knowledge avg. std"] == ""  # one seed: no std
    assert rows["arpo"]["Math avg. mean"] == "" and rows["arpo"]["Math avg. seeds"] == "0"
    assert rows["grpo"]["Knowledge avg. mean"] == ""  # grpo lacks hotpotqa/2wiki/musique
    assert float(rows["grpo"]["Bamboogle mean"]) == pytest.approx(62.5)
    assert rows["grpo"]["Bamboogle seeds"] == "2"


def test_latex_and_deep_search_and_other_tables(runs, tmp_path):
    out = tmp_path / "tables"
    written = make_tables([str(runs)], out)
    tex = (out / "table1.tex").read_text()
    assert "\\begin{tabular}" in tex and "\\toprule" in tex and "\\bottomrule" in tex
    assert "62.5 $\\pm$ 17.7" in tex
    assert " -- " in tex and "–" not in tex.split("\n", 1)[1]  # LaTeX dash for missing cells (past the comment)
    t2 = (out / "table2.md").read_text()
    arpo = next(line for line in t2.splitlines() if line.startswith("| arpo"))
    assert "| 50.0 | – | – | – | – |" in arpo  # GAIA only: no deep-search average
    assert "other.md" in written and "Synthetic" in (out / "other.md").read_text()


def test_values_csv_traces_every_number(runs, tmp_path):
    # one math500 sample ran to its budget, recorded before records had `truncated`: its finish_reason says so
    path = runs / "grpo" / "seed0" / "samples" / "math500.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[0]["finish_reason"] = "length"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "tables"
    make_tables([str(runs)], out)
    values = _csv(out / "values.csv")
    assert len(values) == 2 + 2 + 6
    row = next(r for r in values if (r["method"], r["seed"], r["benchmark"]) == ("grpo", "0", "math500"))
    assert float(row["value"]) == pytest.approx(0.75)
    assert row["per_run_values"] == "1;0.5"
    assert row["num_runs"] == "2" and row["num_questions"] == "2" and row["num_samples"] == "4"
    assert row["samples_file"].endswith("grpo/seed0/samples/math500.jsonl")
    assert (row["truncated"], row["truncated_rate"]) == ("1", "0.25")
    assert {(r["truncated"], r["truncated_rate"]) for r in values if r is not row} == {("0", "0.0")}


def test_pass_at_k_metric(runs, tmp_path):
    out = tmp_path / "tables"
    make_tables([str(runs / "grpo")], out, metric="pass@2")
    rows = {r["benchmark"]: r for r in _csv(out / "values.csv") if r["seed"] == "0"}
    assert float(rows["bamboogle"]["value"]) == pytest.approx(1.0)  # every question right in one of 2 runs
    assert float(rows["math500"]["value"]) == pytest.approx(1.0)


def test_folders_of_one_method_and_seed_split_by_benchmark_join_into_one_run(tmp_path):
    """An evaluation split over GPUs (a folder each, other benchmarks) is one run in the tables."""
    whole = write_run(tmp_path / "whole", "arpo", 0, {"bamboogle": [[1, 0, 1, 1]], "math500": [[1, 0]]})
    write_run(tmp_path / "part0", "arpo", 0, {"bamboogle": [[1, 0, 1, 1]]})
    write_run(tmp_path / "part1", "arpo", 0, {"math500": [[1, 0]]})
    make_tables([str(whole)], tmp_path / "one")
    make_tables([str(tmp_path / "part0"), str(tmp_path / "part1")], tmp_path / "split")
    one, split = _csv(tmp_path / "one" / "values.csv"), _csv(tmp_path / "split" / "values.csv")
    drop = lambda rows: [{k: v for k, v in r.items() if k != "samples_file"} for r in rows]  # noqa: E731
    assert drop(split) == drop(one) and len(split) == 2
    assert {r["benchmark"]: r["samples_file"].split("/")[-5] for r in split} == {"bamboogle": "part0",
                                                                               "math500": "part1"}
    # other settings do not join: their samples would mix
    other = write_run(tmp_path / "part2", "arpo", 0, {"aime24": [[1]]})
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "model_path": "another"}))
    with pytest.raises(ValueError, match="their settings differ"):
        make_tables([str(tmp_path / "part0"), str(other)], tmp_path / "t")


def test_duplicate_method_seed_and_empty_input_are_errors(runs, tmp_path):
    write_run(tmp_path / "copy", "grpo", 0, {"bamboogle": [[1]]})
    with pytest.raises(ValueError, match="two runs for method 'grpo' seed 0: .* both have bamboogle"):
        make_tables([str(runs), str(tmp_path / "copy")], tmp_path / "t")
    with pytest.raises(SystemExit, match="matches nothing"):
        tables_main(["--runs", str(tmp_path / "nothing*"), "--out", str(tmp_path / "t")])


def test_gaia_is_also_shown_per_level(tmp_path):
    run_dir = write_run(tmp_path / "eval", "arpo", 0, {"gaia": [[1, 0, 1, 1]], "xbench": [[0, 1]]})
    path = run_dir / "samples" / "gaia.jsonl"
    levels = [1, 1, 2, 3]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "meta": {"level": levels[r["index"]]}}) + "\n" for r in lines))
    out = tmp_path / "tables"
    make_tables([str(tmp_path / "eval")], out)
    md = (out / "table2.md").read_text()
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    assert header[:6] == ["Method", "GAIA L1", "GAIA L2", "GAIA L3", "GAIA", "HLE"]
    row = next(line for line in md.splitlines() if line.startswith("| arpo"))
    cells = dict(zip(header, [c.strip() for c in row.strip("|").split("|")]))
    assert (cells["GAIA L1"], cells["GAIA L2"], cells["GAIA L3"], cells["GAIA"]) == ("50.0", "100.0", "100.0", "75.0")
    assert cells["xbench"] == "50.0" and cells["Deep search avg."] == "–"  # HLE and WebWalker missing
    values = {r["benchmark"]: r for r in _csv(out / "values.csv")}
    assert set(values) == {"gaia", "gaia@L1", "gaia@L2", "gaia@L3", "xbench"}
    assert values["gaia@L1"]["num_questions"] == "2" and values["gaia@L1"]["samples_file"].endswith("gaia.jsonl")
    assert not (out / "other.md").exists()


# ---- ablation tables of training runs ------------------------------------------------------------------------
def _training_run(root, variant, seed, val_reward, tokens, wall):
    run = root / variant / f"seed{seed}"
    run.mkdir(parents=True)
    steps = [{"step": 0, "val-core/all/reward/mean": 0.0},
             {"step": 1, "critic/score/mean": 0.5, "rollout/tool_calls/total": 6.0, "rollout/trajectories": 4.0,
              "rollout/tokens/generated": tokens, "val-core/all/reward/mean": val_reward}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "ablation_run.json").write_text(json.dumps({"wall_s": wall}))


def test_training_table_mean_std_and_welch_p(tmp_path):
    from scipy import stats

    from arpo.analysis import seed_summaries
    from arpo.evaluation.training_tables import write_training_tables

    root = tmp_path / "runs"
    base, arpo = [0.1, 0.2, 0.3], [0.4, 0.6, 0.65]
    for seed, (b, a) in enumerate(zip(base, arpo)):
        _training_run(root, "grpo", seed, b, 100.0 * (seed + 1), 60.0)
        _training_run(root, "arpo", seed, a, 200.0, 70.0 + seed)
    written = write_training_tables(seed_summaries(root), tmp_path / "out", baseline="grpo", header="Command: x")
    md = written["table.md"].read_text()
    assert md.startswith("Command: x\n\n")
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    rows = {line.split("|")[1].strip(): dict(zip(header, [c.strip() for c in line.strip("|").split("|")]))
            for line in md.splitlines()[4:] if line.startswith("| ")}
    grpo, arpo_row = rows["grpo (baseline)"], rows["arpo"]
    assert grpo["Seeds"] == "3" and grpo["Val reward"] == "0.200 ± 0.100"
    assert grpo["p (Val reward)"] == "–"  # the baseline is not tested against itself
    expected_p = stats.ttest_ind(arpo, base, equal_var=False).pvalue
    assert arpo_row["p (Val reward)"] == f"{expected_p:.3g}"
    assert grpo["Tool calls / traj"] == "1.50 ± 0.00"
    assert grpo["Tokens generated"] == "200 ± 100" and arpo_row["Wall (s)"] == "71 ± 1"
    assert grpo["Val acc (%)"] == "–" and arpo_row["p (Val acc (%))"] == "–"  # not logged: no value, no test
    values = _csv(written["runs.csv"])
    assert len(values) == 6 and {r["variant"] for r in values} == {"grpo", "arpo"}
    assert [float(r["val_reward"]) for r in values if r["variant"] == "arpo"] == arpo and values[0]["val_acc"] == ""


def test_training_table_cli(tmp_path, capsys):
    _training_run(tmp_path / "runs", "grpo", 0, 0.25, 10.0, 5.0)
    written = tables_main(["--training-runs", str(tmp_path / "runs"), "--out", str(tmp_path / "t")])
    assert "| grpo | 1 |" in capsys.readouterr().out and written["runs.csv"].exists()
    with pytest.raises(SystemExit, match="no <variant>/seed<K>/ runs"):
        tables_main(["--training-runs", str(tmp_path / "empty"), "--out", str(tmp_path / "t")])


def test_the_papers_reported_rows_print_after_ours_in_every_format(runs, tmp_path, capsys):
    from arpo.config import config_dir

    out = tmp_path / "tables"
    tables_main(["--runs", str(runs), "--out", str(out), "--reference", str(config_dir() / "paper_reported.yaml")])
    assert "ARPO, paper (Qwen2.5-7B)" in capsys.readouterr().out
    md = (out / "table1.md").read_text()
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    labels = [line.split("|")[1].strip() for line in md.splitlines()[4:] if line.startswith("| ")]
    assert labels[:3] == ["arpo", "grpo", "Direct reasoning, paper (Qwen2.5-3B)"] and len(labels) == 2 + 18
    paper = dict(zip(header, [c.strip() for c in next(
        line for line in md.splitlines() if line.startswith("| ARPO, paper (Qwen2.5-7B)")).strip("|").split("|")]))
    # the paper's own Avg. is over its 10 tasks (WebWalker too): the averages here are ours, over its 9 cells
    assert (paper["AIME24"], paper["AIME25"], paper["Bamboogle"]) == ("30.0", "30.0", "71.5")
    assert (paper["Math avg."], paper["Knowledge avg."], paper["Avg."]) == ("64.0", "59.4", "61.9")
    assert "reported numbers (paper_reported.yaml)" in md
    rows = {r["method"]: r for r in _csv(out / "table1.csv")}
    assert float(rows["GRPO, paper (Qwen2.5-7B)"]["AIME24 mean"]) == pytest.approx(23.3)
    assert "ARPO, paper (Qwen2.5-7B) & 30.0 & 30.0" in (out / "table1.tex").read_text()
    assert ("| ARPO, paper (Qwen3-14B) | 56.4 | 40.4 | 16.7 | 43.7 | 10.0 | 36.0 | 32.0 | 30.4 | – |"
            in (out / "table2.md").read_text())


def test_the_reference_file_holds_every_row_of_the_papers_tables_1_and_2():
    from arpo.config import config_dir
    from arpo.evaluation.tables import load_reference

    reported = load_reference(config_dir() / "paper_reported.yaml")
    t1, t2 = reported["table1"], reported["table2"]
    methods = ["Direct reasoning", "TIR prompting", "GRPO", "REINFORCE++", "DAPO", "ARPO"]
    assert list(t1) == [f"{m}, paper ({b})" for b in ("Qwen2.5-3B", "Llama3.1-8B", "Qwen2.5-7B") for m in methods]
    assert all(len(cells) == 9 for cells in t1.values())  # each of our benchmarks; the paper has no such averages
    assert t1["ARPO, paper (Llama3.1-8B)"]["HotpotQA"] == 65.4 and t1["DAPO, paper (Qwen2.5-3B)"]["MuSiQue"] == 30.0
    assert t1["REINFORCE++, paper (Qwen2.5-7B)"]["MATH500"] == 78.0 and t1["GRPO, paper (Qwen2.5-7B)"]["GSM8K"] == 92.8
    qwen3 = [f"{m}, paper ({b})" for b in ("Qwen3-8B", "Qwen3-14B")
             for m in ("Vanilla RAG", "Search-o1", "WebThinker", "ReAct", "No RL", "GRPO", "ARPO")]
    assert len(t2) == 6 + 14 and list(t2)[6:] == qwen3
    assert t2["ARPO, paper (Qwen3-8B)"] == {"GAIA L1": 53.9, "GAIA L2": 32.7, "GAIA L3": 16.7, "GAIA": 38.8,
                                            "HLE": 8.8, "WebWalker": 30.5, "xbench": 25.0}
    assert t2["GRPO, paper (Qwen3-14B)"]["GAIA"] == 36.9 and t2["Direct reasoning, paper (GPT-4o)"]["HLE"] == 2.6
    assert t2["Direct reasoning, paper (o1-preview)"] == {"HLE": 11.1, "WebWalker": 9.9}  # the paper has no other
    # the columns line up: GAIA overall is the level mean weighted by its 39/52/12 questions (Qwen3 rows)
    for label in qwen3:
        c = t2[label]
        assert (39 * c["GAIA L1"] + 52 * c["GAIA L2"] + 12 * c["GAIA L3"]) / 103 == pytest.approx(c["GAIA"], abs=0.1)


@pytest.mark.parametrize("text, error", [
    ("table3: {x: {Avg.: 1}}\n", "'table3' is not a table of rows"),
    ("table1: {x: {Average: 1}}\n", "row 'x': no column 'Average'"),
    ("table1: {x: {Avg.: high}}\n", "Avg.: 'high' is not a number"),
])
def test_a_bad_reference_file_is_one_error_naming_the_cell(runs, tmp_path, text, error):
    bad = tmp_path / "reported.yaml"
    bad.write_text(text)
    with pytest.raises(SystemExit, match=error):
        tables_main(["--runs", str(runs), "--out", str(tmp_path / "t"), "--reference", str(bad)])
