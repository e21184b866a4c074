"""experiments/bench_peers.py, the side-by-side with TRL: TRL's side trains the job for real (the tiny SFT model, a
few seconds a step); our sides' commands compose and validate as the run's own start-up does (their runs are
the trainer's end-to-end tests' business, and a Ray + vLLM start would add minutes to the suite); the summary
pairs repeats as documented."""

from __future__ import annotations

import json

import pytest

from experiments import bench_peers


def _job(sft_model_dir, tmp_path, **sizes) -> dict:
    data = sft_model_dir.parent.parent / "data" / "synthetic" / "train.parquet"
    args = bench_peers.parse_args(["--model", str(sft_model_dir), "--data", str(data), "--prompts", "2", "--n", "2",
                                   "--max-response-length", "24", "--micro", "2", "--steps", "2", "--warmup", "1",
                                   *[f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]])
    return bench_peers.write_job(args, tmp_path / "work")


@pytest.mark.parametrize("side", ["ours_grpo", "ours_arpo"])
def test_our_sides_compose_the_job_and_pass_start_up_validation(sft_model_dir, tmp_path, side):
    from arpo.config import load_config
    from arpo.main_arpo import validate_config

    job = _job(sft_model_dir, tmp_path)
    cmd = bench_peers.ours_command(side, "float32", job, tmp_path / "run")
    assert cmd[1:3] == ["-m", "arpo.main_arpo"]
    cfg = load_config("arpo_trainer", cmd[3:])
    validate_config(cfg)
    assert cfg.data.train_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 2  # one optimizer step
    assert cfg.actor_rollout_ref.rollout.n == 2 and cfg.data.max_response_length == 24
    assert cfg.actor_rollout_ref.model.dtype == cfg.actor_rollout_ref.rollout.dtype == "float32"
    assert cfg.data.train_files == job["prompts_file"] and cfg.trainer.val_before_train is False
    assert cfg.algorithm.use_kl_in_reward is False and cfg.actor_rollout_ref.actor.use_kl_loss is False  # TRL's beta 0
    # our defaults, as a user runs them (--ours-set adds overrides)
    assert cfg.actor_rollout_ref.rollout.enforce_eager is None and not cfg.actor_rollout_ref.actor.use_torch_compile
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True  # as TRL's side (its default)
    if side == "ours_grpo":  # the single-turn loop: the prompts file has no agent_name
        assert cfg.actor_rollout_ref.rollout.mode == "agent_loop" and cfg.algorithm.adv_estimator == "grpo"
        assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "single_turn_agent"
    else:
        assert cfg.actor_rollout_ref.rollout.mode == "arpo"
    import pandas as pd

    prompts = pd.read_parquet(job["prompts_file"])
    assert len(prompts) == 4 and "agent_name" not in prompts


