"""A program run under cli_main that gets SIGTERM shuts down like one that gets Ctrl-C: atexit hooks run, so child
processes it started (vLLM's engine core, Ray's cluster) do not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

PROGRAM = '''
import multiprocessing, pathlib, sys, time
from arpo.config import cli_main

def child():
    time.sleep(600)

def main():
    proc = multiprocessing.get_context("spawn").Process(target=child, daemon=True)
    proc.start()  # multiprocessing's atexit hook terminates daemonic children, as vLLM's shutdown does its engine
    pathlib.Path(sys.argv[1]).write_text(str(proc.pid))
    time.sleep(600)

if __name__ == "__main__":
    cli_main(main)
'''


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split()[2] != "Z"


def test_sigterm_runs_exit_hooks_and_takes_the_children_down(tmp_path):
    script, pid_file = tmp_path / "prog.py", tmp_path / "child.pid"
    script.write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, str(script), str(pid_file)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.time() + 120
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.2)
    child = int(pid_file.read_text())
    assert alive(child)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while alive(child) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(child), "the child outlived its parent's SIGTERM"
