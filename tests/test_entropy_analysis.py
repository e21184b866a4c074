"""arpo.analysis on hand-made inputs: entropy offsets around tool results, fork trees, metrics loading, seed
bands, run summaries and Welch's test, each checked against values worked out by hand."""

import json
import math

import pandas as pd
import pytest

from arpo import analysis
from arpo.analysis import entropy_around_tool_calls, mean_curve, plot_entropy_around_tools

NAN = float("nan")


def test_offsets_are_relative_to_the_result_and_skip_tool_tokens():
    # 3 model tokens, a 2-token result at [3, 5), then 3 model tokens.
    row = {"token_entropy": [0.1, 0.2, 0.3, NAN, NAN, 0.9, 0.8, 0.7],
           "tool_calls": [{"tool": "search", "start": 3, "end": 5}]}
    df = entropy_around_tool_calls([row], before=2, after=2)
    got = {(r.offset): r.entropy for r in df.itertuples()}
    assert got == {-1: 0.3, -2: 0.2, 0: 0.9, 1: 0.8}


def test_windows_stop_at_the_neighbouring_result_and_null_is_a_tool_token():
    # model [0, 2), search result [2, 4), model [4, 6), python result [6, 7), model [7, 9)
    row = {"token_entropy": [0.1, 0.2, None, None, 0.5, 0.6, None, 0.8, 0.9],
           "tool_calls": [{"tool": "search", "start": 2, "end": 4}, {"tool": "python", "start": 6, "end": 7}]}
    df = entropy_around_tool_calls([row], before=5, after=5)
    by_call = {tool: dict(zip(part.offset, part.entropy)) for tool, part in df.groupby("tool")}
    # search: before = positions 1, 0; after = 4, 5 (position 7 is past the python result: not search's)
    assert by_call["search"] == {-1: 0.2, -2: 0.1, 0: 0.5, 1: 0.6}
    # python: before = positions 5, 4 (not 1, 0: those precede the search result); after = 7, 8
    assert by_call["python"] == {-1: 0.6, -2: 0.5, 0: 0.8, 1: 0.9}


def test_a_fork_counts_only_its_own_tokens():
    parent = {"parent_index": -1, "branch_pos": 0, "token_entropy": [0.1, 0.2, NAN, 0.4, 0.5],
              "tool_calls": [{"tool": "search", "start": 2, "end": 3}]}
    # forked right after the result (branch_pos 3): positions < 3 are the parent's tokens
    fork = {"parent_index": 0, "branch_pos": 3, "token_entropy": [0.1, 0.2, NAN, 0.7, 0.6],
            "tool_calls": [{"tool": "search", "start": 2, "end": 3}]}
    df = entropy_around_tool_calls([parent, fork], before=2, after=2)
    assert sorted(df[df.row == 0].offset) == [-2, -1, 0, 1]
    assert dict(zip(df[df.row == 1].offset, df[df.row == 1].entropy)) == {0: 0.7, 1: 0.6}


def test_mean_curve_per_tool_with_ci():
    rows = [{"token_entropy": [0.2, NAN, 0.6], "tool_calls": [{"tool": "search", "start": 1, "end": 2}]},
            {"token_entropy": [0.4, NAN, 0.2], "tool_calls": [{"tool": "search", "start": 1, "end": 2}]},
            {"token_entropy": [0.5, NAN, 0.1], "tool_calls": [{"tool": "python", "start": 1, "end": 2}]}]
    curve = mean_curve(entropy_around_tool_calls(rows, before=1, after=1)).set_index(["tool", "offset"])
    assert curve.loc[("search", 0), "mean"] == pytest.approx(0.4)
    assert curve.loc[("search", -1), "mean"] == pytest.approx(0.3)
    # offset 0 of search: 0.6 and 0.2 -> sample std 0.2828, sem 0.2, ci95 1.96 * 0.2
    assert curve.loc[("search", 0), "std"] == pytest.approx(math.sqrt(2 * 0.2 ** 2))
    assert curve.loc[("search", 0), "ci95"] == pytest.approx(1.96 * 0.2)
    assert curve.loc[("python", 0), "count"] == 1 and math.isnan(curve.loc[("python", 0), "std"])


