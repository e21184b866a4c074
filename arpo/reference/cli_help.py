"""``--help`` for the entry points configured by Hydra-style ``key=value`` overrides.

Those entry points compose ``configs/<name>.yaml`` with :func:`arpo.config.load_config`, which would take ``--help``
for an override. :func:`exit_if_help` answers it first: usage, what the command does, and what a user may
override — the presets, the config groups with their options, and the config's top-level sections — read from
``configs/`` so the text follows the files.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from arpo.config import config_dir

HELP_FLAGS = ("-h", "--help")


def _defaults(config: Path) -> list:
    return list(OmegaConf.to_container(OmegaConf.load(config)).get("defaults") or [])


def config_groups(name: str) -> dict[str, list[str]]:
    """Group -> its options, for every group of ``configs/<name>.yaml``'s defaults a user selects with
    ``group=option`` (``preset``, ``tools``, ``synthetic`` …); file includes (``rollout/engine``) are not groups."""
    root = config_dir()
    groups: dict[str, list[str]] = {}
    for entry in _defaults(root / f"{name}.yaml"):
        if isinstance(entry, dict):
            for group in entry:
                options = sorted(p.stem for p in (root / str(group)).glob("*.yaml"))
                if options:
                    groups[str(group)] = options
    return groups


def usage_text(name: str, command: str, summary: str) -> str:
    """The help text of a command composing ``configs/<name>.yaml``."""
    from arpo.config import load_config

    groups = config_groups(name)
    presets = groups.pop("preset", None)
    shape = " [preset=NAME]" if presets else ""
    shape += " [GROUP=OPTION ...]" if groups else ""
    lines = [f"usage: {command}{shape} [key=value ...]", "", summary.strip(), "",
             f"config: configs/{name}.yaml (every key is documented there with a comment; override any with "
             f"key=value, e.g. a.b.c=1; an unknown key is a start-up error)"]
    if presets:
        lines += ["", f"presets (preset=NAME, configs/preset/): {', '.join(presets)}"]
    if groups:
        lines += ["", "config groups (GROUP=OPTION):"]
        lines += [f"  {group}: {' | '.join(options)}" for group, options in groups.items()]
    sections = sorted(str(k) for k in load_config(name, []))
    lines += ["", f"sections: {', '.join(sections)}"]
    return "\n".join(lines)


def exit_if_help(name: str, command: str, summary: str | None, argv: Sequence[str] | None = None) -> None:
    """Print the usage of ``command`` and exit 0 when the arguments ask for help (``-h``/``--help``)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in HELP_FLAGS for arg in argv):
        print(usage_text(name, command, (summary or "").split("\n\n")[0]))
        raise SystemExit(0)
