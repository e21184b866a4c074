"""Fixtures for the reward tests: the shared ARPO eval files and ARPO-protocol responses."""

from __future__ import annotations

import json

import pytest

from arpo.protocol import format_tool_result
from tests.conftest import REPO as REPO_ROOT, shared_data_dir  # noqa: F401 (REPO_ROOT: for the tests here)


@pytest.fixture(scope="session")
def eval_rows():
    """Loader for ``eval/<bench>/test.jsonl`` of the shared ARPO data; skips when the data is absent."""
    root = shared_data_dir()

    def load(bench: str) -> list[dict]:
        path = root / "eval" / bench / "test.jsonl"
        if not path.is_file():
            pytest.skip(f"ARPO release data not found at {path}; set ARPO_DATA to a data root holding eval/")
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    return load


def respond(*steps: tuple[str, str, str], answer: str, think: str = "I can answer now.") -> str:
    """A response as the ARPO rollout writes it: per (tool, query, result) step a think block and the tool
    call with the result the rollout appended, then a think block and the boxed final answer."""
    parts = []
    for tool, query, result in steps:
        parts.append(f"<think> I should use {tool} for this. </think>\n<{tool}> {query} </{tool}>"
                     + format_tool_result(result) + "\n")
    parts.append(f"<think> {think} </think>\n<answer> The final answer is \\[ \\boxed{{{answer}}} \\] </answer>")
    return "".join(parts)


SEARCH_CITIBANK = ("search", "Citibank founded year",
                   "Page 1: Citibank was founded in 1812 as the City Bank of New York.\n"
                   "Page 2: James Madison was the fourth president of the United States (1809-1817).")
PYTHON_CHECK = ("python", "print(1809 <= 1812 <= 1817)", "True")


def pytest_collection_modifyitems(config, items):
    """Mark the reward tests that read the shared data (``-m "not shared_data"`` deselects them)."""
    for item in items:
        if "eval_rows" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.shared_data)
