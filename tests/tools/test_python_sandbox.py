"""The Python sandbox against ordinary and hostile programs: real subprocesses, real bwrap / unshare.

Every hostile case asserts two things: the call returns a clear result, and the host is unharmed (files,
processes, the test process itself). The battery runs once per available isolation mechanism.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tools.python_sandbox import SandboxConfig, SandboxPool, execute, resolve_isolation, truncate_text
from tools.python_sandbox import executor as executor_module
from tools.python_sandbox.tool import PythonTool, strip_code_fences

from .sandbox_modes import isolation_params

REPO_ROOT = Path(__file__).resolve().parents[2]
UID_BASE = 3_100_000  # far from the default range, so stray-process checks see only this test's uids


MODES = isolation_params(UID_BASE)


@pytest.fixture(params=MODES)
def cfg(request) -> SandboxConfig:
    return SandboxConfig(isolation=request.param, uid_base=UID_BASE, timeout_s=8, cpu_time_s=4, memory_mb=768,
                         max_processes=16, max_file_size_mb=4, tmpfs_size_mb=16, max_output_chars=2000,
                         max_capture_bytes=256 * 1024)


def _sandbox_processes() -> list[str]:
    """Host processes running as any uid this test module hands out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), "")
        uids = [int(u) for u in uid_line.split()[1:]]
        if any(UID_BASE <= u < UID_BASE + 100 for u in uids):
            found.append(f"{entry.name}: {status.splitlines()[0]}")
    return found


def _assert_host_clean() -> None:
    deadline = time.monotonic() + 15  # waits only while something is left; a busy machine reaps slowly
    while _sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sandbox_processes() == [], "a sandboxed process outlived its call"


# ---------------------------------------------------------------------------------------------------------
# Ordinary programs


def test_arithmetic_strings_and_numpy(cfg):
    result = execute("print(2 ** 100 % 97, sum(range(10)))\n"
                     "s = 'Hello, World'\n"
                     "print(s[::-1].upper(), s.split(', '), f'{3.14159:.2f}')\n"
                     "import numpy as np\n"
                     "a = np.array([[2.0, 1.0], [1.0, 3.0]])\n"
                     "print(round(float(np.linalg.det(a)), 6), np.arange(1, 6).prod())\n", config=cfg)
    assert result.ok, result
    assert result.isolation == cfg.isolation
    assert result.stdout.splitlines() == [f"{2 ** 100 % 97} 45", "DLROW ,OLLEH ['Hello', 'World'] 3.14",
                                          "5.0 120"]
    assert result.to_model_text() == result.stdout.strip()


def test_trailing_expression_is_printed_like_the_repl(cfg):
    assert execute("x = 6\nx * 7", config=cfg).to_model_text() == "42"
    assert execute("print('a')\n'b' + 'c'", config=cfg).to_model_text() == "a\n'bc'"
    assert execute("import math\nmath.sqrt(16)", config=cfg).to_model_text() == "4.0"
    # None is not echoed, an assignment is not an expression, and only the last statement counts.
    assert execute("print('side effect')", config=cfg).to_model_text() == "side effect"
    assert execute("1 + 1\ny = 5", config=cfg).to_model_text() == ""
    assert execute("x = 6\nx * 7", config=cfg.replace(repl_trailing_expression=False)).to_model_text() == ""


def test_failure_returns_stderr_traceback_without_sandbox_frames(cfg):
    result = execute("print('before')\ndef f(x):\n    return 1 / x\nf(0)", config=cfg)
    assert not result.ok and result.exit_code == 1 and result.error is None
    text = result.to_model_text()
    assert "ZeroDivisionError: division by zero" in text
    assert 'File "<string>", line 3, in f' in text and "return 1 / x" in text
    assert text.count('File "<string>"') == 2  # the call site (line 4) and f: no launcher frames
    assert "<sandbox>" not in text and "before" not in text  # stderr only, user frames only
    syntax = execute("def broken(:\n  pass", config=cfg)
    assert syntax.exit_code == 1 and "SyntaxError" in syntax.to_model_text()
    assert execute("import sys\nsys.exit(3)", config=cfg).exit_code == 3