@pytest.mark.slow
def test_trl_side_trains_the_job_and_reports_step_time_tokens_and_memory(sft_model_dir, tmp_path, capsys):
    data = sft_model_dir.parent.parent / "data" / "synthetic" / "train.parquet"
    out = tmp_path / "peers.json"
    rc = bench_peers.main(["--model", str(sft_model_dir), "--data", str(data), "--sides", "trl", "--prompts", "2",
                           "--n", "2", "--max-response-length", "24", "--micro", "2", "--steps", "2", "--warmup", "1",
                           "--repeats", "1", "--dtypes", "float32", "--threads", "1", "--work-dir",
                           str(tmp_path / "work"), "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert rc == 0 and printed == json.loads(out.read_text())
    (run,) = printed["runs"]
    assert run["returncode"] == 0 and len(run["steps"]) == 2, run.get("error")
    for step in run["steps"]:  # 2 prompts x 2 completions of <= 24 tokens; the update adds the prompts
        assert 0 < step["generated_tokens"] <= 4 * 24 < step["trained_tokens"]
        # TRL's generation timed inside its step, so its steps split as ours do
        assert 0 < step["gen_seconds"] < step["seconds"] and step["update_seconds"] > 0
    assert run["step_s"] == round(run["steps"][1]["seconds"], 2)  # the warm-up step is left out
    assert run["generated_tokens_per_s"] > 0 and run["peak_rss_gb"] >= run["peak_pss_gb"] > 0.1
    assert printed["versions"]["trl"] == "1.16.0" and printed["job"]["n"] == 2
    assert set(printed["summary"]["float32"]) == {"trl"}


def test_summary_pairs_each_of_our_repeats_with_trls_of_the_same_repeat():
    runs = [{"side": s, "dtype": "bfloat16", "repeat": r, "step_s": t, "peak_rss_gb": 1.0, "trained_tokens_per_s": k}
            for s, r, t, k in [("trl", 0, 100.0, 10.0), ("trl", 1, 50.0, 20.0), ("ours_grpo", 0, 10.0, 125.0),
                               ("ours_grpo", 1, 10.0, 80.0)]]
    runs.append({"side": "ours_arpo", "dtype": "bfloat16", "repeat": 0, "error": "failed"})  # no step time
    summary = bench_peers.summarize(runs)["bfloat16"]
    assert summary["ours_grpo"]["ratio_to_trl"] == {"median": 0.15, "min": 0.1, "max": 0.2}
    # per trained token: TRL's tokens/s over ours, repeat by repeat (10/125 and 20/80)
    assert summary["ours_grpo"]["ratio_to_trl_per_trained_token"] == {"median": 0.165, "min": 0.08, "max": 0.25}
    assert summary["trl"]["step_s"] == {"median": 75.0, "min": 50.0, "max": 100.0}
    assert "ratio_to_trl" not in summary["trl"] and "ours_arpo" not in summary


def test_table_gathers_every_machine_s_json(tmp_path, capsys):
    runs = [{"side": s, "dtype": "bfloat16", "repeat": r, "step_s": t, "peak_pss_gb": 2.0, "trained_tokens_per_s": k}
            for s, r, t, k in [("trl", 0, 100.0, 10.0), ("ours_grpo", 0, 10.0, 80.0)]]
    machine = {"cpu_model": "Some CPU", "cpus": 2, "torch_cpu_capability": "AVX512", "git_sha": "abcdef0123"}
    (tmp_path / "amx.json").write_text(json.dumps({"benchmark": "bench_peers", "machine": machine,
                                                   "job": {"trl_generation": "continuous", "trl_bf16_weights": True,
                                                           "ours_overrides": ["a.b=false"]},
                                                   "summary": bench_peers.summarize(runs)}))
    (tmp_path / "other.json").write_text(json.dumps({"benchmark": "something else"}))
    assert bench_peers.main(["--table", str(tmp_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [(r["side"], r["dtype"]) for r in printed["rows"]] == [("trl", "bfloat16"), ("ours_grpo", "bfloat16")]
    table = (tmp_path / "table.md").read_text()
    assert ("| Some CPU, 2 cpus, torch AVX512 | bfloat16 | continuous, bf16 weights | `a.b=false` | ours_grpo | 1 | "
            "10.0 [10.0, 10.0] |") in table
    assert "| 0.100 [0.100, 0.100] | 0.125 [0.125, 0.125] | abcdef0 | `amx.json` |" in table
    assert "| continuous, bf16 weights | – | trl | 1 |" in table


def test_bad_sizes_are_one_clear_error(sft_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        _job(sft_model_dir, tmp_path, warmup=2)
    assert "--warmup 2 leaves no timed step of --steps 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--model", str(tmp_path / "missing")])
    assert "--model" in capsys.readouterr().err


def test_a_killed_benchmark_resumes_keeping_the_runs_it_finished(sft_model_dir, tmp_path, monkeypatch, capsys):
    data = sft_model_dir.parent.parent / "data" / "synthetic" / "train.parquet"
    work, out = tmp_path / "work", tmp_path / "peers.json"
    argv = ["--model", str(sft_model_dir), "--data", str(data), "--sides", "trl", "ours_grpo", "--prompts", "2",
            "--n", "2", "--steps", "2", "--repeats", "1", "--dtypes", "float32", "--work-dir", str(work),
            "--out", str(out)]
    job = bench_peers.write_job(bench_peers.parse_args(argv), work)
    kept = {"side": "trl", "dtype": "float32", "repeat": 0, "step_s": 10.0, "peak_rss_gb": 1.0}
    (work / "trl_float32_r0").mkdir()
    (work / "trl_float32_r0" / "result.json").write_text(json.dumps({"job": job, "result": kept}))
    (work / "ours_grpo_float32_r0").mkdir()  # finished for another job: run again
    (work / "ours_grpo_float32_r0" / "result.json").write_text(json.dumps({"job": {**job, "n": 4}, "result": {}}))
    ran = []

    def run_side(side, dtype, job, work, repeat):
        ran.append(side)
        return {"side": side, "dtype": dtype, "repeat": repeat, "step_s": 2.0, "peak_rss_gb": 1.0}

    monkeypatch.setattr(bench_peers, "run_side", run_side)
    assert bench_peers.main(argv) == 0
    assert ran == ["ours_grpo"]  # the finished TRL run is kept, not run again
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["runs"][0] == kept
    assert printed["summary"]["float32"]["ours_grpo"]["ratio_to_trl"]["median"] == 0.2


def test_memory_sampler_reads_rss_and_pss_of_the_process_tree():
    import subprocess
    import sys
    import time

    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; x = bytearray(200 << 20); time.sleep(30)"])
    try:
        while psutil.Process(child.pid).memory_info().rss < 200 << 20:  # the child holds its 200 MB
            time.sleep(0.05)
        root = psutil.Process()
        rss_only, full = bench_peers.tree_rss_pss(root, pss=False), bench_peers.tree_rss_pss(root)
        assert rss_only[0] > 200 << 20 and rss_only[1] == 0 and full[1] > 200 << 20
        with bench_peers.tree_memory_sampler(root, interval=0.01) as memory:
            time.sleep(0.2)
        assert min(memory.peaks) > 200 << 20 and memory.cpu_seconds > 0  # the first sample reads PSS too
    finally:
        child.kill()
        child.wait()


def test_memory_sampler_reads_pss_once_every_pss_every_samples(monkeypatch):
    import time

    flags: list[bool] = []
    monkeypatch.setattr(bench_peers, "tree_rss_pss", lambda root, pss=True: flags.append(pss) or (1.0, float(pss)))
    with bench_peers.tree_memory_sampler(object(), interval=0.0005):
        while len(flags) <= 2 * bench_peers.PSS_EVERY:
            time.sleep(0.001)
    assert [i for i, pss in enumerate(flags) if pss][:3] == [0, bench_peers.PSS_EVERY, 2 * bench_peers.PSS_EVERY]


def test_ours_set_overrides_our_sides_and_changing_it_reruns_only_ours(sft_model_dir, tmp_path, monkeypatch):
    data = sft_model_dir.parent.parent / "data" / "synthetic" / "train.parquet"
    work = tmp_path / "work"
    base = ["--model", str(sft_model_dir), "--data", str(data), "--sides", "trl", "ours_grpo", "--prompts", "2",
            "--n", "2", "--steps", "2", "--repeats", "1", "--dtypes", "float32", "--work-dir", str(work)]
    eager = bench_peers.parse_args(base)
    assert eager.ours_set == []
    old = bench_peers.write_job(eager, work)
    for side in ("trl", "ours_grpo"):  # both finished with the eager engine on our side
        (work / f"{side}_float32_r0").mkdir(parents=True)
        (work / f"{side}_float32_r0" / "result.json").write_text(json.dumps(
            {"job": old, "result": {"side": side, "dtype": "float32", "repeat": 0, "step_s": 4.0}}))
    argv = [*base, "--ours-set", "actor_rollout_ref.rollout.enforce_eager=false",
            "--ours-set", "actor_rollout_ref.actor.optim.lr=2e-5"]
    job = bench_peers.write_job(bench_peers.parse_args(argv), work)
    cmd = bench_peers.ours_command("ours_grpo", "float32", job, tmp_path / "run")
    assert cmd[-2:] == ["actor_rollout_ref.rollout.enforce_eager=false", "actor_rollout_ref.actor.optim.lr=2e-5"]
    ran = []
    monkeypatch.setattr(bench_peers, "run_side", lambda side, dtype, job, work, repeat: ran.append(side) or
                        {"side": side, "dtype": dtype, "repeat": repeat, "step_s": 2.0})
    assert bench_peers.main(argv) == 0
    assert ran == ["ours_grpo"]  # TRL never reads --ours-set: its finished run stands
    with pytest.raises(SystemExit):
        bench_peers.parse_args([*base, "--ours-set", "enforce_eager"])


def test_gradient_checkpointing_off_reaches_both_sides_and_reruns_both(sft_model_dir, tmp_path, monkeypatch):
    """The recompute is part of the job, so both sides follow the flag; a run saved before the job had the key
    (checkpointing on) stays valid for the default and is rerun for ``off``."""
    from arpo.config import load_config

    data = sft_model_dir.parent.parent / "data" / "synthetic" / "train.parquet"
    work = tmp_path / "work"
    base = ["--model", str(sft_model_dir), "--data", str(data), "--sides", "trl", "ours_grpo", "--prompts", "2",
            "--n", "2", "--steps", "2", "--repeats", "1", "--dtypes", "float32", "--work-dir", str(work)]
    old = bench_peers.write_job(bench_peers.parse_args(base), work)
    assert old.pop("gradient_checkpointing") is True
    for side in ("trl", "ours_grpo"):
        (work / f"{side}_float32_r0").mkdir(parents=True)
        (work / f"{side}_float32_r0" / "result.json").write_text(json.dumps(
            {"job": old, "result": {"side": side, "dtype": "float32", "repeat": 0, "step_s": 4.0}}))
    ran = []
    monkeypatch.setattr(bench_peers, "run_side", lambda side, dtype, job, work, repeat: ran.append(side) or
                        {"side": side, "dtype": dtype, "repeat": repeat, "step_s": 2.0})
    assert bench_peers.main(base) == 0 and ran == []  # the default is what the old runs did
    off = [*base, "--gradient-checkpointing", "off"]
    job = bench_peers.write_job(bench_peers.parse_args(off), work)
    assert job["gradient_checkpointing"] is False
    cfg = load_config("arpo_trainer", bench_peers.ours_command("ours_grpo", "float32", job, tmp_path / "run")[3:])
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False
    assert bench_peers.main(off) == 0 and ran == ["trl", "ours_grpo"]


def test_a_rerun_of_our_side_counts_only_its_own_steps(sft_model_dir, tmp_path, monkeypatch):
    """Our trainer appends to its metrics.jsonl: a run dir left by an earlier run must not add its steps."""
    import sys

    job = _job(sft_model_dir, tmp_path)
    work = tmp_path / "work"
    stale = bench_peers.run_dir(work, "ours_grpo", "float32", 0) / "logs"
    stale.mkdir(parents=True)
    old = {"timing_s/step": 50.0, "response_length/model_tokens_mean": 3.0, "perf/total_num_tokens": 10.0}
    (stale / "metrics.jsonl").write_text((json.dumps(old) + "\n") * 2)

    def fake_trainer(side, dtype, job, out):
        step = {**old, "timing_s/step": 5.0}
        return [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(out / 'logs')!r}); p.mkdir(); "
                                      f"(p / 'metrics.jsonl').write_text({(json.dumps(step) + chr(10)) * 2!r})"]

    monkeypatch.setattr(bench_peers, "ours_command", fake_trainer)
    result = bench_peers.run_side("ours_grpo", "float32", job, work, 0)
    assert [s["seconds"] for s in result["steps"]] == [5.0, 5.0] and result["step_s"] == 5.0
