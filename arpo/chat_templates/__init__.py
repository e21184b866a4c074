"""Chat templates of real model families, kept as Jinja text in the package, and the one place a run's tokenizer
gets its template.

``actor_rollout_ref.model.custom_chat_template`` (verl's key) picks it: a name below, a path to a ``.jinja`` file,
Jinja text, or null for the template the tokenizer ships. Prompts are tokenised on the driver (the RL dataset, SFT
demonstrations, evaluation prompts) and the engine receives token ids, so setting ``tokenizer.chat_template``
where the tokenizer is loaded is enough.

* ``qwen2.5``: ChatML with Qwen2.5's default system prompt and its hermes tools block (``<tool_call>`` JSON,
  tool results as ``<tool_response>`` in a user turn);
* ``qwen3``: ChatML without a default system prompt; assistant turns after the last user query keep their
  reasoning as ``<think>\\n...\\n</think>\\n\\n``, earlier ones lose it; ``enable_thinking=false``
  (``data.apply_chat_template_kwargs``) opens the answer with an empty think block;
* ``llama3``: Meta Llama 3 Instruct (``bos_token`` then ``<|start_header_id|>role<|end_header_id|>\\n\\n``
  + trimmed content + ``<|eot_id|>`` per message).

They reproduce the official templates' text for system/user/assistant/tool messages, so the ARPO tags inside a
message pass through untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from arpo.config import ConfigError

KEY = "actor_rollout_ref.model.custom_chat_template"
_DIR = Path(__file__).resolve().parent
#: the named templates and their files in this package
TEMPLATES = {"qwen2.5": "qwen2.5.jinja", "qwen3": "qwen3.jinja", "llama3": "llama3.jinja"}


def template_text(name: str) -> str:
    """The Jinja text of a named template (KeyError for an unknown name)."""
    return (_DIR / TEMPLATES[name]).read_text()


def resolve_chat_template(value: Any) -> str | None:
    """The Jinja text ``value`` stands for: None keeps the tokenizer's own, a name or a ``.jinja`` path reads the
    file, text with Jinja markup is used as is; anything else is a ConfigError naming the key and the choices."""
    if value is None:
        return None
    if isinstance(value, str):
        if value in TEMPLATES:
            return template_text(value)
        if "{{" in value or "{%" in value:
            return value
        if value.endswith(".jinja") and Path(value).expanduser().is_file():
            return Path(value).expanduser().read_text()
    raise ConfigError(f"{KEY}={value!r} is not a template: choose one of {', '.join(TEMPLATES)}, a path to a .jinja "
                     f"file, Jinja text, or null (the tokenizer's own)")


def set_chat_template(tokenizer: Any, value: Any) -> Any:
    """Give ``tokenizer`` the template ``value`` names (:func:`resolve_chat_template`); returns the tokenizer."""
    text = resolve_chat_template(value)
    if text is not None:
        tokenizer.chat_template = text
    return tokenizer


def load_tokenizer(path: str | Path, custom_chat_template: Any = None) -> Any:
    """``AutoTokenizer.from_pretrained(path)`` with the run's chat template applied: every entry point loads its
    tokenizer here, so training, SFT and evaluation render prompts alike."""
    from transformers import AutoTokenizer

    return set_chat_template(AutoTokenizer.from_pretrained(str(path)), custom_chat_template)


def configured_template(cfg: Any) -> str | None:
    """The Jinja text ``actor_rollout_ref.model.custom_chat_template`` stands for (None: the tokenizer's own); entry
    points call it at start-up so a bad value stops the run before any work."""
    return resolve_chat_template(cfg.actor_rollout_ref.model.get("custom_chat_template"))


def tokenizer_for(cfg: Any) -> Any:
    """The tokenizer of ``actor_rollout_ref.model.path`` with ``actor_rollout_ref.model.custom_chat_template``."""
    model = cfg.actor_rollout_ref.model
    return load_tokenizer(model.path, model.get("custom_chat_template"))
