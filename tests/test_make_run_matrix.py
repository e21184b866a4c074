"""The make-run matrix: settings parse into environment and overrides, later seeds reuse the first seed's SFT, and
the tables pair each cell's before/after validation per question and per kind."""

from __future__ import annotations

import csv
import json

import pandas as pd
import pytest

from experiments import make_run_matrix as mrm

KINDS = ["chain", "chain", "search", "search", "python", "python"]


def fake_cell(cell, before, after):
    """A finished cell as the pipeline leaves it: validation parquet, step 0 and step 8 records, summary.json."""
    from arpo.main_arpo import validation_gain

    (cell / "data" / "synthetic").mkdir(parents=True)
    pd.DataFrame({"ability": KINDS, "reward_model": [{"ground_truth": str(i)} for i in range(6)]}).to_parquet(
        cell / "data" / "synthetic" / "val.parquet")
    val = cell / "rl" / "validation"
    val.mkdir(parents=True)
    for step, accs in ((0, before), (8, after)):
        (val / f"step_{step}.jsonl").write_text("".join(
            json.dumps({"prompt_index": i, "acc": a, "score": a, "ground_truth": str(i)}) + "\n"
            for i, a in enumerate(accs)))
    summary = {"validation_gain": validation_gain(str(val), 8), "machine": {"cpu_model": "test"}}
    (cell / "summary.json").write_text(json.dumps(summary))


def test_setting_splits_environment_from_config_overrides():
    s = mrm.Setting.parse("bf16_amx=ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX,sft.dtype=bfloat16,MKL_CBWR=")
    assert s.name == "bf16_amx" and s.env == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "MKL_CBWR": ""}
    assert s.overrides == ("sft.dtype=bfloat16",)
    assert mrm.Setting.parse("default=") == mrm.Setting("default")
    with pytest.raises(SystemExit, match="is not KEY=VALUE"):
        mrm.Setting.parse("x=MKL_CBWR")


def test_seed_sets_sampling_and_prompt_order_and_later_seeds_link_the_first_sft(tmp_path):
    import argparse

    args = argparse.Namespace(preset="smollm2", overrides=["trainer.total_training_steps=2"])
    setting = mrm.Setting.parse("aten=ATEN_CPU_CAPABILITY=default,sft.dtype=float32")
    cmd = mrm.cell_command(args, setting, 2, tmp_path / "aten" / "seed2")
    assert cmd[1:6] == ["-m", "arpo.pipeline", "--preset", "smollm2", "--output-dir"]
    assert cmd[-4:] == ["sft.dtype=float32", "trainer.total_training_steps=2", "trainer.seed=2", "data.seed=3"]
    first = mrm.cell_dir(tmp_path, setting, 0)
    with pytest.raises(SystemExit, match="must finish its SFT first"):
        mrm.link_sft(mrm.cell_dir(tmp_path, setting, 1), first)
    (first / "models" / "smollm2-sft").mkdir(parents=True)
    (first / "data").mkdir()
    later = mrm.cell_dir(tmp_path, setting, 1)
    mrm.link_sft(later, first)
    assert (later / "models" / "smollm2-sft").is_dir() and (later / "data").resolve() == (first / "data").resolve()


def test_sft_of_shares_another_settings_sft_in_every_seed(tmp_path, monkeypatch):
    assert mrm.sft_sources(["lora=default"], {"default", "lora"}) == {"lora": "default"}
    for bad in (["lora=nothere"], ["lora"], ["lora=lora"]):
        with pytest.raises(SystemExit, match="--sft-of"):
            mrm.sft_sources(bad, {"default", "lora"})
    with pytest.raises(SystemExit, match="cannot lend its own"):
        mrm.sft_sources(["a=b", "b=c"], {"a", "b", "c"})
    first = tmp_path / "default" / "seed0"
    (first / "models" / "smollm2-sft").mkdir(parents=True)
    (first / "data").mkdir()
    fake_cell(first, [0] * 6, [1] * 6)  # default's cell is finished: not run again
    ran = []
    monkeypatch.setattr(mrm, "run_cell", lambda args, setting, seed, cell: ran.append((setting.name, seed, cell)))
    mrm.main(["--out", str(tmp_path), "--seeds", "0", "1", "--settings", "default=",
              "lora=actor_rollout_ref.model.lora_rank=16", "--sft-of", "lora=default", "--collect-only"])
    assert ran == []
    monkeypatch.setattr(mrm, "collect", lambda *a: {})
    mrm.main(["--out", str(tmp_path), "--seeds", "0", "--settings", "default=",
              "lora=actor_rollout_ref.model.lora_rank=16", "--sft-of", "lora=default"])
    assert [(name, seed) for name, seed, _ in ran] == [("lora", 0)]
    lora0 = tmp_path / "lora" / "seed0"
    assert (lora0 / "models").resolve() == (first / "models").resolve()


