"""arpo.runtime.fast_exit.exit_now: a process ends at once, its exit handlers run, and a live process pool does not hang it
(multiprocessing's exit handler joins the pool's workers, which stop only once told to)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def test_exit_now_with_a_live_process_pool_ends_promptly_and_runs_the_exit_handlers(tmp_path):
    marker = tmp_path / "handler-ran"
    script = textwrap.dedent(f"""
        import atexit, multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        from arpo.runtime.fast_exit import exit_now

        if __name__ == "__main__":
            pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
            assert pool.submit(abs, -3).result() == 3  # workers started and idle, the pool never shut down
            atexit.register(lambda: open({str(marker)!r}, "w").close())
            keep = pool  # still referenced: nothing but the exit path can stop its workers
            exit_now(7)
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 7, r.stderr[-2000:]
    assert marker.exists()
