"""Experiment scripts (ablations, benchmarks) and what they share."""

from __future__ import annotations

import os
from pathlib import Path

from arpo.runtime.machine import git_sha  # noqa: F401 - the commit every result JSON records

REPO = Path(__file__).resolve().parents[1]


def environ_with(changes: dict[str, str]) -> dict[str, str]:
    """This process's environment with ``changes`` applied, an empty value unsetting its key (a child's settings)."""
    env = dict(os.environ)
    for key, value in changes.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def repo_path(path: Path) -> str:
    """``path`` relative to the repository when inside it (committed files hold no absolute paths)."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def repo_relative(text: str) -> str:
    """``text`` with this checkout's absolute path taken out, so committed results hold repo-relative paths."""
    return text.replace(str(REPO) + "/", "").replace(str(REPO), ".")
