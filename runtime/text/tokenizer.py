"""Tokenizer for the runtime: `tokenizers` plus the checkpoint's Jinja chat template (no torch, no transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import DFlashError

CHAT_ROLES = ("system", "user", "assistant", "tool")


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
        self._template = None  # compiled on first use: `_compiled_template`

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids, with the tokenizer's own special tokens (e.g. BOS) as HF adds them."""
        return self._encode(text, add_special_tokens=True)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: tokenizers would raise a TypeError
            raise DFlashError(f"the text is not valid Unicode (a lone surrogate at character {exc.start}); "
                              "send UTF-8 text") from None
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool = False,
                            tools: list[dict] | None = None) -> list[int]:
        """Render a conversation with the generation prompt and tokenize it (as HF's
        `apply_chat_template(..., add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools)`;
        `tools`: OpenAI function tools, for templates that render them).

        Raises:
            DFlashError: the checkpoint has no chat template.
        """
        if not self.chat_template:
            raise DFlashError("this model has no chat template; pass the prompt without --chat")
        import jinja2

        extra = {k: v for k, v in self.special_tokens.items() if isinstance(k, str) and k not in ("messages",)}
        try:
            text = self._compiled_template().render(
                messages=messages, add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools, **extra
            )
        except jinja2.TemplateError as exc:
            raise DFlashError(f"the model's chat template cannot be rendered: {exc}") from None
        return self._encode(text, add_special_tokens=False)

    def _compiled_template(self):
        """The chat template, compiled on first use and kept (jinja2 compiles a template string on every
        `from_string`: about 1 ms a request for SmolLM2's, more for long templates with tools).

        Raises:
            jinja2.TemplateError: the template does not compile (the caller reports it).
        """
        if self._template is None:
            import json

            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message):
                raise DFlashError(f"chat template error: {message}")

            def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
                # as transformers: plain JSON, not Jinja's HTML-escaping filter
                return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

            # the same environment transformers renders chat templates with
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        return self._template

    def decode(self, ids: list[int]) -> str:
        """Ids -> text, special tokens skipped."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(artifact_dir: Path, manifest: dict) -> "ChatTokenizer | None":
    """The artifact's tokenizer (`tokenizer/tokenizer.json` with the manifest's chat template and special
    tokens), or None for an artifact built without one."""
    tok_json = Path(artifact_dir) / "tokenizer" / "tokenizer.json"
    if not tok_json.is_file():
        return None
    return ChatTokenizer(tok_json, manifest.get("chat_template"), manifest.get("special_tokens", {}))


def check_messages(messages) -> list[dict]:
    """OpenAI-style chat messages, checked: a non-empty list of {"role": system|user|assistant|tool,
    "content": str or a list of {"type": "text", "text": str} parts}; an assistant turn may carry
    `tool_calls` (its content then may be null), a tool turn a `tool_call_id`. Returns them with string
    content (and those fields kept).

    Raises:
        DFlashError: naming the first malformed message.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DFlashError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DFlashError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise DFlashError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)} (got {role!r:.80})")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise DFlashError(f"messages[{i}].tool_calls: only assistant turns carry tool calls")
        if m.get("tool_call_id") is not None and role != "tool":
            raise DFlashError(f"messages[{i}].tool_call_id: only tool turns answer a tool call")
        if content is None and calls:
            content = ""
        content = _text_content(content, i)
        if "name" in m and not isinstance(m["name"], str):  # accepted (OpenAI's participant name), not templated
            raise DFlashError(f"messages[{i}].name must be a string (got {type(m['name']).__name__})")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise DFlashError(f"messages[{i}] has unsupported fields {extra}")
        entry = {"role": role, "content": content}
        if calls is not None:
            entry["tool_calls"] = _check_calls(calls, i)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise DFlashError(f"messages[{i}].tool_call_id must be a string")
            entry["tool_call_id"] = call_id or ""
            if isinstance(m.get("name"), str):
                entry["name"] = m["name"]
        out.append(entry)
    return out


def _text_content(content, i: int) -> str:
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise DFlashError(f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                  "are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise DFlashError(f"messages[{i}].content must be a string (got {type(content).__name__})")
    return content


def _check_calls(calls, i: int) -> list[dict]:
    """An assistant turn's `tool_calls`: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list):
        raise DFlashError(f"messages[{i}].tool_calls must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        if isinstance(c, dict) and c.get("type", "function") != "function":
            raise DFlashError(f'messages[{i}].tool_calls[{j}].type must be "function"')
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not isinstance(fn.get("arguments", "{}"), (str, dict)):
            raise DFlashError(f'messages[{i}].tool_calls[{j}] must be {{"id": ..., "type": "function", "function": '
                              '{"name": ..., "arguments": "<JSON text>"}}')
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out
