"""SFT trajectories from files: OpenAI ``messages`` and ShareGPT ``conversations``, in the ARPO tag protocol.

The cold-start SFT (:mod:`arpo.sft`) trains on one kind of example whatever its source: the chat template's prompt,
then the response laid out as the ARPO rollout lays it out (model text, `` <result>\\n…\\n</result>`` appended after
each tool call, EOS), with the loss on the model's tokens only. The synthetic demonstrations build that layout from
a gold plan; this module builds it from recorded trajectories, so both go through
:func:`arpo.data.sft_demonstrations.tokenize_demonstration` and cannot drift apart.

* ``messages`` (OpenAI): ``system``/``user`` turns before the first ``assistant`` turn are the prompt; an assistant
  turn's ``tool_calls`` become ``<tag> query </tag>`` after its text (the function name picks the tool, the tool's
  tag comes from the loaded tools' :class:`arpo.protocol.ToolProtocol`); each ``tool`` turn is a masked result.
* ``sharegpt`` (LLaMA-Factory, as ARPO's SFT release): ``conversations`` of ``{from, value}`` with ``human``,
  ``gpt``, ``function_call`` (``{"name", "arguments"}`` JSON), ``observation`` and ``system``, plus an optional
  row-level ``system``. A ``gpt`` value may already hold the whole trajectory with its ``<result>`` blocks inline
  (ARPO's own layout); those blocks are masked too, and so is a ``human`` turn that is only a ``<result>`` block.

Every row is checked before any training: an unknown role, a call to a tool no loaded tool declares, a result
without a call, all stop the run with one line naming the file, the row, the field and the fix.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from arpo.config import ConfigError
from arpo.data.sft_demonstrations import Segment, tokenize_demonstration
from arpo.protocol import RESULT_CLOSE, RESULT_OPEN, ToolProtocol, format_tool_result

#: values of ``sft.data_format``
FORMATS = ("auto", "synthetic", "messages", "sharegpt")
KEY = "sft.data_format"
_MESSAGE_ROLES = ("system", "user", "assistant", "tool")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool",
                   "system": "system"}
_INLINE_RESULT = re.compile(re.escape(RESULT_OPEN) + r".*?" + re.escape(RESULT_CLOSE), re.S)
_RESULT_BLOCK = re.compile(r"\s*" + re.escape(RESULT_OPEN) + r"\n?(.*?)\n?" + re.escape(RESULT_CLOSE) + r"\s*", re.S)


def _split_inline_results(text: str) -> Iterator[tuple[str, str]]:
    """``("model", text)`` and ``("result", text)`` pieces of an assistant turn that holds its results inline."""
    pos = 0
    for m in _INLINE_RESULT.finditer(text):
        yield "model", text[pos:m.start()]
        yield "result", m.group(0)
        pos = m.end()
    yield "model", text[pos:]


class SFTDataError(ConfigError):
    """A trajectory file the SFT cannot use; the message names the file, row, field and fix (a ConfigError, so
    the entry point prints it as one line)."""


@dataclass
class Trajectory:
    """One recorded trajectory, ready to tokenise: the prompt messages and the response's segments."""

    prompt: list[dict[str, str]]
    segments: list[Segment]
    kind: str  # the file's format, counted per kind in the SFT summary like the demonstrations' kinds


@dataclass
class _Turn:
    role: str  # system | user | assistant | tool
    text: str
    calls: list[tuple[str, Any, str]]  # (function name, arguments, where), assistant turns only
    where: str


