"""``python -m arpo.eval [key=value ...]``: evaluate a checkpoint with the tools over the paper's benchmarks or
parquet files, ``eval.num_runs`` runs per question, resumable (``configs/eval.yaml``).

Writes ``<eval.run_dir>/samples/<benchmark>.jsonl`` and ``summary.json``; ``python -m arpo.tables`` turns run
folders into the paper's tables. How a sample is generated and graded: :mod:`arpo.evaluation.evaluate`.
"""

from __future__ import annotations

from typing import Any, Sequence


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import load_config
    from arpo.evaluation.evaluate import evaluate, print_summary, run_dir_of
    from arpo.runtime.logging_utils import setup_logging

    exit_if_help("eval", "python -m arpo.eval", __doc__, argv)
    cfg = load_config("eval", argv)
    setup_logging(run_dir_of(cfg) / "logs", filename="eval.log")
    summary = evaluate(cfg)
    print_summary(summary)
    return summary


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
