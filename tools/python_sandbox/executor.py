"""Run one program in a fresh sandboxed interpreter; every failure comes back as a ``SandboxResult``."""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Any

from tools.python_sandbox import cgroups, isolation, seccomp
from tools.python_sandbox.bootstrap import READY, SETUP_FAILED
from tools.python_sandbox.config import SandboxConfig
from tools.python_sandbox.result import SandboxResult

logger = logging.getLogger(__name__)

# The environment of bwrap / unshare themselves (the program's own environment is built from scratch).
_LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
# after SIGKILL, how long the launcher may take to be reaped: seconds on a loaded machine (namespace teardown)
_KILL_GRACE_S = 30.0
_UIDS_PER_PROCESS = 100


class _UidSlots:
    """Hands each concurrent call its own unprivileged uid.

    RLIMIT_NPROC counts all processes of a uid system-wide, so a fork bomb must not eat the process budget
    of the calls running beside it: each running call gets a uid no other running call uses.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()

    def acquire(self) -> int:
        with self._lock:
            index = 0
            while index in self._busy:
                index += 1
            self._busy.add(index)
            return index

    def release(self, index: int) -> None:
        with self._lock:
            self._busy.discard(index)


_SLOTS = _UidSlots()


def sandbox_uid(config: SandboxConfig, slot: int) -> int | None:
    """The uid a call drops to, or None when we are not root (then the kernel keeps our own uid)."""
    if os.geteuid() != 0:
        return None
    base = config.uid_base if config.uid_base is not None else 200_000 + (os.getpid() % 10_000) * _UIDS_PER_PROCESS
    return base + slot


# ------------------------------------------------------------------------------------------------------------
# Choosing the isolation mechanism (probed once per interpreter and mode; the answer is cached).

_probe_lock = threading.Lock()
_probe_cache: dict[tuple, tuple[str | None, str, float]] = {}
# A failed probe (fail closed) is retried after this long: a transient failure under load must not disable
# the tool for the rest of a training run. A working mechanism is cached for good.
_FAILED_PROBE_TTL_S = 60.0
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _probe(mode: str, config: SandboxConfig) -> str | None:
    """Run ``print(6 * 7)`` in ``mode``; return None when it works, else why not."""
    if mode != "none" and not isolation.tool_available(mode):
        return f"'{'bwrap' if mode == 'bwrap' else 'unshare and setpriv (util-linux)'}' is not installed"
    probe_config = config.replace(timeout_s=max(30.0, config.timeout_s), cpu_time_s=max(10.0, config.cpu_time_s),
                                  memory_mb=max(512, config.memory_mb))
    result = _run_in(mode, "print(6 * 7)", probe_config)
    if result.stdout.strip() == "42" and result.exit_code == 0:
        return None
    detail = result.error or result.stderr.strip() or f"exit status {result.exit_code}"
    return detail[-500:]


def resolve_isolation(config: SandboxConfig) -> tuple[str | None, str]:
    """(mode, note): the mechanism to use, or (None, why everything failed) — the caller then fails closed."""
    key = (config.isolation, config.allow_unsandboxed, config.python_executable, config.venv_mount,
           os.geteuid())
    with _probe_lock:
        cached = _probe_cache.get(key)
        if cached is not None and (cached[0] is not None or time.monotonic() - cached[2] < _FAILED_PROBE_TTL_S):
            return cached[0], cached[1]
        candidates = ["bwrap", "unshare"] if config.isolation == "auto" else [config.isolation]
        reasons = []
        chosen = None
        for mode in candidates:
            if mode == "none":
                chosen = "none"
                break
            why = _probe(mode, config)
            if why is None:
                chosen = mode
                break
            reasons.append(f"{mode}: {why}")
        note = "; ".join(reasons)
        if chosen is None and config.isolation == "auto" and config.allow_unsandboxed:
            chosen = "none"
        if chosen == "unshare" and reasons:
            _warn_once("unshare", f"python sandbox: bubblewrap unusable ({note}); using the unshare+chroot fallback")
        if chosen == "none":
            _warn_once("none", "python sandbox: RUNNING UNTRUSTED CODE WITHOUT NAMESPACES (no network, "
                               "filesystem or PID isolation; only rlimits, a temp dir, a scrubbed env and a uid "
                               f"switch when root). {note}".strip())
        if chosen is None:
            _warn_once("closed", f"python sandbox: no isolation mechanism works ({note}); every call fails "
                                 "closed. Install bubblewrap, or set allow_unsandboxed: true to accept the risk.")
        _probe_cache[key] = (chosen, note, time.monotonic())
        return chosen, note


# ------------------------------------------------------------------------------------------------------------
# Running one program.


def _kill_group(proc: subprocess.Popen) -> None:
    # The launcher leads its own session; killing it makes the namespace's init die (PDEATHSIG / --kill-child),
    # and the kernel then kills everything left in the PID namespace.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _decode(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", "replace")


def _launch_config(config: SandboxConfig) -> tuple[SandboxConfig, cgroups.CallCgroup | None]:
    """The call's cgroup, or without one the rlimit bound: max_processes × memory_mb ≤ call_memory_mb."""
    cgroup, why = cgroups.create_call_cgroup(config.call_memory_mb, config.max_processes)
    if cgroup is not None:
        return config, cgroup
    per_process = cgroups.rlimit_fallback_memory_mb(config.memory_mb, config.call_memory_mb, config.max_processes)
    _warn_once("cgroup", f"python sandbox: no per-call cgroup ({why}); bounding a call's memory by rlimits "
                         f"instead: {config.max_processes} processes x {per_process} MiB each <= call_memory_mb "
                         f"{config.call_memory_mb} (numpy + sympy need ~192 MiB per process: lower "
                         "max_processes or raise call_memory_mb if imports fail)")
    return config.replace(memory_mb=per_process), None