def test_plot_draws_one_line_per_tool(tmp_path):
    rows = [{"token_entropy": [0.2, NAN, 0.6, 0.5], "tool_calls": [{"tool": t, "start": 1, "end": 2}]}
            for t in ("search", "python")]
    ax = plot_entropy_around_tools(entropy_around_tool_calls(rows, before=1, after=2))
    assert sorted(line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")) == \
        ["python", "search"]
    ax.figure.savefig(tmp_path / "entropy.png")
    assert (tmp_path / "entropy.png").stat().st_size > 0


# ---- fork trees --------------------------------------------------------------------------------------------
def _tree_rows():
    # group 0: root 0 (10 tokens) -> fork 1 at 4 -> fork 2 at 7 (of row 1, 8 tokens); root 3 alone
    # group 1: one root, no forks
    return [
        {"group": 0, "parent_index": -1, "branch_pos": 0, "response_length": 10,
         "tool_calls": [{"tool": "search", "start": 2, "end": 4, "delta_entropy": 0.1}]},
        {"group": 0, "parent_index": 0, "branch_pos": 4, "response_length": 8,
         "tool_calls": [{"tool": "search", "start": 2, "end": 4, "delta_entropy": 0.1},
                        {"tool": "python", "start": 5, "end": 7, "delta_entropy": -0.2}]},
        {"group": 0, "parent_index": 1, "branch_pos": 7, "response_length": 9, "tool_calls": []},
        {"group": 0, "parent_index": -1, "branch_pos": 0, "response_length": 5, "tool_calls": []},
        {"group": 1, "parent_index": -1, "branch_pos": 0, "response_length": 6,
         "tool_calls": [{"tool": "python", "start": 1, "end": 2, "delta_entropy": 0.3}]},
    ]


def test_branch_stats_depths_and_positions():
    rows = _tree_rows()
    assert analysis.tree_depths(rows) == [0, 1, 2, 0, 0]
    stats = analysis.branch_stats(rows).set_index("group")
    assert stats.loc[0, "trajectories"] == 4 and stats.loc[0, "forks"] == 2 and stats.loc[0, "depth"] == 2
    assert stats.loc[0, "branch_pos_mean"] == pytest.approx((4 + 7) / 2)
    assert stats.loc[0, "branch_frac_mean"] == pytest.approx((4 / 10 + 7 / 8) / 2)
    assert stats.loc[1, "forks"] == 0 and math.isnan(stats.loc[1, "branch_pos_mean"])
    assert list(analysis.branch_positions(rows).branch_pos) == [4, 7]
    summary = analysis.branch_summary(rows)
    assert summary["forks_per_group"] == pytest.approx(1.0) and summary["max_depth"] == 2
    assert summary["trajectories_per_group"] == pytest.approx(2.5) and summary["mean_depth"] == pytest.approx(1.0)


def test_tool_call_records_leave_out_a_forks_inherited_calls():
    calls = analysis.tool_call_records(_tree_rows())
    # row 0's search, row 1's python (its search ended at 4 <= branch_pos 4: the parent's), row 4's python
    assert list(calls.tool) == ["search", "python", "python"]
    assert calls.groupby("tool").delta_entropy.mean().to_dict() == pytest.approx({"search": 0.1, "python": 0.05})


def test_rows_must_come_in_batch_order():
    with pytest.raises(ValueError, match="does not precede"):
        analysis.tree_depths([{"parent_index": 1}, {"parent_index": -1}])


# ---- training metrics --------------------------------------------------------------------------------------
def _write_metrics(path, records):
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _step(step, score, calls=8.0, trajs=16.0, tokens=100.0, time_s=2.0, **extra):
    return {"step": step, "critic/score/mean": score, "rollout/tool_calls/total": calls,
            "rollout/trajectories": trajs, "rollout/tokens/generated": tokens, "timing_s/step": time_s, **extra}


def test_load_metrics_keeps_the_last_copy_of_a_resumed_step(tmp_path):
    run = tmp_path / "pipeline"
    # the pipeline layout: <dir>/rl/logs/metrics.jsonl; steps 2 logged again by the resumed run
    _write_metrics(run / "rl" / "logs", [{"step": 0, "val-core/all/reward/mean": 0.1}, _step(1, 0.2),
                                         _step(2, 0.3), _step(2, 0.5, calls=4.0)])
    m = analysis.load_metrics(run)
    assert list(m.step) == [0, 1, 2]
    assert m.set_index("step").loc[2, "critic/score/mean"] == 0.5
    assert m.set_index("step").loc[2, analysis.TOOL_CALLS_PER_TRAJ] == pytest.approx(4 / 16)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        analysis.load_metrics(tmp_path / "nothing")


def test_run_summary_by_hand(tmp_path):
    _write_metrics(tmp_path, [{"step": 0, "val-core/all/reward/mean": 0.1},
                              _step(1, 0.2, calls=8, tokens=100, time_s=2, **{"reward/acc/mean": 0.25}),
                              _step(2, 0.4, calls=24, tokens=300, time_s=3,
                                    **{"val-core/all/reward/mean": 0.6, "reward/acc/mean": 0.5})])
    s = analysis.run_summary(analysis.load_metrics(tmp_path))
    assert s["val_reward"] == 0.6 and s["train_score"] == 0.4 and s["train_acc"] == 0.5
    assert s["tool_calls_per_traj"] == pytest.approx((8 + 24) / 32)
    assert s["tokens_generated"] == 400 and s["step_time_s"] == 5 and s["steps"] == 2
    assert math.isnan(s["val_acc"])  # not logged


def _ablation(tmp_path):
    root = tmp_path / "runs"
    for variant, seed, scores in [("a", 0, [0.1, 0.3]), ("a", 1, [0.3, 0.5]), ("b", 0, [0.2, 0.2])]:
        run = root / variant / f"seed{seed}"
        _write_metrics(run, [_step(i + 1, s) for i, s in enumerate(scores)])
        (run / analysis.RUN_RECORD).write_text(json.dumps({"wall_s": 10.0 * (seed + 1)}))
    (root / "a" / "notes").mkdir()  # not a seed folder: ignored
    return root


def test_seed_band_and_curves(tmp_path):
    runs = analysis.load_runs(_ablation(tmp_path))
    assert sorted(set(zip(runs.variant, runs.seed))) == [("a", 0), ("a", 1), ("b", 0)]
    band = analysis.seed_band(runs, "critic/score/mean").set_index(["variant", "step"])
    assert band.loc[("a", 1), "mean"] == pytest.approx(0.2) and band.loc[("a", 2), "mean"] == pytest.approx(0.4)
    assert band.loc[("a", 1), "std"] == pytest.approx(math.sqrt(2 * 0.1 ** 2)) and band.loc[("a", 1), "n"] == 2
    assert math.isnan(band.loc[("b", 1), "std"])
    ax = analysis.plot_curves(runs, "critic/score/mean")
    assert [line.get_label() for line in ax.get_lines()] == ["a (seeds: 2)", "b (seeds: 1)"]
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([0.2, 0.4])


def test_seed_summaries_and_experiment_layouts(tmp_path):
    root = _ablation(tmp_path)
    summaries = analysis.seed_summaries(root)
    assert [s["seed"] for s in summaries["a"]] == [0, 1] and [s["wall_s"] for s in summaries["a"]] == [10, 20]
    assert [s["train_score"] for s in summaries["a"]] == [0.3, 0.5]
    # a results folder (runs/ inside), a runs folder and a single run all load
    assert set(analysis.load_experiment(tmp_path).variant) == {"a", "b"}
    assert set(analysis.load_experiment(root).variant) == {"a", "b"}
    single = analysis.load_experiment(root / "b" / "seed0")
    assert set(single.variant) == {"seed0"} and list(single.step) == [1, 2]


def test_load_rollouts_by_name(tmp_path):
    (tmp_path / "rollouts").mkdir()
    for name in ("hard", "soft"):
        (tmp_path / "rollouts" / f"{name}.jsonl").write_text(json.dumps({"row": 0, "name": name}) + "\n")
    got = analysis.load_rollouts(tmp_path)
    assert list(got) == ["hard", "soft"] and got["soft"][0]["name"] == "soft"
    assert list(analysis.load_rollouts(tmp_path / "rollouts" / "hard.jsonl")) == ["hard"]
    assert analysis.load_rollouts(tmp_path / "rollouts" / "none") == {}


def test_compare_variants_means_and_welch_p_by_hand():
    from scipy import stats

    a, b = [1.0, 2.0, 4.0], [3.0, 5.0, 6.0, 8.0]
    summaries = {"hard": [{"val_reward": v, "val_acc": NAN} for v in a],
                 "soft": [{"val_reward": v, "val_acc": 0.5} for v in b]}
    got = analysis.compare_variants(summaries, "hard", "soft", keys=["val_reward", "val_acc"])
    va, vb = pd.Series(a).var(), pd.Series(b).var()
    se2 = va / len(a) + vb / len(b)
    t = (sum(a) / len(a) - sum(b) / len(b)) / math.sqrt(se2)
    df = se2 ** 2 / ((va / len(a)) ** 2 / (len(a) - 1) + (vb / len(b)) ** 2 / (len(b) - 1))
    assert got.loc["val_reward", "welch_p"] == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert got.loc["val_reward", "hard"] == pytest.approx(7 / 3) and got.loc["val_reward", "soft"] == 5.5
    # not logged for one variant: its mean is NaN and there is no test
    assert math.isnan(got.loc["val_acc", "hard"]) and math.isnan(got.loc["val_acc", "welch_p"])


def test_entropy_by_variant_pools_tools_under_the_set_name():
    rows = {"soft": [{"token_entropy": [0.2, NAN, 0.6], "tool_calls": [{"tool": "search", "start": 1, "end": 2}]},
                     {"token_entropy": [0.4, NAN, 0.2], "tool_calls": [{"tool": "python", "start": 1, "end": 2}]}],
            "hard": [{"token_entropy": [0.1, NAN, 0.3], "tool_calls": [{"tool": "search", "start": 1, "end": 2}]}]}
    curve = mean_curve(analysis.entropy_by_variant(rows, before=1, after=1)).set_index(["tool", "offset"])
    assert curve.loc[("soft", 0), "mean"] == pytest.approx(0.4) and curve.loc[("soft", 0), "count"] == 2
    assert curve.loc[("hard", -1), "mean"] == pytest.approx(0.1)
    assert analysis.entropy_by_variant({}).empty
