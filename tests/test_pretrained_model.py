"""The real base model: GGUF → HF conversion, loading by path, and one-line errors for bad sources."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from arpo.config import ConfigError
from arpo.models.pretrained import CONVERSION_RECORD, packaged_gguf, prepare_base_model
from tests.conftest import REPO

PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "<search> founder of Trivex </search> <result>\nTrivex was founded by Ana Lor.\n</result>",
]


def _chat_ids(tok, text: str) -> torch.Tensor:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    return torch.tensor([ids])


@pytest.fixture(scope="module")
def gguf_reference():
    """The model as transformers loads it straight from the GGUF file (the reference for the conversion)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = packaged_gguf("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.mark.slow
def test_converted_logits_match_the_gguf_model(smollm2_base_dir, gguf_reference):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref_tok, ref = gguf_reference
    tok = AutoTokenizer.from_pretrained(smollm2_base_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_base_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert getattr(model.config, "quantization_config", None) is None
    with torch.no_grad():
        for text in PROMPTS:
            ids = _chat_ids(tok, text)
            assert torch.equal(ids, _chat_ids(ref_tok, text))
            # Same dequantized weights in fp32: agreement to float rounding.
            diff = (model(ids).logits - ref(ids).logits).abs().max().item()
            assert diff <= 1e-4, (text, diff)


@pytest.mark.slow
def test_dequantization_matches_gguf_library(smollm2_base_dir):
    """The embedding (stored Q4_1 in the GGUF) equals gguf's own dequantization: the tensor mapping is right."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    reader = GGUFReader(str(packaged_gguf("smollm2-135m-instruct")))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    expected = dequantize(tensor.data, tensor.tensor_type).reshape(49152, 576)
    weights = load_file(str(smollm2_base_dir / "model.safetensors"))
    got = weights["model.embed_tokens.weight"].numpy()
    assert np.abs(got - expected).max() <= 1e-6


@pytest.mark.slow
def test_converted_model_answers_like_a_language_model(smollm2_base_dir):
    """A wrong tensor layout (e.g. unpermuted q/k projections) gives fluent-looking garbage at best; the real
    model knows this fact."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_base_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_base_dir, dtype=torch.float32).eval()
    ids = _chat_ids(tok, "What is the capital of France? Answer in one word.")
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_tokenizer_keeps_template_and_gets_a_distinct_pad(smollm2_base_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_base_dir)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((smollm2_base_dir / "config.json").read_text())
    assert config["pad_token_id"] == tok.pad_token_id and config["eos_token_id"] == tok.eos_token_id


@pytest.mark.slow
def test_conversion_is_reused_and_redone_on_dtype_change(smollm2_base_dir, tmp_path):
    weights = smollm2_base_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert prepare_base_model("smollm2-135m-instruct", smollm2_base_dir) == smollm2_base_dir
    assert weights.stat().st_mtime_ns == before
    # A GGUF given by path is the same source; bfloat16 storage halves the checkpoint.
    out = prepare_base_model(str(packaged_gguf("smollm2-135m-instruct")), tmp_path / "bf16", dtype="bfloat16")
    record = json.loads((out / CONVERSION_RECORD).read_text())
    assert record["dtype"] == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < 0.6 * weights.stat().st_size
    assert not (tmp_path / "bf16.partial").exists()


def test_hf_directory_is_used_in_place(tiny_model_dir, tmp_path):
    assert prepare_base_model(str(tiny_model_dir), tmp_path / "unused") == tiny_model_dir
    assert not (tmp_path / "unused").exists()


@pytest.mark.parametrize("make_source, words", [
    (lambda p: str(p / "missing"), "no such file or directory"),
    (lambda p: str(p), "without config.json"),
    (lambda p: (p / "weights.bin").write_text("x") and str(p / "weights.bin"), "must be a .gguf"),
])
def test_bad_sources_fail_with_one_line(tmp_path, make_source, words):
    with pytest.raises(ConfigError, match=words) as e:
        prepare_base_model(make_source(tmp_path), tmp_path / "out")
    assert "\n" not in str(e.value) and "base_model.source=" in str(e.value)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    with pytest.raises(ConfigError, match="model_type 'vit' is not a causal LM"):
        prepare_base_model(str(tmp_path), tmp_path / "out")


def test_cli_reports_a_bad_source_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "arpo.models.pretrained", f"base_model.source={tmp_path}/nope",
                           f"base_model.out_dir={tmp_path}/out"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error")]
    assert len(errors) == 1 and "base_model.source=" in errors[0] and "no such file" in errors[0]
