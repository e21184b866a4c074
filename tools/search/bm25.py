"""Offline BM25 search over a JSONL corpus (``bm25s``), built once, saved, and loaded fast.

Corpus format: one JSON object per line, ``{"id": ..., "title": ..., "text": ..., "url": ...}``;
only ``text`` is required. The index is saved in a directory (default: ``<corpus>.bm25/`` next to
the corpus, or a per-user cache directory when that is not writable) together with a ``meta.json``
that records the corpus size/mtime and the BM25 settings, so a changed corpus or changed settings
rebuild the index instead of silently serving a stale one. A file lock keeps concurrent workers from
building the same index twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from arpo.data.jsonl import json_lines
from tools.search.base import SearchBackend, SearchBackendError, SearchHit, resolve_path

logger = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 1
#: bm25s.tokenize's default token pattern (scikit-learn's CountVectorizer pattern)
_TOKEN_PATTERN = re.compile(r"(?u)\b\w\w+\b")
_DOCS_FILE = "docs.jsonl"
_META_FILE = "meta.json"


@dataclass(frozen=True)
class Document:
    """One corpus entry."""

    id: str
    title: str
    text: str
    url: str = ""


def load_jsonl_corpus(path: str | Path) -> list[Document]:
    """Read a JSONL corpus; a bad line raises ``ValueError`` naming the line, the field and the fix."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus_path: no file at {path}; give a JSONL file with one "
                                '{"id", "title", "text", "url"} object per line')
    docs: list[Document] = []
    with path.open(encoding="utf-8") as f:
        for lineno, row in json_lines(f, path, "each line must be one JSON object"):
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            text = row.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field 'text' must be a string (got {type(text).__name__}); "
                                 "every document needs its text under 'text'")
            docs.append(Document(
                id=str(row.get("id", lineno - 1)),
                title=str(row.get("title") or ""),
                text=text,
                url=str(row.get("url") or ""),
            ))
    if not docs:
        raise ValueError(f"{path}: the corpus is empty; BM25 needs at least one document")
    return docs


