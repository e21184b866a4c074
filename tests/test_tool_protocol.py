"""The open tool protocol (arpo.protocol.ToolProtocol): tags built from the loaded tools, one start-up error line
for a bad tag, and every ARPO-path reader (rollout, arpo_tags agent loop) taking its tags from there."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from arpo.agent_loop.tool_parsers import make_tool_parser
from arpo.protocol import ALL_TAGS, DEFAULT_PROTOCOL, ToolProtocol
from arpo.rollout.arpo_rollout import ARPORollout
from arpo.rollout.tool_executor import ToolExecutor
from arpo.testing.scripted_engine import ScriptedEngine, ToyTokenizer
from examples.unit_converter_tool import UnitConverterTool
from tests.rollout.fake_tools import FakePython, FakeSearch
from tools.base import BaseTool
from tools.registry import ToolConfigError, load_tools, tool_protocol

CONVERTER = "examples.unit_converter_tool.UnitConverterTool"


class EchoTool(BaseTool):
    """No tag of its own: its name is its tag."""

    name = "echo"

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "echo", "description": "echo", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

    def call_text(self, content: str) -> str:
        return content


def test_default_protocol_keeps_search_and_python():
    assert DEFAULT_PROTOCOL.pairs() == {"search": ("<search>", "</search>"), "python": ("<python>", "</python>")}
    assert DEFAULT_PROTOCOL.stop_strings() == ["</search>", "</python>"]
    assert ToolProtocol.from_tools([FakeSearch(), FakePython()]) == DEFAULT_PROTOCOL
    assert ALL_TAGS[-4:] == ["<search>", "</search>", "<python>", "</python>"]  # the tiny model's added tokens


def test_protocol_is_built_from_the_loaded_tools():
    protocol = ToolProtocol.from_tools([FakeSearch(), UnitConverterTool(), EchoTool()])
    assert protocol.tags == {"search": "search", "unit_converter": "convert", "echo": "echo"}
    assert protocol.stop_strings() == ["</search>", "</convert>", "</echo>"]
    assert protocol.tool_of_tag("convert") == "unit_converter"
    assert pickle.loads(pickle.dumps(protocol)) == protocol  # reaches reward worker processes
    with pytest.raises(TypeError):
        protocol.tags["echo"] = "shout"  # read-only: the format gate caches its patterns by protocol
    call = protocol.parse_trailing_call("<think> miles </think> <convert> 3 km to mi </convert>\n")
    assert (call.tool, call.content) == ("unit_converter", "3 km to mi")
    assert protocol.malformed("unit_converter").error_text() == \
        "Error: malformed tool call: </convert> without a matching <convert>. Write <convert>...</convert>."
    # an agent loop's map holds a tool under its name and its function name: it counts once, by name
    converter = UnitConverterTool()
    assert ToolProtocol.from_tools({"convert_units": converter, "unit_converter": converter}).tags == \
        {"unit_converter": "convert"}


@pytest.mark.parametrize("tags, message", [
    ({"search": "search", "unit_converter": "to-miles"},
     r"^tools\[1\]\.tag \(unit_converter\): 'to-miles' is not a simple identifier .*; "
     r"loaded tools: search <search>, unit_converter <to-miles>$"),
    ({"search": "search", "web": "search"},
     r"^tools\[1\]\.tag \(web\): 'search' is already the tag of tools\[0\]; each tool needs its own tag; "
     r"loaded tools: search <search>, web <search>$"),
    ({"final": "answer"}, r"^tools\[0\]\.tag \(final\): 'answer' is reserved by the protocol"),
    ({"empty": ""}, r"^tools\[0\]\.tag \(empty\): '' is not a simple identifier"),
])
def test_a_bad_tag_is_one_error_line_naming_the_field_and_the_loaded_tools(tags, message):
    with pytest.raises(ValueError, match=message) as err:
        ToolProtocol(tags)
    assert "\n" not in str(err.value)


def test_a_tag_no_loaded_tool_declares_is_one_error_line():
    with pytest.raises(ValueError, match=r"^tag 'convert': no loaded tool declares it; "
                                         r"loaded tools: search <search>, python <python>$"):
        DEFAULT_PROTOCOL.tool_of_tag("convert")
    with pytest.raises(ValueError, match=r"no loaded tool is named 'unit_converter', so it has no tag; "
                                         r"loaded tools: search <search>, python <python>$"):
        DEFAULT_PROTOCOL.stop_strings(["unit_converter"])


def test_tool_yaml_tag_field_sets_and_checks_the_tag():
    reg = load_tools({"tools": [{"class_name": CONVERTER, "tag": "units"}]})
    try:
        assert reg.protocol.tags == {"unit_converter": "units"} and type(reg.by_tag("units")) is UnitConverterTool
    finally:
        reg.close()
    entries = [{"class_name": "tests.rollout.fake_tools.FakeSearch"}, {"class_name": CONVERTER, "tag": "search"}]
    with pytest.raises(ToolConfigError, match=r"^tools\[1\]\.tag \(unit_converter\): 'search' is already the tag of "
                                              r"tools\[0\]; .*loaded tools: search <search>, unit_converter <search>$"):
        load_tools({"tools": entries})
    with pytest.raises(ToolConfigError, match=r"^tools\[0\]\.tag \(unit_converter\): 'to miles' is not a simple"):
        load_tools({"tools": [{"class_name": CONVERTER, "tag": "to miles"}]})


def test_the_rollout_refuses_a_bad_tag_at_start_up():
    engine = ScriptedEngine(ToyTokenizer())
    twin = UnitConverterTool()
    twin.name, twin.tag = "length_converter", "convert"
    with pytest.raises(ValueError, match=r"tools\[2\]\.tag \(length_converter\): 'convert' is already the tag of "
                                         r"tools\[1\]"):
        ARPORollout(engine, engine.tokenizer, {"n": 2, "initial_rollouts": 2},
                    tools=[FakeSearch(), UnitConverterTool(), twin])


def test_the_arpo_tags_agent_loop_parser_reads_the_loaded_tools_tags():
    with ToolExecutor([FakeSearch(), UnitConverterTool()]) as executor:
        parser = make_tool_parser("arpo_tags", executor.tool_names, executor.protocol)
    assert parser.stop_strings == ("</search>", "</convert>")
    (call,) = parser.parse("<think> miles </think> <convert>3 km to mi</convert>")
    assert (call.name, call.text, call.error) == ("unit_converter", "3 km to mi", None)
    (bad,) = parser.parse("<think> x </think> 3 km to mi</convert>")
    assert bad.error == "Error: </convert> without a matching <convert>; write <convert>...</convert>."
    # without the loaded tools' protocol: search and python's tags, as before
    assert make_tool_parser("arpo_tags", ["python", "search", "unit_converter"]).stop_strings == \
        ("</python>", "</search>")


def test_tool_protocol_reads_the_tags_from_the_entries_without_building_the_tools():
    """What the rewards read: the loaded tools' protocol, from a tool file or a run's entries (no tool started, no
    tool config resolved)."""
    from omegaconf import OmegaConf

    reg = load_tools("examples/unit_converter_tools.yaml")
    try:
        assert tool_protocol("examples/unit_converter_tools.yaml") == reg.protocol
    finally:
        reg.close()
    run = OmegaConf.create({"tools": [
        {"class_name": "tests.rollout.fake_tools.FakeSearch", "config": {"corpus": "${no_such_key}"}},
        {"class_name": "tests.test_tool_protocol.EchoTool"}, {"class_name": CONVERTER, "tag": "units"}]})
    assert tool_protocol(run.tools).tags == {"search": "search", "echo": "echo", "unit_converter": "units"}
    entries = [{"class_name": "tests.rollout.fake_tools.FakeSearch"}, {"class_name": CONVERTER, "tag": "search"}]
    with pytest.raises(ToolConfigError, match=r"^tools\[1\]\.tag \(unit_converter\): 'search' is already the tag of "
                                              r"tools\[0\]; .*loaded tools: search <search>, unit_converter <search>$"):
        tool_protocol({"tools": entries})
    with pytest.raises(ToolConfigError, match=r"^tools\[0\]\.class_name: cannot import module 'no_such'"):
        tool_protocol([{"class_name": "no_such.Tool"}])
