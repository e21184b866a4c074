"""Sandboxed Python throughput: calls/s for ordinary small programs at several concurrency levels.

    python experiments/bench_sandbox.py --calls 48 --concurrency 1 8 [--isolation bwrap] [--numpy]
    python experiments/bench_sandbox.py --calls 4 --concurrency 1 2 --timeout-s 60   # smoke: a second or two

Prints one JSON object on stdout and nothing else (without a usable sandbox: the report with no ``runs``, the
reason on stderr, exit status 1). Each call is a fresh interpreter in fresh namespaces, so this measures the whole
per-call cost (namespace setup, interpreter start, the program, teardown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.python_sandbox import SandboxConfig, SandboxPool, resolve_isolation  # noqa: E402

PROGRAMS = [
    "print(sum(i * i for i in range(1000)))",
    "s = 'the quick brown fox'\ns.title().replace(' ', '-')",
    "from fractions import Fraction\nprint(sum(Fraction(1, k) for k in range(1, 30)))",
    "import math\n[math.comb(20, k) for k in range(5)]",
]
NUMPY_PROGRAM = "import numpy as np\nprint(np.linalg.solve(np.array([[3., 1.], [1., 2.]]), np.array([9., 8.])))"


def bench(concurrency: int, calls: int, config: SandboxConfig, programs: list[str]) -> dict:
    codes = [programs[i % len(programs)] for i in range(calls)]
    with SandboxPool(max_workers=concurrency, config=config) as pool:
        pool.map(codes[:concurrency])  # warm-up: page cache, isolation probe
        start = time.perf_counter()
        results = pool.map(codes)
        elapsed = time.perf_counter() - start
    failures = [r.to_model_text() for r in results if not r.ok]
    latencies = sorted(r.duration_s for r in results)
    return {
        "concurrency": concurrency,
        "calls": calls,
        "seconds": round(elapsed, 3),
        "calls_per_s": round(calls / elapsed, 2),
        "latency_ms_p50": round(1000 * statistics.median(latencies), 1),
        "latency_ms_p95": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
        "failures": len(failures),
        "first_failure": failures[0][:300] if failures else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "unshare"])
    parser.add_argument("--numpy", action="store_true", help="also time a program that imports numpy")
    parser.add_argument("--timeout-s", type=float, default=SandboxConfig.timeout_s,
                        help="wall-clock limit per call (the tool's default; the smoke run raises it, since on a "
                             "busy machine an interpreter start alone can take seconds)")
    args = parser.parse_args()
    config = SandboxConfig(isolation=args.isolation, timeout_s=args.timeout_s)
    mode, note = resolve_isolation(config)
    report = {"isolation": mode, "isolation_note": note or None, "cpu_count": os.cpu_count(),
              "python": platform.python_version(), "runs": []}
    if mode is not None:
        for concurrency in args.concurrency:
            report["runs"].append(dict(bench(concurrency, args.calls, config, PROGRAMS), programs="small"))
            if args.numpy:
                report["runs"].append(dict(bench(concurrency, args.calls, config, [NUMPY_PROGRAM]),
                                           programs="numpy"))
    print(json.dumps(report, indent=2))
    if mode is None:
        raise SystemExit(f"no sandbox mechanism available: {note}")


if __name__ == "__main__":
    main()
