"""Command lines that start the interpreter inside Linux namespaces (bubblewrap, or ``unshare`` + chroot).

Both build the same view: a new network (loopback only, nothing listening), PID, IPC, UTS and mount
namespace whose root is an empty tmpfs holding read-only binds of the system dirs (/usr, /bin, /lib*), the
interpreter's installation, and a virtualenv shown at ``venv_mount``; a fresh /proc, a minimal /dev, and a
private tmpfs limited in size and inodes holding the working dir, /tmp and /dev/shm. Nothing else of the
host (/root, /home, /work, /etc, the host /tmp, sockets under /run) exists inside.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools.python_sandbox.bootstrap import LAUNCH_STUB
from tools.python_sandbox.config import STAGING_DIR as STAGING, SandboxConfig

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


@dataclass(frozen=True)
class LaunchFds:
    """File descriptors and cgroup files one call's launcher is handed (the executor owns and closes them)."""

    status_fd: int  # write end of the pipe on which the bootstrap reports "ready" (out of band)
    seccomp_fd: int | None = None  # memfd with the BPF program, for bwrap's --seccomp
    seccomp_bpf: bytes | None = None  # the same program for bootstraps that load it themselves
    cgroup_procs: tuple[str, ...] = ()  # cgroup.procs files the launcher joins before anything runs

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return tuple(fd for fd in (self.status_fd, self.seccomp_fd) if fd is not None)


def bootstrap_args(config: SandboxConfig, uid: int | None, layout: InterpreterLayout,
                   workdir: str, fds: LaunchFds, inside: bool = True) -> list[str]:
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
        "status_fd": fds.status_fd,
        "seccomp_bpf": base64.b64encode(fds.seccomp_bpf).decode() if fds.seccomp_bpf else None,
    }
    return [layout.inside_executable, "-I", "-S", "-X", "utf8", "-B", "-c", LAUNCH_STUB, BOOTSTRAP_SOURCE,
            json.dumps(params)]


def _interpreter_binds(layout: InterpreterLayout, config: SandboxConfig,
                       staged_venv: str | None = None) -> list[tuple[str, str]]:
    binds = []
    if layout.base_prefix != "/usr" and not layout.base_prefix.startswith("/usr/"):
        binds.append((layout.base_prefix, layout.base_prefix))
    if layout.venv_prefix is not None:
        binds.append((staged_venv or layout.venv_prefix, config.venv_mount))
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


def _staging_lines(config: SandboxConfig, layout: InterpreterLayout, cgroup_procs: tuple[str, ...] = ()) -> list[str]:
    """Shell lines (run as root in a private mount namespace) that prepare the writable dirs and the venv.

    One tmpfs holds the working dir, /tmp and /dev/shm, limited in size and inodes here because bwrap 0.8
    can set only a size (each mount is one more process to start, so there is one). The venv is shown
    through a read-only overlay whose layer is named relative to its own dir: a bind mount's root field in
    /proc/*/mountinfo would name the venv's host path (the project's location); the overlay shows
    ``/`` and ``lowerdir=.``.
    """
    q = shlex.quote
    lines = ["set -eu"] + [f"echo $$ > {q(path)}" for path in cgroup_procs]
    lines.append(f"mount -t tmpfs -o mode=0755,size={int(config.tmpfs_size_mb)}m,"
                 f"nr_inodes={int(config.tmpfs_max_files)},nosuid,nodev sandboxtmp {STAGING}")
    dirs = ["work", "tmp", "shm"] + (["venv", "empty"] if layout.venv_prefix is not None else [])
    lines.append("mkdir -m 1777 " + " ".join(f"{STAGING}/{name}" for name in dirs))
    if layout.venv_prefix is not None:
        lines.append(f"cd {q(layout.venv_prefix)} && mount -t overlay -o ro,lowerdir=.:{STAGING}/empty overlay "
                     f"{STAGING}/venv || mount --bind -o ro {q(layout.venv_prefix)} {STAGING}/venv")
        lines.append("cd /")
    return lines


def _bwrap_args(config: SandboxConfig, uid: int | None, layout: InterpreterLayout, fds: LaunchFds,
                staged: bool) -> list[str]:
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
    binds = _interpreter_binds(layout, config, f"{STAGING}/venv" if staged else None)
    for parent in _parents_to_create([dest for _, dest in binds]):
        # bwrap would copy the host's modes for missing parents (/root is 0700): make them traversable.
        cmd += ["--perms", "0755", "--dir", parent]
    for source, dest in binds:
        cmd += ["--ro-bind", source, dest]
    cmd += ["--proc", "/proc", "--dev", "/dev"]
    if staged:
        cmd += ["--bind", f"{STAGING}/tmp", "/tmp", "--bind", f"{STAGING}/work", config.workdir,
                "--bind", f"{STAGING}/shm", "/dev/shm"]
    else:  # not root: bwrap's own tmpfs, size-limited only
        for dest in ("/tmp", config.workdir, "/dev/shm"):
            cmd += ["--size", tmpfs_bytes, "--perms", "1777", "--tmpfs", dest]
    if fds.seccomp_fd is not None:
        cmd += ["--seccomp", str(fds.seccomp_fd)]
    cmd += ["--chdir", config.workdir, "--clearenv"]
    for key, value in sandbox_env(config).items():
        cmd += ["--setenv", key, value]
    # bwrap loads the filter itself, so the bootstrap gets none to load.
    inner_fds = LaunchFds(fds.status_fd)
    return cmd + ["--"] + bootstrap_args(config, uid, layout, config.workdir, inner_fds)


