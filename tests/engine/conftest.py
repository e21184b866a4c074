"""Fixtures for the engine tests: a taught copy of the tiny model, one event loop per module, weight dirs in shm.

vLLM's AsyncLLM binds its output task to the event loop it first runs in, so a module that shares one engine
across tests also shares one loop (``run``) instead of calling ``asyncio.run`` per test.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from arpo.engine.weights import default_weights_dir
from tests.engine.helpers import teach_tool_calls


@pytest.fixture(scope="session")
def taught_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model fine-tuned to emit ``<search>…</search>`` / ``<python>…</python>`` for the LESSONS prompts."""
    return str(teach_tool_calls(tiny_model_dir, tmp_path_factory.mktemp("taught_model")))


@pytest.fixture(scope="module")
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.fixture
def shm_dirs():
    """Weight directories in /dev/shm (as the trainer uses), removed whatever the test's outcome."""
    made = []

    def make():
        made.append(default_weights_dir())
        return made[-1]

    yield make
    for d in made:
        shutil.rmtree(d, ignore_errors=True)
