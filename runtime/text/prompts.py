"""Prompts to token ids for a :class:`runtime.session.Session`: text, one-turn chat, OpenAI-style
messages or ids, each checked (one clear error, never a tokenizer traceback)."""

from __future__ import annotations

from typing import Sequence

from runtime.errors import DFlashError
from runtime.options import as_int
from runtime.text.tokenizer import check_messages


class PromptEncoding:
    """The Session's prompt methods; the class using it provides `manifest` (the artifact's) and
    `tokenizer` (None for an artifact without one)."""

    manifest: dict
    tokenizer: object

    def encode(self, prompt: str | Sequence[int], chat: bool = False, enable_thinking: bool | None = None) -> list[int]:
        """Prompt text (optionally as a one-turn chat) or ids -> ids.

        Raises:
            DFlashError: empty prompt, ids outside the vocabulary, or text without a tokenizer.
        """
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DFlashError("the prompt is empty; pass some text or token ids")
            if chat:
                return self.encode_messages([{"role": "user", "content": prompt}], enable_thinking)
            ids = self._require_tokenizer().encode(prompt)
            if not ids:
                raise DFlashError("the prompt tokenizes to no tokens; pass some text or token ids")
            return ids
        if isinstance(prompt, (bytes, dict)) or prompt is None:
            raise DFlashError("the prompt must be text or a sequence of token ids")
        try:
            ids = [as_int(i, "prompt token id") for i in prompt]
        except TypeError:
            raise DFlashError("the prompt must be text or a sequence of token ids") from None
        if not ids:
            raise DFlashError("the prompt is empty; pass at least one token id")
        vocab = int(self.manifest["target"]["vocab_size"])
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DFlashError(f"prompt ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def encode_messages(self, messages, enable_thinking: bool | None = None) -> list[int]:
        """OpenAI-style messages (`[{"role": "system"|"user"|"assistant", "content": str}, ...]`) -> the
        ids of the model's chat template with the generation prompt. `enable_thinking` (Qwen3's
        template option) defaults to what the draft was trained on (the manifest's
        `draft.enable_thinking`; False when absent: the released drafts are non-thinking).

        Raises:
            DFlashError: malformed messages, no tokenizer or no chat template.
        """
        messages = check_messages(messages)
        if enable_thinking is None:
            enable_thinking = bool(self.manifest["draft"].get("enable_thinking", False))
        elif not isinstance(enable_thinking, bool):
            raise DFlashError(f"enable_thinking must be true or false (got {enable_thinking!r})")
        ids = self._require_tokenizer().apply_chat_template(messages, enable_thinking=enable_thinking)
        if not ids:
            raise DFlashError("the chat template renders these messages to no tokens")
        return ids

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise DFlashError("this artifact has no tokenizer; pass token ids instead of text")
        return self.tokenizer