def test_output_is_cut_with_a_visible_marker(cfg):
    result = execute("print('x' * 5000)", config=cfg.replace(max_output_chars=100))
    text = result.to_model_text()
    assert result.ok and result.truncated
    assert text.startswith("x" * 100) and "x" * 101 not in text
    assert "[... output truncated: 4900 more characters ...]" in text
    # Errors keep their end, where the exception is named.
    err = execute("raise ValueError('y' * 5000 + ' END')", config=cfg.replace(max_output_chars=100)).to_model_text()
    assert err.startswith("[... output truncated:") and err.endswith("END")


def test_truncate_text_keeps_short_text():
    assert truncate_text("short", 10) == ("short", False)
    assert truncate_text("abcdef", 3) == ("abc\n[... output truncated: 3 more characters ...]", True)


def test_working_dir_is_private_and_removed(cfg):
    write = execute("import os\nopen('state.txt', 'w').write('kept?')\nopen('/tmp/t.txt', 'w').write('x')\n"
                    "print(os.getcwd(), sorted(os.listdir('.')), os.environ['HOME'])", config=cfg)
    assert write.to_model_text() == f"{cfg.workdir} ['state.txt'] {cfg.workdir}"
    read = execute("import os\nprint(os.listdir('.'), os.listdir('/tmp'))", config=cfg)
    assert read.to_model_text() == "[] []"


# ---------------------------------------------------------------------------------------------------------
# Hostile programs


