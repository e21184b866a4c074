"""A memory + pids cgroup per sandboxed call, so the limit holds for the whole call, not per process.

RLIMIT_AS is per process: a program that forks children can use ``max_processes × memory_mb``. A cgroup
made for one call (its launcher joins it before anything of the call runs) bounds everything the call
creates together: process memory, the files it writes to its tmpfs, and kernel memory such as inodes.

cgroup v2 is used where our own cgroup delegates the ``memory`` and ``pids`` controllers to children (its
``cgroup.subtree_control`` has them, or we may enable them); otherwise cgroup v1, where the ``memory`` and
``pids`` hierarchies are mounted and our cgroup in them is writable (root on this kind of VM). When neither
works the executor bounds the total by rlimits instead (see ``rlimit_fallback_memory_mb``).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_PREFIX = "arpo-sandbox-"
# The launcher's own processes (bwrap outside, its init inside; the unshare backend's init) share the cgroup.
LAUNCHER_PROCESSES = 4
_counter = 0
_counter_lock = threading.Lock()


@dataclass(frozen=True)
class CgroupSupport:
    """Where per-call cgroups go: ``kind`` is ``v2`` or ``v1``; ``parents`` maps controller to parent dir."""

    kind: str
    parents: tuple[tuple[str, str], ...]  # (controller, dir); v2 has one entry ("memory+pids", dir)


def _own_cgroups() -> dict[str, str]:
    """controller name (or "" for v2) -> our cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                paths[name] = path
    return paths


