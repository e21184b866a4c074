"""A model's sizes from its ``config.json`` alone: the architecture built on the meta device (no weights, no memory),
its parameters counted exactly and grouped the way FSDP2 shards them (one unit per decoder layer plus the root).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class ModelShapes:
    """What memory depends on: parameter shapes (exact, from the meta model) and the transformer's dimensions."""

    architecture: str
    #: every parameter's shape, in ``named_parameters`` order (a tied head appears once)
    param_shapes: tuple[tuple[int, ...], ...]
    #: elements in one decoder layer (an FSDP2 unit) and in the root unit (embeddings, final norm, head)
    layer_numel: int
    root_numel: int
    head_numel: int  # the output head's own weight (0 when tied to the embeddings)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position: int

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes)

    @property
    def largest_param_numel(self) -> int:
        return max(math.prod(s) for s in self.param_shapes)

    @property
    def kv_hidden(self) -> int:
        return self.kv_heads * self.head_dim

    def shard_numel(self, world_size: int) -> int:
        """Elements one rank holds when every parameter is sharded on dim 0 over ``world_size`` ranks, as FSDP2's
        ``fully_shard`` does: dim 0 padded up to a multiple of the world size, so each rank has ceil(d0 / ws) rows."""
        return sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in self.param_shapes)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """vLLM's KV cache per token: a key and a value vector per KV head per layer."""
        return 2 * self.layers * self.kv_hidden * dtype_bytes

    def lora_numel(self, rank: int, targets: str | tuple[str, ...]) -> int:
        """Elements of the LoRA adapters (A: r x in, B: out x r per wrapped linear) of a Llama-style decoder
        (q/k/v/o, gate/up/down projections); ``targets`` all-linear (every one, the LM head excluded, as peft) or
        module names (others count nothing)."""
        q = self.heads * self.head_dim
        h, kv, i = self.hidden, self.kv_hidden, self.intermediate
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        names = list(dims) if targets == "all-linear" else [t for t in targets if t in dims]
        return rank * self.layers * sum(sum(dims[n]) for n in names)

    def critic_numel(self) -> int:
        """The critic (AutoModelForTokenClassification, one output): the backbone, a (1, hidden) value head for the
        LM head."""
        return self.numel - self.head_numel + self.hidden + 1


def _decoder_layer_names(model) -> set[str]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"{type(model).__name__} names no transformer block class in _no_split_modules")
    return names


@lru_cache(maxsize=8)
def model_shapes(model_dir: str) -> ModelShapes:
    """:class:`ModelShapes` of the HF model directory ``model_dir`` (only its ``config.json`` is read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(Path(model_dir)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.named_parameters())  # deduplicated: a tied head is the embedding's tensor
    blocks = [m for m in model.modules() if type(m).__name__ in _decoder_layer_names(model)]
    layer_numel = sum(p.numel() for p in blocks[0].parameters())
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    hidden = int(text.hidden_size)
    return ModelShapes(
        architecture=type(model).__name__,
        param_shapes=tuple(tuple(p.shape) for _, p in params),
        layer_numel=int(layer_numel),
        root_numel=int(sum(p.numel() for _, p in params if id(p) not in in_blocks)),
        head_numel=0 if tied else int(head.weight.numel()),
        hidden=hidden, layers=int(text.num_hidden_layers), heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        intermediate=int(text.intermediate_size), vocab=int(text.vocab_size),
        max_position=int(getattr(text, "max_position_embeddings", 0) or 0))
