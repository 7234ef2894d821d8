"""OpenAI request bodies -> checked generation requests (the server's input side, no server library).

Every problem is an :class:`ApiError` carrying the HTTP status and the OpenAI-style error body, so the
server answers it without a traceback. A parameter this runtime cannot honour (n > 1, the legacy
`functions`, penalties, ...) is refused with 400 rather than ignored: a client relying on it would otherwise get a
different answer than it asked for. Only fields that never change the output (`user`, `metadata`) are
accepted and ignored.

Defaults follow OpenAI where the runtime's differ: temperature 1.0 when absent (pass 0 for greedy
decoding), a fresh random seed per request when `seed` is absent, and `max_tokens` = what fits in the
KV buffers, capped at :data:`runtime.options.DEFAULT_MAX_TOKENS`.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import DFlashError
from runtime.options import MAX_TOP_LOGPROBS, GenerationOptions

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default

# OpenAI name -> GenerationOptions field, checked by GenerationOptions itself (one field at a time, so
# the error names the parameter)
_OPTION_FIELDS = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "verify_len": "verify_len",
    "block_size": "block_size",
    "reuse_prefix": "reuse_prefix",
    "drafter": "drafter",
}
_IGNORED = {"user", "metadata"}  # no effect on the output
# output constraints (`runtime.text.constraints`): OpenAI's response_format, and the extensions grammar
# (Lark) and regex, on both endpoints (as vLLM takes its guided_* parameters on both)
_CONSTRAINTS = ("response_format", "grammar", "regex")
_COMMON = {"model", "stream", "stream_options", "n", "logprobs", "frequency_penalty", "presence_penalty",
           "logit_bias", "stop_token_ids", *_OPTION_FIELDS, *_IGNORED, *_CONSTRAINTS} - {"max_completion_tokens"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "parallel_tool_calls", "enable_thinking", "chat_template_kwargs"}
_COMPLETION = _COMMON | {"prompt", "best_of", "echo", "suffix"}


class ApiError(Exception):
    """An HTTP error answered with OpenAI's error body.

    Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        param: the request field at fault (None if none).
        code: a machine-readable code (e.g. "model_not_found").
        type: OpenAI's error type ("invalid_request_error", "server_error", ...).
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        message = short_numbers(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_LONG_NUMBER = re.compile(r"\d{21,}")
ECHO_CHARS = 80  # at most this much of a bad value is echoed in an error message


def short_numbers(message: str) -> str:
    """`message` with every integer of more than 20 digits in scientific notation (a request's
    `1e308` is an integer to Python: echoed in full it is 309 digits)."""
    return _LONG_NUMBER.sub(lambda m: f"{m[0][0]}.{m[0][1:4]}e+{len(m[0]) - 1}", message)


def shown(value: Any) -> str:
    """repr(value) for an error message, cut to about ECHO_CHARS characters."""
    text = short_numbers(repr(value))
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}... ({len(text)} characters)"


