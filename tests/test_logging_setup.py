"""The one logging setup: engine chatter goes to the run's log file, not the console."""

import logging
import sys

import pytest

from arpo.runtime.logging_utils import setup_logging


@pytest.fixture
def vllm_logger(monkeypatch):
    """The ``vllm`` logger as a fresh process has it, restored after. An in-process engine that an earlier test
    started configured it with vLLM's own config (a handler, no propagation, and the level of
    ``VLLM_LOGGING_LEVEL``, which importing trl had set to ERROR; tests/trainer/test_trl_parity.py now undoes
    that)."""
    logger = logging.getLogger("vllm")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "disabled", False)
    level = logger.level
    logger.setLevel(logging.NOTSET)  # setLevel, not setattr: it also clears the loggers' cached levels
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize("vllm_configured_first", [False, True])
def test_engine_info_reaches_the_file_but_not_the_console(tmp_path, capsys, monkeypatch, vllm_logger,
                                                          vllm_configured_first):
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setenv("ARPO_LOG_DIR", str(tmp_path))  # restored after: setup_logging points workers here
    if vllm_configured_first:  # what an in-process engine does when vLLM's own logging config is on
        vllm_logger.addHandler(logging.StreamHandler(sys.stdout))
        vllm_logger.propagate = False
        vllm_logger.setLevel(logging.INFO)
    root = logging.getLogger()
    before = list(root.handlers)
    for h in before:  # a fresh setup, whatever earlier tests installed (its console binds to capsys's stderr)
        root.removeHandler(h)
    try:
        setup_logging(tmp_path, filename="run.log")
        import os

        assert os.environ["VLLM_CONFIGURE_LOGGING"] == "0"  # vLLM then propagates instead of printing to stdout
        logging.getLogger("vllm.engine").info("KV cache 4 GiB")
        logging.getLogger("vllm.engine").warning("engine slow")
        logging.getLogger("arpo.trainer").info("step 1")
        for h in root.handlers:
            h.flush()
        captured = capsys.readouterr()
        console = captured.err + captured.out
        logged = (tmp_path / "run.log").read_text()
        assert "KV cache 4 GiB" in logged and "KV cache 4 GiB" not in console
        assert "engine slow" in logged and "engine slow" in console
        assert "step 1" in logged and "step 1" in console
    finally:
        _restore(root, before)


def _restore(root, before):
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in before:
        root.addHandler(h)


def test_engine_logs_shown_live_on_request(tmp_path, capsys, monkeypatch, vllm_logger):
    monkeypatch.setenv("ARPO_ENGINE_LOGS", "console")
    monkeypatch.setenv("ARPO_LOG_DIR", str(tmp_path))
    root = logging.getLogger()
    before = list(root.handlers)
    for h in before:
        root.removeHandler(h)
    try:
        setup_logging(tmp_path, filename="run.log")
        logging.getLogger("vllm.engine").info("KV cache 4 GiB")
        logging.getLogger("bm25s").debug("index internals")  # below the console's level either way
        captured = capsys.readouterr()
        assert "KV cache 4 GiB" in captured.err and "index internals" not in captured.err
    finally:
        _restore(root, before)
