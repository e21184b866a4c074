"""Cached test models, built once per version of the code that shapes them.

The SFT model takes minutes of single-threaded training and the SmolLM2 conversion half a minute. Builds hold a
file lock, so two sessions sharing a cache (two worktrees) never build the same model at once. Building them in
a background process while other tests ran was tried and measured slower: on 2 cores the suite's own torch and
vLLM work and the build slowed each other more than the overlap saved (early-phase tests ~2x slower).

Build ahead by hand: ``python -m tests.prebuild sft_model_dir smollm2_base_dir``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

REPO = Path(__file__).resolve().parents[1]

# What shapes each model: a change to any of these files gives a new cache entry.
SFT_SOURCES = ("arpo/data/synthetic.py", "arpo/data/synthetic_world.py", "arpo/data/synthetic_questions.py",
               "arpo/models/tiny.py", "arpo/sft.py", "arpo/data/sft_batches.py", "arpo/trainer/sft_step.py",
               "arpo/protocol.py", "configs/synthetic", "configs/tiny_model",
               "configs/sft.yaml", "configs/tools", "tools/search", "tools/python_sandbox")
SMOLLM2_SOURCES = ("arpo/models/pretrained.py",)


def cache_root() -> Path:
    return Path(os.environ.get("ARPO_TEST_CACHE", Path.home() / ".cache" / "arpo-tests"))


def cache_key(*paths: str, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for rel in paths:
        for f in sorted((REPO / rel).rglob("*") if (REPO / rel).is_dir() else [REPO / rel]):
            if f.is_file() and f.suffix in {".py", ".yaml"}:
                h.update(str(f.relative_to(REPO)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


#: The SFT build runs its demonstrations' tool calls on 8 threads and 8 sandbox workers instead of configs/sft.yaml's 1
#: and 4. The model is the same (bit for bit at 16, checked): demonstrations come out in row order, each with its own
#: RNG (tests/test_prebuild.py compares them built both ways), and training batches them in fixed windows of that order.
#: A sandboxed call mostly waits (namespace and mount set-up: ~15 ms of CPU in ~120 ms of wall), and the first epoch
#: trains on demonstrations as they arrive, so too few threads leave it waiting (a cached build's summary: 276 s of
#: demonstrations in its 434 s). 1,000 demonstrations beside a running SmolLM2 training took 91 s on 4 threads, 81 s on
#: 8, 76 s on 16 (300 beside a lighter load: 22.4 s on 4, 11.8 s on 16); 8 keeps the burst of sandbox starts small for
#: the other worker's Ray start-ups.
SFT_BUILD_OVERRIDES = ("sft.tool_workers=8", "+tools.1.config.max_workers=8")


def _build_sft(root: Path) -> Path:
    from arpo.pipeline import build_base_and_sft

    return build_base_and_sft(root, overrides=list(SFT_BUILD_OVERRIDES))["sft_model"]


def _build_smollm2(root: Path) -> Path:
    from arpo.models.pretrained import prepare_base_model

    return prepare_base_model("smollm2-135m-instruct", root)


# fixture name -> (cache folder prefix, sources, builder, the model's path inside the folder)
MODELS: dict[str, tuple[str, tuple[str, ...], Callable[[Path], Path], str]] = {
    "sft_model_dir": ("sft", SFT_SOURCES, _build_sft, "models/tiny-sft"),
    "smollm2_base_dir": ("smollm2-base", SMOLLM2_SOURCES, _build_smollm2, "."),
}


def model_root(name: str) -> Path:
    prefix, sources, _, _ = MODELS[name]
    return cache_root() / f"{prefix}-{cache_key(*sources)}"


def is_built(name: str) -> bool:
    return (model_root(name) / "DONE").exists()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(name: str) -> Path:
    """The cached model for fixture ``name``, built first if missing (waits for a build in progress)."""
    root = model_root(name)
    _, _, builder, inner = MODELS[name]
    with _locked(root.with_name(root.name + ".lock")):
        if not (root / "DONE").exists():
            shutil.rmtree(root, ignore_errors=True)
            builder(root)
            (root / "DONE").write_text("ok")
    return (root / inner).resolve()


if __name__ == "__main__":
    for fixture in sys.argv[1:]:
        print(f"{fixture}: {build(fixture)}", flush=True)
