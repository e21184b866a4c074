"""Replay of ARPO's search cache: exact answers for recorded queries, BM25 over its snippets for unseen ones.

Tests marked ``shared_data`` read the real cache from the release data root (``$ARPO_DATA``)
and skip when it is absent; the rest use a small cache the test writes.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tools.search.arpo_cache import ArpoCacheBackend, cache_documents, load_arpo_cache
from tools.search.base import NO_RESULTS, parse_pages
from tools.search.bm25 import write_jsonl_corpus
from tools.search.factory import build_backend
from tools.search.tool import SearchTool
from tests.conftest import shared_data_dir

SHARED = shared_data_dir()
CACHE_JSON = SHARED / "search_cache" / "search_cache.json"

SMALL = {
    "Amy Smart film debut": "Page 1: Amy Smart made her debut in a 1996 television thriller.\n"
                            "Page 2: Campfire Tales is a 1997 anthology horror film.",
    "capital of Norvania": "Page 1: The capital of Norvania is Kalotenvor.",
    "unanswerable question": NO_RESULTS,
}


@pytest.fixture
def small_cache(tmp_path):
    path = tmp_path / "search_cache.json"
    path.write_text(json.dumps(SMALL))
    return path


def tool_for(cache_path, **backend):
    return SearchTool({"backend": {"type": "arpo_cache", "cache_path": str(cache_path), **backend}})


def test_recorded_queries_replay_exactly(small_cache):
    tool = tool_for(small_cache)
    for query, text in SMALL.items():
        assert tool.call_text(query) == text
    # ARPO strips double quotes before looking up; case and spacing variants hit the same record
    assert tool.call_text('"capital of Norvania"') == SMALL["capital of Norvania"]
    assert tool.call_text("  Capital  OF norvania ") == SMALL["capital of Norvania"]
    assert tool.backend.hits == 5 and tool.backend.misses == 0


def test_unseen_query_uses_bm25_over_cached_snippets(small_cache):
    tool = tool_for(small_cache)
    out = tool.call_text("Which horror anthology film came out in 1997?")
    assert parse_pages(out)[0] == "Campfire Tales is a 1997 anthology horror film."
    assert tool.backend.misses == 1
    assert tool.call_text("completely unrelated xylophone") == NO_RESULTS


def test_fallback_none_and_fallback_backend(small_cache, tmp_path):
    assert tool_for(small_cache, fallback="none").call_text("which anthology film") == NO_RESULTS
    corpus = tmp_path / "corpus.jsonl"
    write_jsonl_corpus([{"title": "Xylophone", "text": "A xylophone is a percussion instrument."}], corpus)
    backend = build_backend({"type": "arpo_cache", "cache_path": str(small_cache),
                             "fallback": {"type": "bm25", "corpus_path": str(corpus)}})
    tool = SearchTool({}, backend=backend)
    assert tool.call_text("xylophone instrument") == "Page 1: Xylophone: A xylophone is a percussion instrument."
    assert tool.call_text("capital of Norvania") == SMALL["capital of Norvania"]  # the cache still wins


def test_cache_documents_deduplicate_pages():
    docs = cache_documents({"a": "Page 1: same\nPage 2: x", "b": "Page 1: same", "c": NO_RESULTS})
    assert [d.text for d in docs] == ["same", "x"]


def test_bad_cache_files_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="cache_path: no ARPO search cache"):
        load_arpo_cache(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must be a JSON object mapping query -> result text"):
        load_arpo_cache(bad)
    with pytest.raises(ValueError, match="fallback must be 'snippets', 'none'"):
        ArpoCacheBackend(cache={}, fallback="google")


@pytest.fixture(scope="module")
def shared_cache():
    if not CACHE_JSON.is_file():
        pytest.skip(f"ARPO release data not found at {CACHE_JSON}; set ARPO_DATA to the data root holding "
                    "search_cache/search_cache.json (from the ARPO release) to run this test")
    return load_arpo_cache(CACHE_JSON)


@pytest.fixture(scope="module")
def shared_tool(shared_cache):
    return tool_for(CACHE_JSON)


@pytest.mark.shared_data
def test_shared_cache_answers_every_recorded_query_exactly(shared_cache, shared_tool):
    assert len(shared_cache) == 1000
    mismatched = [q for q, text in shared_cache.items() if shared_tool.call_text(q) != text]
    assert mismatched == []
    assert shared_tool.backend.misses == 0


@pytest.mark.shared_data
def test_shared_cache_unseen_queries_go_through_bm25(shared_cache, shared_tool):
    snippets = {d.text for d in cache_documents(shared_cache)}
    rng = random.Random(0)
    candidates = [q for q, v in shared_cache.items() if len(q.split()) >= 3 and v != NO_RESULTS and len(q) < 300]
    found = 0
    for query in rng.sample(candidates, 50):
        unseen = " ".join(reversed(query.split()))  # same words, never recorded
        assert shared_tool.backend.lookup(unseen) is None
        pages = parse_pages(shared_tool.call_text(unseen))
        assert 1 <= len(pages) <= 10 and set(pages) <= snippets
        found += bool(set(pages) & set(parse_pages(shared_cache[query])))
    # the reordered query still retrieves at least one page recorded for the original (96/100 measured)
    assert found >= 45
    assert shared_tool.call_text("Who directed the 1997 film Campfire Tales?").count("Campfire Tales") >= 3