def write_jsonl_corpus(docs: Iterable[Document | dict[str, Any]], path: str | Path) -> int:
    """Write documents as a JSONL corpus; returns the number written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for d in docs:
            row = d if isinstance(d, dict) else {"id": d.id, "title": d.title, "text": d.text, "url": d.url}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def _stemmer(use_stemmer: bool):
    if not use_stemmer:
        return None
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        logger.warning("PyStemmer is not installed: BM25 runs without stemming (pip install PyStemmer)")
        return None
    return Stemmer.Stemmer("english")


class BM25Index:
    """A bm25s index plus the documents it ranks. ``search`` is read-only and safe from many threads."""

    def __init__(self, retriever, docs: list[Document], settings: dict[str, Any]):
        self._retriever = retriever
        self.docs = docs
        self.settings = settings
        self._stemmer = _stemmer(settings["stemmer"])
        if settings["stemmer"] and self._stemmer is None:
            raise RuntimeError("this index was built with stemming but PyStemmer is missing")
        from bm25s.tokenization import _infer_stopwords

        self._stopwords = frozenset(_infer_stopwords(settings["stopwords"]))

    @classmethod
    def build(cls, docs: list[Document], k1: float = 1.5, b: float = 0.75, method: str = "lucene",
              use_stemmer: bool = True, stopwords: str = "en") -> "BM25Index":
        import bm25s

        if not docs:
            raise ValueError("BM25 needs at least one document")
        stemmer = _stemmer(use_stemmer)
        settings = {"k1": k1, "b": b, "method": method, "stemmer": stemmer is not None, "stopwords": stopwords}
        texts = [f"{d.title} {d.text}" if d.title else d.text for d in docs]
        tokens = bm25s.tokenize(texts, stopwords=stopwords, stemmer=stemmer, return_ids=True,
                                show_progress=len(texts) > 50_000)
        retriever = bm25s.BM25(k1=k1, b=b, method=method)
        retriever.index(tokens, show_progress=len(texts) > 50_000)
        return cls(retriever, docs, settings)

    def save(self, index_dir: str | Path, extra_meta: dict[str, Any] | None = None) -> None:
        """Write the index atomically: into a temp dir first, then renamed into place."""
        index_dir = Path(index_dir)
        index_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=index_dir.name + ".tmp", dir=index_dir.parent))
        try:
            self._retriever.save(str(tmp), show_progress=False)
            write_jsonl_corpus(self.docs, tmp / _DOCS_FILE)
            meta = {"format_version": INDEX_FORMAT_VERSION, "settings": self.settings,
                    "num_docs": len(self.docs), **(extra_meta or {})}
            (tmp / _META_FILE).write_text(json.dumps(meta, indent=1))
            if index_dir.exists():
                shutil.rmtree(index_dir)
            os.replace(tmp, index_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    @classmethod
    def load(cls, index_dir: str | Path, mmap: bool = False) -> "BM25Index":
        import bm25s

        index_dir = Path(index_dir)
        meta = read_meta(index_dir)
        if meta is None:
            raise FileNotFoundError(f"no BM25 index at {index_dir} (missing {_META_FILE})")
        retriever = bm25s.BM25.load(str(index_dir), mmap=mmap, show_progress=False, verbosity=0)
        docs = load_jsonl_corpus(index_dir / _DOCS_FILE)
        return cls(retriever, docs, meta["settings"])

    def query_tokens(self, query: str) -> list[str]:
        """The query's terms exactly as ``bm25s.tokenize`` makes them at indexing time.

        Re-implemented because ``bm25s.tokenize`` builds three tqdm bars per call, which cost more
        than scoring the whole corpus; a test checks both agree.
        """
        tokens = [t for t in _TOKEN_PATTERN.findall(query.lower()) if t not in self._stopwords]
        if self._stemmer is not None and tokens:
            tokens = self._stemmer.stemWords(tokens)
        return tokens

    def _query_token_ids(self, query: str) -> list[int]:
        return self._retriever.get_tokens_ids(self.query_tokens(query))

    def search(self, query: str, top_k: int) -> list[SearchHit]:
        """Top ``top_k`` documents that share at least one term with the query (score > 0), best first."""
        ids = self._query_token_ids(query)
        if not ids or top_k <= 0:
            return []
        scores = self._retriever.get_scores_from_ids(ids)
        k = min(top_k, len(scores))
        top = np.argpartition(-scores, k - 1)[:k]
        # stable order on ties (lower doc index first) keeps results reproducible across runs
        top = top[np.lexsort((top, -scores[top]))]
        hits = []
        for i in top:
            s = float(scores[i])
            if s <= 0.0:
                break
            d = self.docs[int(i)]
            hits.append(SearchHit(title=d.title, text=d.text, url=d.url, score=s))
        return hits


def read_meta(index_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(index_dir) / _META_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _corpus_fingerprint(corpus_path: Path) -> dict[str, Any]:
    st = corpus_path.stat()
    return {"corpus_path": str(corpus_path), "corpus_size": st.st_size, "corpus_mtime_ns": st.st_mtime_ns}


def default_index_dir(corpus_path: Path) -> Path:
    """``<corpus>.bm25`` next to the corpus when that folder is writable, else a per-user cache dir."""
    beside = corpus_path.with_name(corpus_path.name + ".bm25")
    if os.access(corpus_path.parent, os.W_OK):
        return beside
    digest = hashlib.sha1(str(corpus_path).encode()).hexdigest()[:16]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arpo" / "bm25"
    return cache_root / f"{corpus_path.stem}-{digest}"


def open_index(corpus_path: str | Path, index_dir: str | Path | None = None, rebuild: bool = False,
               mmap: bool = False, **settings: Any) -> BM25Index:
    """Load the saved index for a corpus, building (and saving) it first if missing or stale.

    ``mmap=True`` memory-maps the score arrays so many worker processes share one copy in the page cache.
    """
    corpus_path = resolve_path(corpus_path)
    if not corpus_path.is_file():
        raise FileNotFoundError(f"corpus_path: no file at {corpus_path}; build one with "
                                "`python -m tools.search.corpus` or point corpus_path at your JSONL corpus")
    index_dir = resolve_path(index_dir) if index_dir else default_index_dir(corpus_path)
    wanted = {"k1": 1.5, "b": 0.75, "method": "lucene", "use_stemmer": True, "stopwords": "en", **settings}
    fingerprint = _corpus_fingerprint(corpus_path)

    def fresh(meta: dict[str, Any] | None) -> bool:
        if rebuild or meta is None or meta.get("format_version") != INDEX_FORMAT_VERSION:
            return False
        s = meta["settings"]
        same_settings = (s["k1"], s["b"], s["method"], s["stopwords"]) == (
            wanted["k1"], wanted["b"], wanted["method"], wanted["stopwords"])
        # an index built without a stemmer is still valid when stemming was asked for but is unavailable
        stem_ok = s["stemmer"] == (wanted["use_stemmer"] and _stemmer(wanted["use_stemmer"]) is not None)
        return same_settings and stem_ok and all(meta.get(k) == v for k, v in fingerprint.items())

    index_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(str(index_dir) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per index; the others wait, then load
        if fresh(read_meta(index_dir)):
            return BM25Index.load(index_dir, mmap=mmap)
        logger.info("building BM25 index for %s into %s", corpus_path, index_dir)
        index = BM25Index.build(load_jsonl_corpus(corpus_path), **wanted)
        index.save(index_dir, extra_meta=fingerprint)
        return BM25Index.load(index_dir, mmap=mmap) if mmap else index


class BM25Backend(SearchBackend):
    """Search a local JSONL corpus with BM25 (see module docstring for the index lifecycle)."""

    kind = "bm25"

    def __init__(self, corpus_path: str | Path | None = None, index_dir: str | Path | None = None,
                 rebuild: bool = False, mmap: bool = False, index: BM25Index | None = None, **settings: Any):
        if index is None:
            if corpus_path is None:
                raise ValueError("bm25 backend: set 'corpus_path' to a JSONL corpus file")
            index = open_index(corpus_path, index_dir=index_dir, rebuild=rebuild, mmap=mmap, **settings)
        self.index = index

    @property
    def num_docs(self) -> int:
        return len(self.index.docs)

    def search(self, query: str, top_k: int) -> list[SearchHit]:
        try:
            return self.index.search(query, top_k)
        except Exception as e:  # a scoring bug must not kill a rollout worker
            raise SearchBackendError(f"BM25 search failed: {type(e).__name__}: {e}") from e
