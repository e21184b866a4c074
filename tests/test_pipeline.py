"""The pipeline: presets route overrides to stages, and the real-model preset runs end to end (smoke)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from arpo.config import ConfigError
from arpo.pipeline import Pipeline, Preset
from tests.conftest import REPO, worker_ray_env


def test_presets_route_overrides_to_their_stages(tmp_path):
    p = Pipeline(tmp_path, "smollm2", ["sft.max_steps=7", "trainer.total_training_steps=3"])
    sft, rl = p.config("sft"), p.config("arpo_trainer")
    assert sft.sft.max_steps == 7 and sft.sft.lr == 5.0e-5            # command line after the preset
    assert rl.trainer.total_training_steps == 3 and rl.actor_rollout_ref.rollout.n == 8
    assert rl.actor_rollout_ref.model.path == str(tmp_path / "models" / "smollm2-sft")
    assert sft.actor_rollout_ref.model.path == str(tmp_path / "models" / "smollm2-base")
    assert p.config("synthetic_data").synthetic.mix.chain > 0                # synthetic=hard
    assert p.config("base_model").base_model.source == "smollm2-135m-instruct"
    tiny = Pipeline(tmp_path, "tiny")
    assert tiny.config("sft").sft.out_dir == str(tmp_path / "models" / "tiny-sft")
    assert tiny.config("synthetic_data").synthetic.mix.chain == 0


def test_algorithm_presets_and_critic_keys_reach_the_trainer_and_typos_stop(tmp_path):
    rl = Pipeline(tmp_path, "smollm2", ["preset=dapo", "critic.optim.lr=3e-6"]).config("arpo_trainer")
    assert rl.critic.optim.lr == 3e-6
    assert rl.algorithm.filter_groups.enable                          # what configs/preset/dapo.yaml turns on
    with pytest.raises(ConfigError, match=r"override 'critc.optim.lr=1' names no section any pipeline stage reads"):
        Pipeline(tmp_path, "smollm2", ["critc.optim.lr=1"])


#: what docs/quickstart.md gives for ``make run ARGS="..."`` with LoRA (the lora ablation suite's settings)
LORA_ARGS = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32",
             "actor_rollout_ref.actor.optim.lr=1e-4"]


def test_lora_overrides_reach_the_rl_stage_and_pass_its_start_up_validation(tmp_path, tiny_model_dir, synthetic_dir):
    """``make run ARGS="actor_rollout_ref.model.lora_rank=16 ..."``: the keys reach only the RL stage, after the
    preset's (the learning rate wins over its 1e-5), and the composed config passes ``main_arpo``'s start-up
    validation (model and data pointed at the test fixtures: the SmolLM2 SFT model is not built here)."""
    from arpo.main_arpo import validate_config, worker_groups

    from arpo.pipeline import overrides_for_stage

    p = Pipeline(tmp_path, "smollm2", LORA_ARGS)
    assert [o for o in p.overrides if o in LORA_ARGS] == overrides_for_stage("arpo_trainer", LORA_ARGS) == LORA_ARGS
    assert not set(LORA_ARGS) & set(overrides_for_stage("sft", p.overrides))  # the SFT stage trains every weight
    rl = Pipeline(tmp_path, "smollm2", [*LORA_ARGS, f"actor_rollout_ref.model.path={tiny_model_dir}",
                                        f"synthetic.out_dir={synthetic_dir}"]).config("arpo_trainer")
    m = rl.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, rl.actor_rollout_ref.actor.optim.lr) == (16, 32, 1e-4)
    assert rl.actor_rollout_ref.rollout.n == 8                        # the preset's sizing stays
    validate_config(rl)
    assert worker_groups(rl) == ["actor"]
    with pytest.raises(ConfigError, match="lora_rank must be an integer >= 0"):
        validate_config(Pipeline(tmp_path, "smollm2", ["actor_rollout_ref.model.lora_rank=-1",
                                                       f"actor_rollout_ref.model.path={tiny_model_dir}",
                                                       f"synthetic.out_dir={synthetic_dir}"]).config("arpo_trainer"))


def test_base_model_source_override_swaps_the_preset_model(tmp_path, tiny_model_dir):
    p = Pipeline(tmp_path, "smollm2", [f"base_model.source={tiny_model_dir}"])
    assert p.base_model_dir == tiny_model_dir
    assert p.config("sft").actor_rollout_ref.model.path == str(tiny_model_dir)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"no configs/pipeline/nope.yaml; choose one of "
                                          r"\['paper_qwen2.5_7b', 'premise', 'smollm2', 'tiny'\]"):
        Preset.load("nope")


# A smoke setting of the smollm2 preset: every stage, 1 RL step, a handful of validation questions.
SMOKE = ["synthetic.sizes.train=64", "synthetic.sizes.val=6", "synthetic.sizes.test=4", "synthetic.sizes.test_easy=0",
         "sft.max_steps=2", "sft.max_samples=16", "data.train_batch_size=2", "data.max_response_length=96",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=4",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.rollout.arpo.initial_rollouts=2", "actor_rollout_ref.rollout.max_model_len=512",
         "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.save_freq=-1",
         "trainer.logger=[console,jsonl]"]


@pytest.mark.slow
def test_real_model_preset_end_to_end_smoke(smollm2_truncated_dir, tmp_path):
    """The smollm2 preset's code path (Llama weights and names, the real tokenizer, hard benchmark, SFT, vLLM, FSDP2
    weight sync, validation records, the gain line) on a 2-layer cut of the model."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "arpo.pipeline", "--preset", "smollm2", "--output-dir", str(out),
                           f"base_model.source={smollm2_truncated_dir}", *SMOKE],
                          cwd=REPO, capture_output=True, text=True, timeout=1200, env=worker_ray_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RL gain (step 0 -> 1): accuracy:") and "95% CI" in last and "n=6" in last
    summary = json.loads((out / "summary.json").read_text())
    gain = summary["validation_gain"]
    for key in ("acc", "score"):
        g = gain[key]
        assert g["n"] == 6 and g["low"] <= g["gain"] <= g["high"]
        assert g["gain"] == pytest.approx(g["after"] - g["before"])
    records = [json.loads(line) for line in (out / "rl" / "validation" / "step_1.jsonl").read_text().splitlines()]
    assert sorted(r["prompt_index"] for r in records) == list(range(6))
    assert {"acc", "score", "format_ok", "response", "data_source"} <= set(records[0])
    assert (out / "models" / "smollm2-sft" / "model.safetensors").exists()
    assert not (out / "models" / "smollm2-base").exists()      # an HF directory is used in place
    metrics = [json.loads(line) for line in (out / "rl" / "logs" / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m.get("training/global_step") == 1)
    # The engine received the actor's weights (the probe is the engine's view after the push).
    assert "rollout/weight_sync_probe" in step and "timing_s/update_actor" in step
    # The console: a header, stage lines, one line per step, the closing summary; no engine chatter or tracebacks
    # (those are in the log folder), and the run's plots and step rollouts on disk.
    console = proc.stderr + proc.stdout
    assert "== ARPO pipeline, preset smollm2 ==" in console and "== ARPO training ==" in console
    assert "[4/4] rl done in" in console and "pipeline finished in" in console
    assert any("step 1/1 | reward" in line and "val_acc" in line for line in console.splitlines())
    assert "Traceback" not in console and "Failed to load weights" not in console
    assert "INFO worker.py" not in console and "(pid=" not in console  # Ray's banner, forwarded worker output
    assert (out / "logs" / "workers.log").stat().st_size > 0
    rows = [json.loads(line) for line in (out / "rl" / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 and all(r["token_entropy"] for r in rows)
    plots = ["curves.png"] + (["entropy_around_tools.png"] if any(r["tool_calls"] for r in rows) else [])
    assert sorted(p.name for p in (out / "rl" / "plots").glob("*.png")) == plots