def test_collect_writes_the_matrix_per_kind_gains_and_the_summary(tmp_path):
    settings = [mrm.Setting("default"), mrm.Setting("mkl", {"MKL_CBWR": "COMPATIBLE"})]
    fake_cell(mrm.cell_dir(tmp_path, settings[0], 0), [0, 0, 1, 1, 0, 1], [1, 1, 1, 0, 1, 1])
    fake_cell(mrm.cell_dir(tmp_path, settings[1], 0), [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 1])
    mrm.cell_dir(tmp_path, settings[1], 1).mkdir(parents=True)  # unfinished: left out
    out = mrm.collect(tmp_path, tmp_path / "results", settings, [0, 1])
    rows = list(csv.DictReader(open(tmp_path / "results" / "matrix.csv")))
    assert [tuple(r.values())[:2] for r in rows] == [("0", "default"), ("0", "mkl")]
    assert list(rows[0]) == list(mrm.MATRIX_COLUMNS)
    assert float(rows[0]["before"]) == 0.5 and float(rows[0]["gain"]) == pytest.approx(2 / 6, abs=1e-4)  # 4 decimals
    assert float(rows[1]["gain"]) == pytest.approx(0.0)
    kinds = {(r["setting"], r["kind"]): r for r in csv.DictReader(open(tmp_path / "results" / "per_kind.csv"))}
    assert float(kinds["default", "chain"]["gain"]) == 1.0 and float(kinds["default", "search"]["gain"]) == -0.5
    assert kinds["mkl", "search"]["n"] == "2" and float(kinds["mkl", "search"]["gain"]) == -1.0
    # every search question lost in the mkl cell: its interval is the single value -1, below zero
    assert out["kinds_significantly_worse"] == ["mkl/seed0/search"]
    assert out["cells"] == 2 and not out["every_ci_above_zero"]
    assert out["worst_cell"]["setting"] == "mkl" and out["gain_mean"] == pytest.approx(1 / 6, abs=1e-4)
    assert (tmp_path / "results" / "matrix.png").stat().st_size > 0
    cells = json.loads((tmp_path / "results" / "cells.json").read_text())
    assert [c["machine"]["cpu_model"] for c in cells] == ["test", "test"]


def test_records_out_of_parquet_order_stop_the_tables(tmp_path):
    cell = mrm.cell_dir(tmp_path, mrm.Setting("default"), 0)
    fake_cell(cell, [0] * 6, [1] * 6)
    pd.DataFrame({"ability": KINDS, "reward_model": [{"ground_truth": str(5 - i)} for i in range(6)]}).to_parquet(
        cell / "data" / "synthetic" / "val.parquet")
    with pytest.raises(SystemExit, match="ground truth is not val.parquet row 0"):
        mrm.collect(tmp_path, tmp_path, [mrm.Setting("default")], [0])


def test_collect_keeps_earlier_results_cells_run_elsewhere_and_replaces_rerun_ones(tmp_path):
    default, amx = mrm.Setting("default"), mrm.Setting("avx512_amx")
    elsewhere, here = tmp_path / "machine_a", tmp_path / "machine_b"
    fake_cell(mrm.cell_dir(elsewhere, default, 0), [0] * 6, [1] * 6)
    fake_cell(mrm.cell_dir(elsewhere, default, 1), [0] * 6, [0, 0, 0, 1, 1, 1])
    results = tmp_path / "results"
    mrm.collect(elsewhere, results, [default], [0, 1])
    # another machine holds only its own cells and a rerun of default seed 1
    fake_cell(mrm.cell_dir(here, amx, 0), [0] * 6, [1, 1, 1, 1, 0, 0])
    fake_cell(mrm.cell_dir(here, default, 1), [0] * 6, [1, 1, 1, 1, 1, 0])
    out = mrm.collect(here, results, [default, amx], [0, 1])
    rows = list(csv.DictReader(open(results / "matrix.csv")))
    assert [(r["setting"], r["seed"], r["gain"]) for r in rows] == [
        ("default", "0", "1.0"), ("default", "1", "0.8333"), ("avx512_amx", "0", "0.6667")]
    kinds = list(csv.DictReader(open(results / "per_kind.csv")))
    assert sorted((r["setting"], r["seed"]) for r in kinds) == sorted(
        [("default", "0")] * 3 + [("default", "1")] * 3 + [("avx512_amx", "0")] * 3)
    cells = json.loads((results / "cells.json").read_text())
    assert [(c["setting"], c["seed"]) for c in cells] == [("default", 0), ("default", 1), ("avx512_amx", 0)]
    assert out["cells"] == 3 and out["worst_cell"]["setting"] == "avx512_amx"
