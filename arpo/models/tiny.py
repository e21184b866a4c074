"""Build the project's own tiny model: a byte-level BPE tokenizer and a small Qwen2, saved in HF format.

No model hub is reachable from our CI or a laptop on a plane, so the end-to-end run trains its own checkpoint.
It is saved exactly like a real one (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with a Qwen-style chat template, ``generation_config.json``), so every other part of
the project takes a model *path* and never special-cases it: point ``actor_rollout_ref.model.path`` at a real
Qwen2.5 checkpoint and the same code runs.

Tokenizer: byte-level BPE trained on the task corpus, digits split one per token (as Qwen2 does), special
tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, and the ARPO tags as added tokens so a tag is one
token (real checkpoints split tags into several tokens; nothing downstream depends on it).

Run: ``python -m arpo.models.tiny [tiny_model.out_dir=...] [tiny_model.hidden_size=...]``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable

import torch

from arpo.protocol import ALL_TAGS

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen2.5-style template: system/user/assistant/tool roles; tool results are wrapped as the user turn
# `<tool_response>` blocks (consecutive tool messages share one turn); `tools` are listed in the system turn
# with the hermes `<tool_call>` convention so the agent loop's function-call path works unchanged.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not (loop.first and tools) %}"
    "{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tc in message.get('tool_calls') or [] %}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc %}"
    "{{- '\\n<tool_call>\\n{\\\"name\\\": \\\"' + f['name'] + '\\\", \\\"arguments\\\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train the byte-level BPE and save it as a transformers fast tokenizer; return the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(ALL_TAGS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return AutoTokenizer.from_pretrained(str(out_dir))


def build_model(tokenizer, out_dir: Path, hidden_size: int, num_layers: int, num_heads: int,
                num_kv_heads: int, intermediate_size: int, max_position_embeddings: int, seed: int,
                tie_word_embeddings: bool = True):
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"tiny_model: hidden_size ({hidden_size}) must divide by num_heads ({num_heads}) and "
                         f"num_heads by num_kv_heads ({num_kv_heads})")
    # Pad the vocabulary to a multiple of 64 like real checkpoints (vLLM and matmuls prefer it).
    vocab = ((len(tokenizer) + 63) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, torch_dtype="float32",
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=config.bos_token_id,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return model


def corpus_texts(paths: Iterable[str | Path]) -> list[str]:
    """Texts to train the tokenizer on: parquet prompts/answers/plans and JSONL corpus documents."""
    import pandas as pd

    texts: list[str] = list(ALL_TAGS)
    for p in map(Path, paths):
        if p.suffix == ".parquet":
            df = pd.read_parquet(p)
            for msgs in df["prompt"]:
                texts.extend(m["content"] for m in msgs)
            for rm in df["reward_model"]:
                texts.append(str(rm["ground_truth"]))
            for ei in df["extra_info"]:
                if isinstance(ei, dict) and ei.get("plan"):
                    for step in json.loads(ei["plan"]):
                        texts.extend([step["content"], step["finding"]])
        elif p.suffix == ".jsonl":
            with p.open() as f:
                for line in f:
                    doc = json.loads(line)
                    texts.append(f"{doc.get('title', '')}: {doc.get('text', '')}")
        else:
            raise ValueError(f"tokenizer corpus file {p} must be .parquet or .jsonl")
    return texts


def build_tiny_model(out_dir: str | Path, corpus_files: Iterable[str | Path], seed: int = 0,
                     vocab_size: int = 2048, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int = 688,
                     max_position_embeddings: int = 4096) -> Path:
    """Train the tokenizer on ``corpus_files``, build the model, save both under ``out_dir``; return it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = list(corpus_files)
    if not files:
        raise ValueError("tiny_model.corpus_files is empty: give the synthetic parquet/corpus files to train the tokenizer on")
    tokenizer = train_tokenizer(corpus_texts(files), vocab_size, out)
    model = build_model(tokenizer, out, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
                        max_position_embeddings, seed)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("tiny model: %.2fM parameters, vocab %d (tokenizer %d) -> %s", n_params / 1e6,
                model.config.vocab_size, len(tokenizer), out)
    return out


def build_from_config(t, data_dir: Path) -> Path:
    """:func:`build_tiny_model` with the ``tiny_model.*`` keys, its tokenizer trained on ``data_dir``'s benchmark."""
    files = [data_dir / "train.parquet", data_dir / "corpus.jsonl"]
    return build_tiny_model(t.out_dir, files, seed=t.seed, vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                            num_layers=t.num_layers, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                            intermediate_size=t.intermediate_size, max_position_embeddings=t.max_position_embeddings)


def main() -> None:
    from arpo.reference.cli_help import exit_if_help
    from arpo.config import ConfigError, load_config
    from arpo.data.synthetic import generate_from_config
    from arpo.runtime.logging_utils import setup_logging

    exit_if_help("tiny_model", "python -m arpo.models.tiny", __doc__)
    cfg = load_config("tiny_model")
    setup_logging()
    data_dir = Path(cfg.data.synthetic_dir)
    if not (data_dir / "train.parquet").exists():
        if not cfg.data.generate_if_missing:
            raise ConfigError(f"data.synthetic_dir={data_dir} has no train.parquet: run "
                              f"`python -m arpo.data.synthetic synthetic.out_dir={data_dir}` or set "
                              f"data.generate_if_missing=true")
        generate_from_config(cfg.synthetic, data_dir)
    path = build_from_config(cfg.tiny_model, data_dir)
    print(f"tiny model saved to {path}")


if __name__ == "__main__":
    from arpo.config import cli_main

    cli_main(main)
