"""How well a checkpoint follows the ARPO tag protocol on the synthetic benchmark, per question kind.

This is the cold-start SFT acceptance measure: sample one trajectory per test question with the real engine
and the real tools (the same rollout code as RL, plain sampling, no branching), then score each with the
benchmark's reward function and report the share with a valid format and the share answered correctly.

    python -m arpo.evaluation.protocol_quality --model outputs/tiny_arpo/models/tiny-sft \
        --data outputs/tiny_arpo/data/synthetic [--split test] [--temperature 1.0] [--samples 3]

Prints one JSON object: ``per_kind`` ({kind: {n, format, acc}}, one entry per kind in the split: the easy
``search``/``python``/``both`` and, with ``synthetic=hard`` data, ``chain``/``compare``/``chain_math``),
``overall``, the settings, and ``samples`` (a few decoded responses per kind, to see *how* the model fails).
``--split test_easy`` measures the hard preset's easy held-out split. The hard kinds need three tool calls
and three result pages: ``--tool-call-limit`` (default 4) and ``--max-response-length`` (default 400 tokens)
must leave room for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any


def measure_protocol_quality(model_dir: str | Path, data_dir: str | Path, *, split: str = "test",
                             temperature: float = 1.0, seed: int = 0, max_response_length: int = 400,
                             tool_call_limit: int = 4, max_questions: int | None = None,
                             samples_per_kind: int = 0, engine: Any = None,
                             loop: asyncio.AbstractEventLoop | None = None) -> dict[str, Any]:
    """Sample each question of ``<data_dir>/<split>.parquet`` once with vLLM and the benchmark's tools; return
    format rate and accuracy per ``ability`` (the question kind) and overall. ``engine`` (an engine already
    serving ``model_dir``, with the ``loop`` it is bound to) is sampled on and left running, so callers that hold
    one do not start a second."""
    import pandas as pd
    from transformers import AutoTokenizer

    from arpo.config import load_config, require_path
    from arpo.engine.config import EngineConfig
    from arpo.engine.vllm_engine import VLLMEngine
    from arpo.rollout.arpo_rollout import ARPORollout
    from reward_fns import default_compute_score
    from tools.registry import load_tools

    if engine is not None and loop is None:
        raise ValueError("measure_protocol_quality: an engine given needs the event loop it serves on (loop=)")
    model_dir = require_path(str(model_dir), "--model", "give an HF checkpoint directory", kind="model directory")
    data_dir = Path(data_dir)
    data_file = require_path(str(data_dir / f"{split}.parquet"), "--data/--split",
                             "generate the benchmark with `python -m arpo.data.synthetic`")
    df = pd.read_parquet(data_file)
    if max_questions:
        df = df.iloc[:max_questions]
    cfg = load_config("sft", [f"synthetic.out_dir={data_dir}"])
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    own_engine = engine is None
    if own_engine:
        engine = VLLMEngine(EngineConfig(model_path=str(model_dir), max_model_len=1024))
    tools = load_tools(cfg.tools)
    rollout = ARPORollout(engine, tok, {"mode": "single", "n": 1, "initial_rollouts": 1, "seed": seed,
                                        "sampling": {"max_response_length": max_response_length,
                                                     "temperature": temperature},
                                        "tools.call_limit": tool_call_limit}, tools)
    prompts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)["input_ids"]
               for p in df.prompt]

    async def sample() -> Any:
        # the engine shuts down inside the loop it served on: its output handler then stops cleanly
        try:
            return await rollout.agenerate(prompts)
        finally:
            if own_engine:
                engine.shutdown()

    try:
        batch = asyncio.run(sample()) if loop is None else loop.run_until_complete(sample())
    finally:
        rollout.close()
        tools.close()
        if own_engine:
            engine.shutdown()

    per_kind: dict[str, list[tuple[bool, bool]]] = {}
    samples: dict[str, list[dict[str, Any]]] = {}
    p_len = batch.tensors["prompts"].shape[1]
    for i in range(len(batch)):
        row = df.iloc[int(batch.non_tensors["group_index"][i])]
        keep = batch.tensors["attention_mask"][i, p_len:].bool()
        text = tok.decode(batch.tensors["responses"][i][keep].tolist(), skip_special_tokens=True)
        score = default_compute_score(row.data_source, text, row.reward_model["ground_truth"], dict(row.extra_info))
        ok_format, correct = bool(score["format_ok"]), score["acc"] > 0
        per_kind.setdefault(row.ability, []).append((ok_format, correct))
        if len(samples.setdefault(row.ability, [])) < samples_per_kind:
            samples[row.ability].append({"question": row.extra_info["question"],
                                         "answer": str(row.reward_model["ground_truth"]),
                                         "format_ok": ok_format, "correct": correct, "response": text})

    def rates(rows: list[tuple[bool, bool]]) -> dict[str, Any]:
        return {"n": len(rows), "format": sum(f for f, _ in rows) / len(rows), "acc": sum(a for _, a in rows) / len(rows)}

    every = [r for rows in per_kind.values() for r in rows]
    return {"model": str(model_dir), "data": str(data_file), "temperature": temperature, "seed": seed,
            "per_kind": {k: rates(v) for k, v in sorted(per_kind.items())}, "overall": rates(every),
            "samples": samples}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (e.g. the SFT output)")
    ap.add_argument("--data", required=True, help="synthetic benchmark directory (train/val/test.parquet, corpus)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-questions", type=int, default=None)
    ap.add_argument("--samples", type=int, default=2, help="decoded responses to show per kind")
    ap.add_argument("--max-response-length", type=int, default=400,
                    help="response tokens per question, tool results included")
    ap.add_argument("--tool-call-limit", type=int, default=4, help="tool calls per question (hard kinds need 3)")
    args = ap.parse_args(argv)
    from arpo.runtime.logging_utils import setup_logging

    setup_logging()  # logs and engine warnings on stderr; stdout carries only the JSON
    for flag, value in (("--max-response-length", args.max_response_length),
                        ("--tool-call-limit", args.tool_call_limit)):
        if value < 1:
            from arpo.config import ConfigError

            raise ConfigError(f"{flag}={value}: must be >= 1")
    result = measure_protocol_quality(args.model, args.data, split=args.split, temperature=args.temperature,
                                      seed=args.seed, max_response_length=args.max_response_length,
                                      tool_call_limit=args.tool_call_limit, max_questions=args.max_questions,
                                      samples_per_kind=args.samples)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
