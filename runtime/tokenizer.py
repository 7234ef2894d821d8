"""Tokenizer for the runtime: `tokenizers` plus the checkpoint's Jinja chat template (no torch, no transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import DFlashError


class ChatTokenizer:
    """Encodes prompts and decodes replies the way Hugging Face's fast tokenizer does.

    Args:
        tokenizer_json: path to `tokenizer.json`.
        chat_template: the checkpoint's Jinja chat template (None if it has none).
        special_tokens: names such as `bos_token` / `eos_token` given to the template.

    Raises:
        DFlashError: the tokenizer file is missing or unreadable.
    """

    def __init__(self, tokenizer_json: Path, chat_template: str | None, special_tokens: dict[str, Any]):
        from tokenizers import Tokenizer

        if not Path(tokenizer_json).is_file():
            raise DFlashError(f"{tokenizer_json} is missing; the artifact is incomplete, rebuild it")
        try:
            self._tok = Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust error types are not exposed
            raise DFlashError(f"cannot read {tokenizer_json}: {exc}") from None
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with the tokenizer's own special tokens (e.g. BOS) as HF adds them."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Render a conversation with the generation prompt and tokenize it (as HF's
        `apply_chat_template(..., add_generation_prompt=True, enable_thinking=False)`).

        Raises:
            DFlashError: the checkpoint has no chat template.
        """
        if not self.chat_template:
            raise DFlashError("this model has no chat template; pass the prompt without --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise DFlashError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, enable_thinking=False, **self.special_tokens
        )
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Ids -> text, special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)
