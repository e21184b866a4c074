from __future__ import annotations

import time
from typing import Any

import pytest

from arpo.testing.scripted_engine import build_chat_tokenizer
from tools.base import BaseTool


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return build_chat_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


class EchoSearch(BaseTool):
    """A search tool that answers ``results for <query>`` (optionally padded and slow)."""

    name = "search"

    def __init__(self, pad: int = 0, latency_s: float = 0.0, **kw: Any):
        super().__init__(**kw)
        self.pad, self.latency_s = pad, latency_s
        self.queries: list[str] = []
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each call, perf_counter seconds

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "search", "description": "web search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

    def call_text(self, content: str) -> str:
        self.queries.append(content)
        start = time.perf_counter()
        if self.latency_s:
            time.sleep(self.latency_s)
        self.intervals.append((start, time.perf_counter()))
        return f"results for {content}" + "x" * self.pad


class BrokenPython(BaseTool):
    """A python tool whose implementation raises (the loop must turn that into text)."""

    name = "python"

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "python", "description": "run code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def call_text(self, content: str) -> str:
        raise RuntimeError("sandbox exploded")
