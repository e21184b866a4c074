"""Tools declared in YAML the way verl declares them, addressable by ARPO tag and by function name.

    tools:
      - class_name: tools.search.tool.SearchTool
        config: {backend: {type: bm25, corpus_path: data/corpus.jsonl}}
        tool_schema: {...}          # optional OpenAI function schema; the class supplies a default
      - class_name: examples.unit_converter_tool.UnitConverterTool
        tag: convert                # optional ARPO tag (<convert>…</convert>); default: the class's tag or name

The ARPO rollout looks tools up by name (``registry["search"]``; ``registry.protocol`` says which tag calls
which tool), the agent loop by function name (``registry.by_function("web_search")`` when a schema renames
it); both get the same object. :func:`tool_protocol` reads the same tags from the entries without building the
tools (the rewards' format gate needs only the tags). Every validation error names the entry and field
(``tools[1].class_name``) and the fix.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Iterator

from arpo.protocol import ToolProtocol
from tools.base import BaseTool

_ENTRY_KEYS = {"class_name", "config", "tool_schema", "tag"}


class ToolConfigError(ValueError):
    """A tool declaration is wrong; the message names the field and the fix."""


class ToolRegistry(Mapping):
    """Tool name -> tool (iteration yields names); ``by_function`` looks up by function name, ``protocol``
    maps each tool to its ARPO tag."""

    def __init__(self, tools: list[BaseTool]):
        self._by_name: dict[str, BaseTool] = {}
        self._by_function: dict[str, BaseTool] = {}
        for i, tool in enumerate(tools):
            _check_name_free(i, tool.name, list(self._by_name))
            if tool.function_name in self._by_function:
                raise ToolConfigError(f"two tools use the function name {tool.function_name!r}; "
                                      "rename one in its tool_schema.function.name")
            self._by_name[tool.name] = tool
            self._by_function[tool.function_name] = tool
        try:
            self.protocol = ToolProtocol.from_tools(tools)
        except ValueError as e:
            raise ToolConfigError(str(e)) from e

    def __getitem__(self, name: str) -> BaseTool:
        """Look up by tool name first, then by function name."""
        if name in self._by_name:
            return self._by_name[name]
        if name in self._by_function:
            return self._by_function[name]
        raise KeyError(f"no tool named {name!r}; names: {sorted(self._by_name)}, functions: {sorted(self._by_function)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name or name in self._by_function

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def tags(self) -> list[str]:
        """The ARPO tag of each tool, in load order."""
        return list(self.protocol.tags.values())

    def by_tag(self, tag: str) -> BaseTool:
        return self._by_name[self.protocol.tool_of_tag(tag)]

    def by_function(self, function_name: str) -> BaseTool:
        return self._by_function[function_name]

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI function schemas of all tools (for chat templates / the agent loop)."""
        return [t.tool_schema for t in self._by_name.values()]

    def call(self, name: str, arguments: dict[str, Any] | str) -> str:
        """Run a tool by name (text content) or function name (argument dict); unknown names become text."""
        if name not in self:
            return f"Error: there is no tool named '{name}'. Available tools: {', '.join(sorted(self._by_name))}."
        tool = self[name]
        return tool.call_text(arguments) if isinstance(arguments, str) else tool.call(arguments)

    async def acall(self, name: str, content: str) -> str:
        """Async text call by name: the tool's own ``acall_text`` if it has one, else ``call_text`` in a thread."""
        if name not in self:
            return self.call(name, content)
        tool = self[name]
        acall_text = getattr(tool, "acall_text", None)
        if acall_text is not None:
            return await acall_text(content)
        return await asyncio.to_thread(tool.call_text, content)

    def close(self) -> None:
        for tool in self._by_name.values():
            tool.close()


