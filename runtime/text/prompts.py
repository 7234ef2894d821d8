"""Prompts to token ids for a :class:`runtime.session.Session`: text, one-turn chat, OpenAI-style
messages or ids, each checked (one clear error, never a tokenizer traceback)."""

from __future__ import annotations

from typing import Sequence

from runtime.errors import DFlashError
from runtime.options import as_int
from runtime.text.tokenizer import check_messages
from runtime.text.tools import ToolFormat, tool_format


class PromptEncoding:
    """The prompt and constraint methods of a Session or BatchEngine; the class using it provides
    `manifest` (the artifact's), `artifact_dir`, `stop_token_ids` and `tokenizer` (None for an artifact
    without one)."""

    manifest: dict
    tokenizer: object
    _grammar_tokenizer = None  # (llguidance's view of the tokenizer: built at the first constrained request)

    def encode(self, prompt: str | Sequence[int], chat: bool = False, enable_thinking: bool | None = None,
               tools: Sequence[dict] | None = None) -> list[int]:
        """Prompt text (optionally as a one-turn chat, offering `tools`) or ids -> ids.

        Raises:
            DFlashError: empty prompt, ids outside the vocabulary, text without a tokenizer, or tools
                with a text prompt that is not a chat (token ids are taken as rendered with the tools).
        """
        if tools and isinstance(prompt, str) and not chat:  # (ids: rendered with the tools by the caller)
            raise DFlashError("tools are offered through the chat template: pass messages= or a text prompt with chat=True")
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DFlashError("the prompt is empty; pass some text or token ids")
            if chat:
                return self.encode_messages([{"role": "user", "content": prompt}], enable_thinking, tools)
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

    @property
    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls (read off its chat template: `runtime.text.tools`)."""
        return tool_format(self.tokenizer.chat_template if self.tokenizer is not None else None)

    def encode_messages(self, messages, enable_thinking: bool | None = None,
                        tools: Sequence[dict] | None = None) -> list[int]:
        """OpenAI-style messages (`[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...]`,
        assistant turns with `tool_calls` included) -> the ids of the model's chat template with the
        generation prompt, offering `tools` (checked OpenAI function tools) in the form the template
        teaches (`runtime.text.tools`). `enable_thinking` (Qwen3's template option) defaults to what the
        draft was trained on (the manifest's `draft.enable_thinking`; False when absent: the released
        drafts are non-thinking).

        Raises:
            DFlashError: malformed messages, no tokenizer or no chat template.
        """
        messages = check_messages(messages)
        if enable_thinking is None:
            enable_thinking = bool(self.manifest["draft"].get("enable_thinking", False))
        elif not isinstance(enable_thinking, bool):
            raise DFlashError(f"enable_thinking must be true or false (got {enable_thinking!r})")
        tokenizer = self._require_tokenizer()
        form = self.tool_format
        rendered = form.prompt_messages(messages, tuple(tools or ()))
        ids = tokenizer.apply_chat_template(rendered, enable_thinking=enable_thinking,
                                            tools=list(tools) if tools and form.native else None)
        if not ids:
            raise DFlashError("the chat template renders these messages to no tokens")
        return ids

    def constraint(self, opts):
        """The request's output constraint (`runtime.text.constraints.Constraint`) for its
        GenerationOptions `opts`, or None without one.

        Raises:
            DFlashError: an artifact without a tokenizer, llguidance missing, a malformed or unsupported
                response_format, or a grammar, regex or schema that does not compile.
        """
        if not opts.constrained:
            return None
        from runtime.text.constraints import Constraint, GrammarTokenizer, constraint_grammar

        if opts.forces_tool_call and self.tokenizer is not None:
            grammar = self.tool_format.grammar(opts.tools, opts.tool_choice, opts.parallel_tool_calls)
        else:
            grammar = constraint_grammar(opts.response_format, opts.grammar, opts.regex)  # (its shape errors first)
        if self.tokenizer is None:
            raise DFlashError("response_format, grammar, regex and tool_choice need the artifact's tokenizer; "
                              "rebuild it with one")
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.artifact_dir / "tokenizer" / "tokenizer.json",
                                                       int(self.manifest["target"]["vocab_size"]), self.stop_token_ids)
        return Constraint(self._grammar_tokenizer, grammar)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise DFlashError("this artifact has no tokenizer; pass token ids instead of text")
        return self.tokenizer