def _cgroup_mounts() -> tuple[str | None, dict[str, str]]:
    """(the cgroup2 mount point, {v1 controller: its mount point}) from /proc/self/mountinfo."""
    v2, v1 = None, {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options, mountpoint = fields[sep + 1], fields[sep + 3], fields[4]
            if fstype == "cgroup2" and v2 is None:
                v2 = mountpoint
            elif fstype == "cgroup":
                for option in options.split(","):
                    if option in ("memory", "pids"):
                        v1.setdefault(option, mountpoint)
    return v2, v1


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _try_v2(mount: str, own: str) -> CgroupSupport | None:
    base = os.path.join(mount, own.lstrip("/"))
    if not {"memory", "pids"} <= set(_read(os.path.join(base, "cgroup.controllers")).split()):
        return None
    control = os.path.join(base, "cgroup.subtree_control")
    if not {"memory", "pids"} <= set(_read(control).split()):
        # Allowed only where our cgroup has no processes of its own (the root cgroup, a delegated subtree).
        _write(control, "+memory +pids")
    probe = os.path.join(base, f"{_PREFIX}probe-{os.getpid()}")
    os.mkdir(probe)
    os.rmdir(probe)
    return CgroupSupport("v2", (("memory+pids", base),))


def _try_v1(mounts: dict[str, str], own: dict[str, str]) -> CgroupSupport | None:
    parents = []
    for controller in ("memory", "pids"):
        if controller not in mounts or controller not in own:
            return None
        base = os.path.join(mounts[controller], own[controller].lstrip("/"))
        probe = os.path.join(base, f"{_PREFIX}probe-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
        parents.append((controller, base))
    return CgroupSupport("v1", tuple(parents))


@functools.lru_cache(maxsize=1)
def cgroup_support() -> tuple[CgroupSupport | None, str]:
    """(where per-call cgroups can be made, or None; why not). Probed once per process."""
    reasons = []
    try:
        v2_mount, v1_mounts = _cgroup_mounts()
        own = _own_cgroups()
    except (OSError, ValueError, IndexError) as exc:
        return None, f"cannot read the cgroup layout: {exc}"
    for kind, attempt in (("v2", lambda: _try_v2(v2_mount, own[""]) if v2_mount and "" in own else None),
                          ("v1", lambda: _try_v1(v1_mounts, own))):
        try:
            support = attempt()
        except OSError as exc:
            reasons.append(f"{kind}: {exc.strerror or exc}")
            continue
        if support is not None:
            _sweep_stale(support)
            return support, ""
        reasons.append(f"{kind}: memory/pids controllers not available")
    return None, "; ".join(reasons)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (someone else's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale(support: CgroupSupport) -> None:
    # A trainer killed mid-call leaves its (empty) call cgroups behind; the owner's pid is in the name.
    for _, parent in support.parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if not name.startswith(_PREFIX):
                continue
            owner = name[len(_PREFIX):].split("-", 1)[0]
            if owner.isdigit() and not pid_alive(int(owner)):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


class CallCgroup:
    """One call's cgroup(s): join it through ``procs_files``, read what happened, ``remove()`` it."""

    def __init__(self, support: CgroupSupport, memory_bytes: int, max_pids: int):
        global _counter
        with _counter_lock:
            _counter += 1
            name = f"{_PREFIX}{os.getpid()}-{_counter}"
        self.kind = support.kind
        self.memory_bytes = memory_bytes
        self.dirs: dict[str, str] = {}
        try:
            for controller, parent in support.parents:
                path = os.path.join(parent, name)
                os.mkdir(path)
                self.dirs[controller] = path
            self._configure(memory_bytes, max_pids)
        except OSError:
            self.remove()
            raise

    def _configure(self, memory_bytes: int, max_pids: int) -> None:
        if self.kind == "v2":
            path = self.dirs["memory+pids"]
            _write(os.path.join(path, "memory.max"), str(memory_bytes))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")
            _write(os.path.join(path, "pids.max"), str(max_pids))
            return
        memory = self.dirs["memory"]
        _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
        memsw = os.path.join(memory, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # memory + swap: without it a call could push its excess into swap
            try:
                _write(memsw, str(memory_bytes))
            except OSError:
                pass
        _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_pids))

    @property
    def procs_files(self) -> list[str]:
        """The files the launcher writes its pid to (before it forks anything of the call)."""
        return [os.path.join(path, "cgroup.procs") for path in self.dirs.values()]

    def _memory_dir(self) -> str:
        return self.dirs["memory+pids" if self.kind == "v2" else "memory"]

    def peak_bytes(self) -> int | None:
        """Highest memory use of the whole call (processes, tmpfs files, kernel memory), if the kernel says."""
        name = "memory.peak" if self.kind == "v2" else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self._memory_dir(), name)))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed for exceeding the call's memory limit."""
        name = "memory.events" if self.kind == "v2" else "memory.oom_control"
        try:
            for line in _read(os.path.join(self._memory_dir(), name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def _pids(self) -> list[int]:
        pids: set[int] = set()
        for procs in self.procs_files:
            try:
                pids.update(int(p) for p in _read(procs).split())
            except (OSError, ValueError):
                pass
        return sorted(pids)

    def remove(self, timeout_s: float = 2.0) -> None:
        """Delete the cgroup; the call's processes are gone by now, stragglers are killed first."""
        deadline = time.monotonic() + timeout_s
        killed = False
        for path in list(self.dirs.values()):
            while True:
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        logger.warning("python sandbox: could not remove cgroup %s", path)
                        break
                    if not killed and time.monotonic() > deadline - timeout_s / 2:
                        # Only this call's processes are in it: killing them is safe.
                        for pid in self._pids():
                            try:
                                os.kill(pid, signal.SIGKILL)
                            except OSError:
                                pass
                        killed = True
                    time.sleep(0.01)
        self.dirs = {}


def create_call_cgroup(memory_mb: int, max_processes: int) -> tuple[CallCgroup | None, str]:
    """A fresh cgroup limited to ``memory_mb`` in total, or (None, why not)."""
    support, why = cgroup_support()
    if support is None:
        return None, why
    try:
        return CallCgroup(support, int(memory_mb) << 20, int(max_processes) + LAUNCHER_PROCESSES), ""
    except OSError as exc:
        return None, f"creating the call's cgroup failed: {exc}"


def rlimit_fallback_memory_mb(memory_mb: int, call_memory_mb: int, max_processes: int) -> int:
    """Without a cgroup, the per-process address-space limit that keeps max_processes × it ≤ call_memory_mb."""
    return max(1, min(int(memory_mb), int(call_memory_mb) // int(max_processes)))