def _import_class(path: Any, where: str) -> type[BaseTool]:
    if not isinstance(path, str) or "." not in path:
        raise ToolConfigError(f"{where}.class_name: expected a dotted path like 'tools.search.tool.SearchTool', "
                              f"got {path!r}")
    module_name, _, class_name = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"{where}.class_name: cannot import module {module_name!r} ({e}); "
                              "check the dotted path and that the module is installed") from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ToolConfigError(f"{where}.class_name: module {module_name!r} has no class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"{where}.class_name: {path} is not a subclass of tools.base.BaseTool")
    return cls


def _check_schema(schema: Any, where: str) -> None:
    fn = schema.get("function") if isinstance(schema, Mapping) else None
    if not isinstance(schema, Mapping) or schema.get("type") != "function" or not isinstance(fn, Mapping):
        raise ToolConfigError(f"{where}.tool_schema: expected OpenAI function format "
                              "{type: function, function: {name, description, parameters}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolConfigError(f"{where}.tool_schema.function.name: must be a non-empty string")
    params = fn.get("parameters")
    if not isinstance(params, Mapping) or params.get("type") != "object":
        raise ToolConfigError(f"{where}.tool_schema.function.parameters: must be a JSON schema with type: object")
    props = params.get("properties", {})
    missing = [r for r in params.get("required", []) if r not in props]
    if missing:
        raise ToolConfigError(f"{where}.tool_schema.function.parameters.required: {missing} are not in 'properties'")


def _to_plain(config: Any) -> Any:
    """Accept OmegaConf/Hydra configs as well as plain dicts (interpolations resolved)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        return config
    if isinstance(config, (DictConfig, ListConfig)):
        return OmegaConf.to_container(config, resolve=True)
    return config


def build_tool(entry: Any, where: str = "tools[0]") -> BaseTool:
    """Instantiate one declared tool."""
    entry = _to_plain(entry)
    if not isinstance(entry, Mapping):
        raise ToolConfigError(f"{where}: expected a mapping with class_name, config, tool_schema; got {entry!r}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise ToolConfigError(f"{where}: unknown key(s) {sorted(unknown)}; a tool entry has {sorted(_ENTRY_KEYS)}")
    if "class_name" not in entry:
        raise ToolConfigError(f"{where}.class_name: missing; e.g. class_name: tools.search.tool.SearchTool")
    cls = _import_class(entry["class_name"], where)
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise ToolConfigError(f"{where}.config: expected a mapping of tool settings, got {type(config).__name__}")
    schema = entry.get("tool_schema")
    if schema is not None:
        _check_schema(schema, where)
    try:
        tool = cls(config=dict(config), tool_schema=dict(schema) if schema is not None else None)
    except ToolConfigError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as e:
        raise ToolConfigError(f"{where}.config ({entry['class_name']}): {e}") from e
    if not tool.name:
        raise ToolConfigError(f"{where}.class_name: {entry['class_name']} has an empty 'name'")
    _check_schema(tool.tool_schema, where)
    if "tag" in entry:
        # an instance attribute: two entries of one class may take different tags. The registry checks the
        # tags against each other (ToolProtocol), so its error can list every loaded tool.
        tool.tag = entry["tag"]
    return tool


def _entries(source: str | Path | Mapping | list | Any, resolve: bool = True) -> Any:
    """The tool entries of a YAML path, a ``{tools: [...]}`` mapping, a list of entries or a DictConfig.

    ``resolve=False`` keeps a DictConfig as it is, so only the keys read are resolved (a config's other
    interpolations may need keys that are absent where only the tags are wanted)."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise ToolConfigError(f"tool config file not found: {path}")
        from omegaconf import OmegaConf

        # OmegaConf rather than plain YAML so ${oc.env:VAR,default} interpolations work in tool files
        source = OmegaConf.load(path)
    if resolve:
        source = _to_plain(source)
    entries = source.get("tools") if isinstance(source, Mapping) else source
    if isinstance(entries, (str, bytes)) or not isinstance(entries, Sequence):
        raise ToolConfigError("tools: expected a list of tool entries "
                              "(tools: [{class_name: ..., config: {...}}])")
    return entries


def load_tools(source: str | Path | Mapping | list | Any) -> ToolRegistry:
    """Build the registry from a YAML path, a ``{tools: [...]}`` mapping, a list of entries, or a DictConfig."""
    entries = _entries(source)
    built: list[BaseTool] = []
    try:
        for i, entry in enumerate(entries):
            built.append(build_tool(entry, where=f"tools[{i}]"))
        return ToolRegistry(built)
    except Exception:
        for tool in built:
            tool.close()
        raise


def tool_protocol(source: str | Path | Mapping | list | Any) -> ToolProtocol:
    """The tag protocol of declared tools (same sources as :func:`load_tools`), without building any tool.

    For processes that only read the tags, such as the rewards' format gate: it imports each class and reads
    its ``name`` and ``tag`` class attributes and the entry's ``tag:``, so no tool is started (no sandbox pool,
    no search index). Equal to ``load_tools(source).protocol`` for tools that set both as class attributes."""
    tags: dict[str, str] = {}
    for i, entry in enumerate(_entries(source, resolve=False)):
        where = f"tools[{i}]"
        if not isinstance(entry, Mapping) or "class_name" not in entry:
            raise ToolConfigError(f"{where}.class_name: missing; e.g. class_name: tools.search.tool.SearchTool")
        cls = _import_class(entry["class_name"], where)
        if not cls.name:
            raise ToolConfigError(f"{where}.class_name: {entry['class_name']} has an empty 'name'")
        _check_name_free(i, cls.name, list(tags))
        tag = entry["tag"] if "tag" in entry else cls.tag  # as build_tool: the entry's tag wins, even empty
        tags[cls.name] = tag or cls.name
    try:
        return ToolProtocol(tags)
    except ValueError as e:
        raise ToolConfigError(str(e)) from e


def _check_name_free(i: int, name: str, names: list[str]) -> None:
    """``tools[i]``'s name must not be one of the earlier tools' ``names``."""
    if name in names:
        raise ToolConfigError(f"tools[{i}]: two tools use the name {name!r} (tools[{names.index(name)}] too); the "
                              "registry and the rollout's records key tools by name, so each needs its own")