def bwrap_command(config: SandboxConfig, uid: int | None, fds: LaunchFds) -> list[str]:
    """bwrap, started (as root) from a shell in a private mount namespace that stages the tmpfs and venv."""
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    if os.geteuid() != 0:
        return joining_cgroup(_bwrap_args(config, uid, layout, fds, staged=False), fds.cgroup_procs)
    lines = _staging_lines(config, layout, fds.cgroup_procs)
    lines.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines),
            "arpo-sandbox"] + _bwrap_args(config, uid, layout, fds, staged=True)


def unshare_command(config: SandboxConfig, uid: int | None, fds: LaunchFds) -> list[str]:
    """util-linux ``unshare`` + a root shell that assembles the same view under a tmpfs and chroots into it.

    Weaker than bwrap in one respect: chroot instead of pivot_root (the bootstrap drops root before user
    code runs, and non-root cannot chroot, so the host root is not reachable).
    """
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    root = f"{STAGING}/root"  # outside it stay the staging mounts, which mountinfo in the chroot skips
    q = shlex.quote
    # Any failure before the final exec ends the call before the bootstrap reports "ready": a setup failure.
    lines = _staging_lines(config, layout)
    lines += [f"mkdir {root}", f"mount -t tmpfs -o mode=0755,size=1m,nr_inodes=4096,nosuid,nodev sandboxroot {root}"]

    def bind(source: str, dest: str, host_path: str | None = None) -> None:
        kind = "-d" if os.path.isdir(host_path or source) else "-f"
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
    for (source, dest), (host_source, _) in zip(_interpreter_binds(layout, config, f"{STAGING}/venv"),
                                                _interpreter_binds(layout, config)):
        bind(source, dest, host_source)
    lines.append(f"mkdir -p {root}/proc {root}/dev && mount -t proc -o nosuid,nodev,noexec proc {root}/proc")
    lines.append(f"mount -t tmpfs -o mode=0755,size=1m,nr_inodes=64,nosuid sandboxdev {root}/dev")
    for dev in DEVICES:
        lines.append(f"touch {root}/dev/{dev} && mount --bind /dev/{dev} {root}/dev/{dev}")
    for name, dest in (("tmp", "/tmp"), ("work", config.workdir), ("shm", "/dev/shm")):
        lines.append(f"mkdir -p {q(root + dest)} && mount --bind {STAGING}/{name} {q(root + dest)}")
    lines.append("hostname sandbox 2>/dev/null || true")
    env_args = " ".join(q(f"{k}={v}") for k, v in sandbox_env(config).items())
    inner = " ".join(q(a) for a in bootstrap_args(config, uid, layout, config.workdir, fds))
    lines.append(f"cd / && exec chroot {root} /usr/bin/env -i {env_args} {inner}")
    # Nothing may outlive the caller: setpriv gives unshare a parent-death SIGKILL (kept across its exec; a
    # killed caller never gets to kill the session itself), and --kill-child passes it on to the namespace's
    # init, whose death kills every process of the PID namespace. util-linux ships both tools.
    return ["setpriv", "--pdeathsig", "KILL", "--",
            "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines)]


def joining_cgroup(cmd: list[str], procs_files: tuple[str, ...]) -> list[str]:
    """``cmd`` started by a shell that first moves itself into the call's cgroup(s), so that everything the
    call starts is inside from its first instruction (Popen cannot place a child in a cgroup itself)."""
    if not procs_files:
        return cmd
    joins = " && ".join(f"echo $$ > {shlex.quote(path)}" for path in procs_files)
    return ["/bin/sh", "-c", f'{joins} && exec "$@"', "arpo-sandbox"] + cmd


def command_for(mode: str, config: SandboxConfig, uid: int | None, fds: LaunchFds) -> list[str]:
    """The launcher command line for a namespaced mode (``bwrap`` or ``unshare``)."""
    if mode == "bwrap":
        return bwrap_command(config, uid, fds)
    if mode == "unshare":
        return joining_cgroup(unshare_command(config, uid, fds), fds.cgroup_procs)
    raise ValueError(f"no namespaced command for isolation mode {mode!r}")


def unsandboxed_command(config: SandboxConfig, uid: int | None, host_workdir: str, fds: LaunchFds) -> list[str]:
    """The host interpreter itself, limits, filter and uid drop only (``isolation: none``)."""
    layout = interpreter_layout(config.python_executable, config.venv_mount)
    cmd = [os.path.abspath(config.python_executable)] + bootstrap_args(config, uid, layout, host_workdir, fds,
                                                                       inside=False)[1:]
    return joining_cgroup(cmd, fds.cgroup_procs)


def tool_available(mode: str) -> bool:
    needed = ("bwrap",) if mode == "bwrap" else ("unshare", "setpriv")
    return all(shutil.which(tool) is not None for tool in needed)
