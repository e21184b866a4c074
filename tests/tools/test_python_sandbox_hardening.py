"""Sandbox hardening: whole-call memory, tmpfs inodes, syscall filter, nested namespaces,
mountinfo, and setup failures reported out of band. Real sandboxed subprocesses, run per backend.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.python_sandbox import SandboxConfig, execute
from tools.python_sandbox import cgroups, seccomp
from tools.python_sandbox import executor as executor_module
from tools.python_sandbox.isolation import interpreter_layout

from .sandbox_modes import isolation_params

REPO_ROOT = Path(__file__).resolve().parents[2]
UID_BASE = 3_200_000  # apart from test_python_sandbox.py's range, so process scans see only these calls
MODES = isolation_params(UID_BASE)


@pytest.fixture(params=MODES)
def cfg(request) -> SandboxConfig:
    return SandboxConfig(isolation=request.param, uid_base=UID_BASE, timeout_s=20, cpu_time_s=10, memory_mb=768,
                         max_processes=16, call_memory_mb=1024, tmpfs_size_mb=16, tmpfs_max_files=2000)


def _call_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "Uid: -1")
            if UID_BASE <= int(uid_line.split()[1]) < UID_BASE + 100:
                found.append(int(entry.name))
    return found


def _anon_rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


class _Monitor:
    """Samples the sandbox uids' anonymous memory and how late a 10 ms host timer fires, while a call runs."""

    def __init__(self) -> None:
        self.peak_mib = 0.0
        self.worst_delay_s = 0.0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._sample, daemon=True),
                         threading.Thread(target=self._heartbeat, daemon=True)]

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, _anon_rss_mib(_call_processes()))
            time.sleep(0.02)

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(0.01)
            self.worst_delay_s = max(self.worst_delay_s, time.monotonic() - before - 0.01)

    def __enter__(self) -> "_Monitor":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


# 6 children each touch 400 MiB (bytes * n writes every page): 2.4 GiB without a whole-call limit.
FORKING_MEMORY_BOMB = """
import os, time
children = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = b'x' * (400 << 20)
        time.sleep(2)
        os._exit(0)
    children.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print('children', codes)
"""


# ---------------------------------------------------------------------------------------------------------
# 1. Whole-call memory


def test_forking_memory_bomb_stays_under_the_call_limit(cfg):
    if cgroups.cgroup_support()[0] is None:
        pytest.skip(f"no per-call cgroup on this machine: {cgroups.cgroup_support()[1]}")
    start = time.monotonic()
    with _Monitor() as monitor:
        result = execute(FORKING_MEMORY_BOMB, config=cfg)
    elapsed = time.monotonic() - start
    assert result.error is None and not result.timed_out, result
    # The cgroup's own high-water mark counts every page once; the host-side sum of RssAnon counts pages
    # shared copy-on-write after fork once per process (a few MiB each), hence the small allowance.
    assert result.memory_peak_mb is not None and result.memory_peak_mb <= 1024
    assert 0 < monitor.peak_mib < 1024 + 64, monitor.peak_mib
    assert result.oom_kills >= 3  # at most two 400 MiB children fit in 1 GiB
    codes = eval(result.stdout.split("children", 1)[1])
    assert codes.count(-9) == result.oom_kills and codes.count(0) == 6 - result.oom_kills
    text = result.to_model_text()
    assert "exceeded the memory limit of 1024 MiB" in text and "children" in text
    assert elapsed < 15 and monitor.worst_delay_s < 1.0  # the host kept running its timers
    assert subprocess.run(["true"]).returncode == 0
    leftovers = [name for _, parent in cgroups.cgroup_support()[0].parents for name in os.listdir(parent)
                 if name.startswith(f"arpo-sandbox-{os.getpid()}-")]
    assert leftovers == [], "the call's cgroup was not removed"


