"""Reading a rank's memory and handing freed heap memory back to the OS (arpo/trainer/memory.py)."""

from __future__ import annotations

import mmap
import platform

import pytest

from arpo.trainer.memory import _libc, allocator_env, memory_stats, release_memory

MIB = 1024 * 1024


def test_memory_stats_peak_follows_an_allocation_and_resets():
    before = memory_stats(reset_peak=True)
    # A fresh anonymous mapping, written through: malloc could hand back pages an earlier test freed but
    # left resident, and then RSS would not move.
    block = mmap.mmap(-1, 64 * MIB)
    block.write(b"\1" * (64 * MIB))
    during = memory_stats()
    block.close()
    after = memory_stats(reset_peak=True)
    assert during["rss_mb"] >= before["rss_mb"] + 60
    assert after["peak_rss_mb"] >= during["rss_mb"] - 1
    assert after["cpu_s"] >= before["cpu_s"] > 0
    if platform.system() == "Linux":  # VmHWM is resettable there
        assert memory_stats()["peak_rss_mb"] < during["rss_mb"] - 30


@pytest.mark.skipif(_libc() is None, reason="malloc_trim is glibc's")
def test_release_memory_returns_fragmented_heap_to_the_os():
    # Many small blocks come from the heap, not from mmap; one survivor allocated after them keeps the
    # heap's top in use, so free() alone cannot shrink it and the pages stay resident.
    blocks = [bytearray(4000) for _ in range(40_000)]  # ~160 MiB
    survivor = bytearray(4000)
    grown = memory_stats()["rss_mb"]
    del blocks
    kept = memory_stats()["rss_mb"]
    assert release_memory() is True
    released = memory_stats()["rss_mb"]
    assert survivor is not None
    # Without the trim the freed blocks stay resident; with it most of their 160 MiB goes back.
    assert kept > grown - 80
    assert released < kept - 80


ALLOCATOR_SCRIPT = r"""
import sys
from arpo.trainer.memory import configure_allocator, memory_stats
if sys.argv[1] == "fixed":
    assert configure_allocator()
# Warm glibc up as a forward pass would: freeing a 24 MiB mapping raises its threshold to 24 MiB ...
warm = bytearray(24 << 20)
del warm
base = memory_stats()["rss_mb"]
# ... so these 8 MiB blocks come from the heap; one small block after them pins the heap's top.
blocks = [bytearray(8 << 20) for _ in range(16)]
pin = bytearray(1000)
del blocks
print(round(memory_stats()["rss_mb"] - base))
"""


def _mib_kept(script: str, mode: str) -> int:
    """The MiB ``script`` prints, run in a process of its own (malloc's settings are process-wide)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=root, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(_libc() is None, reason="mallopt is glibc's")
def test_fixed_mmap_threshold_returns_freed_blocks_at_once(tmp_path):
    kept = {mode: _mib_kept(ALLOCATOR_SCRIPT, mode) for mode in ("glibc_default", "fixed")}
    assert kept["glibc_default"] > 100  # 128 MiB freed, still resident
    assert kept["fixed"] < 20  # unmapped when freed


KEEP_SCRIPT = r"""
import sys
from arpo.trainer.memory import configure_allocator, keep_heap_top, memory_stats
assert configure_allocator()
if sys.argv[1] == "keep":
    assert keep_heap_top()
base = memory_stats()["rss_mb"]
# 64 MiB in 2 MiB blocks: under the 4 MiB threshold, so from the heap, whose top they are once freed
blocks = [bytearray(2 << 20) for _ in range(32)]
del blocks
print(round(memory_stats()["rss_mb"] - base))
"""


@pytest.mark.skipif(_libc() is None, reason="mallopt is glibc's")
def test_keep_heap_top_keeps_freed_activations_resident_for_the_next_micro_batch():
    """Without the pad glibc trims the freed top at once, and the next micro-batch faults the pages in again."""
    kept = {mode: _mib_kept(KEEP_SCRIPT, mode) for mode in ("trim", "keep")}
    assert kept["trim"] < 16  # back to the OS
    assert kept["keep"] > 56  # still the heap's


def test_allocator_env_adds_huge_pages_and_keeps_a_users_tunables():
    assert allocator_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert allocator_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}


def test_release_memory_empties_the_cuda_cache_only_where_cuda_was_initialised(monkeypatch):
    import torch

    from arpo.trainer.memory import empty_cuda_cache

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    if not torch.cuda.is_initialized():  # a CPU process: nothing to free, and CUDA is never initialised for it
        assert empty_cuda_cache() is False and calls == []
        release_memory()
        assert calls == [] and not torch.cuda.is_initialized()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as after a GPU phase
    release_memory()
    assert calls == [1]