class CallTargets:
    """Which tool a recorded call names, and which of its arguments is the text inside the tag.

    Built from the tool entries without starting any tool (no search index, no sandbox pool): the SFT reads the
    results from the file, it needs only the names, tags and schemas."""

    def __init__(self, protocol: ToolProtocol, functions: Mapping[str, str], arguments: Mapping[str, str]):
        self.protocol = protocol
        # a tool's own name wins over another tool's function name or tag: the registry looks names up first
        self._by_key = {**{tag: name for name, tag in protocol.tags.items()}, **dict(functions),
                        **{name: name for name in protocol.names}}
        self._argument = dict(arguments)

    @classmethod
    def from_tools(cls, tools_cfg: Any) -> "CallTargets":
        """From a run's ``tools`` entries (the config list, or a ``{tools: [...]}`` mapping)."""
        from omegaconf import DictConfig, ListConfig, OmegaConf

        from tools.registry import tool_protocol

        try:
            protocol = tool_protocol(tools_cfg)
        except ValueError as e:  # ToolConfigError: already names tools[i] and the fix
            raise ConfigError(str(e)) from None
        entries = OmegaConf.to_container(tools_cfg, resolve=True) if isinstance(tools_cfg, (DictConfig, ListConfig)) \
            else tools_cfg
        entries = entries.get("tools", []) if isinstance(entries, Mapping) else list(entries)
        functions, arguments = {}, {}
        for name, entry in zip(protocol.names, entries):
            fn = (entry.get("tool_schema") or _default_schema(entry) or {}).get("function", {})
            if fn.get("name"):
                functions[fn["name"]] = name
            required = (fn.get("parameters") or {}).get("required") or []
            if required:
                arguments[name] = required[0]
        return cls(protocol, functions, arguments)

    def described(self) -> str:
        return ", ".join(f"{fn} -> <{self.protocol.tags[name]}>" for fn, name in sorted(self._by_key.items()))

    def call_text(self, function: Any, arguments: Any, where: str) -> str:
        """``<tag> text </tag>`` for one recorded call (the spacing of the synthetic demonstrations)."""
        name = self._by_key.get(function) if isinstance(function, str) else None
        if name is None:
            raise SFTDataError(f"{where}: calls {function!r}, which no loaded tool declares (known: "
                               f"{self.described()}); add the tool under tools (configs/tools/) or rename the call")
        open_tag, close_tag = self.protocol.pair(name)
        return f"{open_tag} {self._argument_text(name, arguments, where)} {close_tag}"

    def _argument_text(self, name: str, arguments: Any, where: str) -> str:
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, Mapping):
                return arguments  # a bare query or program, as some exports write it
            arguments = parsed
        if not isinstance(arguments, Mapping):
            return str(arguments)
        key = self._argument.get(name)
        if key in arguments:
            return str(arguments[key])
        if len(arguments) == 1:
            return str(next(iter(arguments.values())))
        fix = f"give its argument {key!r}" if key else "give exactly one argument"
        raise SFTDataError(f"{where}: arguments {sorted(arguments)} for tool {name!r}: a tag call holds one text; "
                           f"{fix}")


