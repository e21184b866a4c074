"""The tool thread pool: results, retries (errors and empty results), timeouts, failures as text."""

from __future__ import annotations

import time

import pytest

from arpo.rollout.tool_executor import ToolExecutor, truncate_text
from tests.rollout.fake_tools import BrokenSearch, FakePython, FakeSearch, FlakyTool, SlowTool


def test_runs_tools_by_tag_name_in_order():
    with ToolExecutor([FakeSearch(), FakePython()]) as ex:
        res = ex.run_many([("python", "print(2 + 3)"), ("search", "capital of France"), ("python", "x")])
    assert [r.text for r in res] == ["5", "Doc 1: France of capital is known.\nDoc 2: about 3 things.",
                                     "SyntaxError: unsupported"]
    assert all(r.ok and r.attempts == 1 for r in res)


def test_exception_becomes_text_after_retries():
    with ToolExecutor([BrokenSearch()], retries=2) as ex:
        (res,) = ex.run_many([("search", "q")])
    assert not res.ok and res.attempts == 3 and res.error == "exception"
    assert res.text == "Error: tool 'search' failed: ConnectionError: search server unreachable"


def test_empty_result_is_retried_like_arpo():
    tool = FlakyTool(failures=2, mode="empty")
    with ToolExecutor([tool], retries=3) as ex:
        (res,) = ex.run_many([("search", "q")])
    assert res.ok and res.attempts == 3 and res.text == "ok after 3 calls" and tool.calls == 3

    tool = FlakyTool(failures=2, mode="empty")
    with ToolExecutor([tool], retries=3, retry_on_empty=False) as ex:
        (res,) = ex.run_many([("search", "q")])
    assert res.ok and res.attempts == 1 and res.text == "" and tool.calls == 1

    tool = FlakyTool(failures=10, mode="empty")
    with ToolExecutor([tool], retries=1) as ex:
        (res,) = ex.run_many([("search", "q")])
    assert not res.ok and res.error == "empty result" and res.attempts == 2 and res.text == ""


def test_transient_exception_recovers():
    with ToolExecutor([FlakyTool(failures=1, mode="raise")], retries=1) as ex:
        (res,) = ex.run_many([("search", "q")])
    assert res.ok and res.attempts == 2 and res.text == "ok after 2 calls"


def test_timeout_becomes_text():
    with ToolExecutor([SlowTool(0.5)], timeout_s=0.05, retries=1) as ex:
        t0 = time.perf_counter()
        (res,) = ex.run_many([("search", "q")])
        elapsed = time.perf_counter() - t0
    assert not res.ok and res.error == "timeout" and res.attempts == 2
    assert res.text == "Error: tool 'search' timed out after 0.05 s."
    assert elapsed < 0.4


def test_unknown_tool_is_text():
    with ToolExecutor([FakeSearch()]) as ex:
        (res,) = ex.run_many([("browser", "q")])
    assert not res.ok and res.attempts == 0 and "unknown tool 'browser'" in res.text and "search" in res.text


def test_calls_run_concurrently():
    with ToolExecutor([SlowTool(0.2)], max_workers=8) as ex:
        t0 = time.perf_counter()
        res = ex.run_many([("search", str(i)) for i in range(8)])
        elapsed = time.perf_counter() - t0
    assert [r.text for r in res] == [f"slow {i}" for i in range(8)]
    assert elapsed < 0.2 * 8 / 2


def test_truncate_text_keeps_the_side_asked_for():
    assert truncate_text("abc", None) == "abc" and truncate_text("abc", 3) == "abc"
    assert truncate_text("a" * 10 + "b" * 10, 10) == "aaaaa...(truncated)...bbbbb"
    assert truncate_text("a" * 10 + "b" * 10, 10, "left") == "a" * 10 + "...(truncated)"
    assert truncate_text("a" * 10 + "b" * 10, 10, "right") == "(truncated)..." + "b" * 10
    with pytest.raises(ValueError, match="use one of"):
        truncate_text("a" * 20, 10, "top")
    with ToolExecutor([FakeSearch()], max_result_chars=12) as ex:
        (res,) = ex.run_many([("search", "a b c d e f")])
    assert "...(truncated)..." in res.text
