"""``python -m arpo.tables``: paper-style tables (Table 1 / Table 2 layouts in Markdown, LaTeX and CSV) from
evaluation runs, or the ablation table of training runs.

``--runs`` reads evaluation run folders (as ``python -m arpo.eval`` writes them); ``--training-runs`` reads an
ablation's ``runs/<variant>/seed<K>/`` folders. What each table holds: :mod:`arpo.evaluation.tables`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from arpo.evaluation.metrics import PROFILES

EPILOG = """examples:
  python -m arpo.tables --runs 'outputs/eval/*' --out tables/                  # the paper's metric profile
  python -m arpo.tables --runs 'outputs/eval/*' --out tables/ --profile strict
  python -m arpo.tables --training-runs experiments/results/advantage/runs --out /tmp/t --baseline grpo"""


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(prog="python -m arpo.tables", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EPILOG)
    runs = parser.add_mutually_exclusive_group(required=True)
    runs.add_argument("--runs", nargs="+", help="evaluation run dirs, globs, or folders above them")
    runs.add_argument("--training-runs", help="folder of training runs <variant>/seed<K>/ (an ablation's runs/): "
                                              "writes table.md and runs.csv")
    parser.add_argument("--baseline", help="--training-runs: the variant the others are tested against")
    parser.add_argument("--out", required=True, help="output folder for the tables")
    parser.add_argument("--metric", default="acc", help="acc (default) | f1 | em | pass@<k>; profile arpo also "
                                                        "substring_acc | math_equal, profile strict also score | "
                                                        "format_ok")
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--methods", nargs="*", default=None, help="rows in this order (default: all, sorted)")
    parser.add_argument("--reference", default=None,
                        help="reported rows to print after ours in Tables 1-2 (e.g. configs/paper_reported.yaml)")
    parser.add_argument("--profile", default="arpo", choices=PROFILES,
                        help="--runs: metric profile of the tables (arpo: the released evaluation's metrics, as in "
                             "the paper; strict: ours); profiles.md shows both")
    args = parser.parse_args(argv)
    from arpo.evaluation.tables import make_tables

    if args.training_runs:
        from arpo.analysis import seed_summaries
        from arpo.evaluation.training_tables import write_training_tables

        try:
            written = write_training_tables(seed_summaries(args.training_runs), args.out, args.baseline)
        except FileNotFoundError as err:
            raise SystemExit(f"arpo.tables: {err}") from None
        print(written["table.md"].read_text(encoding="utf-8"))
        return written
    try:
        written = make_tables(args.runs, args.out, args.metric, args.digits, args.methods, args.profile,
                              args.reference)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"arpo.tables: {err}") from None
    for name in ("table1.md", "table2.md", "other.md", "profiles.md"):
        if name in written:
            print(written[name].read_text(encoding="utf-8"))
    print("written: " + ", ".join(str(p) for p in written.values()))
    return written



if __name__ == "__main__":
    main()
