"""Tool throughput in one JSON document: search (bench_search.py) and the Python sandbox (bench_sandbox.py).

Runs both benchmarks as they are, each in its own process so neither one's threads or caches colour the other,
and prints {"search": ..., "sandbox": ...} on stdout, nothing else (their logs go to stderr). Other arguments are
not forwarded; run the two scripts directly to change their settings. ``--smoke`` runs both at tiny sizes
(seconds): a check that they still run, not a measurement.

    python experiments/bench_tools.py
    python experiments/bench_tools.py --smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: ``--smoke``: the two scripts' arguments for a run of seconds.
SMOKE_ARGS = {"bench_search.py": ["--docs", "200", "--queries", "20", "--concurrency", "1", "2"],
              "bench_sandbox.py": ["--calls", "4", "--concurrency", "1", "2", "--timeout-s", "60"]}


def _run(script: str, *args: str) -> dict:
    # stderr passes through (their logs, and the reason if one fails); stdout is exactly one JSON document
    out = subprocess.run([sys.executable, str(HERE / script), *args], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, seconds: " + "; ".join(f"{s} {' '.join(a)}" for s, a in SMOKE_ARGS.items()))
    args = ap.parse_args()
    extra = SMOKE_ARGS if args.smoke else {}
    result = {"search": _run("bench_search.py", *extra.get("bench_search.py", [])),
              "sandbox": _run("bench_sandbox.py", "--numpy", *extra.get("bench_sandbox.py", []))}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