def test_fork_bomb_is_contained(cfg):
    code = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n")
    start = time.monotonic()
    result = execute(code, config=cfg.replace(timeout_s=3))
    assert time.monotonic() - start < 3 + 6
    assert not result.ok and result.error is None
    assert result.timed_out or result.killed_by in ("SIGXCPU", "SIGKILL")
    _assert_host_clean()
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    # The process cap holds: a well-behaved program cannot exceed it either.
    capped = execute("import os, time\nn = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
                     "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                     "    print('stopped at', n, e.errno)\n", config=cfg)
    assert capped.ok and capped.stdout.startswith("stopped at") and int(capped.stdout.split()[2]) < 16
    _assert_host_clean()


def test_memory_bomb_is_contained(cfg):
    one_shot = execute("x = bytearray(8 << 30)", config=cfg)
    assert one_shot.exit_code == 1 and "MemoryError" in one_shot.to_model_text()
    growing = execute("chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))", config=cfg)
    assert not growing.ok and "MemoryError" in growing.to_model_text()
    tmpfs = execute("data = b'z' * (1 << 20)\nfor i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(data)",
                    config=cfg)
    assert not tmpfs.ok and "No space left on device" in tmpfs.to_model_text()


def test_infinite_loop_hits_the_wall_clock(cfg):
    start = time.monotonic()
    result = execute("import time\nprint('started', flush=True)\nwhile True:\n    time.sleep(0.5)",
                     config=cfg.replace(timeout_s=2))
    assert result.timed_out and not result.ok
    assert time.monotonic() - start < 2 + 6
    text = result.to_model_text()
    assert "TimeoutError: execution exceeded the time limit of 2 seconds" in text and "started" in text
    _assert_host_clean()


def test_busy_cpu_loop_hits_the_cpu_limit(cfg):
    start = time.monotonic()
    result = execute("while True:\n    pass", config=cfg.replace(cpu_time_s=1, timeout_s=20))
    assert not result.timed_out, "the CPU limit, not the wall clock, must stop a busy loop"
    assert result.killed_by in ("SIGXCPU", "SIGKILL")
    assert time.monotonic() - start < 15
    assert "CPU" in result.to_model_text()


def test_huge_output_is_capped_and_stopped(cfg):
    start = time.monotonic()
    result = execute("while True:\n    print('x' * 1000)", config=cfg)
    assert result.output_limit_exceeded and result.truncated and not result.timed_out
    assert len(result.stdout) <= cfg.max_capture_bytes
    assert time.monotonic() - start < 5
    text = result.to_model_text()
    assert len(text) < cfg.max_output_chars + 200 and "output limit" in text
    single = execute("import sys\nsys.stdout.write('y' * (50 << 20))", config=cfg)
    assert single.output_limit_exceeded and len(single.stdout) <= cfg.max_capture_bytes


def test_writes_outside_the_sandbox_do_not_reach_the_host(cfg, tmp_path):
    targets = [REPO_ROOT / "SANDBOX_ESCAPE.txt", tmp_path / "escape.txt", Path("/tmp/arpo_sandbox_escape.txt"),
               Path("/usr/arpo_escape.txt"), Path("/etc/arpo_escape.txt"), Path("/root/arpo_escape.txt")]
    code = ("import os\n"
            f"for path in {[str(t) for t in targets]!r}:\n"
            "    try:\n"
            "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
            "        open(path, 'w').write('pwned')\n"
            "        print('wrote', path)\n"
            "    except OSError as e:\n"
            "        print('blocked', path, type(e).__name__)\n"
            "print('repo visible:', os.path.exists(" + repr(str(REPO_ROOT / "pyproject.toml")) + "))\n")
    result = execute(code, config=cfg)
    assert result.ok, result
    assert "repo visible: False" in result.stdout
    for target in targets:
        assert not target.exists(), f"sandbox wrote {target} on the host"
    for target in targets[3:]:  # read-only or absent system dirs
        assert f"blocked {target}" in result.stdout
    big = execute("open('big.bin', 'wb').write(b'0' * (8 << 20))", config=cfg)
    assert not big.ok and "File too large" in big.to_model_text()


def test_host_secrets_are_not_readable(cfg, monkeypatch):
    secret = "arpo-fake-secret-7c1e9"
    monkeypatch.setenv("ARPO_FAKE_API_KEY", secret)
    code = ("import os\n"
            "print('env', dict(os.environ))\n"
            "for path in ['/etc/shadow', '/etc/passwd', '/root/.bashrc', '/home', '/work', '/proc/1/environ',\n"
            "             '/proc/self/environ']:\n"
            "    try:\n"
            "        data = open(path, 'rb').read() if not os.path.isdir(path) else os.listdir(path)\n"
            "        print('read', path, data)\n"
            "    except OSError as e:\n"
            "        print('denied', path, type(e).__name__)\n"
            "print('root', sorted(os.listdir('/')), os.listdir('/root'))\n"
            "print('uid', os.getuid())\n")
    result = execute(code, config=cfg)
    assert result.ok, result
    assert secret not in result.stdout and secret not in result.stderr
    assert "ARPO_FAKE_API_KEY" not in result.stdout
    for path in ("/etc/shadow", "/etc/passwd", "/root/.bashrc", "/home", "/work"):
        assert f"denied {path}" in result.stdout
    assert str(REPO_ROOT) not in result.stdout
    if os.geteuid() == 0:
        uid = int(result.stdout.split("uid ")[1].split()[0])
        assert UID_BASE <= uid < UID_BASE + 100, "the program must not run as root"


def test_no_network_loopback_or_outside(cfg):
    assert cfg.isolation in ("bwrap", "unshare")  # connect attempts only behind a network namespace
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted = []

    def accept_loop(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                accepted.append(conn)
            except OSError:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=accept_loop, args=(stop,), daemon=True)
    thread.start()
    code = ("import socket\n"
            "names = [n for _, n in socket.if_nameindex()]\n"
            "print('interfaces', names)\n"
            "if names != ['lo']:\n"
            "    raise SystemExit('NETNS_MISSING')\n"
            f"for host, port in [('127.0.0.1', {port}), ('192.0.2.1', 80)]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n"
            "        s.connect((host, port)); print('connected', host)\n"
            "    except OSError as e:\n"
            "        print('failed', host, type(e).__name__)\n")
    try:
        result = execute(code, config=cfg)
    finally:
        stop.set()
        thread.join()
        listener.close()
    assert result.ok, result
    assert "failed 127.0.0.1" in result.stdout and "failed 192.0.2.1" in result.stdout
    assert "connected" not in result.stdout
    assert accepted == [], "the sandbox reached a host listener"


def test_signalling_the_parent_or_the_host_fails(cfg):
    me = os.getpid()
    code = ("import os, signal\n"
            f"for target in [os.getppid(), 1, {me}, -1, 0]:\n"
            "    try:\n"
            "        os.kill(target, signal.SIGKILL) if target not in (-1, 0) else os.kill(target, signal.SIGTERM)\n"
            "        print('sent', target)\n"
            "    except OSError as e:\n"
            "        print('refused', target, type(e).__name__)\n")
    result = execute(code, config=cfg)
    # kill(0/-1, SIGTERM) may end the program itself; what matters is the host side.
    assert result.error is None
    assert f"sent {me}" not in result.stdout
    assert os.getpid() == me  # this test process is alive
    _assert_host_clean()
    assert execute("print('still works')", config=cfg).to_model_text() == "still works"


def test_no_daemon_survives_the_call(cfg):
    marker = "4242.5"
    code = ("import os, time\n"
            "r, w = os.pipe()\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        os.write(w, b'up')\n"
            "        for fd in (0, 1, 2): os.close(fd)\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n"
            "    os._exit(0)\n"
            "print('daemon', os.read(r, 2).decode())\n")
    result = execute(code, config=cfg)
    assert result.ok and result.stdout.strip() == "daemon up", result
    _assert_host_clean()
    survivors = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) == ["sleep", marker]]
    assert survivors == []