def _default_schema(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The class's own schema, read without running its ``__init__`` (which may open an index or a pool); None
    when the class needs its constructor for that, and then only its name and tag address it."""
    module, _, cls_name = str(entry.get("class_name", "")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
        obj = cls.__new__(cls)
        obj.config = dict(entry.get("config") or {})
        return obj.default_schema()
    except Exception:
        return None


def detect_format(path: str | Path, requested: str = "auto") -> str:
    """The layout of a training file: ``requested`` unless ``auto``, then told from its first row's fields; a
    synthetic file must be the generator's parquet (its rows' plans drive the tools)."""
    if requested not in FORMATS:
        raise SFTDataError(f"{KEY}={requested!r} is not valid; choose one of {', '.join(FORMATS)}")
    path = Path(path)
    first = next(iter(_rows(path, limit=1)), None)
    if not isinstance(first, Mapping):
        raise SFTDataError(f"sft.train_file={path}: no rows" if first is None else
                           f"sft.train_file={path}: rows must be objects, the first is {type(first).__name__}")
    extra = first.get("extra_info")
    found = "synthetic" if isinstance(extra, Mapping) and "plan" in extra else \
        "messages" if "messages" in first else "sharegpt" if "conversations" in first else None
    if requested == "synthetic" and (found != "synthetic" or path.suffix != ".parquet"):
        raise SFTDataError(f"sft.train_file={path}: {KEY}=synthetic needs the parquet of `python -m "
                           f"arpo.data.synthetic` (extra_info.plan per row); set {KEY}=auto for a trajectory file")
    if requested != "auto":
        return requested
    if found is None:
        raise SFTDataError(f"sft.train_file={path}: cannot tell its layout from the first row's fields "
                           f"{sorted(first)[:8]}; give rows with 'messages' (OpenAI), 'conversations' (ShareGPT) or "
                           f"extra_info.plan (python -m arpo.data.synthetic), or set {KEY}")
    if found == "synthetic" and path.suffix != ".parquet":
        raise SFTDataError(f"sft.train_file={path}: synthetic rows are read from the generator's parquet; give "
                           f"that file")
    return found


def _plain(value: Any) -> Any:
    """Parquet cells as plain Python (numpy arrays of dicts become lists, a missing cell's NaN None)."""
    if isinstance(value, float) and value != value:
        return None
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _rows(path: Path, limit: int = 0) -> list[dict[str, Any]]:
    """Rows of a ``.parquet``, ``.jsonl`` or ``.json`` (a list of rows) file; ``limit`` > 0 reads that many."""
    if path.suffix == ".parquet":
        import pandas as pd

        df = pd.read_parquet(path)
        df = df.iloc[:limit] if limit else df
        return [_plain(r) for r in df.to_dict(orient="records")]
    if path.suffix == ".jsonl":
        rows = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise SFTDataError(f"sft.train_file={path}: line {n} is not JSON ({e.msg})") from None
                    if limit and len(rows) >= limit:
                        break
        return rows
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise SFTDataError(f"sft.train_file={path}: not JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise SFTDataError(f"sft.train_file={path}: a .json file must hold a list of rows; use .jsonl for one "
                               f"row per line")
        return data[:limit] if limit else data
    raise SFTDataError(f"sft.train_file={path}: unknown file type {path.suffix!r}; give .parquet, .jsonl or .json")


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, null, or OpenAI's list of ``{type: text, text}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise SFTDataError(f"{where}: expected text (or a list of text parts), got {type(content).__name__}")


def _message_turns(messages: Any, where: str) -> list[_Turn]:
    if not isinstance(messages, list):
        raise SFTDataError(f"{where}.messages: expected a list of {{role, content}} messages")
    turns = []
    for i, m in enumerate(messages):
        at = f"{where}.messages[{i}]"
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in _MESSAGE_ROLES:
            raise SFTDataError(f"{at}.role={role!r} is not a role; use one of {', '.join(_MESSAGE_ROLES)}")
        calls = []
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not isinstance(fn, Mapping) or "name" not in fn:
                raise SFTDataError(f"{at}.tool_calls[{j}]: expected {{function: {{name, arguments}}}}")
            calls.append((fn["name"], fn.get("arguments", {}), f"{at}.tool_calls[{j}].function"))
        if calls and role != "assistant":
            raise SFTDataError(f"{at}.tool_calls: only assistant messages call tools (role is {role!r})")
        turns.append(_Turn(role, _text(m.get("content"), f"{at}.content"), calls, at))
    return turns


def _sharegpt_turns(row: Mapping[str, Any], where: str) -> list[_Turn]:
    conversations = row.get("conversations")
    if not isinstance(conversations, list):
        raise SFTDataError(f"{where}.conversations: expected a list of {{from, value}} turns")
    turns = []
    if row.get("system"):
        turns.append(_Turn("system", _text(row["system"], f"{where}.system"), [], f"{where}.system"))
    for i, t in enumerate(conversations):
        at = f"{where}.conversations[{i}]"
        sender = t.get("from") if isinstance(t, Mapping) else None
        if sender not in _SHAREGPT_ROLES:
            raise SFTDataError(f"{at}.from={sender!r} is not a ShareGPT role; use one of {', '.join(_SHAREGPT_ROLES)}")
        value = t.get("value")
        if sender != "function_call":
            turns.append(_Turn(_SHAREGPT_ROLES[sender], _text(value, f"{at}.value"), [], at))
            continue
        parsed = value
        if isinstance(value, str):  # LLaMA-Factory writes the call as a JSON string; some exports as an object
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                parsed = None
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, Mapping) and "name" in c for c in parsed):
            raise SFTDataError(f"{at}.value: a function_call holds JSON {{\"name\": ..., \"arguments\": {{...}}}} "
                               f"(or a list of them), got {str(value)[:80]!r}")
        turns.append(_Turn("assistant", "", [(c["name"], c.get("arguments", {}), f"{at}.value") for c in parsed], at))
    return turns


def _result_text(text: str) -> str:
    """A tool turn's text as the rollout appends it; a turn that already wraps itself in ``<result>`` is re-wrapped
    so the spacing is the rollout's whatever the export wrote."""
    block = _RESULT_BLOCK.fullmatch(text)
    return format_tool_result(block.group(1) if block else text)


def _add_model(segments: list[Segment], text: str) -> None:
    """Model text joins the model span before it; after a result it opens with one space whatever the file wrote,
    as in the synthetic demonstrations (`` <think>`` after ``</result>``), so every source teaches one layout."""
    if not text.strip():
        return
    if segments and segments[-1].is_model:
        prev = segments[-1].text
        sep = "" if prev[-1:].isspace() or text[:1].isspace() else " "
        segments[-1] = Segment(prev + sep + text, True)
    else:
        segments.append(Segment(" " + text.lstrip() if segments else text, True))


def _add_result(segments: list[Segment], text: str) -> None:
    """A masked result; the model span before it ends at the call's close tag, where the rollout's engine stops."""
    if segments and segments[-1].is_model:
        segments[-1] = Segment(segments[-1].text.rstrip(), True)
    segments.append(Segment(_result_text(text), False))


