"""JSON Lines reading whose errors name the file and the line.

Every JSONL file the project reads (RL data, benchmarks, search corpora, evaluation samples) goes through
:func:`json_lines`, so a broken line is always reported as ``path:line: not valid JSON (...)`` followed by the
caller's own advice on what the file should hold. It imports nothing from the project, so ``tools`` may use it too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator


def json_lines(lines: Iterable[str], source: str | Path, fix: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` for each non-blank line, numbered from 1; a line that is not JSON raises
    ``ValueError("{source}:{n}: not valid JSON (...); {fix}")``. Lazy: a caller that stops early never parses
    the lines after."""
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{line_no}: not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
        yield line_no, value
