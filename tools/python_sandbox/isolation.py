"""Command lines that start the interpreter inside Linux namespaces (bubblewrap, or ``unshare`` + chroot).

Both build the same view: a new network (loopback only, nothing listening), PID, IPC, UTS and mount
namespace whose root is an empty tmpfs holding read-only binds of the system dirs (/usr, /bin, /lib*), the
interpreter's installation, and a virtualenv remounted at ``venv_mount``; a fresh /proc, a minimal /dev,
and two private size-limited tmpfs: the working dir and /tmp. Nothing else of the host (/root, /home,
/work, /etc, the host /tmp, sockets under /run) exists inside.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools.python_sandbox.bootstrap import LAUNCH_STUB
from tools.python_sandbox.config import SandboxConfig

BOOTSTRAP_SOURCE = (Path(__file__).with_name("bootstrap.py")).read_text()
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Only what the dynamic loader and time functions read; the rest of /etc (passwd, shadow, hosts) stays out.
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
DEVICES = ("null", "zero", "full", "random", "urandom")


@dataclass(frozen=True)
class InterpreterLayout:
    """Where an interpreter's files are on the host, and how it looks inside the sandbox."""

    base_prefix: str  # the Python installation; bound at its own path (RUNPATH and pyvenv.cfg point there)
    venv_prefix: str | None  # a virtualenv's prefix on the host, or None
    inside_executable: str  # argv[0] inside the sandbox
    inside_prefix: str  # sys.prefix inside (venv_mount for a virtualenv)
    inside_site_packages: tuple[str, ...]  # site dirs as seen inside
    host_site_packages: tuple[str, ...]  # the same dirs on the host (isolation "none")


