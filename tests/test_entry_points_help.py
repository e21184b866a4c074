"""Every entry point answers ``--help`` with its usage and exits 0; the Hydra-configured ones list their presets
and config groups. Entry points are found, not listed: every module of the package, the tools and
``experiments/`` with a ``__main__`` block. One child interpreter runs them all (their imports are paid once and
nothing they set up at import reaches this process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from arpo.config import REPO_ROOT

#: scripts with a __main__ block that are not user commands: the sandbox runs its bootstrap inside the sandbox
NOT_COMMANDS = {"tools/python_sandbox/bootstrap.py"}
_MAIN_BLOCK = re.compile(r'^if __name__ == "__main__":', re.M)

_DRIVER = r"""
import contextlib, io, json, runpy, sys
results = {}
for target in json.loads(sys.argv[1]):
    sys.argv = [target, "--help"]
    out = io.StringIO()
    code = "returned"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if target.endswith(".py"):
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    results[target] = {"code": code, "out": out.getvalue()}
sys.__stdout__.write(json.dumps(results))
"""


def entry_points() -> list[str]:
    """Module names (``arpo.main_arpo``) and script paths (``experiments/bench_engine.py``) with a __main__ block."""
    found = []
    for folder in ("arpo", "tools", "reward_fns"):
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            rel = path.relative_to(REPO_ROOT).as_posix()
            if rel in NOT_COMMANDS or not (_MAIN_BLOCK.search(path.read_text()) or path.name == "__main__.py"):
                continue
            found.append(rel.removesuffix("/__main__.py").removesuffix(".py").replace("/", "."))
    found += sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "experiments").glob("*.py")
                    if _MAIN_BLOCK.search(p.read_text()))
    return found


def test_one_entry_point_per_command():
    """``arpo.tables`` and ``arpo.eval`` are the commands; the modules that hold their logic are not runnable too."""
    points = entry_points()
    for command in ("arpo.main_arpo", "arpo.pipeline", "arpo.eval", "arpo.tables", "arpo.sft",
                    "arpo.data.synthetic", "arpo.models.pretrained", "arpo.models.tiny"):
        assert command in points
    assert "arpo.evaluation.tables" not in points and "arpo.evaluation.evaluate" not in points


@pytest.mark.slow  # ~35 s: one interpreter importing torch, vLLM and Ray for the benchmarks
def test_every_entry_point_prints_its_usage_and_exits_0():
    points = entry_points()
    r = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(points)], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout)
    bad = {t: res for t, res in results.items() if res["code"] not in (0, None) or "usage:" not in res["out"]}
    assert not bad, {t: (res["code"], res["out"][-500:]) for t, res in bad.items()}
    trainer = results["arpo.main_arpo"]["out"]
    assert "preset=NAME" in trainer and "grpo" in trainer and "tools:" in trainer and "synthetic:" in trainer
    assert "actor_rollout_ref" in trainer  # the sections a user may override
    pipeline = results["arpo.pipeline"]["out"]
    assert "default: tiny" in pipeline and "smollm2" in pipeline
    assert "configs/eval.yaml" in results["arpo.eval"]["out"]
    assert "--training-runs" in results["arpo.tables"]["out"]
