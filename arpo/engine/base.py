"""The one interface every generation backend implements (vLLM, Hugging Face, the scripted fake).

Token in, token out: callers hand over prompt token ids and get generated token ids back, so nothing is
ever re-tokenised between turns (re-tokenising a history changes tokens and breaks RL).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from arpo.engine.weights import EngineWeights, WeightBucket


@dataclass(frozen=True)
class SamplingParams:
    """Backend-neutral sampling parameters (names follow vLLM's)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    repetition_penalty: float = 1.0
    #: stop strings (e.g. ``</search>``); the stop string is kept in the output, as ARPO needs it.
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    #: number of top logprobs to return per generated token (None: none).
    logprobs: int | None = None
    seed: int | None = None
    #: False: the backend may return no ``text`` and skip decoding the logprob candidates (vLLM then spends
    #: much less per token on logprobs). Stop strings need decoded text, so ``stop`` must then be empty.
    detokenize: bool = True

    def validate(self) -> "SamplingParams":
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings {list(self.stop)} need detokenize=True (or use stop_token_ids)")
        return self

    def with_(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass
class GenerationOutput:
    """One finished generation request."""

    token_ids: list[int]
    text: str
    #: "stop" (EOS or a stop string/token) or "length" (max_tokens reached) or "abort".
    finish_reason: str
    #: the stop string matched, the stop token id, or None for EOS/length (vLLM's convention).
    stop_reason: str | int | None = None
    #: per generated token, {token_id: logprob} for the top-k tokens (the sampled token included).
    logprobs: list[dict[int, float]] | None = None
    #: prompt tokens served from the prefix cache, where the backend reports it.
    num_cached_tokens: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def sampled_log_probs(token_ids: list[int], logprobs: list[dict[int, float]] | None) -> list[float]:
    """The log-prob of each sampled token from a request's per-token logprobs (rollout correction's
    ``rollout_log_probs``); an engine that left one out is an error, not a silent 0."""
    steps = logprobs or []
    if len(steps) < len(token_ids) or any(t not in lp for t, lp in zip(token_ids, steps)):
        raise RuntimeError("calculate_log_probs: the engine returned no log-prob for a sampled token")
    return [lp[t] for t, lp in zip(token_ids, steps)]


@runtime_checkable
class GenerationEngine(Protocol):
    """Async token-in-token-out engine."""

    async def generate(
        self, prompt_ids: list[int], sampling_params: SamplingParams, request_id: str
    ) -> GenerationOutput: ...

    async def update_weights(self, weights: "EngineWeights") -> None:
        """Take ``weights`` (a state dict in HF names, or a safetensors directory) as the new weights and reset
        the prefix cache (tests, tools; the trainer streams buckets, below)."""

    async def begin_weight_update(self) -> str:
        """Start a bucketed weight update: generation pauses (requests in flight are kept) until
        :meth:`finish_weight_update`. Returns the dtype name the floating-point weights should come in (the one the
        engine computes in, e.g. ``"bfloat16"``)."""

    async def load_weight_bucket(self, bucket: "WeightBucket") -> None:
        """Load one bucket of new weights (HF names; see :mod:`arpo.engine.weights`)."""

    async def finish_weight_update(self) -> None:
        """End the update: finish processing the loaded weights, reset the prefix cache, resume generation."""

    async def reset_prefix_cache(self) -> None: ...

    async def sleep(self) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Give back what :meth:`sleep` freed: ``tags`` ``["weights"]`` or ``["kv_cache"]`` one part (vLLM's
        tags), None both. A weight push wakes the weights first and the KV cache after it, so the GPU never holds
        the cache beside the gathered buckets."""
