"""A scripted, deterministic stand-in for a real engine, for unit tests of everything above the engine.

:class:`ScriptedEngine` implements :class:`~arpo.engine.base.GenerationEngine`. Its "policy" writes ARPO-shaped
text — ``<think>…</think>`` then a ``<search>``/``<python>`` call or an ``<answer>`` with ``\\boxed{}`` and
EOS — chosen by a random generator seeded from (prompt token ids, request seed, weight version) only, so the
same request always gives the same output and a different seed gives a different one. It honours what a
real engine honours: ``max_tokens`` (finish ``length``), EOS and ``stop_token_ids`` and stop strings (finish
``stop``; the stop string is kept in the output and named in ``stop_reason``), top-k logprobs per token (the
sampled token included, mass below 1 like a real top-k), and a simulated block prefix cache that reports
``num_cached_tokens``. Logprobs are flat (high entropy) for the first tokens after a tool result (``<result>``, or a
chat template's ``<tool_response>`` turn) and peaked elsewhere, the shape ARPO's paper measured on real models. It
also records every request and the peak number of requests in flight, so tests can check that callers batch their
requests.

A test that needs exact text instead gives ``replies``: the reply for each model turn of the conversation (the
turn counts the assistant headers and tool results already in the prompt, so forks, retries and concurrent
conversations stay deterministic; the last reply repeats; a turn already begun in the prompt goes on from where it
stopped), or a function of (prompt text, request id). The
reply is tokenized, EOS appended, and cut by stops and ``max_tokens`` exactly as the policy's text is.

:class:`ToyTokenizer` is the small tokenizer it speaks by default (Hugging Face-like ``encode``/``decode``/
``eos_token_id``/``pad_token_id``/``len``); any Hugging Face tokenizer can be passed instead.
:func:`build_chat_tokenizer` builds one with a chat template, for the agent-loop path.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from arpo.engine.base import GenerationOutput, SamplingParams
from arpo.protocol import ALL_TAGS, ANSWER_CLOSE, ANSWER_OPEN, RESULT_CLOSE, RESULT_OPEN, THINK_CLOSE, \
    THINK_OPEN, tag_pair

_WORDS = (
    " the", " answer", " is", " of", " to", " find", " we", " need", " let", " me", " check", " compute",
    " search", " for", " capital", " city", " river", " year", " born", " who", " what", " number", " sum",
    " so", " then", " result", " wait", " first", " next", " because", " and", " which", " python", " print",
    " value", " total", " population", " known", " as", " in", " on", " a", " it", " this", " that",
)
_PIECES = ("\\boxed{", "print(", ")", "</", "search", "python", "answer", "think", "result", "\n", " ")


class ToyTokenizer:
    """A tiny greedy longest-match tokenizer: special tokens, ARPO tags, some words, every printable char.

    ``split_tags=True`` leaves the tags out of the vocabulary, so ``</search>`` becomes several tokens the
    way it does with real BPE vocabularies (this exercises stop strings that span tokens).
    """

    pad_token = "<pad>"
    eos_token = "<eos>"
    unk_token = "<unk>"

    def __init__(self, split_tags: bool = False):
        specials = [self.pad_token, self.eos_token, self.unk_token]
        tags = [] if split_tags else list(ALL_TAGS)
        chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
        vocab: list[str] = []
        for tok in [*specials, *tags, *_WORDS, *_PIECES, *chars]:
            if tok not in vocab:
                vocab.append(tok)
        self.vocab = vocab
        self._ids = {tok: i for i, tok in enumerate(vocab)}
        self._special = set(specials)
        self._max_len = max(len(t) for t in vocab if t not in self._special)
        self.pad_token_id = self._ids[self.pad_token]
        self.eos_token_id = self._ids[self.eos_token]
        self.unk_token_id = self._ids[self.unk_token]

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for length in range(min(self._max_len, len(text) - i), 0, -1):
                tok_id = self._ids.get(text[i: i + length])
                if tok_id is not None and text[i: i + length] not in self._special:
                    ids.append(tok_id)
                    i += length
                    break
            else:
                ids.append(self.unk_token_id)
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        toks = (self.vocab[int(i)] for i in ids)
        if skip_special_tokens:
            toks = (t for t in toks if t not in self._special)
        return "".join(toks)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocab[int(i)] for i in ids]


@dataclass
class ScriptPolicy:
    """Knobs of the scripted policy (probabilities are per segment)."""

    #: the tags it calls tools with (any tag: a rollout stops and runs a call only for its loaded tools' tags)
    tools: tuple[str, ...] = ("search", "python")
    #: chance that a segment ends in a tool call, lowered by ``call_decay`` per result already in context.
    call_prob: float = 0.7
    call_decay: float = 0.1
    #: chance that a segment never stops (rambles until max_tokens).
    ramble_prob: float = 0.0
    #: chance that a tool call lacks its open tag.
    malformed_prob: float = 0.0
    think_words: tuple[int, int] = (2, 24)
    #: tokens the policy would write after a stop string (a real engine cuts them off).
    tokens_after_stop: int = 3
    #: logit gap between the sampled token and the others: small = flat = high entropy.
    high_entropy_gap: tuple[float, float] = (0.05, 1.0)
    low_entropy_gap: tuple[float, float] = (2.5, 7.0)
    #: generated tokens right after a tool result that get the flat distribution.
    high_entropy_tokens: int = 12


@dataclass
class RequestRecord:
    request_id: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str = ""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)


#: a reply per model turn (the last repeats), or a function (prompt text, request id) -> reply
Replies = Sequence[str] | Callable[[str, str], str]


def reply_turn(prompt_text: str) -> int:
    """Model turns already taken in a prompt: assistant headers after the first (chat) plus tool results."""
    return prompt_text.count("<|im_start|>assistant") - 1 + prompt_text.count(RESULT_OPEN)


#: a generation prompt right after a hermes tool result (``</tool_response>``, then chat-template markup)
_AFTER_TOOL_RESPONSE = re.compile(r"</tool_response>(\s|<\|[a-z_]+\|>|user|assistant)*$")


def _after_tool_result(context: str) -> bool:
    """Whether the model is about to write the first tokens after a tool result (ARPO's ``<result>`` or a chat
    template's ``<tool_response>`` turn): where the scripted logprobs are flat."""
    return context.rstrip().endswith(RESULT_CLOSE) or _AFTER_TOOL_RESPONSE.search(context) is not None


def _stable_seed(*parts) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        if isinstance(p, (list, tuple, np.ndarray)):
            h.update(np.asarray(p, dtype=np.int64).tobytes())
        else:
            h.update(repr(p).encode())
        h.update(b"|")
    return int.from_bytes(h.digest(), "little")


class ScriptedEngine:
    """Deterministic fake :class:`~arpo.engine.base.GenerationEngine` (see the module docstring)."""

    def __init__(self, tokenizer=None, policy: ScriptPolicy | None = None, latency_s: float = 0.0,
                 token_latency_s: float = 0.0, block_size: int = 16, replies: Replies | None = None):
        if policy is not None and replies is not None:
            raise ValueError("ScriptedEngine: give a policy or replies, not both")
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.tokenizer = tokenizer if tokenizer is not None else ToyTokenizer()
        self.policy = policy or ScriptPolicy()
        self.replies = replies
        #: the last weights update_weights was given (a state dict or a directory)
        self.weights: Any = None
        #: the tensors of a bucketed weight update in progress
        self._incoming: dict[str, Any] = {}
        self.latency_s = latency_s
        #: extra delay per generated token: concurrent requests overlap, so a batch of requests costs about
        #: its longest one, as with continuous batching on an engine that is not compute-bound.
        self.token_latency_s = token_latency_s
        self.block_size = block_size
        self.weight_version = 0
        self.asleep = False
        #: what a partial wake-up (vLLM's tags) gave back; asleep until both parts are awake
        self.awake_parts = {"weights", "kv_cache"}
        self.requests: list[RequestRecord] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._cached_blocks: set[int] = set()
        self._unseeded = random.Random(0)

    # ---- the GenerationEngine interface -------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], sampling_params: SamplingParams,
                       request_id: str) -> GenerationOutput:
        if self.asleep:
            raise RuntimeError("ScriptedEngine is asleep; call wake_up() before generate()")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        sampling_params.validate()
        record = RequestRecord(request_id, list(prompt_ids), sampling_params)
        self.requests.append(record)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            # Yield before answering, as a real engine does, so concurrent callers are really concurrent.
            await asyncio.sleep(self.latency_s)
            cached = self._lookup_prefix(prompt_ids)
            out = self._generate(list(prompt_ids), sampling_params, request_id)
            self._insert_prefix(list(prompt_ids) + out.token_ids)
            if self.token_latency_s:
                await asyncio.sleep(self.token_latency_s * len(out.token_ids))
        finally:
            self.in_flight -= 1
        out.num_cached_tokens = cached
        record.output_ids, record.num_cached_tokens, record.finish_reason = \
            list(out.token_ids), cached, out.finish_reason
        return out

    async def update_weights(self, weights: Any) -> None:
        # New weights change the policy; stale cache entries would be wrong, as with vLLM.
        self.weights = weights
        self.weight_version += 1
        await self.reset_prefix_cache()

    async def begin_weight_update(self) -> str:
        self._incoming = {}
        return "float32"

    async def load_weight_bucket(self, bucket: Any) -> None:
        # copies: the bucket's buffer is the sender's
        self._incoming.update((name, t.clone()) for name, t in bucket.tensors())

    async def finish_weight_update(self) -> None:
        incoming, self._incoming = self._incoming, {}
        await self.update_weights(incoming)

    async def reset_prefix_cache(self) -> None:
        self._cached_blocks.clear()

    async def sleep(self) -> None:
        self.asleep = True
        self.awake_parts = set()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.awake_parts |= set(tags or ("weights", "kv_cache"))
        self.asleep = not {"weights", "kv_cache"} <= self.awake_parts

    # ---- statistics -----------------------------------------------------------------------------------
    def prefix_cache_hit_rate(self) -> float:
        prompt = sum(r.prompt_len for r in self.requests)
        return sum(r.num_cached_tokens for r in self.requests) / prompt if prompt else 0.0

    # ---- the scripted policy --------------------------------------------------------------------------
    def _rng(self, prompt_ids: list[int], params: SamplingParams) -> random.Random:
        if params.temperature == 0:
            return random.Random(_stable_seed(prompt_ids, "greedy", self.weight_version))
        if params.seed is None:
            return random.Random(self._unseeded.getrandbits(64))
        return random.Random(_stable_seed(prompt_ids, params.seed, self.weight_version))

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _reply(self, context: str, request_id: str) -> list[int]:
        """The scripted reply's token ids, EOS appended."""
        if callable(self.replies):
            text = self.replies(context, request_id)
        else:
            text = self.replies[min(max(reply_turn(context), 0), len(self.replies) - 1)]
            # a turn split over requests (an entropy probe, a length cut) goes on where the last one stopped
            written = context[max(context.rfind("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"),
                                  context.rfind(RESULT_CLOSE) + len(RESULT_CLOSE), 0):]
            if written and text.startswith(written):
                text = text[len(written):]
        return self._encode(text) + [self.tokenizer.eos_token_id]

    def _plan(self, context: str, rng: random.Random) -> list[int]:
        """Token ids the policy wants to write next."""
        pol, tok = self.policy, self._encode
        n_results = context.count(RESULT_OPEN)
        words = lambda lo, hi: "".join(rng.choice(_WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
        text = f"{THINK_OPEN}{words(*pol.think_words)} {THINK_CLOSE}"
        if rng.random() < pol.ramble_prob:
            return tok(text + words(400, 600))
        if pol.tools and rng.random() < pol.call_prob - pol.call_decay * n_results:
            name = rng.choice(pol.tools)
            open_tag, close_tag = tag_pair(name)
            body = f"print({rng.randint(1, 99)} + {rng.randint(1, 99)})" if name == "python" else words(1, 5)
            if rng.random() < pol.malformed_prob:
                open_tag = ""
            text += f" {open_tag}{body}{close_tag}"
            after = [rng.choice(_WORDS) for _ in range(pol.tokens_after_stop)]
            return tok(text) + tok("".join(after))
        text += f" {ANSWER_OPEN} \\boxed{{{rng.randint(0, 99)}}} {ANSWER_CLOSE}"
        return tok(text) + [self.tokenizer.eos_token_id]

    def _generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> GenerationOutput:
        tok, pol = self.tokenizer, self.policy
        rng = self._rng(prompt_ids, params)
        context = tok.decode(prompt_ids, skip_special_tokens=False)
        after_tool = _after_tool_result(context)
        planned = self._reply(context, request_id) if self.replies is not None else self._plan(context, rng)
        stop_ids = set(params.stop_token_ids)
        out_ids: list[int] = []
        logprobs: list[dict[int, float]] = []
        finish, stop_reason = "length", None
        text = ""
        for pos, tok_id in enumerate(planned):
            if len(out_ids) >= params.max_tokens:
                break
            out_ids.append(tok_id)
            if params.logprobs is not None:
                flat = after_tool and pos < pol.high_entropy_tokens
                logprobs.append(self._top_logprobs(tok_id, params.logprobs, flat, rng))
            if tok_id == tok.eos_token_id:
                finish = "stop"
                break
            if tok_id in stop_ids:
                finish, stop_reason = "stop", tok_id
                break
            text = tok.decode(out_ids)
            hit = next((s for s in params.stop if s and s in text), None)
            if hit is not None:
                finish, stop_reason = "stop", hit
                break
        else:
            if len(out_ids) < params.max_tokens and planned:
                # The plan ran out without EOS or a stop (a stop string was excluded from the request):
                # a real model would keep writing; end as if at the length limit.
                finish = "length"
        return GenerationOutput(
            token_ids=out_ids, text=tok.decode(out_ids), finish_reason=finish, stop_reason=stop_reason,
            logprobs=logprobs if params.logprobs is not None else None,
        )

    def _top_logprobs(self, sampled: int, k: int, flat: bool, rng: random.Random) -> dict[int, float]:
        vocab = len(self.tokenizer)
        lo, hi = self.policy.high_entropy_gap if flat else self.policy.low_entropy_gap
        size = min(max(k, 1), vocab)
        others = [c for c in rng.sample(range(vocab), size) if c != sampled][: size - 1]
        logits = [0.0] + [-rng.uniform(lo, hi) for _ in others]
        # A tail outside the top-k keeps the returned mass below 1, as with a real engine.
        norm = math.log(sum(math.exp(x) for x in logits) + 0.05)
        return {tid: lg - norm for tid, lg in zip([sampled, *others], logits)}

    # ---- a block prefix cache, like vLLM's (hashes of full blocks chained from the start) ------------
    def _block_hashes(self, ids: list[int]) -> list[int]:
        hashes, prev = [], 0
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            prev = hash((prev, tuple(ids[start: start + self.block_size])))
            hashes.append(prev)
        return hashes

    def _lookup_prefix(self, prompt_ids: list[int]) -> int:
        hits = 0
        for h in self._block_hashes(prompt_ids):
            if h not in self._cached_blocks:
                break
            hits += 1
        # At least one prompt token is always computed (vLLM needs its logits).
        return min(hits * self.block_size, (len(prompt_ids) - 1) // self.block_size * self.block_size)

    def _insert_prefix(self, ids: list[int]) -> None:
        self._cached_blocks.update(self._block_hashes(ids))


# ---- a chat tokenizer for the agent-loop path (which renders chat messages) -----------------------------
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", *ALL_TAGS]

# Same structure as Qwen2.5's template: a default system block when none is given, the tool schemas in
# the system block, consecutive tool messages grouped in one user turn inside <tool_response> tags.
_CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a tiny assistant.{% endif %}"
    "{{ '\\n\\n' }}# Tools\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "\n</tools>\n\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% else %}"
    "{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% else %}<|im_start|>system\nYou are a tiny assistant.<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for tc in message.tool_calls %}{{ '\\n' }}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "You are a tiny assistant. Call a function with the tools below.",
    "What is the capital of France? The answer is Paris.",
    "search results for the query: population of Paris is about two million people",
    "def add(a, b): return a + b  print(add(2, 3))  # 5",
    '{"name": "search", "arguments": {"query": "capital of France"}}',
    "The final answer is \\boxed{42}. Let me think step by step about numbers 0 1 2 3 4 5 6 7 8 9.",
    "Error: unknown tool; the tool call is not valid JSON. truncated results for",
]


def build_chat_tokenizer(out_dir: str | Path, vocab_size: int = 600) -> str:
    """A small byte-level BPE tokenizer with a Qwen2.5-style chat template (hermes tool calls) and the ARPO
    tags as single tokens, saved to ``out_dir`` (milliseconds; AutoTokenizer and Ray actors can load it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    tok.add_tokens(_ADDED)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return str(out_dir)
