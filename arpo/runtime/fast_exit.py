"""Ending a process without the interpreter's final garbage collection.

A process that imported torch, transformers, Ray or vLLM spends seconds in that last collection (measured here:
~4 s for an entry point, over 5 s for a vLLM engine core, which then overran vLLM's 5 s shutdown grace and was
SIGKILLed). Freezing the heap instead left nanobind (triton's bindings) reporting "leaked instances" on stderr,
so the exit handlers run and the process ends right after: nothing the collection would free outlives it.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys


def exit_now(code: int = 0, run_exit_handlers: bool = True) -> None:
    """Run the exit handlers, flush the logs and standard streams, and end the process with ``code``.
    ``run_exit_handlers=False`` when called as an exit handler itself (the ones registered after it have run;
    running them again from inside would start over with this one)."""
    if run_exit_handlers:
        # What interpreter shutdown does before the exit handlers (threading's exit hooks): tell process pools'
        # workers to stop. Without it multiprocessing's exit handler joins a live pool's workers forever (seen:
        # a training run's reward pool hung its exit after the summary).
        pools = sys.modules.get("concurrent.futures.process")
        if pools is not None:
            pools._python_exit()
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to flush
            pass
    os._exit(code)
