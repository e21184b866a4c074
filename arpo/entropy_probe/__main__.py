"""Probe a model's token entropy around tool results: ``python -m arpo.entropy_probe --model M --trajectories F``.

Writes ``<out>/<name>.json`` (curves, premise statistic with 95% intervals, settings, timing) and
``<out>/<name>.png``. Without ``--model`` only rollout dumps can be read: their recorded top-k entropy is analysed;
with it, rollout dumps that keep their token ids are re-scored teacher-forced like any other source.
The defaults of ``--topk``, ``--window`` and ``--reduction`` are the trainer's
(``actor_rollout_ref.rollout.arpo.entropy.*`` in configs/arpo_trainer.yaml).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    from arpo.rollout.config import EntropyConfig

    defaults = EntropyConfig()
    parser = argparse.ArgumentParser(prog="python -m arpo.entropy_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", required=True, nargs="+",
                        help="JSONL files or folders: rollout dumps, arpo.eval samples, 'messages' or ShareGPT rows")
    parser.add_argument("--model", help="HF checkpoint directory (e.g. a run's exported checkpoint) to score with")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", default="probe", help="file stem of the JSON and PNG")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1 ...")
    parser.add_argument("--topk", type=int, default=defaults.topk_logprobs, help="entropy.topk_logprobs")
    parser.add_argument("--window", type=int, default=defaults.window, help="entropy.window (W)")
    parser.add_argument("--reduction", default=defaults.reduction, choices=["mean", "sum"], help="entropy.reduction")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="|V| of the normalisation (entropy.vocab_size; default: the tokenizer's length)")
    parser.add_argument("--before", type=int, default=20, help="model tokens drawn before the result")
    parser.add_argument("--after", type=int, default=50, help="model tokens drawn after the result")
    parser.add_argument("--limit", type=int, default=None, help="trajectories read per file (its first)")
    parser.add_argument("--tool-tags", nargs="+", default=None, metavar="NAME=TAG",
                        help="the run's tools and their ARPO tags, e.g. search python unit_converter=convert "
                             "(a bare NAME is its own tag; default: search python)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per forward pass")
    parser.add_argument("--max-length", type=int, default=None, help="tokens scored per trajectory (its first)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    parser.add_argument("--seed", type=int, default=0, help="control points and bootstrap")
    args = parser.parse_args(argv)

    from arpo.config import ConfigError
    from arpo.entropy_probe import load_model, plot, probe, read_trajectories
    from arpo.runtime.logging_utils import setup_logging
    from arpo.protocol import DEFAULT_PROTOCOL, ToolProtocol
    from arpo.runtime.tracking import json_safe

    setup_logging()
    model, tokenizer = load_model(args.model, args.dtype, args.device) if args.model else (None, None)
    try:
        protocol = DEFAULT_PROTOCOL if args.tool_tags is None else ToolProtocol(
            {name: tag or name for name, _, tag in (item.partition("=") for item in args.tool_tags)})
        trajectories = [t for path in args.trajectories
                        for t in read_trajectories(path, tokenizer, args.limit, protocol)]
        vocab = args.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        summary = probe(trajectories, model, vocab, args.topk, args.window, args.reduction, args.before,
                        args.after, args.seed, args.batch_tokens, args.max_length, args.resamples)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    summary["model"] = Path(args.model).name if args.model else None  # the folder's name: no local path recorded
    summary["sources"] = [str(p) for p in args.trajectories]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(json_safe(summary), indent=1) + "\n")
    plot(summary, args.name, str(out / f"{args.name}.png"))
    for measure_name, rows in summary["premise"].items():
        for kind, s in rows.items():
            print(f"{measure_name:4s} {kind:10s} after-before {s['mean']:+.4f} [{s['lo']:+.4f}, {s['hi']:+.4f}] "
                  f"(n={s['n']} trajectories)", flush=True)
    print(f"wrote {out / args.name}.json and .png", flush=True)


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
