"""The retrieval server and its client end to end: a real uvicorn subprocess on 127.0.0.1, real HTTP."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tools.search.base import SearchBackendError
from tools.search.bm25 import BM25Backend, write_jsonl_corpus
from tools.search.build_corpus import synthetic_documents
from tools.search.client import RetrievalServerBackend
from tools.search.server import ServerProcess
from tools.search.tool import SearchTool

N_DOCS = 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("server") / "corpus.jsonl"
    write_jsonl_corpus(synthetic_documents(N_DOCS, seed=3), path)
    return path


@pytest.fixture(scope="module")
def server(corpus):
    with ServerProcess("--corpus", str(corpus), startup_timeout=90) as server:
        yield server


def test_health_reports_the_index(server):
    url = server.url
    info = RetrievalServerBackend(url).health()
    assert info["status"] == "ok" and info["backend"] == "bm25" and info["num_docs"] == N_DOCS


def test_concurrent_clients_get_the_in_process_answers(server, corpus):
    url = server.url
    local = BM25Backend(corpus)  # loads the index the server saved beside the corpus
    docs = local.index.docs
    queries = [f"{d.title} {d.text.split()[4]}" for d in docs[:60]]
    shared = RetrievalServerBackend(url, max_connections=8)
    with ThreadPoolExecutor(8) as pool:
        via_shared = list(pool.map(lambda q: shared.search(q, 5), queries))
        # separate clients (as separate rollout workers would have) see the same index
        via_own = list(pool.map(lambda q: RetrievalServerBackend(url).search(q, 5), queries[:16]))
    for q, hits in zip(queries, via_shared):
        expected = local.search(q, 5)
        assert [h.text for h in hits] == [h.text for h in expected]
        assert [h.score for h in hits] == pytest.approx([h.score for h in expected], rel=1e-6)
    assert via_own == via_shared[:16]
    assert all(hits[0].title == d.title for hits, d in zip(via_shared, docs))


def test_batch_endpoint_and_request_validation(server):
    url = server.url
    resp = httpx.post(f"{url}/batch_search", json={"queries": ["alpha", "beta gamma"], "top_k": 3})
    assert resp.status_code == 200 and len(resp.json()["results"]) == 2
    # an invalid top_k is a client error: reported at once, not retried
    backend = RetrievalServerBackend(url, max_retries=3)
    with pytest.raises(SearchBackendError, match="HTTP 422"):
        backend.search("anything", 0)
    assert backend.requests_sent == 1


def test_disk_cache_answers_after_the_server_is_gone(corpus, tmp_path):
    """Own server instance: this test stops it to prove the client cache answers without the network."""
    spec = tmp_path / "backend.yaml"  # this server gets its backend from a config block instead of --corpus
    spec.write_text(f"type: bm25\ncorpus_path: {corpus}\n")
    with ServerProcess("--backend-config", str(spec), startup_timeout=90) as server:
        url = server.url
        cache = tmp_path / "client_cache.sqlite"
        config = {"backend": {"type": "server", "url": url, "cache_path": str(cache), "max_retries": 1,
                              "backoff_base": 0.01, "timeout": 5.0}, "max_results": 3}
        tool = SearchTool(config)
        queries = [f"{d.title} history" for d in synthetic_documents(20, seed=3)]
        with ThreadPoolExecutor(4) as pool:
            online = list(pool.map(tool.call_text, queries))
        assert all(t.startswith("Page 1: ") for t in online)
        assert tool.backend.requests_sent == len(queries)
        assert tool.call_text(queries[0]) == online[0] and tool.backend.requests_sent == len(queries)
    # server gone: a new client (another worker) answers cached queries from disk, others become error text
    offline = SearchTool(config)
    assert [offline.call_text(q) for q in queries] == online
    assert offline.backend.requests_sent == 0
    err = offline.call_text("never asked before")
    assert err.startswith("Search error: server search failed after 2 attempts: connection failed")
