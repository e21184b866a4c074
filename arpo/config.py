"""Config loading for every entry point: Hydra composition from ``configs/`` plus one-line start-up errors.

Entry points call :func:`load_config` (or run under :func:`cli_main`) so that a typo in a key, a missing file or
an invalid value stops the program before any work with one line that names the key and the fix.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from omegaconf import DictConfig, OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]


class ConfigError(ValueError):
    """A bad config value; the message names the key and the fix."""


def section_values(section: Mapping[str, Any] | None, key: str, known: set[str]) -> dict[str, Any]:
    """The set (non-null) values of config section ``key``; a key outside ``known`` is an error naming it."""
    section = dict(section or {})
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]} is not a key; the keys are {', '.join(sorted(known))}")
    return {k: v for k, v in section.items() if v is not None}


def config_dir() -> Path:
    return Path(os.environ.get("ARPO_CONFIG_DIR", REPO_ROOT / "configs")).resolve()


def load_config(name: str, overrides: Sequence[str] | None = None) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with Hydra-style ``key=value`` overrides (default: ``sys.argv[1:]``).

    Unknown keys are rejected (configs are in struct mode); add new keys with ``+key=value`` only if the code
    reads them — every documented key is used.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(sys.argv[1:] if overrides is None else overrides)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            cfg = compose(config_name=name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        msg = str(e).splitlines()[0]
        if "not in struct" in msg or "Could not override" in msg:
            key = msg.split("'")[1] if "'" in msg else msg
            from arpo.rollout.config import CONFIG_PREFIX, RENAMED

            leaf = key.removeprefix(CONFIG_PREFIX + ".")
            if key.startswith(CONFIG_PREFIX + ".") and leaf in RENAMED:
                raise ConfigError(f"config key '{key}' is now '{CONFIG_PREFIX}.{RENAMED[leaf]}' (configs/rollout/"
                                  f"arpo.yaml: one sub-section per concern)") from None
            raise ConfigError(f"unknown config key '{key}' for configs/{name}.yaml: check its spelling against "
                              f"that file (every valid key is documented there)") from None
        raise ConfigError(f"configs/{name}.yaml: {msg}") from None
    OmegaConf.resolve(cfg)
    OmegaConf.set_struct(cfg, True)
    return cfg


def require_path(value: str | None, key: str, fix: str, kind: str = "path") -> Path:
    """Return ``value`` as an existing path or raise ConfigError naming ``key`` and ``fix``."""
    if not value:
        raise ConfigError(f"{key} is not set: {fix}")
    p = Path(value).expanduser()
    if not p.exists():
        raise ConfigError(f"{key}={value}: no such {kind}; {fix}")
    return p


def _exit_cleanly_on_sigterm() -> None:
    """SIGTERM (``kill``, a scheduler's stop) ends the program as Ctrl-C does, through ``finally`` blocks and
    ``atexit``: Python's default ends it on the spot, which left the in-process vLLM engine core and a Ray cluster
    the program started running as orphans, still using the CPUs."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def cli_main(fn: Callable[[], object]) -> None:
    """Run an entry point; a ConfigError becomes one line on stderr and exit status 2.

    Called from a program's ``__main__`` module, both end the process without the interpreter's final garbage
    collection (:mod:`arpo.runtime.fast_exit`: seconds per run); called from other code (a test) it returns or raises
    SystemExit as usual. An unexpected exception takes Python's usual path (traceback, status 1)."""
    from arpo.runtime.fast_exit import exit_now

    as_program = sys._getframe(1).f_globals.get("__name__") == "__main__"
    if as_program:
        _exit_cleanly_on_sigterm()
    try:
        fn()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        exit_now(2) if as_program else sys.exit(2)
    if as_program:
        exit_now(0)
