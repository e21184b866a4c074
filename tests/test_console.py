"""What a run prints: the header, one concise line per step, plots at the end, and engine output kept off the
console."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from arpo.analysis import rollout_rows, write_run_plots
from arpo.batch import DataBatch
from arpo.runtime.console import config_diff, run_header, step_line, validation_line
from arpo.engine.vllm_worker_ext import RELOAD_LOGGER, ReloadWarningFilter
from arpo.runtime.tracking import Tracking

REPO = Path(__file__).resolve().parents[1]
STEP = {"critic/score/mean": 0.41234, "reward/acc/mean": 0.375, "rollout/tool_calls/in_trajectory_mean": 1.953,
        "rollout/branches": 14.0, "rollout/entropy/delta_mean": 0.00213, "actor/pg_loss": -0.0123,
        "timing_s/step": 94.4, "actor/grad_norm": 0.7, "rollout/requests": 61.0, "training/global_step": 3}


def test_step_line_is_one_short_line_with_the_fields_a_researcher_scans():
    line = step_line(3, STEP, total=8)
    assert line == ("step 3/8 | reward 0.412 | acc 0.375 | tools/traj 1.95 | branches 14 | dH +0.0021 | "
                    "pg_loss -0.0123 | 94 s")
    assert "\n" not in line and "grad_norm" not in line
    # a missing or NaN metric is left out, not printed as nan
    assert step_line(1, {"critic/score/mean": float("nan"), "timing_s/step": 2.0}) == "step 1 | 2 s"
    with_val = step_line(8, {**STEP, "val-core/all/acc/mean": 0.7344}, total=8)
    assert "val_acc 0.734" in with_val
    assert validation_line(0, {"val-core/all/acc/mean": 0.59, "val-core/all/reward/mean": 0.61}) == \
        "validation at step 0 | val_acc 0.590 | val_reward 0.610"


def test_config_diff_lists_changed_and_added_leaves_only():
    defaults = {"trainer": {"seed": 0, "steps": 6}, "actor": {"lr": 1e-5}}
    cfg = {"trainer": {"seed": 1, "steps": 6}, "actor": {"lr": 1e-5, "new": True}}
    assert config_diff(cfg, defaults) == ["actor.new=True (added)", "trainer.seed=1 (default: 0)"]
    assert config_diff(defaults, defaults) == []
    # values that only follow another change are counted, not listed
    defaults = {"trainer": {"output_dir": "o/rl", "ckpt": "o/rl/checkpoints"}, "data": "o/data/train.parquet"}
    cfg = {"trainer": {"output_dir": "x/rl", "ckpt": "x/rl/checkpoints"}, "data": "d/train.parquet"}
    assert config_diff(cfg, defaults) == ["data='d/train.parquet' (default: 'o/data/train.parquet')",
                                          "trainer.output_dir='x/rl' (default: 'o/rl')",
                                          "(+1 values that follow from these, e.g. paths under a new folder)"]


def test_run_header_cuts_long_lists_and_says_where_the_rest_is():
    text = run_header("ARPO training", {"model": "m", "output dir": "/o"},
                      {"keys that differ": [f"k{i}=1" for i in range(40)]}, max_items=5, more_at="/o/config.yaml")
    lines = text.splitlines()
    assert lines[0] == "== ARPO training ==" and lines[1] == "  model       m"
    assert "  keys that differ:" in lines and "    k4=1" in lines and "    k5=1" not in lines
    assert lines[-1] == "    ... 35 more: see /o/config.yaml"


def test_tracking_console_backend_logs_one_concise_line(tmp_path, caplog):
    tracker = Tracking("p", "e", ["console", "jsonl"], tmp_path)
    tracker.total_steps = 8
    with caplog.at_level(logging.INFO, logger="arpo.runtime.tracking"):
        tracker.log({"val-core/all/acc/mean": 0.5}, step=0)
        tracker.log(STEP, step=3)
        # a step that skipped its update (dynamic sampling kept no group) is still a step line
        tracker.log({"train/num_groups_kept": 0.0, "train/num_gen_batches": 3.0, "timing_s/step": 56.0,
                     "training/global_step": 4}, step=4)
    tracker.finish()
    messages = [r.getMessage() for r in caplog.records if r.name == "arpo.runtime.tracking"]
    assert messages == ["validation at step 0 | val_acc 0.500", step_line(3, STEP, 8),
                        "step 4/8 | groups kept 0 | gen rounds 3 | 56 s"]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[1]["actor/grad_norm"] == 0.7  # every metric still reaches the JSONL


def test_reload_warnings_of_layers_without_checkpoint_entries_are_dropped_and_nothing_else():
    def record(layer):
        return logging.getLogger(RELOAD_LOGGER).makeRecord(RELOAD_LOGGER, logging.WARNING, "f", 1,
                                                           "%s: Failed to load weights", (layer,), None)

    tied, untied = ReloadWarningFilter(tied=True), ReloadWarningFilter(tied=False)
    assert not tied.filter(record("ParallelLMHead")) and not tied.filter(record("RotaryEmbedding"))
    assert untied.filter(record("ParallelLMHead"))  # an untied head must load: that warning stays
    assert tied.filter(record("QKVParallelLinear")) and not untied.filter(record("RotaryEmbedding"))


def _rollout_batch() -> DataBatch:
    """Two trajectories of one group: a root with one python call, and a fork of it after the result."""
    ent = [0.1, 0.2, 0.3, float("nan"), float("nan"), 0.5, 0.6, 0.4]
    nt = {"group_index": np.array([0, 0]), "parent_index": np.array([-1, 0]), "branch_pos": np.array([-1, 5]),
          "finish_reason": np.array(["stop", "stop"], dtype=object),
          "token_entropy": np.array([ent, ent], dtype=object),
          "tool_calls": np.array([[{"tool": "python", "start": 3, "end": 5}]] * 2, dtype=object),
          "data_source": np.array(["synthetic", "synthetic"], dtype=object),
          "reward_acc": np.array([1.0, 0.0], dtype=object)}
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1]] * 2)
    scores = torch.zeros(2, 8)
    scores[0, -1] = 1.0
    attention = torch.ones(2, 12, dtype=torch.long)
    attention[1, :2] = 0  # the second prompt is 2 tokens shorter (left padding)
    t = {"prompts": torch.arange(8).view(2, 4), "responses": torch.arange(16).view(2, 8),
         "attention_mask": attention, "response_mask": mask, "token_level_scores": scores}
    return DataBatch(t, nt, {})


def test_rollout_rows_and_run_plots(tmp_path):
    rows = rollout_rows(_rollout_batch())
    assert [r["parent_index"] for r in rows] == [-1, 0] and rows[1]["branch_pos"] == 5
    assert rows[0]["token_entropy"][3] is None and rows[0]["token_entropy"][5] == 0.5
    assert rows[0]["score"] == 1.0 and rows[1]["acc"] == 0.0 and rows[0]["model_tokens"] == 6
    json.dumps(rows, allow_nan=False)  # JSON-safe: NaN became null
    # the tokens themselves (padding left out), so that a model can re-score the trajectories
    assert rows[0]["prompt_ids"] == [0, 1, 2, 3] and rows[1]["prompt_ids"] == [6, 7]
    assert rows[1]["response_ids"] == list(range(8, 16)) and rows[0]["response_mask"] == [1, 1, 1, 0, 0, 1, 1, 1]

    run = tmp_path / "rl"
    (run / "logs").mkdir(parents=True)
    steps = [{"step": 0, "val-core/all/acc/mean": 0.5}]
    steps += [{"step": s, "critic/score/mean": 0.1 * s, "reward/acc/mean": 0.1 * s, "rollout/tool_calls/total": 4.0,
               "rollout/trajectories": 8.0} for s in (1, 2, 3)]
    steps += [{"step": 3, "val-core/all/acc/mean": 0.6}]
    (run / "logs" / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "rollouts").mkdir()
    (run / "rollouts" / "step_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = write_run_plots(run, run / "rollouts")
    assert [p.name for p in written] == ["curves.png", "entropy_around_tools.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    # no rollouts with entropy: the curves alone
    assert [p.name for p in write_run_plots(run, tmp_path / "none")] == ["curves.png"]


def test_worker_output_goes_to_the_run_log_not_the_console(tmp_path):
    """What a Ray worker does at start-up (``setup_worker_logging``): its log records join arpo.log and its raw
    output (vLLM banners, prints, C-level writes) lands in workers.log; nothing reaches the console."""
    code = ("import logging, os, sys\n"
            "from arpo.runtime.logging_utils import setup_worker_logging\n"
            "setup_worker_logging()\n"
            "print('raw print from a worker')\n"
            "os.write(2, b'C-level stderr\\n')\n"
            "logging.getLogger('vllm.engine').info('KV cache 4 GiB')\n"
            "logging.getLogger('arpo.worker').warning('rank 0 slow')\n")
    env = {**os.environ, "ARPO_LOG_DIR": str(tmp_path), "ARPO_ENGINE_LOGS": "file"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    raw = (tmp_path / "workers.log").read_text()
    assert "raw print from a worker" in raw and "C-level stderr" in raw
    logged = (tmp_path / "arpo.log").read_text()
    assert "KV cache 4 GiB" in logged and "rank 0 slow" in logged
    # shown live on request
    env["ARPO_ENGINE_LOGS"] = "console"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert "raw print from a worker" in proc.stdout and "C-level stderr" in proc.stderr
