"""Roll out a model with per-token entropy on a parquet split and save the rows for arpo/analysis.py (and
notebooks/arpo_analysis.ipynb): entropy around tool calls, the fork trees.

The rollout is the trainer's (``configs/arpo_trainer.yaml``, ``actor_rollout_ref.rollout.mode=arpo``) with
``return_entropy`` on; trailing ``key=value`` overrides change it like a training run's (e.g. the branching
rule of an ablation variant). One JSONL row per trajectory, in batch order (``parent_index`` is a line number).

Example:
    python experiments/dump_rollout_entropy.py --model outputs/tiny_arpo/models/tiny-sft \
        --data outputs/tiny_arpo/data/synthetic --out outputs/analysis/rollouts.jsonl --limit 64 \
        [actor_rollout_ref.rollout.arpo.branching.rule=paper ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger("arpo.dump_rollout_entropy")

def dump_jobs(jobs: Sequence[dict[str, Any]], data: str, split: str = "test", limit: int = 64,
              n: int | None = None, initial: int | None = None, backend: str = "vllm",
              overrides: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Dump each job's model (``{model, out, overrides}``) in turn; returns each one's metrics. One engine
    serves every job whose engine settings and model architecture match the previous one's: it loads the next
    checkpoint's weights instead of starting again (a start is most of a small dump's time)."""
    return asyncio.run(_dump_jobs(jobs, data, split, limit, n, initial, backend, overrides))


async def _dump_jobs(jobs, data, split, limit, n, initial, backend, overrides) -> list[dict[str, Any]]:
    import pandas as pd
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from arpo.analysis import rollout_rows
    from arpo.config import load_config
    from arpo.engine.config import EngineConfig
    from arpo.engine.factory import create_engine
    from arpo.main_arpo import build_rollout
    from tools.registry import load_tools

    data_dir = Path(data)
    df = pd.read_parquet(data_dir / f"{split}.parquet").head(limit)
    budget = ([f"actor_rollout_ref.rollout.n={n}"] if n else []) + \
        ([f"actor_rollout_ref.rollout.arpo.initial_rollouts={initial}"] if initial else [])
    engine, engine_key, results = None, None, []
    try:
        for job in tqdm(jobs, desc="dump rollouts", unit="model", disable=len(jobs) < 2):
            model = job["model"]
            cfg = load_config("arpo_trainer", [
                f"synthetic.out_dir={data_dir}", f"actor_rollout_ref.model.path={model}",
                f"actor_rollout_ref.rollout.name={backend}", "actor_rollout_ref.rollout.mode=arpo", *budget,
                *overrides, *job.get("overrides", []), "actor_rollout_ref.rollout.arpo.return_entropy=true"])
            key = (replace(EngineConfig.from_cfg(cfg), model_path=""), (Path(model) / "config.json").read_text())
            if engine is not None and key == engine_key:
                await engine.update_weights(model)
            else:
                if engine is not None:
                    engine.shutdown()
                engine, engine_key = create_engine(cfg, ray_actor=False), key
            tok = AutoTokenizer.from_pretrained(model)
            prompts = [tok.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)["input_ids"]
                       for p in df.prompt]
            tools = load_tools(cfg.tools)
            rollout = build_rollout(cfg, [engine], tok, tools)
            try:
                batch = await rollout.agenerate(prompts)
            finally:
                rollout.close()
                tools.close()
            path = Path(job["out"])
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = rollout_rows(batch, list(df.data_source))
            with path.open("w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            logger.info("wrote %d rollout rows to %s", len(rows), path)
            results.append({"rows": len(rows), "out": str(path), **batch.meta.get("metrics", {})})
    finally:
        # on the loop the engine served: its output-handler task ends cleanly (no AsyncLLM.__del__ traceback)
        if engine is not None:
            engine.shutdown()
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF checkpoint directory")
    parser.add_argument("--out", help="output JSONL")
    parser.add_argument("--jobs", help="JSON list of {model, out, overrides}: several dumps in one process "
                                      "(vLLM's import is most of a small dump's time)")
    parser.add_argument("--data", required=True, help="folder with <split>.parquet and corpus.jsonl (synthetic layout)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=64, help="prompts rolled out (the split's first)")
    parser.add_argument("--n", type=int, default=None, help="budget M per prompt (default: the trainer config's)")
    parser.add_argument("--initial", type=int, default=None, help="initial rollouts N per prompt (default: config)")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("overrides", nargs="*", help="configs/arpo_trainer.yaml overrides (key=value)")
    args = parser.parse_args(argv)
    if bool(args.jobs) == bool(args.model and args.out):
        parser.error("give either --model and --out, or --jobs")
    jobs = json.loads(Path(args.jobs).read_text()) if args.jobs else [{"model": args.model, "out": args.out}]
    from arpo.runtime.tracking import json_safe
    from arpo.runtime.logging_utils import setup_logging

    setup_logging()
    for result in dump_jobs(jobs, args.data, args.split, args.limit, args.n, args.initial, args.backend,
                            args.overrides):
        print(json.dumps(json_safe(result)), flush=True)


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
