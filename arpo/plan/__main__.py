"""``python -m arpo.plan [--stage sft|rl|eval] [--preset NAME] [--model DIR] [--gpu-memory-gb G] [--cost]
[key=value ...]``: print a stage's memory plan, start nothing.

The overrides are the stage's own (``rl``, the default: configs/arpo_trainer.yaml as ``python -m arpo.main_arpo``
takes them; ``sft``: configs/sft.yaml; ``eval``: configs/eval.yaml); ``--preset`` starts from a pipeline preset's
settings for that stage and ``--model`` points the stage's model at a directory (a ``config.json`` is enough). Exit
status 0 when the stage fits, 2 when it does not (or the config is bad), with one line naming the keys to change.
"""

from __future__ import annotations

import argparse
import sys

from arpo.plan.memory import GIB

USAGE_EPILOG = ("example: python -m arpo.plan --gpu-memory-gb 80 --cost "
                "actor_rollout_ref.model.path=tests/fixtures/models/qwen2.5-7b trainer.n_gpus_per_node=8 "
                "data.max_response_length=4096 actor_rollout_ref.rollout.n=16 (a directory with a config.json is "
                "enough: no weights are read)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    from arpo.plan.cost import Throughputs

    d = Throughputs()
    p = argparse.ArgumentParser(prog="python -m arpo.plan", description=__doc__.split("\n\n")[0],
                                epilog=USAGE_EPILOG)
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory of each GPU in GiB (an H100 80GB reports 79.2); default: this machine's GPU, or a "
                        "CPU plan (host RAM only) without one")
    p.add_argument("--host-memory-gb", type=float, default=None, help="RAM of each node in GiB, checked when given")
    p.add_argument("--cost", action="store_true", help="also predict seconds per step (docs/scaling/cost_model.md)")
    p.add_argument("--mfu", type=float, default=d.training_mfu, help="training MFU (default %(default)s)")
    p.add_argument("--decode-efficiency", type=float, default=d.decode_bandwidth_efficiency,
                   help="share of HBM bandwidth a decode step reaches (default %(default)s)")
    p.add_argument("--hbm-tb-per-s", type=float, default=d.hbm_bytes_per_s / 1e12,
                   help="GPU memory bandwidth, TB/s (default %(default)s: H100 SXM)")
    p.add_argument("--peak-tflops", type=float, default=d.peak_flops / 1e12,
                   help="dense BF16 peak, TFLOP/s (default %(default)s: H100 SXM)")
    p.add_argument("--tool-latency-s", type=float, default=d.tool_latency_s, help="seconds a tool call takes")
    p.add_argument("--mean-response-tokens", type=int, default=None,
                   help="mean response length (default: half of data.max_response_length)")
    from arpo.plan.stages import STAGES

    p.add_argument("--stage", default="rl", choices=STAGES,
                   help="the pipeline stage to plan (default rl: the training run)")
    p.add_argument("--preset", default=None, help="a pipeline preset (configs/pipeline/<name>.yaml) whose settings "
                                                   "for the stage come first, e.g. paper_qwen2.5_7b")
    p.add_argument("--model", default=None, help="the stage's model: a directory with its config.json (no weights)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the stage's config")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    from arpo.config import ConfigError, load_config
    from arpo.plan.cost import Throughputs, step_seconds
    from arpo.plan.stages import STAGE_CONFIG, build_stage_plan, format_stage_plan, stage_failure_line

    args = parse_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config(STAGE_CONFIG[args.stage], stage_overrides(args))
    gpu_bytes = None if args.gpu_memory_gb is None else args.gpu_memory_gb * GIB
    device = cfg.sft.device if args.stage == "sft" else cfg.trainer.device if args.stage == "rl" else "auto"
    if gpu_bytes is None and device != "cpu" and torch.cuda.is_available():
        gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
    host = None if args.host_memory_gb is None else args.host_memory_gb * GIB
    try:
        plan = build_stage_plan(args.stage, cfg, gpu_bytes, host_limit=host)
    except (ValueError, OSError) as e:
        raise ConfigError(f"actor_rollout_ref.model.path={cfg.actor_rollout_ref.model.path}: {e}") from None
    print(format_stage_plan(args.stage, plan))
    if args.cost and args.stage == "rl" and plan.engine is not None:
        rates = Throughputs(hbm_bytes_per_s=args.hbm_tb_per_s * 1e12, decode_bandwidth_efficiency=args.decode_efficiency,
                            peak_flops=args.peak_tflops * 1e12, training_mfu=args.mfu,
                            tool_latency_s=args.tool_latency_s, mean_response_tokens=args.mean_response_tokens)
        cost = step_seconds(plan, rates)
        print("\npredicted seconds per step: " + ", ".join(
            f"{k} {cost[k]:.1f}" for k in cost if k not in ("decode_tokens_per_s_per_gpu", "concurrency",
                                                            "decoded_tokens", "trained_tokens")))
        print(f"  decode {cost['decode_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU at {cost['concurrency']:.0f} "
              f"sequences a replica; {cost['decoded_tokens']:,.0f} tokens decoded, {cost['trained_tokens']:,.0f} "
              f"trained a step")
    if not plan.fits:
        raise ConfigError(stage_failure_line(args.stage, cfg, plan, host))
    return 0


def stage_overrides(args: argparse.Namespace) -> list[str]:
    """The preset's overrides for the stage (its paths under a placeholder folder: nothing is written), the model,
    then the command line's."""
    from arpo.plan.stages import STAGE_CONFIG

    out: list[str] = []
    if args.preset is not None:
        from arpo.pipeline import Pipeline

        out = Pipeline("/nonexistent/arpo-plan", args.preset).stage_overrides(STAGE_CONFIG[args.stage])
    if args.model is not None:
        out.append(f"actor_rollout_ref.model.path={args.model}")
    return out + list(args.overrides)


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
