"""Tool registry: verl-style YAML, lookup by ARPO tag and by function name, config errors that say the fix."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
import yaml

from tools.base import BaseTool
from tools.registry import ToolConfigError, ToolRegistry, build_tool, load_tools
from tools.search.base import REPO_ROOT
from tools.search.bm25 import write_jsonl_corpus
from tools.search.tool import SearchTool

HAVE_PYTHON_TOOL = importlib.util.find_spec("tools.python_sandbox.tool") is not None
PYTHON_CLASS = "tools.python_sandbox.tool.PythonTool" if HAVE_PYTHON_TOOL else f"{__name__}.UpperTool"


class UpperTool(BaseTool):
    """Test-only stand-in for the python tool: upper-cases its input (tag name ``python``)."""

    name = "python"

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "python", "description": "test tool",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}

    def call_text(self, content: str) -> str:
        return content.upper()


class NotATool:
    pass


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_jsonl_corpus([{"title": "Berlin", "text": "Berlin is the capital of Germany."},
                        {"title": "Paris", "text": "Paris is the capital of France."}], path)
    return path


def write_yaml(tmp_path, data) -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def search_entry(corpus, **extra):
    return {"class_name": "tools.search.tool.SearchTool",
            "config": {"backend": {"type": "bm25", "corpus_path": str(corpus)}, "max_results": 1}, **extra}


def test_yaml_load_and_lookup_by_tag_and_function(tmp_path, corpus):
    renamed = {"type": "function", "function": {
        "name": "web_search", "description": "Search.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
    path = write_yaml(tmp_path, {"tools": [search_entry(corpus, tool_schema=renamed),
                                           {"class_name": PYTHON_CLASS, "config": {}}]})
    reg = load_tools(path)
    assert isinstance(reg, ToolRegistry) and reg.tags == ["search", "python"] and len(reg) == 2
    search = reg["search"]
    assert isinstance(search, SearchTool)
    assert reg["web_search"] is search and reg.by_function("web_search") is search and reg.by_tag("search") is search
    assert "web_search" in reg and "search" in reg and "browser" not in reg
    expected = "Page 1: Berlin: Berlin is the capital of Germany."
    assert reg.call("search", "capital of Germany") == expected  # ARPO tag call: the text inside the tag
    assert reg.call("web_search", {"query": "capital of Germany"}) == expected  # function call
    assert [s["function"]["name"] for s in reg.schemas()] == ["web_search", "python"]
    assert reg.call("browser", "x").startswith("Error: there is no tool named 'browser'")
    with pytest.raises(KeyError, match="no tool named 'browser'"):
        reg["browser"]
    assert asyncio.run(reg.acall("search", "capital of Germany")) == expected
    assert asyncio.run(reg.acall("browser", "x")).startswith("Error: there is no tool named 'browser'")
    if HAVE_PYTHON_TOOL:  # the real sandbox: the same object answers the tag call and the function call
        assert reg.call("python", "print(6 * 7)").strip() == "42"
        assert reg.call("python", {"code": "print(6 * 7)"}).strip() == "42"
    else:
        assert reg.call("python", "print(1)") == "PRINT(1)"
        assert asyncio.run(reg.acall("python", "print(1)")) == "PRINT(1)"  # no acall_text: runs in a thread
    reg.close()
    reg.close()  # closing twice is safe


def test_repo_configs_load(tmp_path, corpus, monkeypatch):
    """configs/tools/*.yaml load once their data paths point somewhere real."""
    from omegaconf import OmegaConf

    default = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "configs/tools/default.yaml"))
    assert default["tools"][0]["config"]["backend"]["type"] == "bm25"
    assert default["tools"][1]["class_name"] == "tools.python_sandbox.tool.PythonTool"
    default["tools"][0]["config"]["backend"]["corpus_path"] = str(corpus)
    default["tools"][0]["config"]["backend"]["index_dir"] = str(tmp_path / "idx")
    default["tools"][1]["class_name"] = PYTHON_CLASS
    reg = load_tools(default)
    assert reg.tags == ["search", "python"]
    assert reg["search"].call_text("capital of France").startswith("Page 1: Paris")

    cache = tmp_path / "search_cache.json"
    cache.write_text('{"who is here": "Page 1: we are"}')
    arpo = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "configs/tools/arpo_cache.yaml"))
    assert arpo["tools"][0]["config"]["backend"]["cache_path"].endswith("search_cache/search_cache.json")
    arpo["tools"][0]["config"]["backend"]["cache_path"] = str(cache)
    arpo["tools"][1]["class_name"] = PYTHON_CLASS
    assert load_tools(arpo)["search"].call_text("who is here") == "Page 1: we are"

    # the live-web preset asks for its credentials by name, and takes another engine by its type alone
    web = OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "configs/tools/web.yaml"))
    web["tools"][1]["class_name"] = PYTHON_CLASS
    for var in ("BRIGHTDATA_API_KEY", "BRIGHTDATA_ZONE", "SERPER_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ToolConfigError, match="BRIGHTDATA_API_KEY"):
        load_tools(web)
    web["tools"][0]["config"]["backend"]["type"] = "serper"
    monkeypatch.setenv("SERPER_API_KEY", "k")
    assert load_tools(web).tags == ["search", "python"]


def test_accepts_omegaconf_and_plain_lists(corpus):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"corpus": str(corpus), "tools": [
        {"class_name": "tools.search.tool.SearchTool",
         "config": {"backend": {"type": "bm25", "corpus_path": "${corpus}"}}}]})
    assert load_tools(cfg).tags == ["search"]
    assert load_tools([search_entry(corpus)]).tags == ["search"]


@pytest.mark.parametrize("entry, message", [
    ({"config": {}}, r"tools\[0\].class_name: missing"),
    ({"class_name": "SearchTool"}, r"tools\[0\].class_name: expected a dotted path"),
    ({"class_name": "tools.nowhere.Tool"}, r"tools\[0\].class_name: cannot import module 'tools.nowhere'"),
    ({"class_name": "tools.search.tool.SerchTool"}, r"module 'tools.search.tool' has no class 'SerchTool'"),
    ({"class_name": f"{__name__}.NotATool"}, r"is not a subclass of tools.base.BaseTool"),
    ({"class_name": "tools.search.tool.SearchTool", "cfg": {}}, r"unknown key\(s\) \['cfg'\]"),
    ({"class_name": "tools.search.tool.SearchTool", "config": [1]}, r"tools\[0\].config: expected a mapping"),
    ({"class_name": "tools.search.tool.SearchTool", "config": {}}, r"tools\[0\].config .*'backend' is missing"),
    ({"class_name": "tools.search.tool.SearchTool",
      "config": {"backend": {"type": "bm25", "corpus_path": "/nonexistent/c.jsonl"}}},
     r"tools\[0\].config .*corpus_path: no file at /nonexistent/c.jsonl"),
    ({"class_name": f"{__name__}.UpperTool", "tool_schema": {"type": "function"}},
     r"tools\[0\].tool_schema: expected OpenAI function format"),
    ({"class_name": f"{__name__}.UpperTool", "tool_schema": {"type": "function", "function": {
        "name": "p", "parameters": {"type": "object", "properties": {}, "required": ["code"]}}}},
     r"tools\[0\].tool_schema.function.parameters.required: \['code'\] are not in 'properties'"),
])
def test_bad_entries_name_field_and_fix(entry, message):
    with pytest.raises(ToolConfigError, match=message):
        load_tools({"tools": [entry]})


def test_bad_top_level_and_duplicates(tmp_path, corpus):
    with pytest.raises(ToolConfigError, match="tools: expected a list of tool entries"):
        load_tools({"tool": []})
    with pytest.raises(ToolConfigError, match="tool config file not found"):
        load_tools(tmp_path / "nope.yaml")
    with pytest.raises(ToolConfigError, match=r"tools\[1\]: two tools use the name 'search' \(tools\[0\] too\)"):
        load_tools({"tools": [search_entry(corpus), search_entry(corpus)]})
    with pytest.raises(ToolConfigError, match=r"tools\[1\]"):
        load_tools({"tools": [search_entry(corpus), "tools.search.tool.SearchTool"]})
    tool = build_tool(search_entry(corpus))
    assert tool.name == "search"