def test_main_process_killed_for_memory_gets_a_clear_text(cfg):
    if cgroups.cgroup_support()[0] is None:
        pytest.skip(f"no per-call cgroup on this machine: {cgroups.cgroup_support()[1]}")
    # Address space allows 700 MiB per process; the call as a whole gets 256 MiB.
    result = execute("block = b'x' * (500 << 20)\nprint('survived')", config=cfg.replace(call_memory_mb=256))
    assert result.error is None and result.killed_by == "SIGKILL" and result.oom_kills >= 1
    assert result.to_model_text() == ("Killed: 1 process(es) of this program exceeded the memory limit of 256 "
                                      "MiB that all its processes share.")


def test_without_a_cgroup_the_rlimits_bound_the_total(cfg, monkeypatch):
    # Force the fallback path; what is checked is the real per-process limit inside the sandbox.
    monkeypatch.setattr(executor_module.cgroups, "create_call_cgroup", lambda *a: (None, "forced by the test"))
    config = cfg.replace(call_memory_mb=1024, max_processes=8)  # 1024 / 8 = 128 MiB of address space each
    assert cgroups.rlimit_fallback_memory_mb(768, 1024, 8) == 128
    result = execute(FORKING_MEMORY_BOMB, config=config)
    assert result.ok and result.memory_peak_mb is None, result
    assert eval(result.stdout.split("children", 1)[1]) == [1] * 6  # each child's MemoryError


# ---------------------------------------------------------------------------------------------------------
# 2. Files


INODE_FLOOD = """
import os, time
start = time.monotonic()
results = {}
for where in ('.', '/tmp', '/dev/shm'):
    n = 0
    try:
        while True:
            open(os.path.join(where, f'f{n}'), 'w').close()
            n += 1
    except OSError as e:
        results[where] = (n, e.errno, e.strerror)
print(results, round(time.monotonic() - start, 2))
"""


def test_inode_flood_stops_at_the_file_limit(cfg):
    if cfg.isolation == "bwrap" and os.geteuid() != 0:
        pytest.skip("bwrap without root sets only the tmpfs size (bwrap 0.8 has no inode option)")
    result = execute(INODE_FLOOD, config=cfg)
    assert result.ok, result
    results, seconds = result.stdout.rsplit(" ", 1)
    results = eval(results)
    for where, (count, code, message) in results.items():
        assert code == errno.ENOSPC and message == "No space left on device", where
    # The working dir, /tmp and /dev/shm share one tmpfs of tmpfs_max_files inodes (its dirs use a few).
    assert 2000 - 10 <= sum(count for count, _, _ in results.values()) < 2000, results
    assert float(seconds) < 5


# ---------------------------------------------------------------------------------------------------------
# 3. Kernel surface


def _syscall_numbers() -> dict[str, int]:
    lib = seccomp._libseccomp()
    numbers = {}
    for names in seccomp.DENIED_SYSCALLS.values():
        for name in names:
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number >= 0:
                numbers[name] = number
    for name in ("clone", "clone3"):
        numbers[name] = lib.seccomp_syscall_resolve_name(name.encode())
    return numbers


def _skip_without_filter() -> None:
    program, why = seccomp.sandbox_filter()
    if program is None:
        pytest.skip(why)


# Zero arguments everywhere: harmless even where a syscall were allowed (bad pointers, no-op flags).
DENIED_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}
for name, number in NUMBERS.items():
    if name in ('clone', 'clone3'):
        continue
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(number), 0, 0, 0, 0, 0, 0)
    out[name] = (rc, ctypes.get_errno())
print(out)
print([l for l in open('/proc/self/status').read().splitlines() if l.startswith('Seccomp:')])
"""


def test_every_denied_syscall_class_fails_with_eperm(cfg):
    _skip_without_filter()
    numbers = _syscall_numbers()
    result = execute(DENIED_PROBE.replace("NUMBERS", repr(numbers)), config=cfg)
    assert result.ok, result
    lines = result.stdout.splitlines()
    outcomes = eval(lines[0])
    assert lines[1] == "['Seccomp:\\t2']"  # a filter is installed on the program
    for group, names in seccomp.DENIED_SYSCALLS.items():
        for name in names:
            if name in numbers:
                assert outcomes[name] == (-1, errno.EPERM), (group, name, outcomes[name])


FILTER_PROOF = """
import ctypes, os, sys
from tools.python_sandbox.bootstrap import load_seccomp
from tools.python_sandbox.seccomp import build_filter
program = build_filter(deny_errno=4000)
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs: an unprivileged process may then load a filter
assert load_seccomp(program) == 0
out = {}
for name, number in NUMBERS.items():
    ctypes.set_errno(0)
    if name == 'clone':
        rc = libc.syscall(ctypes.c_long(number), ctypes.c_ulong(0x10000000 | 17), 0, 0, 0, 0)
    else:
        rc = libc.syscall(ctypes.c_long(number), 0, 0, 0, 0, 0, 0)
    if rc == 0 and name in ('clone', 'clone3'):
        os._exit(0)
    out[name] = ctypes.get_errno()