@dataclass
class ParsedRequest:
    """A checked request body (types and ranges; the prompt is tokenized later, by the server).

    Attributes:
        kind: "chat" or "completion".
        model: the model named by the client (None: the served one).
        prompt: completions: text or token ids.
        messages: chat: the OpenAI messages (checked again by the tokenizer).
        enable_thinking: chat template option (None: the artifact's default).
        stream: answer with server-sent events.
        include_usage: streamed: a last chunk with the usage counts.
        options: GenerationOptions keyword arguments; `max_new_tokens` is absent when the client
            named none (the server then fills in what fits).
    """

    kind: str
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list | None = None
    enable_thinking: bool | None = None
    stream: bool = False
    include_usage: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def parse_request(body: Any, kind: str) -> ParsedRequest:
    """Check a decoded JSON body of /v1/chat/completions (`kind` "chat") or /v1/completions ("completion").

    Raises:
        ApiError: 400 for a non-object body, unknown or unsupported parameters, wrong types or ranges.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = _CHAT if kind == "chat" else _COMPLETION
    for name in body:
        if name not in allowed:
            where = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            raise ApiError(400, f"unrecognized request argument {shown(name)} for {where}", param=name,
                           code="unrecognized_argument")
    body = {k: v for k, v in body.items() if v is not None}  # JSON null = not given, as OpenAI treats it
    _refuse_unsupported(body, kind)
    req = ParsedRequest(kind=kind, model=_model(body))
    req.stream = _bool(body, "stream", False)
    req.include_usage = _stream_options(body, req.stream)
    req.options = _options(body, kind)
    if kind == "chat":
        if "messages" not in body:
            raise ApiError(400, "messages is required", param="messages")
        req.messages = body["messages"]
        req.enable_thinking = _enable_thinking(body)
    else:
        req.prompt = _prompt(body)
    return req


# ---- parameters this runtime does not support --------------------------------------------------------
def _refuse_unsupported(body: dict, kind: str) -> None:
    """400 for a parameter set to anything but its no-op value."""
    for name in ("n", "best_of"):  # a count of choices: 1 works, more is unsupported, less is wrong
        value = body.get(name, 1)
        counted = isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
        if not (counted and value >= 1):
            raise ApiError(400, f"{name} must be a positive integer (got {shown(value)}); this server generates one "
                                f"choice per request: pass {name} 1 or leave it out", param=name)
    checks = [  # (name, the values that change nothing, why not)
        ("n", (1,), "n > 1 is not supported: the server generates one choice per request"),
        ("frequency_penalty", (0,), "frequency_penalty is not supported (only 0)"),
        ("presence_penalty", (0,), "presence_penalty is not supported (only 0)"),
        ("logit_bias", ({},), "logit_bias is not supported"),
    ]
    if kind == "chat":
        checks += [
            ("functions", ([],), "functions (the legacy function calling) is not supported: pass tools"),
            ("function_call", ("none",), "function_call (the legacy function calling) is not supported: pass tool_choice"),
        ]
    else:
        checks += [
            ("best_of", (1,), "best_of > 1 is not supported"),
            ("echo", (False,), "echo is not supported"),
            ("suffix", ("",), "suffix (insertion) is not supported"),
        ]
    for name, no_op, why in checks:
        if name in body and not any(_same(body[name], v) for v in no_op):
            raise ApiError(400, why, param=name, code="unsupported_parameter")


def _same(value, no_op) -> bool:
    """JSON equality that keeps true apart from 1 and false apart from 0."""
    return type(value) is type(no_op) and value == no_op or (
        isinstance(no_op, int) and not isinstance(value, bool) and isinstance(value, (int, float)) and value == no_op)


# ---- fields ----------------------------------------------------------------------------------------
def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string (got {shown(model)})", param="model")
    return model


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false (got {shown(value)})", param=name)
    return value


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise ApiError(400, 'stream_options must be {"include_usage": true|false}', param="stream_options")
    return _bool(opts, "include_usage", False)


def _options(body: dict, kind: str = "chat") -> dict[str, Any]:
    """GenerationOptions keyword arguments, each checked by GenerationOptions (errors name the field)."""
    if "max_tokens" in body and "max_completion_tokens" in body and body["max_tokens"] != body["max_completion_tokens"]:
        raise ApiError(400, "max_tokens and max_completion_tokens differ; pass one of them", param="max_tokens")
    opts: dict[str, Any] = {"temperature": DEFAULT_TEMPERATURE}
    for name, option in _OPTION_FIELDS.items():
        if name not in body:
            continue
        value = body[name]
        if name == "top_k" and value == -1 and not isinstance(value, bool):
            value = 0  # vLLM's "off"
        if name == "stop" and not (isinstance(value, str) or isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise ApiError(400, f"stop must be a string or a list of strings (got {shown(value)})", param="stop")
        try:
            GenerationOptions(**{option: value})
        except DFlashError as exc:  # (its message may echo the value: a long one is cut)
            message = _rename(str(exc), option, name).replace(repr(value), shown(value))
            raise ApiError(400, message, param=name) from None
        opts[option] = value
    if "stop_token_ids" in body:  # (vLLM's; the server checks the ids against the vocabulary)
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError(400, f"stop_token_ids must be a list of token ids (integers; got {shown(ids)})",
                           param="stop_token_ids")
        opts["stop_token_ids"] = ids
    opts.update(_logprobs(body, kind))
    opts.update(_tools(body))
    for name in _CONSTRAINTS:  # (types here; the grammar is compiled, and its errors named, before queueing)
        if name in body:
            try:
                GenerationOptions(**{name: body[name]})
            except DFlashError as exc:
                raise ApiError(400, str(exc), param=name) from None
            opts[name] = body[name]
    if "seed" not in opts:  # as OpenAI: without a seed, sampled replies differ from request to request
        opts["seed"] = secrets.randbits(31)
    return opts


def _logprobs(body: dict, kind: str) -> dict[str, Any]:
    """Chat's `logprobs` (true/false) and `top_logprobs` (0..20), or completions' `logprobs` (0..5: how many
    of each position's most likely tokens to return), as GenerationOptions' logprobs / top_logprobs."""
    chat = kind == "chat"
    value = body.get("logprobs")
    if value is None:
        if body.get("top_logprobs"):
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return {}
    if chat:
        if not isinstance(value, bool):
            raise ApiError(400, f"logprobs must be true or false (got {shown(value)})", param="logprobs")
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS} (got {shown(top)})",
                           param="top_logprobs")
        if top and not value:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return {"logprobs": value, "top_logprobs": top}
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 5:
        raise ApiError(400, f"logprobs must be an integer from 0 to 5 (got {shown(value)})", param="logprobs")
    return {"logprobs": True, "top_logprobs": value}


def _tools(body: dict) -> dict[str, Any]:
    """Chat's `tools`, `tool_choice` and `parallel_tool_calls`, checked together (a named choice must be
    one of the tools), as GenerationOptions' normalised values."""
    given = {name: body[name] for name in ("tools", "tool_choice", "parallel_tool_calls") if name in body}
    if not given:
        return {}
    try:
        opts = GenerationOptions(**given)
    except DFlashError as exc:
        message = str(exc)
        param = next((n for n in ("tool_choice", "parallel_tool_calls") if message.startswith(n)), "tools")
        raise ApiError(400, message, param=param) from None
    return {"tools": opts.tools, "tool_choice": opts.tool_choice, "parallel_tool_calls": opts.parallel_tool_calls}


def _rename(message: str, option: str, name: str) -> str:
    """The runtime's message with its option name replaced by the request's parameter name."""
    return message.replace(option, name, 1) if option != name else message


def _enable_thinking(body: dict) -> bool | None:
    """`enable_thinking`, or vLLM's `chat_template_kwargs: {"enable_thinking": ...}`."""
    value = body.get("enable_thinking")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
            raise ApiError(400, 'chat_template_kwargs supports only {"enable_thinking": true|false}',
                           param="chat_template_kwargs")
        if "enable_thinking" in kwargs:
            if value is not None and value != kwargs["enable_thinking"]:
                raise ApiError(400, "enable_thinking and chat_template_kwargs.enable_thinking differ",
                               param="enable_thinking")
            value = kwargs["enable_thinking"]
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"enable_thinking must be true or false (got {shown(value)})", param="enable_thinking")
    return value


def _prompt(body: dict) -> str | list[int]:
    """/v1/completions `prompt`: text or token ids; a list holding one of them is unwrapped."""
    if "prompt" not in body:
        raise ApiError(400, "prompt is required", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise ApiError(400, f"{len(prompt)} prompts in one request are not supported (batch 1); "
                                "send one request per prompt", param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
