"""Search throughput: BM25 in-process and through the retrieval server, on a synthetic corpus and ARPO's cache.

    python experiments/bench_search.py                      # ~5k synthetic docs + ARPO cache if present
    python experiments/bench_search.py --docs 20000 --queries 2000 --concurrency 1 8 16
    python experiments/bench_search.py --docs 200 --queries 20 --concurrency 1 2     # smoke: seconds

Prints one JSON object: index build/load seconds and queries/s for each (corpus, path, concurrency).
The ARPO cache is read from --arpo-cache (default: the release data root's, ``$ARPO_DATA``);
its section reports exact-replay hits and BM25 misses (reordered recorded queries) separately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


from tools.search.arpo_cache import ArpoCacheBackend, load_arpo_cache  # noqa: E402
from tools.search.base import NO_RESULTS, SearchBackend  # noqa: E402
from tools.search.bm25 import BM25Backend, open_index, write_jsonl_corpus  # noqa: E402
from tools.search.build_corpus import synthetic_documents  # noqa: E402
from tools.search.client import RetrievalServerBackend  # noqa: E402
from tools.search.server import ServerProcess  # noqa: E402


def throughput(search: Callable[[str], object], queries: list[str], concurrency: int) -> dict[str, float]:
    start = time.perf_counter()
    if concurrency == 1:
        for q in queries:
            search(q)
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(search, queries))
    elapsed = time.perf_counter() - start
    return {"queries": len(queries), "seconds": round(elapsed, 3), "qps": round(len(queries) / elapsed, 1)}


def bench_backend(backend: SearchBackend, queries: list[str], top_k: int, concurrency: list[int]) -> dict:
    return {f"c{c}": throughput(lambda q: backend.search(q, top_k), queries, c) for c in concurrency}


def bench_server(source_args: list[str], queries: list[str], top_k: int, concurrency: list[int]) -> dict:
    with ServerProcess(*source_args) as server:
        client = RetrievalServerBackend(server.url, max_connections=max(concurrency))
        client.search(queries[0], top_k)  # warm the connection
        out = bench_backend(client, queries, top_k, concurrency)
        client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=5000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    from arpo.data.release import data_root

    parser.add_argument("--arpo-cache", default=str(data_root() / "search_cache" / "search_cache.json"))
    parser.add_argument("--no-server", action="store_true", help="skip the through-the-server measurements")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    result: dict = {"machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
                    "top_k": args.top_k}

    with tempfile.TemporaryDirectory(prefix="bench_search_") as tmp:
        corpus = Path(tmp) / "synthetic.jsonl"
        docs = synthetic_documents(args.docs, seed=args.seed)
        write_jsonl_corpus(docs, corpus)
        t0 = time.perf_counter()
        open_index(corpus)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        backend = BM25Backend(corpus)
        load_s = time.perf_counter() - t0
        # queries name an entity plus a few words of its text, like an agent's keyword search
        queries = []
        for _ in range(args.queries):
            d = rng.choice(docs)
            words = d.text.split()
            queries.append(" ".join([d.title, *rng.sample(words, 4)]))
        result["synthetic"] = {
            "docs": len(docs), "index_build_s": round(build_s, 3), "index_load_s": round(load_s, 4),
            "in_process": bench_backend(backend, queries, args.top_k, args.concurrency),
        }
        if not args.no_server:
            result["synthetic"]["server"] = bench_server(["--corpus", str(corpus)], queries, args.top_k,
                                                         args.concurrency)

    cache_path = Path(args.arpo_cache)
    if cache_path.is_file():
        cache = load_arpo_cache(cache_path)
        t0 = time.perf_counter()
        replay = ArpoCacheBackend(cache_path)
        build_s = time.perf_counter() - t0
        recorded = [q for q, v in cache.items() if v != NO_RESULTS]
        hits = [rng.choice(recorded) for _ in range(args.queries)]
        misses = [" ".join(reversed(q.split())) for q in hits]  # same words, never recorded
        misses = [q for q in misses if replay.lookup(q) is None]
        result["arpo_cache"] = {
            "recorded_queries": len(cache), "snippet_docs": replay.fallback.num_docs,
            "load_and_index_s": round(build_s, 3),
            "in_process_exact_hits": bench_backend(replay, hits, args.top_k, args.concurrency),
            "in_process_bm25_misses": bench_backend(replay, misses, args.top_k, args.concurrency),
        }
        if not args.no_server:
            result["arpo_cache"]["server_bm25_misses"] = bench_server(
                ["--arpo-cache", str(cache_path)], misses, args.top_k, args.concurrency)
    else:
        result["arpo_cache"] = f"skipped: no ARPO search cache at {cache_path} (set --arpo-cache or ARPO_DATA; python -m arpo.data.release --only search-cache fetches it)"

    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
