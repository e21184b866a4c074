"""Retrieval server: one process holds the index, rollout workers query it over HTTP on 127.0.0.1.

    python -m tools.search.server --corpus data/corpus.jsonl --port 8000
    python -m tools.search.server --arpo-cache $ARPO_DATA/search_cache/search_cache.json --port 8000
    python -m tools.search.server --backend-config my_backend.yaml --port 8000   # any backend block, e.g. a
                                                                               # web backend with a cache_path

Endpoints: ``POST /search {"query", "top_k"} -> {"hits": [...]}``, ``POST /batch_search
{"queries", "top_k"} -> {"results": [[...], ...]}``, ``GET /health``. Handlers are plain functions,
so FastAPI runs them in its thread pool and slow queries do not block the event loop.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from tools.search.base import REPO_ROOT, SearchBackend, SearchBackendError

logger = logging.getLogger(__name__)

MAX_TOP_K = 100


class SearchRequest(BaseModel):
    query: str
    top_k: int = Field(10, ge=1, le=MAX_TOP_K)


class BatchSearchRequest(BaseModel):
    queries: list[str]
    top_k: int = Field(10, ge=1, le=MAX_TOP_K)


def create_app(backend: SearchBackend) -> FastAPI:
    """The FastAPI app serving one backend."""
    app = FastAPI(title="ARPO retrieval server")
    stats = {"queries": 0, "started": time.time()}

    def run(query: str, top_k: int) -> list[dict[str, Any]]:
        try:
            hits = backend.search(query, top_k)
        except SearchBackendError as e:
            raise HTTPException(status_code=502, detail=str(e))
        stats["queries"] += 1
        return [h.to_dict() for h in hits]

    @app.get("/health")
    def health() -> dict[str, Any]:
        info: dict[str, Any] = {"status": "ok", "backend": backend.kind, "queries": stats["queries"],
                                "uptime_s": round(time.time() - stats["started"], 3)}
        num_docs = getattr(backend, "num_docs", None)
        if num_docs is not None:
            info["num_docs"] = num_docs
        return info

    @app.post("/search")
    def search(req: SearchRequest) -> dict[str, Any]:
        return {"hits": run(req.query, req.top_k)}

    @app.post("/batch_search")
    def batch_search(req: BatchSearchRequest) -> dict[str, Any]:
        return {"results": [run(q, req.top_k) for q in req.queries]}

    return app


class ServerProcess:
    """The server as a subprocess on a free port of 127.0.0.1, for scripts and tests: ``with
    ServerProcess("--corpus", path) as server: RetrievalServerBackend(server.url)``. Ready (``/health``
    answers) when the block starts; stopped when it ends."""

    def __init__(self, *source_args: str, startup_timeout: float = 300.0):
        self.args, self.startup_timeout = source_args, startup_timeout
        self.url = ""

    def __enter__(self) -> "ServerProcess":
        import httpx

        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.search.server", *self.args, "--port", "0"],
                                     cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        try:
            first = self.proc.stdout.readline()  # the address line, or EOF when the server dies first
            if not first.startswith("retrieval server on "):
                self.fail("exited before announcing its address")
            self.url = first.split()[-1]
            deadline = time.monotonic() + self.startup_timeout
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                        return self
                if self.proc.poll() is not None:
                    self.fail(f"exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    self.fail(f"did not answer /health within {self.startup_timeout:.0f} s")
                time.sleep(0.2)
        except BaseException:
            self.__exit__()
            raise

    def fail(self, what: str) -> None:
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace")[-2000:]
        raise RuntimeError(f"retrieval server ({' '.join(self.args)}) {what}:\n{tail}")

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", help="JSONL corpus ({id,title,text,url} per line) to serve with BM25")
    src.add_argument("--arpo-cache", help="ARPO search_cache.json to replay (misses: BM25 over its snippets)")
    src.add_argument("--backend-config", help="YAML file holding one backend block ({type: ..., ...}); "
                                              "see tools.search.factory")
    parser.add_argument("--index-dir", default=None, help="where the BM25 index lives (default: beside the corpus)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the BM25 index even if a fresh one exists")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000,
                        help="0: the OS picks a free port; the first stdout line names the address either way")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper())
    logging.getLogger("bm25s").setLevel(args.log_level.upper())  # bm25s sets its own level otherwise
    if args.corpus:
        from tools.search.bm25 import BM25Backend

        backend: SearchBackend = BM25Backend(args.corpus, index_dir=args.index_dir, rebuild=args.rebuild)
    elif args.arpo_cache:
        from tools.search.arpo_cache import ArpoCacheBackend

        backend = ArpoCacheBackend(args.arpo_cache)
    else:
        from omegaconf import OmegaConf

        from tools.search.factory import build_backend

        spec = OmegaConf.to_container(OmegaConf.load(args.backend_config), resolve=True)
        backend = build_backend(spec, where=args.backend_config)

    import uvicorn

    # Bound here, not by uvicorn, so that port 0 is resolved before the address is announced: a caller that
    # probes a free port and passes it can lose it to another socket before the server binds.
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"retrieval server on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(backend), log_level=args.log_level))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
