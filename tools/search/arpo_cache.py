"""Replay of ARPO's recorded web searches (``search_cache.json``: ``{query: "Page 1: …\\nPage 2: …"}``).

A query recorded in the cache is answered with exactly the recorded pages (ARPO keys the cache by the
query with double quotes removed; we also accept case/whitespace variants). A query that was never
recorded goes to a fallback: by default BM25 over the cache's own snippets (every page of every
recorded answer, deduplicated), or any other configured backend, or nothing (``fallback: none``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tools.search.base import (
    SearchBackend,
    SearchHit,
    clean_query,
    normalize_query,
    parse_pages,
    resolve_path,
)
from tools.search.bm25 import BM25Backend, BM25Index, Document

logger = logging.getLogger(__name__)


def load_arpo_cache(path: str | Path) -> dict[str, str]:
    """Read an ARPO search cache; errors name the file and what is wrong with it."""
    path = resolve_path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"cache_path: no ARPO search cache at {path}; it ships with the ARPO release as "
            "search_cache/search_cache.json: python -m arpo.data.release --only search-cache (into $ARPO_DATA), "
            "or set cache_path to its location")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"cache_path: {path} is not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError(f"cache_path: {path} must be a JSON object mapping query -> result text")
    return data


def cache_documents(cache: dict[str, str]) -> list[Document]:
    """Every recorded page as a document (duplicates across queries kept once, first occurrence wins)."""
    docs: list[Document] = []
    seen: set[str] = set()
    for qi, (query, text) in enumerate(cache.items()):
        for pi, snippet in enumerate(parse_pages(text), 1):
            s = snippet.strip()
            if s and s not in seen:
                seen.add(s)
                # title stays empty: the model saw bare snippets in ARPO, and the recording query is not a title
                docs.append(Document(id=f"{qi}-{pi}", title="", text=s))
    return docs


class ArpoCacheBackend(SearchBackend):
    """Answer from ARPO's search cache; unseen queries go to ``fallback`` (see module docstring)."""

    kind = "arpo_cache"

    def __init__(self, cache_path: str | Path | None = None, fallback: SearchBackend | str | None = "snippets",
                 cache: dict[str, str] | None = None, **bm25_settings: Any):
        if cache is None:
            if cache_path is None:
                raise ValueError("arpo_cache backend: set 'cache_path' to ARPO's search_cache.json")
            cache = load_arpo_cache(cache_path)
        self.cache_path = str(cache_path) if cache_path else None
        self._exact: dict[str, list[str]] = {}
        self._normalized: dict[str, list[str]] = {}
        for query, text in cache.items():
            pages = parse_pages(text)
            self._exact[clean_query(query)] = pages
            self._normalized.setdefault(normalize_query(query), pages)
        if fallback == "snippets":
            docs = cache_documents(cache)
            self.fallback: SearchBackend | None = (
                BM25Backend(index=BM25Index.build(docs, **bm25_settings)) if docs else None)
        elif fallback in (None, "none"):
            self.fallback = None
        elif isinstance(fallback, SearchBackend):
            self.fallback = fallback
        else:
            raise ValueError(f"arpo_cache backend: fallback must be 'snippets', 'none' or a backend spec, "
                             f"got {fallback!r}")
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._exact)

    def lookup(self, query: str) -> list[str] | None:
        """The recorded pages for a query, or None if it was never recorded."""
        pages = self._exact.get(clean_query(query))
        if pages is None:
            pages = self._normalized.get(normalize_query(query))
        return pages

    def search(self, query: str, top_k: int) -> list[SearchHit]:
        pages = self.lookup(query)
        if pages is not None:
            self.hits += 1
            # rank-decreasing scores keep the recorded page order meaningful to score-based consumers
            return [SearchHit(title="", text=p, score=float(len(pages) - i)) for i, p in enumerate(pages[:top_k])]
        self.misses += 1
        if self.fallback is None:
            return []
        return self.fallback.search(query, top_k)

    def close(self) -> None:
        if self.fallback is not None:
            self.fallback.close()
