"""Resident memory of a training rank: reading it (benchmarks, logs) and giving freed memory back to the OS.

On CPU every tensor is a malloc. glibc serves blocks above its mmap threshold with their own mappings, but
that threshold starts at 128 KiB and rises to the size of each such block freed, up to 32 MiB; after one
forward/backward nearly all activations come from the heap, which only shrinks from its top. A rank's RSS
then ratchets up with fragmentation: SmolLM2-135M on 2 ranks peaked at 3.5 GB per rank for micro-batches
of one row and 5.8 GB for 16 rows, for ~2.6 and ~2.9 GB of live memory.

:func:`configure_allocator` (once, at start-up) fixes the threshold at 4 MiB, so activation-sized blocks
are mapped and unmapped on free and RSS follows live memory (measured: 2.6 and 2.9 GB peaks for the
runs above). Each such block is then page-faulted afresh; :data:`ALLOCATOR_ENV` asks glibc for
transparent huge pages on them (one fault per 2 MiB), which kept the cost to 0-10% of the update's time
(1 to 16 rows; about twice that without). The smaller blocks come from the heap, which glibc trimmed back to the
OS whenever its free top passed 128 KiB, so each micro-batch faulted those pages in again too: once the model is
loaded, :func:`keep_heap_top` keeps :data:`TOP_PAD` free at the heap's top (16M page faults → 7.5M and the update
6-13% faster on one rank of 2 threads, 4.5% on two ranks of one, for ~0.3 GB a rank:
experiments/results/trainer_speed/). :func:`release_memory` after each big phase (``gc.collect`` for reference
cycles, then ``malloc_trim(0)``) returns what the heap still holds. All of it is a no-op where glibc is absent
(musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re
import sys
import time
from functools import lru_cache
from pathlib import Path

_STATUS = Path("/proc/self/status")
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # mallopt parameter numbers (malloc.h)
#: Blocks at least this large get their own mapping, returned to the OS when freed.
MMAP_THRESHOLD = 4 * 1024 * 1024
#: Free memory the heap keeps at its top when it shrinks (and adds when it grows), for the next micro-batch.
TOP_PAD = 1024 * 1024 * 1024
#: Environment for a training process, read by glibc at process start: THP for malloc's mappings.
ALLOCATOR_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only: probe the symbol once
    except (OSError, AttributeError):
        return None
    return libc


def configure_allocator(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (see the module docstring); True when it was set."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)))


def keep_heap_top(pad: int = TOP_PAD) -> bool:
    """From now on the heap keeps ``pad`` bytes free at its top instead of trimming them (see the module
    docstring); True when it was set. After the model's load, whose one pass gains nothing from it."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(_M_TOP_PAD, int(pad)))


def allocator_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """:data:`ALLOCATOR_ENV` merged into ``environ``'s own ``GLIBC_TUNABLES`` (a user's tunables stay)."""
    current = (environ if environ is not None else os.environ).get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in current:
        return {"GLIBC_TUNABLES": current}
    return {"GLIBC_TUNABLES": ":".join(t for t in (current, ALLOCATOR_ENV["GLIBC_TUNABLES"]) if t)}


def release_memory(full: bool = False) -> bool:
    """Collect garbage, return the CUDA caching allocator's free blocks to the driver (where this process has
    used CUDA: the next phase, or the engine sharing the GPU, gets them) and hand free heap pages back to the OS;
    True when ``malloc_trim`` ran.

    Only the young generations by default: a full collection walks every object torch and transformers
    ever made (0.2 s per call here), while what one phase leaves in reference cycles is young."""
    gc.collect() if full else gc.collect(1)
    empty_cuda_cache()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def empty_cuda_cache() -> bool:
    """``torch.cuda.empty_cache()`` where this process has initialised CUDA; True when it ran. Never initialises
    CUDA itself (nor imports torch), so on CPU it does nothing."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    torch.cuda.empty_cache()
    return True


def _status_kb(field: str) -> float | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+)\s+kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return float(match.group(1)) if match else None


def memory_stats(reset_peak: bool = False) -> dict[str, float]:
    """``rss_mb`` (now) and ``peak_rss_mb`` (since start or the last reset) of this process, in MiB, and its
    CPU seconds so far (``cpu_s``: what a phase costs on a machine shared with other jobs, where wall time
    measures the neighbours).

    Linux reports the peak as VmHWM; ``reset_peak`` sets it back to the current RSS (``/proc/self/clear_refs``)
    so a caller can measure one phase. Elsewhere the peak is ``ru_maxrss`` (never reset)."""
    rss, peak = _status_kb("VmRSS"), _status_kb("VmHWM")
    if peak is None:
        import resource

        peak = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    out = {"rss_mb": (rss or 0.0) / 1024, "peak_rss_mb": peak / 1024, "cpu_s": time.process_time()}
    if reset_peak:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
    return out
