"""The server's output side: OpenAI response objects and server-sent events (no server library)."""

from __future__ import annotations

import json
import time
import uuid

from runtime.errors import DFlashError
from runtime.serve.params import ApiError, ParsedRequest


class Reply:
    """The OpenAI response objects of one request (its id and creation time shared by every chunk)."""

    def __init__(self, req: ParsedRequest, model: str, decode=None, tool_reader=None):
        self.kind, self.model, self.include_usage = req.kind, model, req.include_usage
        self.decode = decode  # ids -> text: a log-probability entry's token string
        self.tool_reader = tool_reader  # a runtime.text.tools.ToolCallReader where tools are offered
        self.text_offset = 0  # completions' logprobs.text_offset: characters before the next token
        chat = req.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, result) -> dict:
        """The non-streamed response."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}}
            if result.tool_calls is not None:
                choice["message"]["content"] = result.content
                if result.tool_calls:
                    choice["message"]["tool_calls"] = result.tool_calls
        else:
            choice = {"index": 0, "text": result.text}
        choice.update(logprobs=self.logprobs(result.logprobs), finish_reason=result.finish_reason)
        return {**self._head(self.object), "choices": [choice], "usage": usage(result)}

    def logprobs(self, entries: list[dict] | None) -> dict | None:
        """OpenAI's `logprobs` of a choice: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
        or completions' {tokens, token_logprobs, top_logprobs, text_offset}; None when not asked for."""
        if entries is None:
            return None
        text = lambda i: self.decode([i])  # noqa: E731
        if self.kind == "chat":
            item = lambda i, lp: {"token": text(i), "logprob": lp, "bytes": list(text(i).encode())}  # noqa: E731
            return {"content": [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
                                for e in entries]}
        tokens = [text(e["token_id"]) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{text(i): lp for i, lp in e["top"]} for e in entries], "text_offset": offsets}

    def text_chunks(self, text: str | None, logprobs=None) -> list[dict]:
        """The chunks of a text delta (None: the end of the reply): the text itself, or, where tools are
        offered, its content and OpenAI tool-call deltas (id and name, then argument fragments)."""
        if self.tool_reader is None:
            return [self.chunk(text=text, logprobs=logprobs)] if text or logprobs else []
        content, calls = self.tool_reader.feed(text) if text is not None else self.tool_reader.finish()
        out = [self.chunk(text=content, logprobs=logprobs)] if content or logprobs else []
        return out + [self.chunk(tool_call=d.openai()) for d in calls]

    def chunk(self, text: str | None = None, role: bool = False, finish: str | None = None, logprobs=None,
              tool_call: dict | None = None) -> dict:
        """One streamed chunk: the role (chat's first), a text delta, a tool-call delta or the finish reason."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
            if tool_call is not None:
                delta = {"tool_calls": [tool_call]}
            choice = {"index": 0, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice, obj = {"index": 0, "text": text or ""}, "text_completion"
        choice.update(logprobs=self.logprobs(logprobs) if logprobs else None, finish_reason=finish)
        out = {**self._head(obj), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, result) -> dict:
        """The last chunk with `stream_options.include_usage`: no choices, the usage counts."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(result)}


def usage(result) -> dict:
    """Token counts: the prompt as tokenized (with the chat template), every id generated (a committed
    stop token included) and, as OpenAI's prompt caching reports it, the prompt tokens whose KV rows
    were reused from the previous request."""
    completion = len(result.output_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": completion,
            "total_tokens": result.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": result.reused_tokens}}




def sse(obj: dict) -> bytes:
    """One server-sent event: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def as_api_error(exc: BaseException) -> ApiError:
    """What a failure is answered with: its own status (ApiError), 400 for the runtime's user errors,
    500 for anything else (a bug or a backend failure)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, DFlashError):
        return ApiError(400, str(exc))
    return ApiError(500, f"internal server error ({type(exc).__name__}: {exc}); see the server log",
                    type="server_error")
