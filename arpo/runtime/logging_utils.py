"""The project's one logging setup: a concise console plus a process-safe rotating file (concurrent-log-handler).

Library modules use ``logging.getLogger(__name__)``; entry points call :func:`setup_logging` once, so Ray
workers, rollout threads and the driver all write to the same file without clobbering each other. Engine chatter
(vLLM, Ray, torch.distributed, Ray workers' own output) goes to the run's log folder only, unless
``ARPO_ENGINE_LOGS=console`` (``--show-engine-logs`` on the pipeline) shows it live.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

_FILE_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
#: Engines whose INFO lines (model loading, KV cache sizes, per-request chatter) go to the log file only.
ENGINE_LOGGERS = ("vllm", "ray", "torch.distributed", "bm25s")
#: ``console`` shows engine logs live; anything else (default ``file``) keeps them in the log folder.
ENGINE_LOGS_ENV = "ARPO_ENGINE_LOGS"
#: The log folder of the run, for Ray workers (set by :func:`setup_logging`, read by :func:`setup_worker_logging`).
LOG_DIR_ENV = "ARPO_LOG_DIR"
#: Raw stdout/stderr of Ray workers (engine start-up banners, C++ warnings, prints) when not shown live.
WORKER_OUTPUT_FILE = "workers.log"


def engine_logs_live() -> bool:
    return os.environ.get(ENGINE_LOGS_ENV, "file").lower() == "console"


class _ConsoleFilter(logging.Filter):
    """Keep engine INFO/DEBUG off the console: the file has them; warnings and errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(ENGINE_LOGGERS)


class _ConsoleFormatter(logging.Formatter):
    """``12:03:04 message``; warnings and errors also name their level and logger."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        stamp = self.formatTime(record, "%H:%M:%S")
        if record.levelno >= logging.WARNING:
            return f"{stamp} {record.levelname} {record.name}: {text}"
        return f"{stamp} {text}"


class _ConsoleHandler(logging.StreamHandler):
    """Writes through ``tqdm.write`` so log lines land above a progress bar instead of breaking it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def setup_logging(log_dir: str | Path | None = None, level: str | int | None = None,
                  filename: str = "arpo.log", console: bool = True) -> logging.Logger:
    """Configure the root logger once per process (idempotent). Returns the ``arpo`` logger."""
    level = level or os.environ.get("ARPO_LOG_LEVEL", "INFO")
    # vLLM otherwise installs its own stdout handler at import, which mixes its chatter into a script's output
    # (and into JSON printed on stdout); with this its records reach the handlers below. Inherited by workers.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # If vLLM was imported first it has already installed that handler (and stopped propagation): undo it.
    adopt_library_logger("vllm")
    root = logging.getLogger()
    root.setLevel(level)
    if console and not any(getattr(h, "_arpo", False) for h in root.handlers):
        handler = _ConsoleHandler()
        handler.setLevel(level)  # a library that sets its own logger to DEBUG stays off the console
        handler.setFormatter(_ConsoleFormatter())
        if not engine_logs_live():
            handler.addFilter(_ConsoleFilter())
        handler._arpo = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    if log_dir is not None:
        from concurrent_log_handler import ConcurrentRotatingFileHandler

        path = Path(log_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        os.environ[LOG_DIR_ENV] = str(path.parent.resolve())
        if not any(getattr(h, "_arpo_file", None) == str(path) for h in root.handlers):
            fh = ConcurrentRotatingFileHandler(str(path), maxBytes=20 * 1024 * 1024, backupCount=3)
            fh.setFormatter(logging.Formatter(_FILE_FORMAT))
            fh._arpo_file = str(path)  # type: ignore[attr-defined]
            root.addHandler(fh)
    # Third-party chatter drowns the training log at INFO.
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger("arpo")


def json_stdout() -> TextIO:
    """For a script whose stdout is one JSON object (the benchmarks): returns a stream on the real stdout for that
    object; from here on whatever else writes to fd 1 (engine chatter, C++ warnings, child processes such as vLLM's
    engine core or Ray's workers) lands on stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def adopt_library_logger(name: str) -> None:
    """Route a library logger that installs its own console handler at import (vLLM, Ray) through ours: its
    records then reach the run's log file and the console only through the engine filter."""
    lib = logging.getLogger(name)
    for handler in list(lib.handlers):
        lib.removeHandler(handler)
    lib.propagate = True


def setup_worker_logging() -> None:
    """Ray's ``worker_process_setup_hook``: a worker's log records join the run's ``arpo.log`` and its raw
    output (which Ray would otherwise forward to the driver's console) goes to ``workers.log`` beside it."""
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir or engine_logs_live():
        return
    path = Path(log_dir) / WORKER_OUTPUT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # O_APPEND: workers' lines never overlap
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    setup_logging(log_dir, console=False)