def _cmdline(proc_dir: Path) -> list[str]:
    try:
        return (proc_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


# ---------------------------------------------------------------------------------------------------------
# Pool, fail-closed behaviour, tool


def test_pool_hung_program_does_not_block_others(cfg):
    finished: dict[str, float] = {}
    with SandboxPool(max_workers=2, config=cfg.replace(timeout_s=4)) as pool:
        start = time.monotonic()
        hung = pool.submit("import time\ntime.sleep(60)")
        hung.add_done_callback(lambda _: finished.setdefault("hung", time.monotonic() - start))
        quick = [pool.submit(f"{i} * {i}") for i in range(4)]
        for i, future in enumerate(quick):
            future.add_done_callback(lambda _, i=i: finished.setdefault(f"q{i}", time.monotonic() - start))
        assert [f.result().to_model_text() for f in quick] == ["0", "1", "4", "9"]
        assert hung.result().timed_out
    assert max(finished[f"q{i}"] for i in range(4)) < finished["hung"]
    assert max(finished[f"q{i}"] for i in range(4)) < 3.5


def test_pool_runs_concurrently_and_never_raises(cfg):
    with SandboxPool(max_workers=4, config=cfg) as pool:
        results = pool.map([f"print({i} + 1)" for i in range(8)] + ["raise RuntimeError('boom')"])
        assert [r.stdout.strip() for r in results[:8]] == [str(i + 1) for i in range(8)]
        assert "RuntimeError: boom" in results[8].to_model_text()
        assert pool.execute(123).error is not None  # not a string: reported, not raised
    assert pool.execute("1").error == "the sandbox pool is closed"


def test_fails_closed_without_a_mechanism(monkeypatch):
    monkeypatch.setattr(executor_module.isolation, "tool_available", lambda mode: False)
    monkeypatch.setattr(executor_module, "_probe_cache", {})
    result = execute("print('ran')", isolation="auto", uid_base=UID_BASE)
    assert result.exit_code is None and "refusing to run untrusted code" in result.to_model_text()
    assert "bwrap" in result.error and "unshare" in result.error


def test_unsandboxed_mode_needs_explicit_consent():
    with pytest.raises(ValueError, match="allow_unsandboxed"):
        SandboxConfig(isolation="none").validate()
    result = execute("print(6 * 7)", isolation="none", allow_unsandboxed=True, uid_base=UID_BASE)
    assert result.isolation == "none" and result.to_model_text() == "42"
    assert "invalid sandbox settings" in execute("1", timeout_s=-1).to_model_text()


def test_python_tool_text_and_function_calls():
    tool = PythonTool({"max_workers": 2, "timeout_s": 5, "max_output_chars": 50, "uid_base": UID_BASE})
    try:
        assert tool.name == "python" and tool.function_name == "python"
        assert tool.tool_schema["function"]["parameters"]["required"] == ["code"]
        assert tool.call_text("```python\nx = 2\nx ** 10\n```") == "1024"
        assert tool.call({"code": "print('hi')"}) == "hi"
        assert "needs the argument 'code'" in tool.call({})
        assert "[... output truncated" in tool.call_text("print('z' * 500)")
        assert "NameError" in tool.call_text("undefined_name")
    finally:
        tool.close()
        tool.close()
    with pytest.raises(ValueError, match="unknown key"):
        PythonTool({"timeout": 5})


def test_strip_code_fences():
    assert strip_code_fences("```py\nprint(1)\n```") == "print(1)"
    assert strip_code_fences("print('```')") == "print('```')"


@pytest.mark.skipif(os.geteuid() != 0, reason="uid switching only happens when running as root")
def test_concurrent_calls_get_distinct_uids(cfg):
    with SandboxPool(max_workers=3, config=cfg) as pool:
        uids = pool.map(["import os, time\ntime.sleep(1)\nos.getuid()"] * 3)
    assert len({r.stdout for r in uids}) == 3, [r.stdout for r in uids]


def test_yaml_config_documents_every_option_with_its_default():
    import dataclasses

    import yaml

    from tools.python_sandbox.tool import TOOL_KEYS

    spec = yaml.safe_load((REPO_ROOT / "configs/tools/python.yaml").read_text())["tools"][0]
    assert spec["class_name"] == "tools.python_sandbox.tool.PythonTool"
    values = spec["config"]
    defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in dataclasses.fields(SandboxConfig)}
    assert set(values) == set(defaults) | set(TOOL_KEYS)
    for key, default in {**defaults, **TOOL_KEYS}.items():
        if key == "python_executable":
            assert values[key] is None
        elif key == "extra_ro_binds":
            assert tuple(values[key]) == default
        else:
            assert values[key] == default, key
    tool = PythonTool(spec["config"], spec["tool_schema"])
    try:
        assert tool.tool_schema == tool.default_schema()
    finally:
        tool.close()


