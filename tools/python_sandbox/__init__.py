"""Sandboxed Python execution for the ARPO ``python`` tool (see README.md in this folder).

What is enforced on every call: a fresh interpreter process; a wall-clock timeout; RLIMIT_CPU, RLIMIT_AS,
RLIMIT_NPROC (counted for a per-call unprivileged uid when we are root), RLIMIT_FSIZE, RLIMIT_NOFILE and no
core dumps; a memory + pids cgroup for the whole call (``call_memory_mb``) where one can be made; a seccomp
filter (ptrace, mount, keyring, bpf, perf, modules, namespaces, ...: EPERM); an environment built from
scratch; new network, PID, IPC, UTS and mount namespaces (bubblewrap, or ``unshare`` + chroot as the
fallback) with only /usr, /bin, /lib*, the interpreter and the virtualenv (read-only, the venv under
``/opt/venv`` so no project path is visible) plus one private tmpfs limited in size and inodes (the working
dir ``/sandbox``, ``/tmp`` and ``/dev/shm``), all gone when the call returns; no_new_privs; and every process
the program started is killed when its main process exits or the call times out.

When no namespace mechanism works, calls fail closed (the result's ``error`` says why) unless the config
sets ``allow_unsandboxed: true``, which runs with rlimits, the uid switch and a temp dir only and logs a loud
warning. Nothing here raises into the caller: failures become text the model can read.
"""

from tools.python_sandbox.config import SandboxConfig
from tools.python_sandbox.executor import execute, resolve_isolation
from tools.python_sandbox.pool import SandboxPool
from tools.python_sandbox.result import SandboxResult, truncate_text

__all__ = ["SandboxConfig", "SandboxPool", "SandboxResult", "execute", "resolve_isolation", "truncate_text"]
