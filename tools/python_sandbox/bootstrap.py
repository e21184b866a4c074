"""First code run inside the sandbox: set limits, drop root, run the user's code.

Stdlib only and self-contained: the project tree is not visible inside the sandbox. It is started as
``python -I -S -c LAUNCH_STUB <this source> <JSON limits>`` (so its frames are named ``<sandbox>`` and the
user's ``<string>``); the user's code arrives on stdin, which is then replaced by /dev/null.

The user's code runs like ``python -c`` (``__name__ == "__main__"``, tracebacks name ``<string>``) with
one REPL rule: when the last statement is an expression, its ``repr`` is printed unless it is ``None``.
"""

# All imports happen before root is dropped: with isolation "none" the interpreter may live in a dir the
# sandbox uid cannot read (/root/.pyenv).
import ast
import base64
import builtins
import json
import linecache
import os
import resource
import site
import sys
import traceback
import types

LAUNCH_STUB = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
SETUP_FAILED = "ARPO_SANDBOX_SETUP_FAILED"  # human-readable prefix on stderr; the verdict is the status fd
SETUP_FAILED_STATUS = 125
READY = b"ready\n"  # written to the status fd just before user code runs, which never gets that fd
USER_FILENAME = "<string>"
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_status_fd = None


def _fail_setup(message):
    # Fail closed: never run user code with a limit or privilege drop missing.
    line = f"{SETUP_FAILED}: {message}\n".encode()
    os.write(2, line)
    if _status_fd is not None:
        try:
            os.write(_status_fd, line)
        except OSError:
            pass
    os._exit(SETUP_FAILED_STATUS)


def _report_ready():
    """Tell the executor, out of band, that setup is complete; then drop every inherited fd but 0-2.

    A program can print anything on stderr, so only this pipe, which it never holds, tells a setup
    failure from the program's own output.
    """
    if _status_fd is not None:
        try:
            os.write(_status_fd, READY)
        except OSError as exc:
            _fail_setup(f"cannot report on the status fd: {exc}")
    os.closerange(3, 1 << 20)


def _read_code():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return b"".join(chunks).decode("utf-8", "replace")


def _add_site_packages(prefix, site_dirs):
    """What ``site`` would do (the interpreter runs with -S), minus executing ``.pth`` import lines.

    Those lines (editable-install finders, setuptools' distutils hack) cost ~100 ms per start and point at
    host paths that are not visible here anyway; plain directory lines of ``.pth`` files are kept.
    The host computed the site dirs with the interpreter's normal startup and mapped them to this view.
    """
    site.setquit()
    site.setcopyright()
    site.sethelper()
    sys.prefix = sys.exec_prefix = prefix
    for directory in site_dirs:
        if not os.path.isdir(directory) or directory in sys.path:
            continue
        sys.path.append(directory)
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".pth"):
                continue
            try:
                with open(os.path.join(directory, name)) as pth:
                    lines = pth.read().splitlines()
            except OSError:
                continue
            for line in lines:
                line = line.strip()
                if not line or line.startswith(("#", "import ", "import\t")):
                    continue
                path = os.path.join(directory, line)
                if os.path.isdir(path) and path not in sys.path:
                    sys.path.append(path)


def _run_as_namespace_init():
    """As PID 1 of a fresh PID namespace (unshare mode), stay as a reaper and run the program in a child.

    The kernel ignores default-action signals (SIGXCPU from RLIMIT_CPU included) sent to a namespace's
    init, so the limited program must not be PID 1. When this init exits, every process left in the
    namespace is killed, so daemons cannot outlive the call.
    """
    child = os.fork()
    if child == 0:
        return
    if _status_fd is not None:
        os.close(_status_fd)  # only the child reports
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(SETUP_FAILED_STATUS)
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            os._exit(code if code >= 0 else 128 - code)


def _set_no_new_privs():
    try:
        with open("/proc/self/status") as status:
            if any(line.split() == ["NoNewPrivs:", "1"] for line in status):
                return  # bwrap already set it; skip loading ctypes (~10 ms per call)
    except OSError:
        pass
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        _fail_setup(f"prctl(PR_SET_NO_NEW_PRIVS) failed with errno {ctypes.get_errno()}")


def load_seccomp(program):
    """Install a raw seccomp BPF program (``struct sock_filter[]`` bytes) on this process and its children."""
    import ctypes

    class _SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return ctypes.get_errno()
    return 0


def _set_limits(cfg):
    cpu = max(1, int(round(cfg["cpu_time_s"])))
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (cfg["memory_bytes"],) * 2),
        (resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2),
        (resource.RLIMIT_FSIZE, (cfg["max_file_size_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    for which, value in limits:
        try:
            resource.setrlimit(which, value)
        except (ValueError, OSError) as exc:
            _fail_setup(f"setrlimit({which}, {value}) failed: {exc}")


def _drop_privileges(uid):
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except OSError as exc:
        _fail_setup(f"could not switch to uid {uid}: {exc}")
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        _fail_setup(f"uid switch to {uid} did not take effect")
    try:
        with open("/proc/self/status") as status:
            effective = [line.split()[1] for line in status if line.startswith("CapEff:")]
    except OSError:
        effective = []
    if effective and int(effective[0], 16) != 0:
        _fail_setup("capabilities remain after dropping root")


def _user_traceback(exc, namespace):
    # Drop the bootstrap's frames; the user's frames (and functions they define) run in `namespace`.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals is not namespace:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _run_user_code(source, repl):
    linecache.cache[USER_FILENAME] = (len(source), None, source.splitlines(True), USER_FILENAME)
    # A real module registered as __main__ (as with `python -c`), so pickle finds the program's functions
    # and multiprocessing can send them to its workers.
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    namespace = main_module.__dict__
    try:
        tree = ast.parse(source, USER_FILENAME)
    except (SyntaxError, ValueError) as exc:
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        sys.exit(1)
    trailing = None
    if repl and tree.body and isinstance(tree.body[-1], ast.Expr):
        trailing = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, USER_FILENAME, "exec"), namespace)
        if trailing is not None:
            sys.displayhook(eval(compile(trailing, USER_FILENAME, "eval"), namespace))
    except SystemExit:
        raise
    except BaseException as exc:  # the program's own error: report it like the interpreter would
        _user_traceback(exc, namespace)
        sys.exit(1)


def main():
    global _status_fd
    cfg = json.loads(sys.argv[2])
    _status_fd = cfg.get("status_fd")
    source = _read_code()
    _add_site_packages(cfg["prefix"], cfg["site_packages"])
    if os.getpid() == 1:
        _run_as_namespace_init()
    _set_no_new_privs()
    _set_limits(cfg)
    if cfg.get("seccomp_bpf"):  # bwrap loaded it already; the other launchers leave it to us
        failed = load_seccomp(base64.b64decode(cfg["seccomp_bpf"]))
        if failed:
            _fail_setup(f"could not load the seccomp filter: {os.strerror(failed)}")
    if cfg.get("uid") is not None and os.getuid() == 0:
        _drop_privileges(cfg["uid"])
    elif cfg.get("require_non_root") and os.getuid() == 0:
        _fail_setup("running as root inside the sandbox and no uid to switch to")
    try:
        os.chdir(cfg["workdir"])
    except OSError as exc:
        _fail_setup(f"cannot enter the working dir {cfg['workdir']}: {exc}")
    _report_ready()
    # Like `python -c`: the working dir is importable (it is private to this call).
    sys.path.insert(0, cfg["workdir"])
    sys.argv = ["-c"]
    _run_user_code(source, cfg.get("repl", True))


if __name__ == "__main__":
    main()
