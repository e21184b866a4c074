"""The paper-scale path on one GPU with only torch and transformers installed: an FSDP2 rank that loads from rank 0,
a bucketed weight sync, and the memory planner's prediction against the measured peaks.

The model is Qwen2.5-7B's architecture (``tests/fixtures/models/qwen2.5-7b``: its real hidden size, heads, MLP and
152,064-token vocabulary) cut to ``--layers`` decoder layers, with random weights: the embedding and the untied head
are full size, so every tensor the sync moves and every activation of one layer is the 7B model's own. The trainer
step is ``experiments/bench_trainer.py`` (one rank, no Ray); the planner gets the same keys with
``trainer.n_gpus_per_node=1`` and the engine on a GPU of its own (``hybrid_engine=false``), so its training-GPU
table is the bench's GPU. Prints one JSON object: the bench's phases, the planner's phases, and their ratios.

    python experiments/gpu_check_scale.py --out gpu_check.json               # one H200: about 1 min
    python experiments/gpu_check_scale.py --layers 28 --lora-rank 16 --out lora.json   # the whole 7B, LoRA
    python experiments/gpu_check_scale.py --device cpu --smoke --out x.json  # the same calls on small shapes
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FIXTURE = REPO / "tests" / "fixtures" / "models" / "qwen2.5-7b"
#: bench phase -> the planner's column for the same work
PHASES = {"load": None, "old_log_prob": "old log-probs", "update_policy": "actor update", "weight_sync": "weight sync"}
#: small shapes for --smoke (CPU): the architecture's ratios, not its size
SMOKE_SHAPES = {"hidden_size": 256, "intermediate_size": 1344, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 4096}


def cut_config(out: Path, layers: int, smoke: bool) -> Path:
    """The 7B config with ``layers`` decoder layers (and small widths with ``smoke``), as a model directory."""
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if smoke:
        cfg.update(SMOKE_SHAPES)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def run_bench(model: Path, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(REPO / "experiments" / "bench_trainer.py"), "--model", str(model), "--random-init",
           "--no-ray", "--ranks", "1", "--settings", "multi", "--device", args.device, "--rows", str(args.rows),
           "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len), "--micro",
           str(args.micro), "--steps", "1", "--warmup", "1"] + [f"--set={o}" for o in lora_overrides(args)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise SystemExit(f"bench_trainer failed ({done.returncode}):\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def lora_overrides(args: argparse.Namespace) -> list[str]:
    if not args.lora_rank:
        return []
    return [f"actor_rollout_ref.model.lora_rank={args.lora_rank}",
            f"actor_rollout_ref.model.lora_alpha={2 * args.lora_rank}"]


def planner_overrides(model: Path, args: argparse.Namespace) -> list[str]:
    rows = args.rows
    return [f"actor_rollout_ref.model.path={model}", f"trainer.device={args.device}", "trainer.nnodes=1",
            "trainer.n_gpus_per_node=1", "actor_rollout_ref.hybrid_engine=false",
            f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
            "actor_rollout_ref.rollout.n=2", f"data.train_batch_size={rows // 2}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={rows // 2}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro}",
            "actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.model.tree_packing=false", "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=false", "algorithm.adv_estimator=grpo"] + lora_overrides(args)


def run_planner(model: Path, args: argparse.Namespace, gpu_bytes: float) -> dict:
    from arpo.config import load_config
    from arpo.plan import build_plan

    cfg = load_config("arpo_trainer", planner_overrides(model, args))
    plan = build_plan(cfg, gpu_bytes)
    import math

    table = plan.gpu_tables[0]
    # torch.cuda.max_memory_allocated (what the bench measures) does not see the CUDA context
    allocated = [sum(v[i] for name, v in table.rows if not name.startswith("CUDA context"))
                 for i in range(len(table.phases))]
    return {"title": table.title, "phases_gib": dict(zip(table.phases, (round(v / 2**30, 3) for v in allocated))),
            "rows_gib": {name: [round(v / 2**30, 3) for v in values] for name, values in table.rows},
            "num_params": sum(math.prod(shape) for shape in plan.shapes.param_shapes)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/gpu_check_scale.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the JSON goes (also printed)")
    p.add_argument("--device", default="cuda", help="cuda | cpu")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept of Qwen2.5-7B's 28")
    p.add_argument("--rows", type=int, default=16, help="trajectories in the step (n=2 per prompt)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1536)
    p.add_argument("--micro", type=int, default=2, help="ppo_micro_batch_size_per_gpu and the log-prob micro-batch")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (alpha 2 x rank) instead "
                   "of full fine-tuning; with --layers 28 the whole 7B on one GPU")
    p.add_argument("--smoke", action="store_true", help="small widths (CPU check of the script itself)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.rows, args.prompt_len, args.response_len, args.micro = 2, 4, 16, 32, 2
    import torch

    gpu_bytes = (float(torch.cuda.get_device_properties(0).total_memory) if args.device == "cuda"
                 else 80.0 * 2**30)  # on CPU the GPU table is still drawn, for a GPU of this size
    with tempfile.TemporaryDirectory() as work:
        model = cut_config(Path(work) / "qwen2.5-7b-cut", args.layers, args.smoke)
        planned = run_planner(model, args, gpu_bytes)
        bench = run_bench(model, args)
    setting = bench["results"][0][next(k for k in bench["results"][0] if k.startswith("fsdp2_"))]
    measured_gib = {phase: round(max(v) / 1024, 3) for phase, v in (setting.get("peak_gpu_mb_per_rank") or {}).items()}
    comparison = {phase: {"measured_gib": measured_gib.get(phase), "planned_gib": planned["phases_gib"].get(column),
                          "planned_over_measured": (round(planned["phases_gib"][column] / measured_gib[phase], 3)
                                                    if column in planned["phases_gib"] and measured_gib.get(phase)
                                                    else None)}
                  for phase, column in PHASES.items()}
    report = {"check": "gpu_check_scale", "device": args.device, "device_name": bench.get("device_name"),
              "torch": torch.__version__, "layers": args.layers, "lora_rank": args.lora_rank, "rows": args.rows, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "micro": args.micro, "smoke": args.smoke,
              "seconds": {k: setting.get(f"{k}_s") for k in ("old_log_prob", "update_policy", "weight_sync")},
              "start_s": setting.get("start_s"), "last_update": setting.get("last_update"),
              "peak_gpu_vs_plan": comparison, "plan": planned, "bench_wall_s": bench["wall_s"]}
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
