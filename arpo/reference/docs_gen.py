"""Pages of the docs site generated from the code, so they cannot drift: the configuration reference and the
metrics glossary.

The configuration reference is every key of the composed training config (``load_config("arpo_trainer")``), its
default, and the comment written beside it in ``configs/**/*.yaml`` (``key: value  # comment`` lines, their
continuation lines, or a comment block right above the key). The glossary is :mod:`arpo.reference.metrics_glossary`.
``docs/hooks.py`` adds both pages to every ``mkdocs build``; ``python -m arpo.reference.docs_gen --out DIR`` writes them as
files. ``tests/test_docs.py`` fails on a composed key without a comment, naming the key and where to add one.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from arpo.config import REPO_ROOT, config_dir

#: the composed config the reference documents (the trainer's: it includes every group a training run reads)
TRAINING_CONFIG = "arpo_trainer"

#: typed config classes that validate each section at start-up (shown in the reference, linked to their API page)
TYPED_SECTIONS = {
    "actor_rollout_ref.rollout.arpo": "arpo.rollout.config.ARPORolloutConfig",
    "actor_rollout_ref.rollout": "arpo.engine.config.EngineConfig",
    "actor_rollout_ref.actor": "arpo.trainer.worker_config.WorkerConfig",
    "critic": "arpo.trainer.worker_config.WorkerConfig",
    "algorithm": "arpo.trainer.algo_config.validate_algorithm_config",
}

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w\-]*)\s*:(?P<rest>.*)$")
_COMMENT_LINE = re.compile(r"^(?P<indent> *)#(?P<text>.*)$")


@dataclass
class KeyDoc:
    """The comment of one key in one YAML file (``where`` is ``configs/<file>:<line>``)."""

    comment: str
    where: str


@dataclass
class ConfigDocs:
    """Every commented key found in ``configs/``: full dotted key -> its comments, in file order."""

    by_key: dict[str, list[KeyDoc]] = field(default_factory=dict)
    #: full dotted key -> where it is written (commented or not), for the error message
    written_at: dict[str, list[str]] = field(default_factory=dict)


def _package(path: Path, text: str, root: Path) -> str:
    """The dotted prefix the file's keys live under (Hydra's ``# @package``; a group file defaults to its group)."""
    match = re.search(r"^#\s*@package\s+(\S+)", text, re.M)
    if match:
        return "" if match[1] == "_global_" else match[1]
    rel = path.relative_to(root).parent
    return ".".join(rel.parts)


def _split_comment(rest: str) -> tuple[str, str]:
    """``value  # comment`` -> (value, comment); a ``#`` inside quotes or ``${...}`` is part of the value."""
    quote, depth = "", 0
    for i, ch in enumerate(rest):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "#" and depth <= 0 and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].strip(), rest[i + 1:].strip()
    return rest.strip(), ""


def parse_yaml_comments(path: Path, root: Path) -> list[tuple[str, str, int]]:
    """(full dotted key, comment, line number) for every mapping key of ``path``. A key's comment is its inline
    ``# ...`` plus the comment lines indented past the key that follow it, or else the comment block right above
    it. Block-list items are skipped (they belong to their parent key), so is the Hydra ``defaults`` list."""
    text = path.read_text()
    prefix = _package(path, text, root)
    entries: list[list[Any]] = []  # [dotted key, comment, line]
    stack: list[tuple[int, str]] = []  # (indent, key) of the open mappings
    pending: list[str] = []  # a comment block right above the next key
    continues: int | None = None  # indent of the last key line with an inline comment (continuations go deeper)
    skip_deeper_than: int | None = None  # indent of a key whose value is a block list
    block_run: tuple[int, str] | None = None  # (indent, text) of a comment block documenting a run of siblings
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if not stripped:
            pending, continues, block_run = [], None, None
            continue
        comment = _COMMENT_LINE.match(line)
        if comment:
            body = comment["text"].strip()
            if body.startswith("@package"):
                continue
            if continues is not None and indent > continues:
                entries[-1][1] = f"{entries[-1][1]} {body}".strip()
            else:
                pending.append(body)
                continues, block_run = None, None
            continue
        if skip_deeper_than is not None and indent > skip_deeper_than:
            continue
        skip_deeper_than = None
        match = _KEY_LINE.match(line)
        if stripped.startswith("- ") or not match:
            pending, continues = [], None
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        value, inline = _split_comment(match["rest"])
        if match["key"] == "defaults" and not stack:
            skip_deeper_than, pending, continues = indent, [], None
            continue
        dotted = ".".join(p for p in (prefix, *(k for _, k in stack), match["key"]) if p)
        inherited = block_run[1] if block_run and block_run[0] == indent and not pending else ""
        entries.append([dotted, inline or " ".join(pending) or inherited, lineno])
        continues = indent if inline else None
        # a comment block above a run of sibling keys documents each key of the run (until a blank line, a
        # comment or a key that opens a mapping)
        block_run = (indent, " ".join(pending)) if pending and not inline else (
            block_run if not inline and block_run and block_run[0] == indent and value != "" else None)
        pending = []
        if value == "":
            if _next_is_list(text, lineno):
                skip_deeper_than = indent
            else:
                stack.append((indent, match["key"]))
    return [(k, c, n) for k, c, n in entries]


