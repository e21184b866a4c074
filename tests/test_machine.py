"""Where a run ran: the machine record every summary carries (arpo/runtime/machine.py)."""

import json

import pytest
import torch

from arpo.runtime.machine import describe_machine, machine_info
from arpo.pipeline import final_summary, pipeline_machine

AMX_CPU = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile
"""
AVX2_CPU = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse4_2 avx avx2 fma\n"


def test_machine_record_names_the_cpu_its_kernel_isa_and_the_overrides_in_force():
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2", "HOME": "/root"}
    info = machine_info(AMX_CPU, env)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert info["cpu_isa"] == ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2", "fma"]
    assert info["env"] == {"ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "2"}  # only kernel/thread settings
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["torch_threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert len(info["git_sha"].removesuffix("-dirty")) == 40
    json.dumps(info)  # goes into summary.json as is

    plain = machine_info(AVX2_CPU, {})
    assert plain["cpu_isa"] == ["avx2", "fma"] and plain["env"] == {}


def test_pipeline_closing_lines_say_where_it_ran_in_one_line():
    rl = {"machine": {**machine_info(AVX2_CPU, {"ATEN_CPU_CAPABILITY": "default"}), "dtypes": {"trainer": "float32"},
                      "trainer_rank_threads": 1}}
    machine = pipeline_machine({**rl, "sft": {"compute_dtype": "float32"}})
    assert machine["dtypes"] == {"sft": "float32", "trainer": "float32"}
    line = describe_machine(machine)
    assert line.startswith("AMD EPYC 7B12, ") and "ISA avx2 fma (torch " in line
    assert "sft float32, trainer float32" in line and "(1 a trainer rank)" in line
    assert "ATEN_CPU_CAPABILITY=default" in line and machine["git_sha"][:12] in line
    closing = final_summary({"stage_timings_s": {"sft_s": 3.0}, "wall_s": 5.0, "machine": machine}, root=".")
    assert [ln for ln in closing.splitlines() if ln.strip().startswith("machine")] == [f"  machine   {line}"]


def test_rl_summary_records_the_trainers_resolved_dtype_and_rank_threads():
    from arpo.config import load_config
    from arpo.main_arpo import run_machine

    info = run_machine(load_config("arpo_trainer", ["actor_rollout_ref.model.dtype=float32"]), {"torch_threads": 1})
    assert info["dtypes"] == {"trainer": "float32"} and info["trainer_rank_threads"] == 1
    assert info["cpu_model"] == machine_info()["cpu_model"]


def _wait_policy_after_import(env: dict) -> str:
    import subprocess
    import sys

    code = "import arpo, os, torch; torch.ones(2).sum(); print(os.environ.get('OMP_WAIT_POLICY'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_arpo_processes_wait_passively_in_openmp_unless_the_user_exported_a_policy():
    import os

    from arpo import THREAD_ENV

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _wait_policy_after_import(env) == THREAD_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    assert _wait_policy_after_import({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


@pytest.mark.slow
def test_ray_workers_start_with_the_thread_env(ray_cluster):
    import os

    ray = ray_cluster
    worker_env = ray.get(ray.remote(num_cpus=1)(lambda: os.environ.get("OMP_WAIT_POLICY")).remote())
    assert worker_env == os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


@pytest.mark.slow
def test_a_process_given_ray_address_joins_that_cluster(ray_cluster):
    """init_ray without an address key (the SFT stage, the benchmarks) joins $RAY_ADDRESS, as the trainer's
    config default does; the suite's subprocess runs join their pytest worker's cluster this way."""
    import subprocess
    import sys

    from tests.conftest import worker_ray_env

    code = ("from arpo.runtime.ray_utils import init_ray; init_ray({'num_cpus': 1}); import ray; "
            "print(ray.get_runtime_context().gcs_address)")
    out = subprocess.run([sys.executable, "-c", code], env=worker_ray_env(), capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()[-1]
    assert out == ray_cluster.get_runtime_context().gcs_address
