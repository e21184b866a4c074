"""Experiment scripts (ablations, benchmarks) and what they share."""

from __future__ import annotations

from pathlib import Path

from arpo.machine import git_sha  # noqa: F401 - the commit every result JSON records

REPO = Path(__file__).resolve().parents[1]