@functools.lru_cache(maxsize=8)
def interpreter_layout(python_executable: str, venv_mount: str) -> InterpreterLayout:
    """Ask the interpreter for its prefixes and site dirs (once per interpreter)."""
    probe = "import sys, site, json; print(json.dumps([sys.prefix, sys.base_prefix, site.getsitepackages()]))"
    out = subprocess.run([python_executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    raw_prefix, raw_base, raw_sites = json.loads(out)
    prefix, base_prefix = os.path.realpath(raw_prefix), os.path.realpath(raw_base)
    host_sites = tuple(os.path.realpath(p) for p in raw_sites)
    executable = os.path.abspath(python_executable)
    if prefix == base_prefix:
        return InterpreterLayout(base_prefix, None, os.path.realpath(executable), base_prefix, host_sites,
                                 host_sites)
    # Run the venv's own bin/python under venv_mount: the project path (the venv often lives inside the
    # project) never appears, and the interpreter still resolves to the base install bound at its own path.
    rel = os.path.relpath(executable, os.path.abspath(os.path.dirname(os.path.dirname(executable))))
    if not os.path.exists(os.path.join(prefix, rel)):
        rel = os.path.join("bin", os.path.basename(executable))
    inside_sites = tuple(venv_mount + p[len(prefix):] if p == prefix or p.startswith(prefix + "/") else p
                         for p in host_sites)
    return InterpreterLayout(base_prefix, prefix, os.path.join(venv_mount, rel), venv_mount, inside_sites,
                             host_sites)


def sandbox_env(config: SandboxConfig) -> dict[str, str]:
    """The program's whole environment: nothing inherited from the host."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": config.workdir,
        "TMPDIR": "/tmp",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # One BLAS/OpenMP thread: threads count against max_processes and memory_mb.
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp",
    }
    env.update(config.env)
    return env


def bootstrap_args(config: SandboxConfig, uid: int | None, layout: InterpreterLayout,
                   workdir: str, inside: bool = True) -> list[str]:
    params = {
        "prefix": layout.inside_prefix if inside else (layout.venv_prefix or layout.base_prefix),
        "site_packages": list(layout.inside_site_packages if inside else layout.host_site_packages),
        "cpu_time_s": config.cpu_time_s,
        "memory_bytes": int(config.memory_mb) << 20,
        "max_processes": int(config.max_processes),
        "max_file_size_bytes": int(config.max_file_size_mb) << 20,
        "max_open_files": int(config.max_open_files),
        "uid": uid,
        "require_non_root": uid is not None,
        "workdir": workdir,
        "repl": config.repl_trailing_expression,
    }
    return [layout.inside_executable, "-I", "-S", "-X", "utf8", "-B", "-c", LAUNCH_STUB, BOOTSTRAP_SOURCE,
                                   json.dumps(params)]


def _interpreter_binds(layout: InterpreterLayout, config: SandboxConfig) -> list[tuple[str, str]]:
    binds = []
    if layout.base_prefix != "/usr" and not layout.base_prefix.startswith("/usr/"):
        binds.append((layout.base_prefix, layout.base_prefix))
    if layout.venv_prefix is not None:
        binds.append((layout.venv_prefix, config.venv_mount))
    binds.extend((path, path) for path in config.extra_ro_binds)
    return binds


def _parents_to_create(dests: list[str]) -> list[str]:
    covered = set(SYSTEM_DIRS) | set(dests)
    parents: list[str] = []
    for dest in dests:
        chain = []
        parent = os.path.dirname(dest.rstrip("/"))
        while parent not in ("/", "") and parent not in covered:
            chain.append(parent)
            parent = os.path.dirname(parent)
        if parent in covered and parent != "/":
            continue  # inside another bind: the mount provides the parents
        parents.extend(p for p in reversed(chain) if p not in parents)
    return parents


def bwrap_command(config: SandboxConfig, uid: int | None) -> list[str]:
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    tmpfs_bytes = str(int(config.tmpfs_size_mb) << 20)
    cmd = ["bwrap", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
           "--hostname", "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if uid is not None:
        # Only for the bootstrap's switch to the unprivileged uid; setuid clears them before user code.
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            cmd += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            cmd += ["--ro-bind", path, path]
    for path in ETC_FILES:
        if os.path.exists(path):
            cmd += ["--ro-bind", path, path]
    binds = _interpreter_binds(layout, config)
    for parent in _parents_to_create([dest for _, dest in binds]):
        # bwrap would copy the host's modes for missing parents (/root is 0700): make them traversable.
        cmd += ["--perms", "0755", "--dir", parent]
    for source, dest in binds:
        cmd += ["--ro-bind", source, dest]
    cmd += ["--proc", "/proc", "--dev", "/dev",
            "--size", tmpfs_bytes, "--perms", "1777", "--tmpfs", "/tmp",
            "--size", tmpfs_bytes, "--perms", "1777", "--tmpfs", config.workdir,
            "--chdir", config.workdir, "--clearenv"]
    for key, value in sandbox_env(config).items():
        cmd += ["--setenv", key, value]
    cmd += ["--"] + bootstrap_args(config, uid, layout, config.workdir)
    return cmd


def unshare_command(config: SandboxConfig, uid: int | None) -> list[str]:
    """util-linux ``unshare`` + a root shell that assembles the same view under a tmpfs and chroots into it.

    Weaker than bwrap in one respect: chroot instead of pivot_root (the bootstrap drops root before user
    code runs, and non-root cannot chroot, so the host root is not reachable).
    """
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    tmpfs_mb = int(config.tmpfs_size_mb)
    root = "/mnt"  # any existing dir; the tmpfs over it exists only in this private mount namespace
    q = shlex.quote
    # Any failure before the final exec leaves the marker the executor reports as a sandbox error.
    lines = ["set -eu", "trap 'echo \"ARPO_SANDBOX_SETUP_FAILED: namespace setup failed\" >&2' EXIT",
             f"mount -t tmpfs -o mode=0755,size=64m,nosuid,nodev sandboxroot {root}"]

    def bind(source: str, dest: str) -> None:
        kind = "-d" if os.path.isdir(source) else "-f"
        target = q(root + dest)
        lines.append(f"mkdir -p {target}" if kind == "-d" else
                     f"mkdir -p {q(os.path.dirname(root + dest))} && touch {target}")
        lines.append(f"mount --bind -o ro,nosuid,nodev {q(source)} {target}")

    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            lines.append(f"ln -s {q(os.readlink(path))} {q(root + path)}")
        elif os.path.isdir(path):
            bind(path, path)
    for path in ETC_FILES:
        if os.path.exists(path):
            bind(path, path)
    for source, dest in _interpreter_binds(layout, config):
        bind(source, dest)
    lines.append(f"mkdir -p {root}/proc {root}/dev && mount -t proc -o nosuid,nodev,noexec proc {root}/proc")
    lines.append(f"mount -t tmpfs -o mode=0755,size=1m,nosuid sandboxdev {root}/dev")
    for dev in DEVICES:
        lines.append(f"touch {root}/dev/{dev} && mount --bind /dev/{dev} {root}/dev/{dev}")
    for path in ("/tmp", config.workdir):
        lines.append(f"mkdir -p {q(root + path)} && mount -t tmpfs -o mode=1777,size={tmpfs_mb}m,nosuid,nodev "
                     f"sandboxtmp {q(root + path)}")
    lines.append("hostname sandbox 2>/dev/null || true")
    lines.append("trap - EXIT")
    env_args = " ".join(q(f"{k}={v}") for k, v in sandbox_env(config).items())
    inner = " ".join(q(a) for a in bootstrap_args(config, uid, layout, config.workdir))
    lines.append(f"cd / && exec chroot {root} /usr/bin/env -i {env_args} {inner}")
    # Nothing may outlive the caller: setpriv gives unshare a parent-death SIGKILL (kept across its exec; a
    # killed caller never gets to kill the session itself), and --kill-child passes it on to the namespace's
    # init, whose death kills every process of the PID namespace. util-linux ships both tools.
    return ["setpriv", "--pdeathsig", "KILL", "--",
            "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines)]


def command_for(mode: str, config: SandboxConfig, uid: int | None) -> list[str]:
    """The launcher command line for a namespaced mode (``bwrap`` or ``unshare``)."""
    if mode == "bwrap":
        return bwrap_command(config, uid)
    if mode == "unshare":
        return unshare_command(config, uid)
    raise ValueError(f"no namespaced command for isolation mode {mode!r}")


def unsandboxed_command(config: SandboxConfig, uid: int | None, host_workdir: str) -> list[str]:
    """The host interpreter itself, limits and uid drop only (``isolation: none``)."""
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    return [os.path.abspath(config.python_executable)] + bootstrap_args(config, uid, layout, host_workdir,
                                                                                 inside=False)[1:]


def tool_available(mode: str) -> bool:
    needed = ("bwrap",) if mode == "bwrap" else ("unshare", "setpriv")
    return all(shutil.which(tool) is not None for tool in needed)