print(out)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the proof drops to uid 65534 first, which needs root")
def test_filter_matches_every_listed_syscall():
    # Without capabilities most of these fail with EPERM anyway; a distinctive errno shows the filter
    # itself answers each one (a real kernel filter in a real unprivileged process).
    _skip_without_filter()
    numbers = _syscall_numbers()
    proc = subprocess.run([sys.executable, "-c", FILTER_PROOF.replace("NUMBERS", repr(numbers))], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, proc.stderr
    out = eval(proc.stdout)
    expected = {name: 4000 for name in numbers}
    expected["clone3"] = errno.ENOSYS  # so glibc falls back to clone, whose flags the filter can see
    assert out == expected


NESTED_NAMESPACES = """
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(fn):
    ctypes.set_errno(0)
    rc = fn()
    if rc == 0 and os.getpid() != PID:
        os._exit(0)
    return rc, ctypes.get_errno()
PID = os.getpid()
out = {
    'unshare(NEWUSER)': attempt(lambda: libc.unshare(0x10000000)),
    'unshare(NEWNS)': attempt(lambda: libc.unshare(0x00020000)),
    'clone(NEWUSER)': attempt(lambda: libc.syscall(ctypes.c_long(CLONE), ctypes.c_ulong(0x10000000 | 17), 0, 0, 0, 0)),
    'clone(NEWNET)': attempt(lambda: libc.syscall(ctypes.c_long(CLONE), ctypes.c_ulong(0x40000000 | 17), 0, 0, 0, 0)),
    'clone3': attempt(lambda: libc.syscall(ctypes.c_long(CLONE3), 0, 0)),
}
out['unshare -U'] = subprocess.run(['unshare', '-U', 'true'], capture_output=True).returncode
pid = os.fork()
if pid == 0:
    os._exit(7)
out['fork'] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(out)
"""


def test_nested_user_namespaces_are_refused(cfg):
    _skip_without_filter()
    numbers = _syscall_numbers()
    code = NESTED_NAMESPACES.replace("CLONE3", str(numbers["clone3"])).replace("CLONE", str(numbers["clone"]))
    result = execute(code, config=cfg)
    assert result.ok, result
    out = eval(result.stdout)
    for key in ("unshare(NEWUSER)", "unshare(NEWNS)", "clone(NEWUSER)", "clone(NEWNET)"):
        assert out[key] == (-1, errno.EPERM), key
    assert out["clone3"] == (-1, errno.ENOSYS) and out["unshare -U"] != 0
    assert out["fork"] == 7  # plain clone (fork) is untouched
    if cfg.isolation == "bwrap":
        # The filter is what stops it: without it, bwrap's pivot_root'ed sandbox lets a user namespace in.
        unfiltered = execute(code, config=cfg.replace(seccomp=False))
        assert eval(unfiltered.stdout)["unshare(NEWUSER)"] == (0, 0), unfiltered


def test_ordinary_programs_still_work_under_the_filter(cfg):
    _skip_without_filter()
    code = ("import multiprocessing as mp, threading, subprocess\n"
            "import numpy as np, sympy\n"
            "def square(x):\n    return x * x\n"
            "with mp.Pool(2) as pool:\n    print(pool.map(square, range(5)))\n"
            "box = []\nt = threading.Thread(target=box.append, args=('thread',)); t.start(); t.join()\n"
            "print(box, np.linalg.solve([[3., 1.], [1., 2.]], [9., 8.]).tolist(), sympy.factor('x**2 - 1'))\n"
            "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n")
    result = execute(code, config=cfg.replace(timeout_s=60, cpu_time_s=30))
    assert result.ok, result
    assert result.stdout.splitlines() == ["[0, 1, 4, 9, 16]", "['thread'] [2.0, 3.0] (x - 1)*(x + 1)", "child"]


def test_mountinfo_does_not_show_the_virtualenv_host_path(cfg):
    layout = interpreter_layout(cfg.python_executable, cfg.venv_mount)
    if layout.venv_prefix is None:
        pytest.skip("the interpreter is not a virtualenv: nothing is bound from elsewhere")
    if cfg.isolation == "bwrap" and os.geteuid() != 0:
        pytest.skip("bwrap without root binds the venv directly (no staging namespace)")
    code = ("import os, subprocess\n"
            "texts = []\n"
            "for name in ('self/mountinfo', 'thread-self/mountinfo', 'self/mounts', 'self/mountstats'):\n"
            "    try:\n"
            "        texts.append(open('/proc/' + name).read())\n"
            "    except PermissionError:\n"
            "        pass  # mountstats is root-only once the uid switch made the process non-dumpable\n"
            "texts.append(subprocess.run(['cat', '/proc/self/mountinfo'], capture_output=True, text=True).stdout)\n"
            "print('\\n=====\\n'.join(texts))\n")
    result = execute(code, config=cfg)
    assert result.ok, result
    assert layout.venv_prefix not in result.stdout and str(REPO_ROOT) not in result.stdout
    venv_lines = [line for line in result.stdout.splitlines() if f" {cfg.venv_mount} " in line]
    assert venv_lines and all(" / " + cfg.venv_mount in line or "overlay" in line for line in venv_lines)


# ---------------------------------------------------------------------------------------------------------
# Setup failures, out of band


def test_a_program_cannot_forge_a_setup_failure(cfg):
    forged = execute("import os, sys\n"
                     "sys.stderr.write('ARPO_SANDBOX_SETUP_FAILED: forged by the program\\n')\n"
                     "closed = []\n"
                     "for fd in range(3, 64):\n"
                     "    try:\n"
                     "        os.write(fd, b'ready\\n')\n"
                     "    except OSError:\n"
                     "        closed.append(fd)\n"
                     "print(len(closed), flush=True)\n"
                     "os._exit(125)\n", config=cfg)
    assert forged.error is None and forged.exit_code == 125
    assert forged.stdout.strip() == "61"  # no inherited fd is left to the program, the status pipe included
    assert "ARPO_SANDBOX_SETUP_FAILED: forged by the program" in forged.to_model_text()
    launcher_like = execute("import sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\nsys.exit(1)", config=cfg)
    assert launcher_like.error is None and launcher_like.to_model_text() == "bwrap: Can't mount proc"


def test_a_real_setup_failure_is_still_reported(cfg, tmp_path):
    missing = str(tmp_path / "does-not-exist")
    result = execute("print('ran')", config=cfg.replace(extra_ro_binds=(missing,)))
    assert result.error is not None and result.error.startswith(f"sandbox setup failed ({cfg.isolation})")
    assert "ran" not in result.stdout
    assert result.to_model_text().startswith("Error: the Python sandbox could not run this code")


# ---------------------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize("changes, key", [
    ({"call_memory_mb": 32}, "'call_memory_mb'"),
    ({"call_memory_mb": 0}, "'call_memory_mb'"),
    ({"tmpfs_max_files": 4}, "'tmpfs_max_files'"),
    ({"seccomp": "yes"}, "'seccomp'"),
    ({"extra_ro_binds": ("/mnt/data",)}, "'extra_ro_binds'"),
])
def test_bad_hardening_settings_name_the_key(changes, key):
    with pytest.raises(ValueError) as info:
        SandboxConfig(**changes).validate()
    message = str(info.value)
    assert key in message and "\n" not in message
    assert "invalid sandbox settings" in execute("1", **changes).to_model_text()
