"""A tool: converts a quantity between units of length, mass or time (a BaseTool subclass, tools/base.py).

Declare it in a tool YAML with its ``class_name`` (``examples/unit_converter_tools.yaml``) and load it with
:func:`tools.registry.load_tools`, or, in training, put the same entry in a file under ``configs/tools/`` and run
with ``tools=<that file's name>``. The agent loop (``rollout.mode=agent_loop``) calls it by function name
(``convert_units`` with ``{"value", "from_unit", "to_unit"}``); the ARPO rollout by its tag: the model writes
``<convert>3 km to mi</convert>``, generation stops on ``</convert>`` and the text inside goes to ``call_text``.
The tag is the class's ``tag``; a YAML entry's ``tag:`` overrides it (without either, the tag is the ``name``).
"""

from __future__ import annotations

import re
from typing import Any

from tools.base import BaseTool

#: unit -> (dimension, size in the dimension's base unit: metre, kilogram, second)
UNITS: dict[str, tuple[str, float]] = {
    "mm": ("length", 1e-3), "cm": ("length", 1e-2), "m": ("length", 1.0), "km": ("length", 1e3),
    "in": ("length", 0.0254), "ft": ("length", 0.3048), "mi": ("length", 1609.344),
    "g": ("mass", 1e-3), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237),
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0), "day": ("time", 86400.0),
}


class UnitConverterTool(BaseTool):
    """``convert_units(value, from_unit, to_unit)``; every failure is a readable error text, never an exception."""

    name = "unit_converter"
    tag = "convert"  # the model calls it with <convert>…</convert>

    def default_schema(self) -> dict[str, Any]:
        return {"type": "function", "function": {
            "name": "convert_units", "description": "Convert a quantity between units: " + ", ".join(UNITS),
            "parameters": {"type": "object", "properties": {
                "value": {"type": "number"}, "from_unit": {"type": "string"}, "to_unit": {"type": "string"}},
                "required": ["value", "from_unit", "to_unit"]}}}

    def call(self, arguments: dict[str, Any]) -> str:
        missing = [k for k in ("value", "from_unit", "to_unit") if k not in arguments]
        if missing:
            return f"Error: convert_units needs {missing}."
        return self.convert(arguments["value"], str(arguments["from_unit"]), str(arguments["to_unit"]))

    def call_text(self, content: str) -> str:
        m = re.fullmatch(r"\s*(\S+)\s*([A-Za-z]+)\s+(?:to|in)\s+([A-Za-z]+)\s*", content)
        if m is None:
            return "Error: write the conversion as '<value> <unit> to <unit>', e.g. '3 km to mi'."
        return self.convert(m.group(1), m.group(2), m.group(3))

    def convert(self, value: Any, from_unit: str, to_unit: str) -> str:
        try:
            x = float(value)
        except (TypeError, ValueError):
            return f"Error: {value!r} is not a number."
        a, b = UNITS.get(from_unit.lower()), UNITS.get(to_unit.lower())
        if a is None or b is None:
            return f"Error: unknown unit {from_unit if a is None else to_unit!r}; known: {', '.join(UNITS)}."
        if a[0] != b[0]:
            return f"Error: cannot convert {a[0]} ({from_unit}) to {b[0]} ({to_unit})."
        digits = int(self.config.get("digits", 4))
        return f"{x:g} {from_unit} = {round(x * a[1] / b[1], digits):g} {to_unit}"