def _next_is_list(text: str, lineno: int) -> bool:
    """Whether the first non-comment line after ``lineno`` is a block-list item."""
    for line in text.splitlines()[lineno:]:
        s = line.strip()
        if s and not s.startswith("#"):
            return s.startswith("- ")
    return False


def collect_config_docs(root: Path | None = None) -> ConfigDocs:
    """The comments of every key in ``configs/**/*.yaml`` (preset and pipeline files excluded: they override
    keys documented elsewhere)."""
    root = root or config_dir()
    docs = ConfigDocs()
    for path in sorted(root.rglob("*.yaml")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("preset", "pipeline"):
            continue
        for key, comment, lineno in parse_yaml_comments(path, root):
            where = f"configs/{rel.as_posix()}:{lineno}"
            docs.written_at.setdefault(key, []).append(where)
            if comment:
                docs.by_key.setdefault(key, []).append(KeyDoc(comment, where))
    return docs


def composed_keys(cfg: Any) -> list[tuple[str, Any]]:
    """(dotted key, default) for every leaf of a composed config; lists and empty mappings are leaves."""
    from omegaconf import OmegaConf

    out: list[tuple[str, Any]] = []

    def walk(node: Any, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                walk(v, key)
            else:
                out.append((key, v))

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return out


def _documented(key: str, docs: ConfigDocs) -> KeyDoc | None:
    """The key's own comment, or the comment of the nearest enclosing section that documents a whole list or
    mapping value (``tools``, ``reward_kwargs``)."""
    entries = docs.by_key.get(key)
    return entries[0] if entries else None


def undocumented_keys(cfg: Any | None = None, docs: ConfigDocs | None = None) -> list[str]:
    """One line per composed training-config key without a YAML comment: the key and where to add the comment."""
    from arpo.config import load_config

    cfg = cfg if cfg is not None else load_config(TRAINING_CONFIG, [])
    docs = docs or collect_config_docs()
    lines = []
    for key, _ in composed_keys(cfg):
        if _documented(key, docs) is None:
            where = docs.written_at.get(key)
            place = (f"add `  # <what it does>` after the value at {where[0]}" if where else
                     f"the key is not written in any configs/**/*.yaml (set by code or a preset): add it, with a "
                     f"comment, to the YAML of its section")
            lines.append(f"{key}: no comment; {place}")
    return lines


def typed_fields(cls: type, prefix: str) -> dict[str, str]:
    """Dotted key -> type name of every field of a typed config dataclass (nested sections recursed)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(typed_fields(kind, f"{prefix}.{f.name}"))
        else:
            out[f"{prefix}.{f.name}"] = getattr(kind, "__name__", str(kind)).replace("typing.", "")
    return out


def _fmt_default(value: Any) -> str:
    text = "null" if value is None else str(value).replace("True", "true").replace("False", "false")
    text = text.replace("|", "\\|")
    return f"`{text}`" if len(text) <= 60 else f"`{text[:57]}...`"


def configuration_page(cfg: Any | None = None, docs: ConfigDocs | None = None) -> str:
    """Markdown of the configuration reference."""
    from arpo.config import load_config

    from arpo.rollout.config import ARPORolloutConfig

    cfg = cfg if cfg is not None else load_config(TRAINING_CONFIG, [])
    docs = docs or collect_config_docs()
    keys = composed_keys(cfg)
    types = typed_fields(ARPORolloutConfig, "actor_rollout_ref.rollout.arpo")
    lines = [
        "# Configuration reference",
        "",
        "Every key of the training config (`python -m arpo.main_arpo`, composed from `configs/arpo_trainer.yaml` "
        "and its groups), with its default and the comment beside it in the YAML. Generated at build time from "
        "`configs/**/*.yaml` by `arpo/reference/docs_gen.py`; override any key on the command line "
        "(`python -m arpo.main_arpo actor_rollout_ref.rollout.n=16`), or pick a preset (`preset=<name>`, "
        "`configs/preset/`) or a group option (`tools=default`, `synthetic=hard`).",
        "",
        "Typed config objects validate these sections at start-up (one error line naming the key and the fix):",
        "",
    ]
    for section, target in TYPED_SECTIONS.items():
        lines.append(f"- `{section}`: `{target}`")
    lines.append("")
    sections: dict[str, list[tuple[str, Any]]] = {}
    for key, value in keys:
        top = key.split(".")[0]
        if top == "actor_rollout_ref":
            top = ".".join(key.split(".")[:3]) if key.startswith("actor_rollout_ref.rollout.arpo.") else \
                ".".join(key.split(".")[:2])
        sections.setdefault(top, []).append((key, value))
    for section, items in sections.items():
        typed = any(key in types for key, _ in items)
        lines += [f"## `{section}`", "", "| key | default | " + ("type | " if typed else "") + "what | where |",
                  "|---|---|" + ("---|" if typed else "") + "---|---|"]
        for key, value in items:
            doc = _documented(key, docs)
            comment = (doc.comment if doc else "").replace("|", "\\|")
            where = doc.where.rsplit(":", 1)[0] if doc else ""
            kind = f"`{types[key]}` | " if typed else ""
            lines.append(f"| `{key}` | {_fmt_default(value)} | {kind}{comment} | {where} |")
        lines.append("")
    return "\n".join(lines)


def metrics_page() -> str:
    """Markdown of the metrics glossary."""
    from arpo.reference.metrics_glossary import GLOSSARY

    lines = [
        "# Metrics glossary",
        "",
        "Every metric a training run logs (`<run>/logs/metrics.jsonl`, wandb, the console's step line), under "
        "verl's names where verl has one. Generated from `arpo/reference/metrics_glossary.py`, the one registry of metric "
        "names; the end-to-end training tests fail when a run logs a name it lacks. `*` stands for any run of "
        "characters (`critic/score/*`: `critic/score/mean`, `/max`, `/min`).",
        "",
    ]
    groups: dict[str, list[tuple[str, str]]] = {}
    for entry in GLOSSARY:
        groups.setdefault(entry.group, []).append((entry.name, entry.meaning))
    for group, entries in groups.items():
        lines += [f"## {group}", "", "| metric | meaning |", "|---|---|"]
        lines += [f"| `{name}` | {meaning.replace('|', chr(92) + '|')} |" for name, meaning in entries]
        lines.append("")
    return "\n".join(lines)


GENERATED_PAGES = {"configuration.md": configuration_page, "metrics.md": metrics_page}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arpo.reference.docs_gen", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "site-generated",
                        help="folder to write configuration.md and metrics.md into")
    parser.add_argument("--check", action="store_true",
                        help="only list composed config keys without a YAML comment (exit 1 if any)")
    args = parser.parse_args(argv)
    if args.check:
        missing = undocumented_keys()
        print("\n".join(missing) or "every key has a comment")
        raise SystemExit(1 if missing else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in GENERATED_PAGES.items():
        (args.out / name).write_text(make())
        print(args.out / name)


if __name__ == "__main__":
    main()
