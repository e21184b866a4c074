"""Factories that plug the real engine and tools into experiments/bench_arpo_rollout.py.

    ARPO_SYNTHETIC_DIR=outputs/tiny_arpo/data/synthetic python experiments/bench_arpo_rollout.py \
        --engine-factory experiments.rollout_factories:vllm_engine --model outputs/tiny_arpo/models/tiny-sft \
        --tools-factory experiments.rollout_factories:synthetic_tools \
        --data outputs/tiny_arpo/data/synthetic/test.parquet
"""

from __future__ import annotations

import os


def vllm_engine(model_path: str):
    from transformers import AutoTokenizer

    from arpo.engine.config import EngineConfig
    from arpo.engine.vllm_engine import VLLMEngine

    return VLLMEngine(EngineConfig(model_path=model_path, max_model_len=2048)), AutoTokenizer.from_pretrained(model_path)


def hf_engine(model_path: str):
    from transformers import AutoTokenizer

    from arpo.engine.config import EngineConfig
    from arpo.engine.hf_engine import HFEngine

    return HFEngine(EngineConfig(model_path=model_path, name="hf", max_model_len=2048)), \
        AutoTokenizer.from_pretrained(model_path)


def synthetic_tools():
    from arpo.config import load_config
    from tools.registry import load_tools

    data = os.environ.get("ARPO_SYNTHETIC_DIR", "outputs/tiny_arpo/data/synthetic")
    return list(load_tools(load_config("sft", [f"synthetic.out_dir={data}"]).tools).values())
