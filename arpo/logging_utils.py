"""The project's one logging setup: console plus a process-safe rotating file (concurrent-log-handler).

Library modules use ``logging.getLogger(__name__)``; entry points call :func:`setup_logging` once, so Ray
workers, rollout threads and the driver all write to the same file without clobbering each other.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s"
#: Engines whose INFO lines (model loading, KV cache sizes, per-request chatter) go to the log file only.
ENGINE_LOGGERS = ("vllm", "ray", "torch.distributed")


class _ConsoleFilter(logging.Filter):
    """Keep engine INFO/DEBUG off the console: the file has them; warnings and errors still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(ENGINE_LOGGERS)



def setup_logging(log_dir: str | Path | None = None, level: str | int | None = None,
                  filename: str = "arpo.log") -> logging.Logger:
    """Configure the root logger once per process (idempotent). Returns the ``arpo`` logger."""
    level = level or os.environ.get("ARPO_LOG_LEVEL", "INFO")
    # vLLM otherwise installs its own stdout handler at import, which mixes its chatter into a script's output
    # (and into JSON printed on stdout); with this its records reach the handlers below. Inherited by workers.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # If vLLM was imported first it has already installed that handler (and stopped propagation): undo it.
    vllm_logger = logging.getLogger("vllm")
    for handler in list(vllm_logger.handlers):
        vllm_logger.removeHandler(handler)
    vllm_logger.propagate = True
    root = logging.getLogger()
    root.setLevel(level)
    if not any(getattr(h, "_arpo", False) and isinstance(h, logging.StreamHandler) for h in root.handlers):
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter(_FORMAT))
        console.addFilter(_ConsoleFilter())
        console._arpo = True  # type: ignore[attr-defined]
        root.addHandler(console)
    if log_dir is not None:
        from concurrent_log_handler import ConcurrentRotatingFileHandler

        path = Path(log_dir) / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if not any(getattr(h, "_arpo_file", None) == str(path) for h in root.handlers):
            fh = ConcurrentRotatingFileHandler(str(path), maxBytes=20 * 1024 * 1024, backupCount=3)
            fh.setFormatter(logging.Formatter(_FORMAT))
            fh._arpo_file = str(path)  # type: ignore[attr-defined]
            root.addHandler(fh)
    # Third-party chatter drowns the training log at INFO.
    for noisy in ("httpx", "urllib3", "filelock", "datasets"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger("arpo")
