"""How one segment of a branch (the tokens up to its next tool call, EOS or the length limit) is asked of the
engine: one request per segment, with top-k logprobs on every token when entropy is measured.

When every stop string (the tools' close tags) is a single token of the vocabulary, as the ARPO tags are in the
tiny model's, requests run without detokenisation (vLLM's flat logprobs: the k candidates are not decoded) and
stop on those token ids. Otherwise the engine detokenises to find the stop strings. Asking logprobs only for a
segment's entropy window (a window request, then a continuation without them) was measured slower on both
models here: the extra request per segment cost more than the logprobs it saved (docs/differences.md). A
stop string the engine could not see (in an undetokenised request, or split across two) is cut here, where an
engine matching strings would have stopped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from arpo.engine.base import GenerationEngine, GenerationOutput, SamplingParams
from arpo.rollout.branch import Branch, Phase
from arpo.rollout.branching import derive_seed
from arpo.rollout.rollout_metrics import RolloutMetrics


def stop_strings_as_token_ids(tok: Any, params: SamplingParams) -> tuple[int, ...] | None:
    """``params``' stop strings (with its ``stop_token_ids``) as token ids, or None if one is not a single
    token of ``tok``'s vocabulary."""
    ids = []
    for stop in params.stop:
        enc = tok.encode(stop, add_special_tokens=False)
        if len(enc) != 1 or tok.decode(enc) != stop:
            return None
        ids.append(int(enc[0]))
    return tuple(dict.fromkeys(tuple(params.stop_token_ids) + tuple(ids)))


def cut_at_stop(tok: Any, stops: tuple[str, ...], prev_ids: list[int], ids: list[int], lps: list, finish: str,
                stop_reason: Any) -> tuple[list[int], list, str, Any]:
    """Cut ``ids`` right after the first stop string that ends inside them, with ``prev_ids`` (the segment's
    tokens from an earlier request) as context; returns (ids, logprobs, finish reason, stop reason)."""
    prev = tok.decode(prev_ids)
    text = prev + tok.decode(ids)
    found = [(i, s) for s in stops if s for i in [text.find(s, max(0, len(prev) - len(s) + 1))] if i >= 0]
    if not found:
        return ids, lps, finish, stop_reason
    start, stop = min(found)
    for m in range(1, len(ids) + 1):
        if len(prev + tok.decode(ids[:m])) >= start + len(stop):
            return ids[:m], lps[:m], "stop", stop
    return ids, lps, finish, stop_reason


class SegmentRequester:
    """Engine requests for one rollout call: seeds from each branch's identity and request number (so no
    output depends on the order requests complete in), request ids, and the engine-side counters."""

    def __init__(self, engines: Sequence[GenerationEngine], tok: Any, params: SamplingParams, *, seed: int,
                 nonce: str, group_ids: list[int], window: int, max_response_length: int, metrics: RolloutMetrics):
        #: each group's engine (the same one for every group unless the rollout spreads groups over replicas)
        self.engines, self.tok, self.params, self.seed, self.nonce = list(engines), tok, params, seed, nonce
        self.group_ids = group_ids
        self.window, self.max_response_length = window, max_response_length
        self.want_logprobs = params.logprobs is not None
        self.stop_ids = stop_strings_as_token_ids(tok, params)
        self.m = metrics

    def cut_at_stop(self, prev_ids: list[int], ids: list[int], lps: list, finish: str, stop_reason: Any):
        return cut_at_stop(self.tok, self.params.stop, prev_ids, ids, lps, finish, stop_reason)

    async def request(self, b: Branch) -> GenerationOutput:
        """The next piece of ``b``'s current segment (or its entropy probe: the window's tokens only)."""
        room = self.max_response_length - len(b.response_ids)
        probing = b.phase is Phase.PROBE
        if probing or self.stop_ids is not None:  # a probe (the window only) may stop inside a tag: cut here
            return await self._undetokenized(b, min(room, self.window) if probing else room,
                                             logprobs=self.want_logprobs or probing)
        return await self._call(b, room, logprobs=self.want_logprobs)

    async def _undetokenized(self, b: Branch, max_tokens: int, logprobs: bool) -> GenerationOutput:
        """At most ``max_tokens`` tokens without detokenisation; the engine stops only on ``stop_ids``, a stop
        string spelt another way is cut here (tokens sampled after it are dropped, never used)."""
        out = await self._call(b, max_tokens, logprobs=logprobs, detokenize=False)
        ids, lps, finish, stop_reason = self.cut_at_stop(
            [], list(out.token_ids), list(out.logprobs or []), out.finish_reason, out.stop_reason)
        return dataclasses.replace(out, token_ids=ids, logprobs=lps if out.logprobs is not None else None,
                                   finish_reason=finish, stop_reason=stop_reason, text="")

    async def _call(self, b: Branch, max_tokens: int, logprobs: bool, detokenize: bool = True) -> GenerationOutput:
        params = self.params.with_(max_tokens=max_tokens, seed=derive_seed(self.seed, self.group_ids[b.group], b.key, b.n_requests),
                                   logprobs=self.params.logprobs if logprobs else None)
        if not detokenize:
            params = params.with_(stop=(), detokenize=False, stop_token_ids=self.stop_ids or params.stop_token_ids)
        request_id = f"arpo-{self.nonce}-g{self.group_ids[b.group]}-t{b.local}-r{b.n_requests}"
        first_of_branch = b.kind == "branch" and b.n_requests == 0
        b.n_requests += 1
        prompt = b.prompt_ids + b.response_ids
        if b.sent_at is None:
            b.sent_at = time.perf_counter()
        with self.m.generate_clock:
            out = await self.engines[b.group].generate(prompt, params, request_id)
        b.done_at = time.perf_counter()
        c = self.m.count
        c["requests"] += 1
        if out.num_cached_tokens is not None:
            c["prompt_tokens"] += len(prompt)
            c["cached_tokens"] += out.num_cached_tokens
            if first_of_branch:
                c["branch_prompt_tokens"] += len(prompt)
                c["branch_cached_tokens"] += out.num_cached_tokens
        return out
