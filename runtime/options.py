"""Validated generation options: what `Session.generate` / `stream` / `chat` and the server accept.

Every check raises one :class:`DFlashError` naming the option, its allowed range and the value given,
so the server can answer it as a 400 and the command line print it without a traceback.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from runtime.errors import DFlashError
from runtime.graphs.tree import parse_tree

# Longest stop string accepted (characters): they are matched on the decoded text, and a streamed
# reply holds back that many characters until it knows they do not start a stop string.
DEFAULT_MAX_TOKENS = 512  # chat and server: when a request names no max_tokens: what fits, but at most this many
MAX_STOP_CHARS = 256
MAX_STOP_STRINGS = 16
# Temperatures below this decode greedily (the T -> 0 limit of sampling): logits / T would overflow
# float32 below about 1e-36, and anything this small already puts all the mass on the argmax.
MIN_TEMPERATURE = 1e-5
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API
TOOL_CHOICE_MODES = ("none", "auto", "required")
DRAFTERS = ("auto", "dflash", "mtp")
MTP_DEFAULT_LENGTH = 3  # chained MTP proposals a step when verify_len does not say (vLLM's and SGLang's usual 1-3)
# OpenAI's function-name rule (and "." as some clients send); matched whole (`fullmatch`)
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class GenerationOptions:
    """One request's options, checked for types and ranges (limits of the artifact are checked by the
    Session: vocabulary, block size, KV capacity).

    Attributes:
        max_new_tokens: at most this many new tokens (>= 1).
        temperature: 0 for greedy; > 0 samples the target's processed distribution (below
            MIN_TEMPERATURE = 1e-5: greedy, the limit).
        top_p: nucleus sampling, in (0, 1] (1 = off): keep the smallest set of most likely tokens whose
            probability reaches top_p (Holtzman et al., 2020; Hugging Face's TopPLogitsWarper order:
            temperature, then top_k, then top_p).
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 = off.
        seed: seed of the sampling random numbers (>= 0).
        stop: stop strings; the reply ends before the first one (which is not returned).
        stop_token_ids: ids that end the reply once committed (None: the manifest's; () for none).
        block_size: tokens per draft block (None: the draft's; 1: plain decoding).
        verify_len: "auto" / None, "all", an integer or a verify tree "L+A" (see `Session.generate`).
        record_steps: keep each step's proposals and acceptance in `result.steps`.
        reuse_prefix: reuse the KV cache rows of the longest common token prefix with the session's
            previous request (prefill only the new tokens); output is the same either way.
        response_format: OpenAI's `{"type": "json_object"}` or `{"type": "json_schema", "json_schema":
            {"name": ..., "schema": {...}}}` (`{"type": "text"}`: none): the reply follows it
            (`runtime.text.constraints`; needs llguidance).
        grammar: a Lark grammar the reply follows (llguidance's syntax); regex: a regular expression the
            whole reply matches. At most one of response_format, grammar and regex.
        logprobs: return each committed token's log-probability under the target (its raw distribution:
            before temperature, top_k/top_p and any output constraint), in `result.logprobs`.
        top_logprobs: with logprobs, also the MAX_TOP_LOGPROBS or fewer most likely tokens of each row.
        tools: OpenAI function tools (`[{"type": "function", "function": {"name", "description",
            "parameters"}}]`) offered to a chat prompt through the model's template (`runtime.text.tools`).
        tool_choice: "auto" (default with tools: the model chooses, its calls are parsed), "none" (tools are
            not offered), "required" (the reply is one or more calls) or a function name / OpenAI's
            `{"type": "function", "function": {"name": ...}}` (one call of it); normalised to the name.
        parallel_tool_calls: "required" may produce several calls (False: exactly one).
        drafter: where proposals come from: "auto" (default: the DFlash draft and lookups as the policy
            chooses, and, where the artifact has the target's MTP head, that head's chain when it measures
            faster: `runtime.speculation.drafters`), "dflash" (the draft and lookups only), or "mtp" (the
            head's chain of `verify_len` proposals a step; unset or "auto": a length that starts at
            MTP_DEFAULT_LENGTH and follows what the head's steps accept, `runtime.speculation.drafters.MTPChain`;
            artifacts with `mtp.onnx`).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] | None = None
    block_size: int | None = None
    verify_len: int | str | None = None
    record_steps: bool = False
    reuse_prefix: bool = True
    response_format: dict | None = None
    grammar: str | None = None
    regex: str | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    tools: tuple | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    drafter: str = "auto"

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        set_("max_new_tokens", as_int(self.max_new_tokens, "max_new_tokens"))
        if self.max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be at least 1 (got {self.max_new_tokens})")
        set_("temperature", _as_float(self.temperature, "temperature"))
        if self.temperature < 0:
            raise DFlashError(f"temperature must be a finite number >= 0 (got {self.temperature!r})")
        if self.temperature < MIN_TEMPERATURE:
            set_("temperature", 0.0)
        set_("top_p", _as_float(self.top_p, "top_p"))
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1] (got {self.top_p!r}); 1 turns it off")
        set_("top_k", as_int(self.top_k, "top_k"))
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0 (got {self.top_k}); 0 turns it off")
        set_("seed", as_int(self.seed, "seed"))
        if self.seed < 0:
            raise DFlashError(f"seed must be a non-negative integer (got {self.seed})")
        set_("stop", _stop_strings(self.stop))
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (int, str)):
                raise DFlashError("stop_token_ids must be a list of token ids (or None for the model's defaults)")
            set_("stop_token_ids", tuple(as_int(t, "stop token id") for t in self.stop_token_ids))
            for t in self.stop_token_ids:  # (the Session checks the upper end: the vocabulary size)
                if t < 0:
                    raise DFlashError(f"stop_token_ids holds {t}, which is not a token id (ids are >= 0)")
        if self.block_size is not None:
            set_("block_size", as_int(self.block_size, "block_size"))
        v = self.verify_len
        if isinstance(v, str) and "+" in v:  # a fixed verify tree, "L+A" (`runtime.graphs.tree`)
            try:
                parse_tree(v)
            except ValueError as e:
                raise DFlashError(f"verify_len: {e}") from None
        elif v is not None and v not in ("auto", "all"):
            if isinstance(v, str) and v.isascii() and v.isdigit():  # "3" from a command line or a JSON string
                v = int(v)
            if isinstance(v, (str, bool)):
                raise DFlashError(f'verify_len must be "auto", "all", an integer or a verify tree "L+A" (got {v!r})')
            set_("verify_len", as_int(v, "verify_len"))
        if self.response_format is not None and not isinstance(self.response_format, dict):
            raise DFlashError('response_format must be an object such as {"type": "json_object"}')
        for name in ("grammar", "regex"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise DFlashError(f"{name} must be a string")
        set_("top_logprobs", as_int(self.top_logprobs, "top_logprobs"))
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise DFlashError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS} (got {self.top_logprobs})")
        if self.top_logprobs and not self.logprobs:
            raise DFlashError("top_logprobs needs logprobs=True")
        set_("tools", check_tools(self.tools) or None)
        set_("tool_choice", check_tool_choice(self.tool_choice, self.tools or ()))
        if self.forces_tool_call and self.stop:
            raise DFlashError(f"tool_choice {self.tool_choice!r} forces a tool call, which a stop string would cut; "
                              'pass no stop with it (or use tool_choice "auto")')
        if self.forces_tool_call and self.constrained_output:
            raise DFlashError(f"tool_choice {self.tool_choice!r} forces a tool call: pass no response_format, grammar or "
                              'regex with it (or use tool_choice "auto")')
        if self.drafter not in DRAFTERS:
            raise DFlashError(f"drafter must be one of {', '.join(DRAFTERS)} (got {self.drafter!r:.80})")
        for flag in ("record_steps", "reuse_prefix", "logprobs", "parallel_tool_calls"):
            if not isinstance(getattr(self, flag), bool):
                raise DFlashError(f"{flag} must be true or false (got {getattr(self, flag)!r})")

    @property
    def samples_on_host(self) -> bool:
        """Sampling with top_p / top_k runs on the host from the target's logits (the graph samples
        temperature alone; greedy decoding ignores both, as they never remove the argmax)."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)

    @property
    def on_host(self) -> bool:
        """Each row's token is chosen on the host from the target's logits (top_k/top_p sampling, an
        output constraint, or log-probabilities to return)."""
        return self.samples_on_host or self.constrained or self.logprobs

    @property
    def constrained(self) -> bool:
        """The reply must follow a grammar (response_format other than text, grammar, regex, or a forced
        tool call)."""
        return self.constrained_output or self.forces_tool_call

    @property
    def constrained_output(self) -> bool:
        """response_format (other than text), grammar or regex is given."""
        text = isinstance(self.response_format, dict) and self.response_format.get("type") == "text"
        return (self.response_format is not None and not text) or self.grammar is not None or self.regex is not None

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the reply is calls only, by grammar."""
        return self.tool_choice not in ("none", "auto")

    @property
    def uses_tools(self) -> bool:
        """Tools are offered in the prompt and calls read from the reply (tool_choice other than "none")."""
        return bool(self.tools) and self.tool_choice != "none"


# the keyword arguments Session.generate / stream / chat accept as options
GENERATION_OPTION_NAMES = frozenset(f.name for f in fields(GenerationOptions))

def check_speculation_options(opts: GenerationOptions, default_block: int, limit: int, tree_length=None,
                              limit_note: str = "") -> int:
    """The block size a request runs at, after checking `block_size` (1..`limit`; default `default_block`)
    and `verify_len` against it: an integer, or a tree's chain length (`tree_length(verify_len)`, which may
    raise for trees an artifact cannot verify; default: the parsed chain), in 1..block_size - 1, and none
    with block_size 1. Shared by `Session` and `BatchEngine`, so a request is refused or run alike.

    Raises:
        DFlashError: naming the value out of range and the range.
    """
    b = default_block if opts.block_size is None else opts.block_size
    if not 1 <= b <= limit:
        raise DFlashError(f"block_size {b} must be between 1 and {limit}{limit_note}")
    v = opts.verify_len
    if isinstance(v, str) and "+" in v:
        length, shown = (tree_length or (lambda s: parse_tree(s).length))(v), f'"{v}"'
    else:
        length, shown = v, v
    if isinstance(length, int):
        if b == 1 and v != 1:  # (a tree's string is never 1)
            raise DFlashError(f"block_size 1 (plain decoding) verifies no proposals; omit verify_len (got {shown})")
        if not 1 <= length <= max(b - 1, 1):
            raise DFlashError(f"verify_len must be between 1 and block_size - 1 = {b - 1} "
                              f"(got {shown}); block_size {b} proposes {b - 1} token{'s' if b != 2 else ''} per step")
    return b


def check_vocabulary_options(opts: GenerationOptions, vocab: int, has_tokenizer: bool = True) -> None:
    """Raise DFlashError where stop_token_ids or top_k do not fit a vocabulary of `vocab` ids, or stop
    strings come without a tokenizer to make the text they match (shared by `Session` and `BatchEngine`)."""
    if opts.stop and not has_tokenizer:
        raise DFlashError("stop strings are matched on the reply's text and this artifact has no tokenizer: "
                          "drop them (--stop), or end replies at token ids with stop_token_ids")
    outside = [t for t in (opts.stop_token_ids or ()) if not 0 <= t < vocab]
    if outside:
        raise DFlashError(f"stop_token_ids holds {outside[0]}, which is not a token id of this model: ids are 0 to "
                          f"{vocab - 1} (vocabulary size {vocab})")
    if opts.top_k > vocab:
        raise DFlashError(f"top_k {opts.top_k} exceeds the vocabulary size {vocab}")


def refuse_unknown_options(options: dict, extra: frozenset[str] = frozenset()) -> None:
    """Raise one DFlashError naming keyword arguments that are neither GenerationOptions fields nor in
    `extra` (the dataclass's own TypeError would show Python internals)."""
    unknown = sorted(set(options) - GENERATION_OPTION_NAMES - extra)
    if unknown:
        raise DFlashError(f"unknown generation option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the "
                          f"options are {', '.join(sorted(GENERATION_OPTION_NAMES | extra))} (penalties and logit bias "
                          "are not supported: they cannot be kept exact)")


def as_int(value, what: str) -> int:
    """An integer argument (bools and non-integral floats refused) or a DFlashError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        if isinstance(value, (float, np.floating)) and float(value).is_integer():
            return int(value)
        raise DFlashError(f"{what} must be an integer (got {value!r})")
    return int(value)


def _as_float(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not math.isfinite(value):
        raise DFlashError(f"{what} must be a finite number (got {value!r})")
    return float(value)


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stop = tuple(stop)
    except TypeError:
        raise DFlashError(f"stop must be a string or a list of strings (got {stop!r})") from None
    if len(stop) > MAX_STOP_STRINGS:
        raise DFlashError(f"at most {MAX_STOP_STRINGS} stop strings are accepted (got {len(stop)})")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise DFlashError(f"each stop string must be a non-empty string (got {s!r})")
        if len(s) > MAX_STOP_CHARS:
            raise DFlashError(f"stop strings are limited to {MAX_STOP_CHARS} characters (got {len(s)})")
    return stop


# ---- a request's tools (`runtime.text.tools` writes them into prompts and grammars) ----------------------------------------------------------------------
def check_tools(tools: Any) -> tuple[dict, ...]:
    """OpenAI `tools`, checked: `[{"type": "function", "function": {"name", "description"?, "parameters"?,
    "strict"?}}, ...]`. Returns them normalised (parameters default to an empty object schema).

    Raises:
        DFlashError: naming the first malformed tool (`tools[i]...`).
    """
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise DFlashError('tools must be a list of {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise DFlashError(f'{where} must be {{"type": "function", "function": {{...}}}} (only function tools exist)')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise DFlashError(f'{where}.function must be an object with a name (and description, parameters)')
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise DFlashError(f"{where}.function.name must be 1-64 letters, digits, '_', '-' or '.' (got {name!r:.80})")
        if name in TOOL_CHOICE_MODES:
            raise DFlashError(f"{where}.function.name {name!r} is one of tool_choice's modes (none, auto, required); "
                              "name the function otherwise")
        if name in names:
            raise DFlashError(f"{where}.function.name {name!r} is given twice; function names must be unique")
        names.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise DFlashError(f"{where}.function.description must be a string")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise DFlashError(f'{where}.function.parameters must be a JSON schema of type "object"')
        strict = fn.get("strict", False)
        if not isinstance(strict, bool):
            raise DFlashError(f"{where}.function.strict must be true or false")
        if strict:
            params = {**params, "additionalProperties": params.get("additionalProperties", False)}
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise DFlashError(f"{where}.function has unknown fields {extra}")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise DFlashError(f"{where} has unknown fields {extra}")
        entry = {"name": name, "parameters": params}
        if desc:
            entry["description"] = desc
        out.append({"type": "function", "function": entry})
    return tuple(out)


def check_tool_choice(choice: Any, tools: tuple[dict, ...]) -> str:
    """OpenAI `tool_choice` -> "none", "auto", "required" or the name of the function to call.
    Default: "auto" with tools, "none" without.

    Raises:
        DFlashError: an unknown mode, a malformed or unknown named function, or a choice without tools.
    """
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise DFlashError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                              '{"name": ...}}')
        known = [t["function"]["name"] for t in tools]
        if name not in known:
            raise DFlashError(f"tool_choice names the function {name!r:.80}, which is not in tools "
                              f"({', '.join(known) or 'none given'})")
        return name
    if isinstance(choice, str) and choice not in TOOL_CHOICE_MODES and choice in [t["function"]["name"] for t in tools]:
        return choice  # (the normalised form of a named function)
    if choice not in TOOL_CHOICE_MODES:
        raise DFlashError(f'tool_choice must be "none", "auto", "required" or a named function (got {choice!r:.80})')
    if choice != "none" and not tools:
        raise DFlashError(f'tool_choice "{choice}" needs tools')
    return choice
