"""The paper's recipe as one pipeline preset (configs/pipeline/paper_qwen2.5_7b.yaml): its stages, how overrides
reach the evaluation, the checks that stop a bad run early, and the whole chain end to end on CPU (smoke)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from arpo.config import ConfigError
from arpo.pipeline import Pipeline, Preset
from tests.conftest import REPO, shared_data_dir, worker_ray_env

PAPER = "paper_qwen2.5_7b"
SHAREGPT = REPO / "tests" / "fixtures" / "sft" / "sharegpt_arpo.json"


def test_paper_preset_reads_the_release_data_and_carries_the_papers_rl_settings(tmp_path):
    p = Pipeline(tmp_path, PAPER, [f"sft.train_file={SHAREGPT}"])
    assert p.stages == ("data", "base_model", "sft", "rl", "eval", "tables")
    assert p.preset.rl_data == "files" and p.preset.base_model == "Qwen/Qwen2.5-7B-Instruct"
    assert p.preset.tables_reference == str(REPO / "configs" / "paper_reported.yaml")
    rl = p.config("arpo_trainer")
    # every release path is under data.root ($ARPO_DATA, else data/arpo)
    root = os.environ.get("ARPO_DATA", "data/arpo")
    assert rl.data.train_files == f"{root}/rl/train_10k.parquet" and rl.data.val_files == f"{root}/rl/valid.parquet"
    assert rl.tools[0].config.backend.cache_path == f"{root}/search_cache/search_cache.json"
    assert Pipeline(tmp_path, PAPER).config("sft").sft.train_file == f"{root}/sft/train.parquet"
    r = rl.actor_rollout_ref.rollout
    assert (rl.data.train_batch_size, r.n, r.arpo.initial_rollouts, rl.actor_rollout_ref.actor.optim.lr) == \
        (128, 16, 8, 1e-6)
    assert rl.actor_rollout_ref.model.path == str(tmp_path / "models" / f"{PAPER}-sft")
    assert p.config("sft").sft.train_file == str(SHAREGPT)
    ev = p.config("eval")
    # the evaluation takes the RL model, the run's engine and tool settings, its own context length, not RL's
    assert ev.actor_rollout_ref.model.path == str(tmp_path / "rl" / "hf_model")
    assert ev.actor_rollout_ref.rollout.arpo.tools.workers == 64 and ev.actor_rollout_ref.rollout.max_model_len is None
    assert ev.eval.method == "arpo" and ev.eval.output_dir == str(tmp_path / "eval")
    assert "bamboogle" in ev.eval.benchmarks
    # the command line comes after the preset's eval list; --eval-arg after everything
    ev = Pipeline(tmp_path, PAPER, ["actor_rollout_ref.rollout.max_model_len=640", "eval.num_runs=1"],
                  eval_overrides=["actor_rollout_ref.rollout.max_model_len=700"]).config("eval")
    assert ev.actor_rollout_ref.rollout.max_model_len == 700 and ev.eval.num_runs == 1


def test_the_existing_presets_have_no_evaluation_stage_and_refuse_eval_keys(tmp_path):
    assert Pipeline(tmp_path, "smollm2").stages == ("data", "base_model", "sft", "rl")
    assert Preset.load("tiny").eval is None and Preset.load("tiny").rl_data == "synthetic"
    with pytest.raises(ConfigError, match=r"'eval.num_runs=1': preset smollm2 has no evaluation stage"):
        Pipeline(tmp_path, "smollm2", ["eval.num_runs=1"])


@pytest.mark.parametrize("text, error", [
    ("base_model: tiny\noutput_dir: o\nrl_source: files\n", r"unknown key 'rl_source'; a preset has base_model, "
                                                            r"output_dir, rl_data, overrides, eval"),
    ("base_model: tiny\noutput_dir: o\nrl_data: parquet\n",
     r"rl_data='parquet'; choose one of \['synthetic', 'files'\]"),
    ("base_model: tiny\noutput_dir: o\neval: [eval.num_runs]\n", r"eval must be a list of 'key=value' strings"),
    ("base_model: tiny\noutput_dir: o\ntables_reference: paper.yaml\n",
     r"tables_reference='paper.yaml': no such file under configs/"),
])
def test_a_bad_preset_is_one_error_line_naming_the_field(tmp_path, monkeypatch, text, error):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "bad.yaml").write_text(text)
    monkeypatch.setattr("arpo.pipeline.config_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match=r"configs/pipeline/bad.yaml: " + error):
        Preset.load("bad")


def test_missing_sft_file_or_rl_data_stops_before_any_model_work(tmp_path, shared_data):
    # the release's SFT set is the default; absent, the error names the command that fetches it
    with pytest.raises(ConfigError, match=r"sft.train_file=.*/sft/train.parquet: no such file; it is part of the ARPO "
                                          r"release, fetched by python -m arpo.data.release --only sft"):
        Pipeline(tmp_path, PAPER).build_base_and_sft()
    with pytest.raises(ConfigError, match=r"data.val_files=/nope.parquet: no such file; or give data.val_files=PATH"):
        Pipeline(tmp_path, PAPER, [f"sft.train_file={SHAREGPT}", "data.val_files=/nope.parquet"]).build_base_and_sft()
    assert not (tmp_path / "models").exists()


def test_a_cold_start_made_elsewhere_skips_the_base_model_and_sft(tmp_path, tiny_model_dir, shared_data):
    """``sft.out_dir=DIR`` holding a checkpoint (experiments/paper_qwen7b.sh's $MODEL): no download, no SFT."""
    p = Pipeline(tmp_path, PAPER, [f"sft.out_dir={tiny_model_dir}"])
    assert p.build_base_and_sft()["sft_model"] == tiny_model_dir and set(p.timings) == {"data_s"}
    assert p.config("arpo_trainer").actor_rollout_ref.model.path == str(tiny_model_dir)


#: the paper preset cut to seconds a stage on 2 CPU cores: 2 RL prompts x 4 trajectories, 1 step, 2 validation
#: prompts, 2 questions of 2 benchmarks; one CPU rank instead of the preset's 8 GPUs
SMOKE = ["sft.max_steps=2", "sft.batch_size=2", "sft.num_ranks=1", "sft.dtype=float32", "sft.max_length=1024", "sft.lr=5e-5", "sft.num_threads=2",
         "data.train_batch_size=2", "data.max_prompt_length=512", "data.max_response_length=64",
         "data.val_max_samples=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.arpo.initial_rollouts=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.arpo.tools.workers=4", "actor_rollout_ref.rollout.arpo.tools.timeout_s=30",
         "actor_rollout_ref.rollout.max_model_len=640", "actor_rollout_ref.rollout.cpu_kvcache_space_gb=1",
         "actor_rollout_ref.rollout.num_replicas=1", "trainer.n_gpus_per_node=1",
         "trainer.total_training_steps=1", "trainer.test_freq=1",
         "trainer.save_freq=-1", "trainer.logger=[console,jsonl]",
         "eval.benchmarks=[bamboogle,gsm8k]", "eval.max_samples=2", "eval.num_runs=1"]


def _release_rows(tmp_path: Path) -> list[str]:
    """A handful of rows of the released RL parquet, read from the path the preset is configured with."""
    rl = Pipeline(tmp_path / "probe", PAPER, [f"sft.train_file={SHAREGPT}"]).config("arpo_trainer")
    out = []
    for key, rows in (("train_files", 4), ("val_files", 2)):
        path = Path(rl.data[key])
        path = path if path.is_absolute() else REPO / path
        small = tmp_path / f"{key}.parquet"
        pd.read_parquet(path).head(rows).to_parquet(small)
        out.append(f"data.{key}={small}")
    return out


@pytest.mark.slow
def test_paper_preset_end_to_end_smoke(smollm2_truncated_dir, shared_data, tmp_path):
    """Every stage of the paper's recipe on a 2-layer cut of SmolLM2: SFT on the ShareGPT fixture, ARPO on released
    prompts with the replayed search cache, evaluation on two released benchmarks, the paper's tables."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "arpo.pipeline", "--preset", PAPER, "--output-dir", str(out),
                           f"base_model.source={smollm2_truncated_dir}", f"sft.train_file={SHAREGPT}",
                           *_release_rows(tmp_path), *SMOKE,
                           # the evaluation on the transformers engine: vLLM's start-up (~45 s here) is paid once, by
                           # RL; the eval on vLLM is tests/eval/test_eval_end_to_end.py's
                           "--eval-arg", "actor_rollout_ref.rollout.arpo.sampling.max_response_length=48",
                           "--eval-arg", "actor_rollout_ref.rollout.name=hf"],
                          cwd=REPO, capture_output=True, text=True, timeout=1200, env=worker_ray_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stderr + proc.stdout
    for stage in ("data", "sft", "rl", "eval", "tables"):
        assert f"] {stage} done in" in console, stage
    assert "[6/6] tables done in" in console and "Traceback" not in console
    assert "  eval      bamboogle: acc" in proc.stdout and "  tables    " in proc.stdout
    sft = json.loads((out / "models" / f"{PAPER}-sft" / "sft_summary.json").read_text())
    assert sft["steps"] == 2 and sft["demos"]["sharegpt"] == 4
    assert (out / "models" / f"{PAPER}-sft" / "model.safetensors").exists()
    assert not (out / "models" / f"{PAPER}-base").exists()          # an HF directory is used in place
    summary = json.loads((out / "summary.json").read_text())
    assert summary["validation_gain"]["acc"]["n"] == 2
    assert Path(summary["hf_model"]) == out / "rl" / "hf_model" and (out / "rl" / "hf_model" / "config.json").exists()
    run_dir = out / "eval" / "arpo" / "seed0"
    assert summary["eval"]["run_dir"] == str(run_dir)
    for bench in ("bamboogle", "gsm8k"):
        records = [json.loads(line) for line in (run_dir / "samples" / f"{bench}.jsonl").read_text().splitlines()]
        assert sorted(r["index"] for r in records) == [0, 1]
        assert all(r["response_tokens"] <= 48 and 0.0 <= r["metrics"]["acc"] <= 1.0 for r in records)
        assert summary["eval"]["benchmarks"][bench]["samples"] == 2
    assert json.loads((run_dir / "run.json").read_text())["model_path"] == str(out / "rl" / "hf_model")
    md = (out / "tables" / "table1.md").read_text()
    header = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    row = next(line for line in md.splitlines() if line.startswith("| arpo"))
    cells = dict(zip(header, [c.strip() for c in row.strip("|").split("|")]))
    assert cells["Bamboogle"] != "–" and cells["GSM8K"] != "–" and cells["AIME24"] == "–"
    assert float(cells["GSM8K"]) == pytest.approx(100 * summary["eval"]["benchmarks"]["gsm8k"]["acc"])
    paper = next(line for line in md.splitlines() if line.startswith("| ARPO, paper (Qwen2.5-7B)"))
    reported = dict(zip(header, [c.strip() for c in paper.strip("|").split("|")]))
    assert (reported["AIME24"], reported["Bamboogle"]) == ("30.0", "71.5")  # configs/paper_reported.yaml's cells


def test_an_hf_id_is_downloaded_once_into_models_then_used_by_sft(tmp_path, tiny_model_dir, monkeypatch):
    """``base_model: Qwen/Qwen2.5-7B-Instruct``: fetched with huggingface_hub into models/<preset>-base (here a
    stand-in copies the tiny checkpoint), checked as an HF checkpoint, and the SFT stage reads it from there."""
    import shutil

    import huggingface_hub

    calls = []

    def fake_download(repo_id: str, local_dir: str, allow_patterns: list[str]) -> str:
        calls.append(repo_id)
        shutil.copytree(tiny_model_dir, local_dir, dirs_exist_ok=True)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    p = Pipeline(tmp_path, PAPER, [f"sft.train_file={SHAREGPT}"])
    base = tmp_path / "models" / f"{PAPER}-base"
    assert p.base_model_dir == base and p.config("sft").actor_rollout_ref.model.path == str(base)
    p._build_base()
    assert calls == ["Qwen/Qwen2.5-7B-Instruct"] and (base / "config.json").is_file()


def test_eval_samples_resume_only_for_the_same_rl_model(tmp_path):
    """A rerun after more RL must not report the earlier model's answers: the eval folder records the weights'
    fingerprint; the same weights resume, other weights stop the run, --force starts the folder afresh."""
    from arpo.pipeline_stages import claim_eval_dir

    model, run_dir = tmp_path / "hf_model", tmp_path / "eval" / "arpo" / "seed0"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"a" * 10_000)
    claim_eval_dir(run_dir, model, force=False)
    (run_dir / "samples").mkdir()
    (run_dir / "samples" / "gsm8k.jsonl").write_text("{}\n")
    claim_eval_dir(run_dir, model, force=False)                      # the same weights (re-exported): resume
    (model / "model.safetensors").write_bytes(b"a" * 9_999 + b"b")
    with pytest.raises(ConfigError, match=r"holds samples of another RL model than .* rerun with --force"):
        claim_eval_dir(run_dir, model, force=False)
    claim_eval_dir(run_dir, model, force=True)
    assert not (run_dir / "samples").exists() and (run_dir / "pipeline_model.json").is_file()