def build_trajectory(turns: Sequence[_Turn], kind: str, targets: CallTargets, where: str) -> Trajectory:
    """The prompt and the response segments of one row, checked turn by turn."""
    first = next((i for i, t in enumerate(turns) if t.role == "assistant"), None)
    if first is None:
        raise SFTDataError(f"{where}: no assistant turn; a trajectory needs the model's own text to train on")
    for t in turns[:first]:
        if t.role == "tool":
            raise SFTDataError(f"{t.where}: a tool result before the first assistant turn; results follow a call")
    segments: list[Segment] = []
    queued: list[tuple[str, Any, str]] = []  # calls of one turn after its first, each emitted after a result
    open_call: str | None = None  # where the call awaiting its result was made
    for t in turns[first:]:
        is_result = t.role == "tool" or (t.role == "user" and _RESULT_BLOCK.fullmatch(t.text) is not None)
        if t.role == "assistant":
            if open_call:
                raise SFTDataError(f"{t.where}: an assistant turn while the call at {open_call} has no result; "
                                   f"put its tool result after it")
            for piece, text in _split_inline_results(t.text):  # ARPO's layout: results inline in the model's text
                if piece == "result":
                    if not open_call:
                        raise SFTDataError(f"{t.where}: a <result> block with no tool call before it; write a "
                                           f"loaded tool's tags before each result ({targets.protocol.described})")
                    _add_result(segments, text)
                    open_call = None
                elif text.strip():
                    if open_call:
                        raise SFTDataError(f"{t.where}: text after the tool call at {open_call} before its result; "
                                           f"each call's result follows it")
                    _add_model(segments, text)
                    # a call written in tags (the file is in the protocol already) awaits its result like tool_calls
                    open_call = t.where if targets.protocol.parse_trailing_call(text) else None
            if t.calls:
                if open_call:
                    raise SFTDataError(f"{t.where}: its text ends with a tag call and it has tool_calls too; give "
                                       f"each call once")
                fn, args, at = t.calls[0]
                _add_model(segments, targets.call_text(fn, args, at))
                queued, open_call = list(t.calls[1:]), at
        elif is_result:
            if not open_call:
                raise SFTDataError(f"{t.where}: a tool result with no tool call before it; give the assistant turn "
                                   f"before it its tool_calls (or a function_call turn)")
            _add_result(segments, t.text)
            open_call = None
            if queued:
                # the rollout runs one call per generated segment: a turn's later calls follow the earlier results
                fn, args, at = queued.pop(0)
                _add_model(segments, targets.call_text(fn, args, at))
                open_call = at
        else:
            raise SFTDataError(f"{t.where}: a {t.role} turn after the assistant began; an ARPO trajectory is one "
                               f"prompt and one response with tool results, so end the row before it")
    if open_call:
        raise SFTDataError(f"{open_call}: the trajectory ends on this call without its result; add the tool turn "
                           f"and the assistant's answer after it")
    if not segments or not segments[-1].is_model:
        raise SFTDataError(f"{where}: the trajectory ends on a tool result; end it with the assistant's answer")
    prompt = [{"role": t.role, "content": t.text} for t in turns[:first]]
    return Trajectory(prompt, segments, kind)


def load_trajectories(path: str | Path, fmt: str, targets: CallTargets, max_samples: int = 0) -> list[Trajectory]:
    """Every row of a ``messages`` or ``sharegpt`` file, checked now so that a bad row stops the run before the
    model is loaded; ``max_samples`` > 0 keeps the first rows only."""
    path = Path(path)
    if fmt not in ("messages", "sharegpt"):
        raise ValueError(f"load_trajectories reads messages or sharegpt files, not {fmt!r}")
    out = []
    for i, row in enumerate(_rows(path, limit=max_samples)):
        where = f"{path.name}[{i}]"
        if not isinstance(row, Mapping):
            raise SFTDataError(f"{where}: expected an object, got {type(row).__name__}")
        if fmt == "messages":
            if "messages" not in row:
                raise SFTDataError(f"{where}: no 'messages' field (fields {sorted(row)[:8]}); set {KEY} to the "
                                   f"file's layout")
            turns = _message_turns(row["messages"], where)
        else:
            if "conversations" not in row:
                raise SFTDataError(f"{where}: no 'conversations' field (fields {sorted(row)[:8]}); set {KEY} to "
                                   f"the file's layout")
            turns = _sharegpt_turns(row, where)
        out.append(build_trajectory(turns, fmt, targets, where))
    if not out:
        raise SFTDataError(f"sft.train_file={path}: no rows")
    return out


def iter_trajectory_examples(trajectories: Sequence[Trajectory], tokenizer: Any
                             ) -> Iterator[tuple[tuple[list[int], list[int]], str]]:
    """``((ids, mask), kind)`` per trajectory, the shape :class:`~arpo.data.sft_demonstrations.DemonstrationStream`
    takes, tokenised by the demonstrations' own :func:`~arpo.data.sft_demonstrations.tokenize_demonstration` (loss on
    model tokens and EOS only)."""
    for t in trajectories:
        yield tokenize_demonstration(tokenizer, t.prompt, t.segments), t.kind
