"""Log-probabilities and entropies of response tokens without materialising full-vocabulary logits.

With a 152k vocabulary, fp32 logits for 16 rows × 8k tokens are 80 GB. Everything here works on chunks of
``chunk_size`` token positions: at most (chunk_size, V) logits exist at a time, and under autograd each
chunk is recomputed in the backward pass (activation checkpointing) so the saved state is the hidden
states, not the logits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.cache_utils import DynamicLayer

DEFAULT_CHUNK_SIZE = 256  # configs/algorithm.yaml: actor_rollout_ref.actor.logprob_chunk_size


def _logprob_entropy_rows(logits: torch.Tensor, labels: torch.Tensor | None,
                          calc_entropy: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of ``labels`` and entropy for 2-D fp32 ``logits`` (N, V)."""
    lse = torch.logsumexp(logits, dim=-1)
    logp = None if labels is None else logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if calc_entropy:
        # H = logsumexp(z) − Σ softmax(z)·z
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return logp, ent


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor,
                         chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """log softmax(logits)[labels] for logits (..., V) and labels (...), computed ``chunk_size`` rows at a
    time in fp32 (only a (chunk_size, V) fp32 temporary exists at once). Returns fp32 of shape (...)."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = [
        _logprob_entropy_rows(flat[i: i + chunk_size].float(), flat_labels[i: i + chunk_size], False)[0]
        for i in range(0, flat.shape[0], chunk_size)
    ]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Categorical entropy of logits (..., V) in nats, chunked like :func:`logprobs_from_logits`."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = [
        _logprob_entropy_rows(flat[i: i + chunk_size].float(), None, True)[1]
        for i in range(0, flat.shape[0], chunk_size)
    ]
    return (torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)).reshape(logits.shape[:-1])


class _PreciseLinear(torch.autograd.Function):
    """``x @ W.T (+ b)`` in fp32, with the backward's two matmuls in ``low`` precision (fp32 accumulation).

    The forward is what log-probs are made of, so it keeps fp32; the backward only feeds gradients, which
    the decoder computes in bf16 anyway, and its two matmuls are half the head's cost (bf16 is ~5x fp32 on a
    CPU with avx512_bf16)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                low: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.low, ctx.has_bias = low, bias is not None
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.to(ctx.low)
        grad_x = (g @ weight.to(ctx.low)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (g.t() @ x.to(ctx.low)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def _head_chunk(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                calc_entropy: bool, entropy_grad: bool, head_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    device_type = hidden.device.type
    if head_fp32 and torch.is_autocast_enabled(device_type) and isinstance(head, nn.Linear):
        # bf16 logits are rounded to 8 bits of mantissa: 0.125 apart at 16-32, so log-probs would be off
        # by up to ~0.06. The head's forward alone in fp32 keeps them to the decoder's own smaller error.
        low = torch.get_autocast_dtype(device_type)
        # a model kept in bf16 (the frozen reference) has its head upcast here; fp32 ones pass as they are
        weight, bias = (None if t is None else t.float() for t in (head.weight, head.bias))
        with torch.autocast(device_type, enabled=False):
            logits = _PreciseLinear.apply(hidden.float(), weight, bias, low)
    else:
        logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    if not calc_entropy or entropy_grad:
        logp, ent = _logprob_entropy_rows(logits, labels, calc_entropy)
        return logp, (ent if ent is not None else torch.zeros_like(logp))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    # Entropy as a metric only: nothing saved for backward, and a recompute stops before it (checkpoint's
    # early stop ends the replay once the tensors the backward needs exist).
    with torch.no_grad():
        probs = (logits - lse.unsqueeze(-1)).exp_()
        ent = lse - torch.linalg.vecdot(probs, logits)
    return logp, ent


class ChunkedResponseHead(nn.Module):
    """Stands in for a causal LM's output head during one forward: instead of logits it returns a (B, R, 2)
    tensor of [log-prob of the response token, entropy] for ``labels`` (B, R), where ``sources`` (B, R)
    is the column whose hidden state predicts each of them.

    Running inside the model's own forward keeps wrappers such as FSDP2 (which gather parameters in the
    root module's forward hooks, tied embeddings included) working unchanged.
    """

    def __init__(self, head: nn.Module, labels: torch.Tensor, valid: torch.Tensor, sources: torch.Tensor,
                 chunk_size: int, temperature: float, calc_entropy: bool, entropy_grad: bool = True,
                 head_fp32: bool = True):
        super().__init__()
        self.head = head
        self.labels, self.valid, self.sources = labels, valid, sources
        self.chunk_size, self.temperature, self.calc_entropy = chunk_size, temperature, calc_entropy
        self.entropy_grad, self.head_fp32 = entropy_grad, head_fp32

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, r = self.labels.shape
        rows, cols = self.valid.nonzero(as_tuple=True)
        hidden = hidden_states[rows, self.sources[rows, cols]]
        labels = self.labels[rows, cols]
        use_ckpt = torch.is_grad_enabled() and hidden.requires_grad
        logps, ents = [], []
        for i in range(0, hidden.shape[0], self.chunk_size):
            args = (self.head, hidden[i: i + self.chunk_size], labels[i: i + self.chunk_size],
                    self.temperature, self.calc_entropy, self.entropy_grad, self.head_fp32)
            logp, ent = checkpoint(_head_chunk, *args, use_reentrant=False) if use_ckpt else _head_chunk(*args)
            logps.append(logp)
            ents.append(ent)
        out = hidden_states.new_zeros((b, r, 2), dtype=torch.float32)
        if logps:
            out = out.index_put((rows, cols), torch.stack([torch.cat(logps), torch.cat(ents)], dim=-1))
        return out


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               response_length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rows of a verl-layout batch (left-padded prompt ‖ right-padded response) moved to the left edge and
    cut to the longest: ``(input_ids, position_ids, sources)``, with ``sources`` (B, R) the column whose
    hidden state predicts each response token. None when a row's tokens are not one contiguous run.

    The batch is padded to its longest prompt plus its longest response; a micro-batch then runs the
    decoder on every padding column, and the padding mask forces masked attention. Left-aligned, each row
    needs only the causal mask (the padding now sits after all its tokens, where causality hides it), so
    the model runs without an attention mask: sdpa's causal kernel, over max(prompt + response) columns.
    Real tokens keep their positions, so they compute exactly what they did; padding columns get positions
    that continue the row's (HF would otherwise read repeated positions as packed sequences)."""
    mask = attention_mask.bool()
    lengths = mask.sum(dim=1)
    starts = mask.int().argmax(dim=1)  # first real column (0 for an empty row)
    width = int(lengths.max()) if lengths.numel() else 0
    cols = torch.arange(input_ids.shape[1], device=input_ids.device)
    run = (cols >= starts.unsqueeze(1)) & (cols < (starts + lengths).unsqueeze(1))
    if width == 0 or not torch.equal(run, mask):
        return None
    new_cols = torch.arange(width, device=input_ids.device)
    src = (starts.unsqueeze(1) + new_cols).clamp(max=input_ids.shape[1] - 1)
    real = new_cols < lengths.unsqueeze(1)
    ids = torch.where(real, input_ids.gather(1, src), 0)
    last_pos = position_ids.gather(1, (starts + lengths - 1).clamp(min=0).unsqueeze(1))
    pos = torch.where(real, position_ids.gather(1, src), last_pos + 1 + new_cols - lengths.unsqueeze(1))
    prompt_lengths = input_ids.shape[1] - response_length - starts
    sources = (prompt_lengths.unsqueeze(1) - 1 + torch.arange(response_length, device=input_ids.device)).clamp(min=0)
    return ids, pos, sources


#: shortest common prefix worth a separate pass (below it the extra layer calls cost more than they save)
MIN_SHARED_PREFIX = 16


def shared_prefix_length(input_ids: torch.Tensor, sources: torch.Tensor, valid: torch.Tensor) -> int:
    """Columns at the start of every (left-aligned) row that hold the same tokens in all rows and whose hidden
    states predict no scored token: the system prompt that every trajectory of a batch begins with, or a
    group's whole prompt. 0 when fewer than :data:`MIN_SHARED_PREFIX` or the batch has one row."""
    if input_ids.shape[0] < 2 or not bool(valid.any()):
        return 0
    same = (input_ids == input_ids[:1]).all(dim=0)
    common = int(same.int().argmin()) if not bool(same.all()) else input_ids.shape[1]
    first_source = int(sources[valid].min())  # the hidden state at this column is needed per row
    n = min(common, first_source)
    return n if n >= MIN_SHARED_PREFIX else 0


class _FrozenPrefixLayer(DynamicLayer):
    """One decoder layer's key/value cache of a shared prefix, read-only: ``update`` returns the prefix's
    states (broadcast over the batch) followed by the new ones and stores nothing. Gradient checkpointing
    replays a layer's forward in the backward pass; a cache that grew on the first call would hand the
    replay a different prefix, so HF drops caches under checkpointing unless the layer only reads them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        b = key_states.shape[0]
        return (torch.cat([self.keys.expand(b, -1, -1, -1), key_states], dim=-2),
                torch.cat([self.values.expand(b, -1, -1, -1), value_states], dim=-2))


class _AnchorHead(nn.Module):
    """The output head of the prefix pass, whose hidden states are only needed as keys and values: a zero
    that depends on them. Added to the result, it puts the prefix pass's outputs in the loss's graph, so
    that wrappers which act on gradients reaching a module's outputs (FSDP2 gathers the parameters again
    for the backward there) see this forward's backward too."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[:, -1:, :1].float() * 0.0


def _checkpointing_modules(model: nn.Module) -> list[nn.Module]:
    """The model and its layers with HF gradient checkpointing on (they drop caches in training mode)."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]


@contextlib.contextmanager
def head_swapped(model: nn.Module, head: nn.Module) -> Iterator[None]:
    """``model.lm_head`` is ``head`` inside the block: the stand-in runs within the model's own forward, so
    wrappers' root hooks (FSDP2 gathers the embedding and head there) stay in charge."""
    original = model.lm_head
    model.lm_head = head
    try:
        yield
    finally:
        model.lm_head = original


@contextlib.contextmanager
def shared_prefix_cache(model: nn.Module, input_ids: torch.Tensor,
                        position_ids: torch.Tensor) -> Iterator[tuple[Any, torch.Tensor]]:
    """``(cache, anchor)`` of the shared prefix ``input_ids`` (one row): its keys and values as read-only
    layers for every row of the forward run inside the block, and a zero to add to that forward's loss.

    The prefix runs once through the model's root forward (its head an :class:`_AnchorHead`), so wrappers such
    as FSDP2 gather and reduce its parameters as for any forward; the anchor puts that pass in the loss's graph.
    Under autograd the prefix's activations are kept (one row): gradients of every row's loss flow back through
    its keys and values. Gradient checkpointing may replay the block's layers: they only read the cache.
    An empty prefix (no columns) runs nothing and gives ``(None, None)``."""
    if input_ids.shape[1] == 0:
        yield None, None
        return
    checkpointing = _checkpointing_modules(model)
    for m in checkpointing:  # the prefix pass must return its cache (HF drops it under checkpointing)
        m.gradient_checkpointing = False
    try:
        with head_swapped(model, _AnchorHead()):
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True)
    finally:
        for m in checkpointing:
            m.gradient_checkpointing = True
    cache = out.past_key_values
    cache.layers = [_FrozenPrefixLayer(layer.keys, layer.values) for layer in cache.layers]
    readers = [m for m in checkpointing if hasattr(m, "_can_checkpoint_with_cache")]
    for m in readers:  # the frozen prefix is read, never written: safe to replay under checkpointing
        m._can_checkpoint_with_cache = True
    try:
        yield cache, out.logits.sum()
    finally:
        for m in readers:
            del m._can_checkpoint_with_cache  # back to the class default


def compute_logprobs_and_entropy(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    calc_entropy: bool = False,
    entropy_grad: bool = True,
    head_fp32: bool = True,
    pack: bool = True,
    head_mask: torch.Tensor | None = None,
    share_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens of a verl-layout batch under a HF causal LM.

    ``input_ids = prompts ‖ responses`` (B, P + R) with ``response_length`` = R. Runs the model's forward
    once with its ``lm_head`` temporarily replaced by a chunked head, so the decoder's hidden states are
    projected to the vocabulary ``chunk_size`` response tokens at a time (padding positions skipped) and
    the full (B, T, V) logits never exist. Logits are divided by ``temperature`` (the rollout's) before the
    softmax, as verl does. Returns fp32 ``(log_probs (B, R), entropy (B, R) or None)``; positions where
    ``attention_mask`` is 0 are 0.

    ``entropy_grad=False`` computes the entropy as a metric (no graph, no backward cost). Under autocast
    ``head_fp32`` runs the output projection in fp32 (see :func:`_head_chunk`). ``pack`` runs the rows
    left-aligned without padding mask (:func:`left_align`). ``head_mask`` (B, R), e.g. the update's loss
    mask, restricts the vocabulary projection to those positions (tool results carry no loss): others are
    0 too. ``share_prefix`` (with ``pack``) runs the columns every row begins with (:func:`shared_prefix_length`)
    once instead of once per row, and the rest of each row on their keys and values: the same log-probs and
    gradients (up to float rounding) for fewer tokens.
    """
    if response_length < 1 or response_length >= input_ids.shape[1]:
        raise ValueError(f"response_length must be in [1, {input_ids.shape[1] - 1}], got {response_length}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    head = getattr(model, "lm_head", None)
    if head is None:
        raise ValueError(f"{type(model).__name__} has no lm_head; pass a causal LM (e.g. Qwen2ForCausalLM)")
    labels = input_ids[:, -response_length:]
    valid = attention_mask[:, -response_length:].bool()
    if head_mask is not None:
        valid = valid & head_mask.bool()
    aligned = left_align(input_ids, attention_mask, position_ids, response_length) if pack else None
    if aligned is not None:
        input_ids, position_ids, sources = aligned
        attention_mask = None
    else:
        # The hidden state at column p predicts token p + 1: columns [-R-1, -1) predict the response.
        first = input_ids.shape[1] - response_length - 1
        sources = (first + torch.arange(response_length, device=input_ids.device)).expand(len(labels), -1)
    prefix = shared_prefix_length(input_ids, sources, valid) if aligned is not None and share_prefix else 0
    with shared_prefix_cache(model, input_ids[:1, :prefix], position_ids[:1, :prefix]) as (cache, anchor):
        input_ids, position_ids, sources = input_ids[:, prefix:], position_ids[:, prefix:], sources - prefix
        with head_swapped(model, ChunkedResponseHead(head, labels, valid, sources, chunk_size, temperature,
                                                     calc_entropy, entropy_grad, head_fp32)):
            out: Any = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=cache, use_cache=False)
    packed = out.logits if hasattr(out, "logits") else out[0]
    if anchor is not None:
        packed = packed + anchor
    return packed[..., 0], (packed[..., 1] if calc_entropy else None)
