"""Models by Hugging Face Hub ID: which strings are one, and the files of a checkpoint that are fetched."""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

#: ``org/name``: a Hugging Face model id
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: an HF checkpoint's files: weights, config, tokenizer (no other weight formats)
MODEL_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken")


def is_hub_id(source: str) -> bool:
    """``Qwen/Qwen2.5-7B-Instruct``-like and not a local path."""
    return bool(_HUB_ID.match(source)) and not Path(source).expanduser().exists()


def download_base_model(repo_id: str, out_dir: Path) -> Path:
    """Fetch an HF checkpoint once into ``out_dir`` (weights, config, tokenizer; no other formats)."""
    from huggingface_hub import snapshot_download

    logger.info("downloading %s from the Hugging Face Hub into %s", repo_id, out_dir)
    snapshot_download(repo_id=repo_id, local_dir=str(out_dir), allow_patterns=list(MODEL_FILES))
    return out_dir
