"""The planner for every pipeline stage (``python -m arpo.plan --stage sft|rl|eval``) on Qwen2.5-7B's real shapes
(meta device, no weights): the paper preset's three stages fit 8 x 80 GB, a one-rank fp32 SFT does not and says
which key to change, and the start-up checks stop a stage that cannot fit before any model loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from arpo.config import ConfigError, load_config
from arpo.plan.__main__ import main
from arpo.plan.memory import GIB

QWEN7B = Path(__file__).parent / "fixtures" / "models" / "qwen2.5-7b"
PAPER = ["--preset", "paper_qwen2.5_7b", "--model", str(QWEN7B), "--gpu-memory-gb", "80"]


@pytest.mark.parametrize("stage", ["sft", "rl", "eval"])
def test_every_stage_of_the_paper_preset_fits_eight_80gb_gpus(stage, capsys):
    assert main(["--stage", stage, *PAPER]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("fits") and "7,615,616,512 parameters" in out


def test_the_paper_sft_stage_shards_over_every_gpu_and_checkpoints_its_16k_rows(capsys):
    main(["--stage", "sft", *PAPER])
    out = capsys.readouterr().out
    assert "8 FSDP2 rank(s), micro-batch 1 x 16384 tokens, compute 16-bit" in out
    assert "fp32 weights + AdamW m, v (shard 1/8)" in out and "checkpointing on" in out


def test_a_one_rank_fp32_sft_of_7b_does_not_fit_and_names_the_key(capsys):
    with pytest.raises(ConfigError) as err:
        main(["--stage", "sft", *PAPER, "sft.num_ranks=1", "sft.dtype=float32"])
    line = str(err.value)
    assert line.startswith("the sft stage does not fit (per SFT GPU: ") and "set one of sft.num_ranks=" in line
    assert "\n" not in line
    # the key it names makes the plan fit
    key = line.split("set one of ")[1].split(" ")[0].rstrip(",")
    assert main(["--stage", "sft", *PAPER, "sft.dtype=float32", key]) == 0


def test_an_eval_whose_kv_cache_holds_no_sequence_names_a_fix(capsys):
    with pytest.raises(ConfigError, match=r"the eval stage does not fit \(vLLM's KV cache .* holds no sequence.*"
                                          r"set one of actor_rollout_ref.rollout.gpu_memory_utilization="):
        main(["--stage", "eval", *PAPER, "actor_rollout_ref.rollout.gpu_memory_utilization=0.2"])


def test_the_engine_gets_the_token_budget_the_planner_sizes(tmp_path):
    """A GPU engine with max_num_batched_tokens null is given the planner's number (vLLM 0.32's own default,
    2,048, would throttle the branch prefills); an explicit value reaches both."""
    from arpo.engine.config import EngineConfig
    from arpo.engine.vllm_engine import vllm_engine_args
    from arpo.plan.settings import PlanSettings
    from arpo.plan.stages import eval_settings

    def engine(**kw):
        return vllm_engine_args(EngineConfig(model_path=str(tmp_path), max_model_len=256, **kw).validate(), "cuda")

    rl = PlanSettings.from_config(load_config("arpo_trainer", []), gpu=True)
    ev = eval_settings(load_config("eval", []), gpu=True)
    assert engine()["max_num_batched_tokens"] == rl.max_num_batched_tokens == ev.max_num_batched_tokens == 8192
    set_ = load_config("arpo_trainer", ["actor_rollout_ref.rollout.max_num_batched_tokens=4096"])
    assert engine(max_num_batched_tokens=4096)["max_num_batched_tokens"] == \
        PlanSettings.from_config(set_, gpu=True).max_num_batched_tokens == 4096


def test_sft_stops_before_any_model_loads_when_it_cannot_fit(monkeypatch, tmp_path):
    from arpo.sft import run_sft

    class H100:
        total_memory = 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H100)
    cfg = load_config("sft", [f"actor_rollout_ref.model.path={QWEN7B}", "sft.device=cuda", "sft.num_ranks=1",
                              "sft.max_length=16384", f"sft.train_file={tmp_path / 'never-read.parquet'}"])
    with pytest.raises(ConfigError, match=r"^the sft stage does not fit \(per SFT GPU: [\d.]+ GiB at update > 80.0"):
        run_sft(cfg)  # the training file is never opened: the plan stops it first


def test_the_sft_ranks_checkpoint_activations_when_asked():
    from arpo.sft import worker_config

    s = load_config("sft", ["sft.enable_gradient_checkpointing=true"]).sft
    assert worker_config(s, "m", 10)["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is True
    assert worker_config(load_config("sft", []).sft, "m", 10)["actor_rollout_ref"]["model"][
        "enable_gradient_checkpointing"] is False


def test_the_evaluation_stops_before_any_engine_starts_when_it_cannot_fit(monkeypatch, tmp_path):
    from arpo.evaluation import evaluate as ev

    class H100:
        total_memory = 80 * GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: H100)
    monkeypatch.setattr(ev, "start_engines", lambda cfg: pytest.fail("an engine started"))
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "Two plus two?", "answer": "4"}\n')
    cfg = load_config("eval", [f"actor_rollout_ref.model.path={QWEN7B}", f"eval.data_dir={tmp_path}",
                               "eval.benchmarks=[gsm8k]", f"eval.run_dir={tmp_path / 'run'}",
                               "actor_rollout_ref.rollout.gpu_memory_utilization=0.2"])
    with pytest.raises(ConfigError, match=r"^the eval stage does not fit \(vLLM's KV cache"):
        ev.evaluate(cfg)


def test_the_reference_is_planned_in_the_compute_dtype():
    """verl keeps the reference policy in the training dtype: 2 bytes a parameter under bf16, not 4."""
    from arpo.plan.check import build_plan

    cfg = load_config("arpo_trainer", [f"actor_rollout_ref.model.path={QWEN7B}", "trainer.n_gpus_per_node=8",
                                       "actor_rollout_ref.actor.use_kl_loss=true"])
    plan = build_plan(cfg, 80 * GIB)
    rows = dict(plan.gpu_tables[0].rows)
    assert rows["reference weights, compute dtype (shard 1/8)"][0] == 2 * plan.shapes.shard_numel(8)
