"""Hugging Face transformers backend: :class:`HFEngine`, the logprob reference and the fallback without vLLM.

It follows vLLM's semantics so the two are interchangeable behind :class:`~arpo.engine.base.GenerationEngine`:

- sampling: repetition penalty (over prompt and output tokens, divide positive / multiply negative logits),
  then temperature, top-k, top-p; ``temperature == 0`` is greedy; a request ``seed`` makes its sampling
  reproducible whatever else is in the batch;
- logprobs: per generated token the top-k ``{token_id: logprob}`` plus the sampled token, from the raw
  log-softmax of the logits (``raw_logprobs``) or from the processed distribution (``processed_logprobs``);
- stopping: EOS from ``generation_config`` (stop_reason None), ``stop_token_ids`` (stop_reason = the id), stop
  strings (stop_reason = the string, text cut right after it, tokens kept whole), ``max_tokens`` ("length");
  ``text`` is the decoded tokens with special tokens kept (a final EOS included, as vLLM does with
  ``skip_special_tokens=False``), cut right after a matched stop string;
- ``max_tokens`` is clipped to the room left in ``max_model_len``.

Concurrent :meth:`HFEngine.generate` calls are decoded together: requests waiting when a batch starts join it
(up to ``hf_max_batch_size``), left-padded, with one KV cache; finished rows leave the cache. There is no prefix
cache (``num_cached_tokens`` is None).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from arpo.engine.base import GenerationOutput, SamplingParams
from arpo.engine.config import EngineConfig, default_device, resolve_dtype
from arpo.engine.weights import EngineWeights, WeightBucket, dtype_name, state_dict_of

logger = logging.getLogger(__name__)


def process_logits(logits: torch.Tensor, sp: SamplingParams, seen_ids: torch.Tensor | None) -> torch.Tensor:
    """The logits sampling draws from for one row (float32, masked entries -inf)."""
    logits = logits.float().clone()
    if sp.repetition_penalty != 1.0 and seen_ids is not None and seen_ids.numel():
        ids = torch.unique(seen_ids)
        vals = logits[ids]
        logits[ids] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if sp.temperature > 0:
        logits = logits / sp.temperature
    if sp.top_k is not None and 0 < sp.top_k < logits.numel():
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the best token always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def top_logprobs(logprobs: torch.Tensor, k: int, sampled: int) -> dict[int, float]:
    """``{token_id: logprob}`` for the ``k`` most likely tokens plus the sampled one (vLLM's layout)."""
    out: dict[int, float] = {}
    if k > 0:
        vals, ids = torch.topk(logprobs, min(k, logprobs.numel()))
        out = {int(i): float(v) for i, v in zip(ids.tolist(), vals.tolist())}
    out.setdefault(int(sampled), float(logprobs[sampled]))
    return out


@dataclass
class _Row:
    """One request being decoded."""

    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    max_new: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class HFEngine:
    """A :class:`~arpo.engine.base.GenerationEngine` running a transformers causal LM with a KV cache.

    ``config`` is an :class:`EngineConfig` or a mapping of its fields (``model_path``, ``dtype``,
    ``max_model_len``, ``seed``, ``logprobs_mode``, ``hf_max_batch_size`` are used).
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any]):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.config = (config if isinstance(config, EngineConfig) else EngineConfig.from_mapping(config)).validate()
        cfg = self.config
        start = time.perf_counter()
        self.device = default_device()
        self.dtype = resolve_dtype(cfg.dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(cfg.model_path, dtype=self.dtype).to(self.device).eval()
        try:
            gen_cfg = GenerationConfig.from_pretrained(cfg.model_path)
            eos = gen_cfg.eos_token_id
        except OSError:
            eos = None
        if eos is None:
            eos = self.model.config.eos_token_id if self.model.config.eos_token_id is not None \
                else self.tokenizer.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.max_model_len: int = int(cfg.max_model_len or self.model.config.max_position_embeddings)
        self.pad_token_id: int = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                                     else next(iter(self.eos_token_ids), 0))
        # Requests without a seed draw one from here, so a whole run is reproducible from config.seed.
        self._seed_rng = torch.Generator().manual_seed(int(cfg.seed))
        self._pending: list[tuple[_Row, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        # Held while a batch decodes or weights load, so a weight update never lands mid-batch.
        self._model_lock = threading.Lock()
        #: during a bucketed weight update: the model's state dict and the names loaded so far
        self._incoming: tuple[dict[str, torch.Tensor], set[str]] | None = None
        self.startup_seconds = time.perf_counter() - start

    # ---------------------------------------------------------------- GenerationEngine

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> GenerationOutput:
        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt_ids is empty; give at least one token")
        sp = sampling_params.validate()
        seed = sp.seed if sp.seed is not None else None
        generator = None
        if sp.temperature > 0:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_rng))
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        row = _Row(prompt_ids=[int(t) for t in prompt_ids], params=sp, request_id=request_id,
                   max_new=max(0, min(sp.max_tokens, self.max_model_len - len(prompt_ids))), generator=generator,
                   logprobs=[] if sp.logprobs is not None else None)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((row, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._drain())
        start = time.perf_counter()
        await future
        return GenerationOutput(
            token_ids=row.token_ids, text=row.text, finish_reason=row.finish_reason or "abort",
            stop_reason=row.stop_reason, logprobs=row.logprobs, num_cached_tokens=None,
            metrics={"prompt_tokens": float(len(row.prompt_ids)), "wall_s": time.perf_counter() - start},
        )

    async def update_weights(self, weights: EngineWeights) -> None:
        """Load a state dict (or a safetensors directory) into the model (waits for a running batch to end)."""
        await asyncio.to_thread(self._load_state, state_dict_of(weights))

    async def begin_weight_update(self) -> str:
        """Hold the model (a running batch ends first; new ones wait) until :meth:`finish_weight_update`."""
        await asyncio.to_thread(self._model_lock.acquire)
        self._incoming = (self.model.state_dict(), set())
        return dtype_name(self.dtype)

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Copy one bucket into the model's parameters."""
        await asyncio.to_thread(self._load_bucket, bucket)

    async def finish_weight_update(self) -> None:
        """Check every weight arrived, re-tie a tied head, release the model."""
        try:
            targets, loaded = self._incoming
            tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
            missing = sorted(set(targets) - loaded - tied)
            if missing:
                raise ValueError(f"weight update left {len(missing)} weights out, e.g. {missing[:5]}")
            self.model.tie_weights()
        finally:
            self._incoming = None
            self._model_lock.release()

    async def reset_prefix_cache(self) -> None:
        """Nothing to do: this backend keeps no KV cache between requests."""

    async def sleep(self) -> None:
        """No-op: the HF backend keeps its weights in place."""

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """No-op (see :meth:`sleep`)."""

    def get_startup_seconds(self) -> float:
        return self.startup_seconds

    def shutdown(self) -> None:
        """Nothing to stop (kept for parity with the vLLM backend)."""

    # ---------------------------------------------------------------- internals

    @torch.no_grad()
    def _load_bucket(self, bucket: WeightBucket) -> None:
        targets, loaded = self._incoming
        for name, tensor in bucket.tensors():
            target = targets.get(name)
            if target is None:
                raise ValueError(f"weight {name!r} is not in the engine's model ({type(self.model).__name__})")
            target.copy_(tensor)
            loaded.add(name)

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        with self._model_lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
            missing = [k for k in missing if k not in tied]
            if missing or unexpected:
                raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected "
                                 f"{unexpected[:5]}; save them with save_weights_for_engine(model, dir)")
            self.model.tie_weights()

    async def _drain(self) -> None:
        while self._pending:
            batch = self._pending[: self.config.hf_max_batch_size]
            del self._pending[: len(batch)]
            try:
                await asyncio.to_thread(self._decode_batch, [row for row, _ in batch])
            except Exception as e:  # a failed batch fails its requests, not the engine
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    @torch.inference_mode()
    def _decode_batch(self, rows: list[_Row]) -> None:
        from transformers import DynamicCache

        for row in rows:
            if row.max_new == 0:
                row.finish_reason = "length"
        active = [r for r in rows if r.finish_reason is None]
        if not active:
            return
        with self._model_lock:
            width = max(len(r.prompt_ids) for r in active)
            input_ids = torch.full((len(active), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(active), width), dtype=torch.long)
            for i, r in enumerate(active):
                input_ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
                mask[i, width - len(r.prompt_ids):] = 1
            input_ids, mask = input_ids.to(self.device), mask.to(self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            cache = DynamicCache(config=self.model.config)
            while True:
                out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                 past_key_values=cache, use_cache=True)
                last = out.logits[:, -1, :]
                next_ids = [self._step(r, last[i]) for i, r in enumerate(active)]
                keep = [i for i, r in enumerate(active) if r.finish_reason is None]
                if not keep:
                    return
                if len(keep) < len(active):
                    index = torch.tensor(keep, device=self.device)
                    cache.batch_select_indices(index)
                    mask, positions = mask[index], positions[index]
                    active = [active[i] for i in keep]
                    next_ids = [next_ids[i] for i in keep]
                input_ids = torch.tensor(next_ids, device=self.device).unsqueeze(1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[:, -1:] + 1

    def _step(self, row: _Row, logits: torch.Tensor) -> int:
        """Sample the next token of ``row``, record it, and decide whether the row is finished."""
        sp = row.params
        seen = None
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(row.prompt_ids + row.token_ids, device=logits.device)
        processed = process_logits(logits, sp, seen)
        if sp.temperature > 0:
            probs = torch.softmax(processed, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=row.generator))
        else:
            token = int(torch.argmax(processed))
        if row.logprobs is not None:
            if self.config.logprobs_mode == "processed_logprobs":
                lp = torch.log_softmax(processed, dim=-1)
            else:
                lp = torch.log_softmax(logits.float(), dim=-1)
            row.logprobs.append(top_logprobs(lp, int(sp.logprobs or 0), token))
        row.token_ids.append(token)

        text = self._decode(row.token_ids)
        if token in self.eos_token_ids or token in sp.stop_token_ids:
            row.text = text
            row.finish_reason = "stop"
            row.stop_reason = token if token in sp.stop_token_ids else None
            return token
        if sp.stop:
            new_chars = len(text) - len(row.text)
            for stop in sp.stop:
                # Only a match that ends in the characters this token added is new.
                at = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
                if at >= 0:
                    row.text = text[: at + len(stop)]
                    row.finish_reason, row.stop_reason = "stop", stop
                    return token
        row.text = text
        if len(row.token_ids) >= row.max_new:
            row.finish_reason = "length"
        return token

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