def _read_status(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _run_in(mode: str, code: str, config: SandboxConfig) -> SandboxResult:
    result = SandboxResult(isolation=mode, timeout_s=config.timeout_s, cpu_time_s=config.cpu_time_s,
                           max_output_chars=config.max_output_chars, call_memory_mb=config.call_memory_mb)
    slot = _SLOTS.acquire()
    host_workdir = None
    cgroup = None
    owned_fds: list[int] = []
    status_r = None
    status = b""
    start = time.monotonic()
    try:
        uid = sandbox_uid(config, slot)
        program = None
        if config.seccomp:
            program, why = seccomp.sandbox_filter()
            if program is None:
                result.error = why
                return result
        config, cgroup = _launch_config(config)
        status_r, status_w = os.pipe()
        owned_fds.append(status_w)
        seccomp_fd = seccomp.filter_memfd(program) if (mode == "bwrap" and program) else None
        if seccomp_fd is not None:
            owned_fds.append(seccomp_fd)
        fds = isolation.LaunchFds(status_w, seccomp_fd, program if mode != "bwrap" else None,
                                  tuple(cgroup.procs_files) if cgroup else ())
        if mode == "none":
            host_workdir = tempfile.mkdtemp(prefix="arpo-sandbox-")
            if uid is not None:
                os.chown(host_workdir, uid, uid)
            os.chmod(host_workdir, 0o700)
            cmd = isolation.unsandboxed_command(config, uid, host_workdir, fds)
            env = dict(isolation.sandbox_env(config), HOME=host_workdir, TMPDIR=host_workdir)
        else:
            cmd = isolation.command_for(mode, config, uid, fds)
            env = dict(_LAUNCHER_ENV)
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode("utf-8", "replace"))
            code_file.seek(0)
            proc = subprocess.Popen(cmd, stdin=code_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, cwd=host_workdir or "/", start_new_session=True, close_fds=True,
                                    pass_fds=fds.pass_fds)
        while owned_fds:  # the launcher has its copies; ours would keep the status pipe from reaching EOF
            os.close(owned_fds.pop())
        try:
            _collect(proc, config, start, result)
        finally:
            if proc.returncode is None:  # never signal a pid that was already reaped (it may be reused)
                _kill_group(proc)
            try:
                proc.wait(timeout=_KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.error("python sandbox: launcher pid %d did not exit after SIGKILL", proc.pid)
            for stream in (proc.stdout, proc.stderr):
                stream.close()
        status = _read_status(status_r)
    except Exception as exc:  # noqa: BLE001 — never raise into the rollout
        logger.exception("python sandbox: call failed")
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        _SLOTS.release(slot)
        for fd in owned_fds + ([status_r] if status_r is not None else []):
            os.close(fd)
        if cgroup is not None:
            result.oom_kills = cgroup.oom_kills()
            peak = cgroup.peak_bytes()
            result.memory_peak_mb = None if peak is None else round(peak / (1 << 20), 1)
            cgroup.remove()
        if host_workdir is not None:
            shutil.rmtree(host_workdir, ignore_errors=True)
        result.duration_s = time.monotonic() - start
    _classify_setup_failure(result, mode, status)
    return result


def _collect(proc: subprocess.Popen, config: SandboxConfig, start: float, result: SandboxResult) -> None:
    """Read both pipes until EOF, the deadline, or the capture cap; fill ``result``."""
    cap = int(config.max_capture_bytes)
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    deadline = start + config.timeout_s
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                result.timed_out = True
                break
            for key, _ in selector.select(timeout=min(remaining, 1.0)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = cap - len(buffer)
                buffer += data[:max(room, 0)]
                if len(data) > room:
                    result.truncated = result.output_limit_exceeded = True
            if result.output_limit_exceeded:
                break
    if not (result.timed_out or result.output_limit_exceeded):
        # Both pipes closed, but a program may close its stdout/stderr and keep running: the deadline holds.
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            result.timed_out = True
    if proc.returncode is None:
        _kill_group(proc)
    result.exit_code = proc.wait(timeout=_KILL_GRACE_S)
    result.stdout = _decode(buffers[proc.stdout.fileno()])
    result.stderr = _decode(buffers[proc.stderr.fileno()])
    if len(result.stdout) > config.max_output_chars or len(result.stderr) > config.max_output_chars:
        result.truncated = True


def _classify_setup_failure(result: SandboxResult, mode: str, status: bytes) -> None:
    """Tell the sandbox's own failures (bad mount, missing uid switch) from the program's errors.

    The verdict comes from the status pipe, which user code never holds: no ``ready`` there means the
    call ended before user code ran. Whatever the program prints on stderr cannot forge it.
    """
    if result.error is not None or result.timed_out or status.startswith(READY):
        return
    reported = _decode(status).strip()
    detail = reported[len(SETUP_FAILED) + 2:] if reported.startswith(SETUP_FAILED) else reported
    lines = result.stderr.strip().splitlines()
    result.error = f"sandbox setup failed ({mode}): {detail or ' '.join(lines[-3:]) or 'no ready signal'}"


def execute(code: str, *, timeout_s: float | None = None, cpu_time_s: float | None = None,
            memory_mb: int | None = None, max_processes: int | None = None,
            max_file_size_mb: int | None = None, max_output_chars: int | None = None,
            config: SandboxConfig | None = None, **overrides: Any) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter and return what happened. Never raises.

    Keyword limits override ``config`` (default ``SandboxConfig()``); other ``SandboxConfig`` fields may be
    passed as keywords too. See README.md in this folder for exactly what is enforced.
    """
    try:
        config = (config or SandboxConfig()).replace(
            timeout_s=timeout_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb, max_processes=max_processes,
            max_file_size_mb=max_file_size_mb, max_output_chars=max_output_chars, **overrides)
    except (ValueError, TypeError) as exc:
        return SandboxResult(error=f"invalid sandbox settings: {exc}")
    if not isinstance(code, str):
        return SandboxResult(error=f"code must be a string, got {type(code).__name__}",
                             max_output_chars=config.max_output_chars)
    try:
        mode, note = resolve_isolation(config)
    except Exception as exc:  # noqa: BLE001
        logger.exception("python sandbox: probing the isolation mechanism failed")
        mode, note = None, f"{type(exc).__name__}: {exc}"
    if mode is None:
        return SandboxResult(error=f"no sandbox mechanism is available, refusing to run untrusted code ({note})",
                             max_output_chars=config.max_output_chars, timeout_s=config.timeout_s)
    return _run_in(mode, code, config)
