"""The shared JSON Lines reader: line numbers, blank lines, the error's wording, and laziness."""

import json

import pytest

from arpo.data.jsonl import json_lines


def test_blank_lines_are_skipped_and_numbers_count_every_line():
    lines = ['{"a": 1}\n', "\n", "   \n", "[2]\n"]
    assert list(json_lines(lines, "x.jsonl", "fix it")) == [(1, {"a": 1}), (4, [2])]


def test_a_broken_line_names_the_source_the_line_and_the_fix():
    with pytest.raises(ValueError, match=r"^x.jsonl:2: not valid JSON \(.* at column 2\); one object a line$"):
        list(json_lines(['{"a": 1}\n', "{oops\n"], "x.jsonl", "one object a line"))


def test_lines_after_an_early_stop_are_not_parsed():
    rows = json_lines(['{"a": 1}\n', "{oops\n"], "x.jsonl", "fix it")
    assert next(rows) == (1, {"a": 1})


def test_a_benchmark_limit_stops_before_a_broken_line_past_it(tmp_path):
    from arpo.evaluation.benchmarks import load_jsonl_benchmark

    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n{oops\n")
    assert [item.question for item in load_jsonl_benchmark(path, "b", "sys", limit=1)] == ["q?"]
    assert load_jsonl_benchmark(path, "b", "sys", limit=0) == []
    with pytest.raises(ValueError, match="test.jsonl:2: not valid JSON"):
        load_jsonl_benchmark(path, "b", "sys")
