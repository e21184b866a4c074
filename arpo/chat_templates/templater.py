"""Chat-template token ids, computed incrementally so a conversation's ids are never re-tokenised.

A multi-turn rollout keeps the exact ids the engine sampled; only newly added messages (tool results)
are turned into ids. Rendering a tool message needs the template's surrounding markup, so we render a
fixed one-message system prefix followed by the new messages, and keep only what comes after the
prefix (verl's trick). The prefix ids are computed once.

Unlike verl we also restore what the template puts between the end-of-turn token and the next message
(ChatML's newline after ``<|im_end|>``, which verl's prefix cut drops), and close a model turn that ended
without its end-of-turn token (a stop string) — as mask-0 tokens — so the context the model continues from
is exactly the chat template's rendering of the conversation. How a turn closes is read off the template
(an assistant turn rendered with a marker), not guessed from the tokenizer's EOS token, which some families
set to another token (Llama 3's ``<|end_of_text|>`` where turns end in ``<|eot_id|>``). Both rollout paths
(the agent loops and the ARPO rollout's hermes calls) take tool messages from here.
"""

from __future__ import annotations

from typing import Any

_PREFIX_MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}]
_MARK = "ARPO_TEMPLATE_MARK_9b1f"  # stands for an assistant turn's content while the template renders it


class ChatTemplater:
    """Token ids of a prompt, and of messages appended to a running conversation."""

    def __init__(self, tokenizer: Any, tool_schemas: list[dict[str, Any]] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat_template; set tokenizer.chat_template "
                             "(or the model's custom_chat_template) before building agent loops")
        self.tokenizer = tokenizer
        self.tool_schemas = tool_schemas or None
        self.kwargs = dict(chat_template_kwargs or {})
        self._prefix_text = self._render(_PREFIX_MESSAGES, add_generation_prompt=False, tools=None)
        turn = self._render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}],
                            add_generation_prompt=False, tools=None)
        #: what the template writes after an assistant turn's content (ChatML: "<|im_end|>\n"; Llama 3: "<|eot_id|>")
        self.turn_close = turn[turn.index(_MARK) + len(_MARK):] if turn.count(_MARK) == 1 else ""
        eos = getattr(tokenizer, "eos_token", None) or ""
        #: the part of turn_close after the end-of-turn token, for a turn whose sampled ids end in that token
        #: (None: the tokenizer's EOS token is not what closes a turn)
        self.turn_separator = self.turn_close[len(eos):] if eos and self.turn_close.startswith(eos) else None
        self.eos_token_id = getattr(tokenizer, "eos_token_id", None)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], with_tools: bool = True) -> list[int]:
        """The first prompt: the whole template with the tool schemas and the generation prompt."""
        if not messages:
            raise ValueError("raw_prompt is empty: each sample needs at least one chat message")
        text = self._render(messages, add_generation_prompt=True, tools=self.tool_schemas if with_tools else None)
        return self.encode(text)

    def message_text(self, messages: list[dict[str, Any]], closed: bool) -> str:
        """The text ``messages`` add after an assistant turn, through the next generation prompt: the turn's
        close (its separator only when ``closed``: the turn's ids already end in the end-of-turn token), then the
        messages as the template renders them."""
        full = self._render([*_PREFIX_MESSAGES, *messages], add_generation_prompt=True, tools=None)
        if not full.startswith(self._prefix_text):
            raise ValueError("the chat template does not render a conversation as a prefix of its extension; "
                             "incremental tokenisation needs a prefix-stable template (ChatML-like)")
        lead = (self.turn_separator or "") if closed else self.turn_close
        return lead + full[len(self._prefix_text):]

    def message_ids(self, messages: list[dict[str, Any]], after: list[int] | None = None) -> list[int]:
        """Ids for ``messages`` appended after an assistant turn, ending in the next generation prompt.

        ``after`` is the assistant turn's ids: if they end with the end-of-turn token only the separator is
        added before the messages, otherwise the turn is closed first.
        """
        closed = after is None or (bool(after) and after[-1] == self.eos_token_id and self.turn_separator is not None)
        return self.encode(self.message_text(messages, closed))