def test_python_tool_async_calls_run_concurrently():
    import asyncio

    tool = PythonTool({"max_workers": 3, "timeout_s": 5, "uid_base": UID_BASE})

    async def run_all() -> list:
        return await asyncio.gather(*(tool.acall_text(f"import time\ntime.sleep(1)\n{i} + 100") for i in range(3)))

    try:
        start = time.monotonic()
        assert asyncio.run(run_all()) == ["100", "101", "102"]
        assert time.monotonic() - start < 2.8  # three 1 s programs overlapped
    finally:
        tool.close()


def test_closing_its_output_does_not_escape_the_deadline(cfg):
    start = time.monotonic()
    result = execute("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", config=cfg.replace(timeout_s=2))
    assert result.timed_out and time.monotonic() - start < 2 + 6
    _assert_host_clean()


CALLER = r"""
import sys
from tools.python_sandbox import SandboxConfig, execute, resolve_isolation
cfg = SandboxConfig(isolation=sys.argv[1], uid_base=int(sys.argv[2]), timeout_s=120, cpu_time_s=120)
resolve_isolation(cfg)  # the probe runs under a sandbox uid too; its process must not pass for the program
print("probed", flush=True)
execute("while True:\n    pass\n", config=cfg)
"""


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("mode", [p.values[0] for p in MODES], ids=[p.id for p in MODES])
def test_nothing_outlives_a_killed_caller(mode):
    # a trainer SIGKILLed mid-call (OOM killer, a user): its sandboxed program and launcher must die with it
    chosen, note = resolve_isolation(SandboxConfig(isolation=mode, uid_base=UID_BASE))
    if chosen != mode:
        pytest.skip(f"{mode} unusable here: {note}")
    caller = subprocess.Popen([sys.executable, "-c", CALLER, mode, str(UID_BASE)], cwd=REPO_ROOT,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline().strip() == "probed", f"the caller failed (exit code: {caller.wait()})"
        deadline = time.monotonic() + 120  # a busy 2-core machine (the suite runs two workers) starts it slowly
        while not _sandbox_processes() and time.monotonic() < deadline and caller.poll() is None:
            time.sleep(0.1)
        assert _sandbox_processes(), f"the sandboxed program never started (caller exit code: {caller.poll()})"
        tree = _descendants(caller.pid)
        assert tree
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (any(_alive(p) for p in tree) or _sandbox_processes()):
        time.sleep(0.05)
    assert not [p for p in tree if _alive(p)] and not _sandbox_processes()
