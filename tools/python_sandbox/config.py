"""Limits and isolation settings of one sandboxed Python call (see README.md in this folder)."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any

ISOLATION_MODES = ("auto", "bwrap", "unshare", "none")
# Where the launcher assembles the sandbox's mounts in its private mount namespace (hidden from the host).
STAGING_DIR = "/mnt"


@dataclass(frozen=True)
class SandboxConfig:
    """Every knob of the sandbox; ``configs/tools/python.yaml`` documents each one for users.

    Sizes are in MiB, times in seconds. ``validate()`` names the offending key and the fix.
    """

    # --- limits -------------------------------------------------------------------------------
    # wall clock for the whole call, interpreter start included: a backstop for programs that block; the CPU limit
    # bounds computation, so a busy machine (slower wall clock) does not change which programs finish
    timeout_s: float = 60.0
    cpu_time_s: float = 10.0  # RLIMIT_CPU per process (soft → SIGXCPU, hard one second later → SIGKILL)
    memory_mb: int = 1024  # RLIMIT_AS per process (address space, not RSS; numpy imports within 128 MiB)
    max_processes: int = 16  # RLIMIT_NPROC: processes + threads of the sandbox uid, interpreter included
    call_memory_mb: int = 2048  # all processes + tmpfs files + kernel memory of one call together (cgroup)
    max_file_size_mb: int = 16  # RLIMIT_FSIZE: largest file the program may write
    max_open_files: int = 256  # RLIMIT_NOFILE
    tmpfs_size_mb: int = 64  # the tmpfs holding the working dir, /tmp and /dev/shm (non-root bwrap: each)
    tmpfs_max_files: int = 10000  # inodes (files + dirs) of that tmpfs (as root; bwrap 0.8 cannot set them)
    max_output_chars: int = 4096  # model text is cut to this many characters, with a visible marker
    max_capture_bytes: int = 1 << 20  # per stream; beyond it the program is stopped (huge-output guard)
    # --- isolation ----------------------------------------------------------------------------
    isolation: str = "auto"  # auto: bwrap, else unshare, else fail closed (see allow_unsandboxed)
    allow_unsandboxed: bool = False  # True: with no namespaces, run with rlimits only and warn loudly
    seccomp: bool = True  # deny syscalls a calculator never needs (fail closed if the filter cannot be built)
    python_executable: str = field(default_factory=lambda: sys.executable)
    venv_mount: str = "/opt/venv"  # where a virtualenv's prefix appears inside the sandbox
    workdir: str = "/sandbox"  # the program's private working dir (a tmpfs), also its $HOME
    uid_base: int | None = None  # first uid for dropped privileges (as root); None → derived from pid
    extra_ro_binds: tuple[str, ...] = ()  # extra host paths shown read-only at the same path
    repl_trailing_expression: bool = True  # print repr() of a trailing expression, like the REPL
    env: dict[str, str] = field(default_factory=dict)  # extra environment variables for the program

    def validate(self) -> "SandboxConfig":
        positive = ("timeout_s", "cpu_time_s", "memory_mb", "max_processes", "call_memory_mb", "max_file_size_mb",
                    "max_open_files", "tmpfs_size_mb", "tmpfs_max_files", "max_output_chars", "max_capture_bytes")
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"python sandbox config: '{key}' must be a positive number, got {value!r}")
        if self.max_processes < 2:
            raise ValueError("python sandbox config: 'max_processes' must be >= 2 (the interpreter counts as one)")
        if self.call_memory_mb < 64:
            raise ValueError(f"python sandbox config: 'call_memory_mb' must be >= 64 (one interpreter needs ~30 "
                             f"MiB; numpy + sympy ~150 MiB), got {self.call_memory_mb!r}")
        if self.tmpfs_max_files < 16:
            raise ValueError(f"python sandbox config: 'tmpfs_max_files' must be >= 16 (the interpreter writes a "
                             f"few files), got {self.tmpfs_max_files!r}")
        if not isinstance(self.seccomp, bool):
            raise ValueError(f"python sandbox config: 'seccomp' must be true or false, got {self.seccomp!r}")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"python sandbox config: 'isolation' must be one of {ISOLATION_MODES}, "
                             f"got {self.isolation!r}")
        if self.isolation == "none" and not self.allow_unsandboxed:
            raise ValueError("python sandbox config: 'isolation: none' runs untrusted code on the host without "
                             "namespaces; set 'allow_unsandboxed: true' as well to confirm")
        for key in ("venv_mount", "workdir"):
            path = getattr(self, key)
            if not path.startswith("/") or path in ("/", "/tmp", "/usr", "/proc", "/dev"):
                raise ValueError(f"python sandbox config: '{key}' must be an absolute path of its own "
                                 f"(e.g. '/sandbox'), got {path!r}")
        if not os.path.exists(self.python_executable):
            raise ValueError(f"python sandbox config: 'python_executable' {self.python_executable!r} does not "
                             f"exist; point it at an interpreter (default: the running one)")
        for path in self.extra_ro_binds:
            if not os.path.isabs(path):
                raise ValueError(f"python sandbox config: 'extra_ro_binds' entries must be absolute, got {path!r}")
            if path == STAGING_DIR or path.startswith(STAGING_DIR + "/"):
                raise ValueError(f"python sandbox config: 'extra_ro_binds' entry {path!r} is under {STAGING_DIR}, "
                                 f"which the launcher covers with its own tmpfs; bind it from another path")
        if self.uid_base is not None and not 1000 <= self.uid_base < 2**31 - 100_000:
            raise ValueError(f"python sandbox config: 'uid_base' must be in [1000, 2^31 - 100000), "
                             f"got {self.uid_base!r}")
        return self

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> "SandboxConfig":
        """Build from a YAML/dict section; unknown keys are an error so typos do not silently do nothing."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"python sandbox config: unknown key(s) {unknown}; known keys: {sorted(known)}")
        if "extra_ro_binds" in values:
            values["extra_ro_binds"] = tuple(values["extra_ro_binds"] or ())
        if "env" in values:
            values["env"] = {str(k): str(v) for k, v in (values["env"] or {}).items()}
        if values.get("python_executable") is None:
            values.pop("python_executable", None)
        return cls(**values).validate()

    def replace(self, **changes: Any) -> "SandboxConfig":
        """A copy with some fields changed (``None`` values are ignored), validated."""
        changes = {k: v for k, v in changes.items() if v is not None}
        return dataclasses.replace(self, **changes).validate() if changes else self
