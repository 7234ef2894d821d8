"""Tool calls (OpenAI's `tools` / `tool_choice`): the prompt that offers the functions, the grammar that
forces a call, and the reader that takes the calls back out of a reply.

A model writes calls in the form its chat template teaches. The form is read off the template text:

- "hermes" (Qwen2.5 / Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- "xml" (Qwen3.5 / Qwen3.6 / Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`;
- "llama3_json" (Llama 3.1+): the whole reply is `{"name": ..., "parameters": {...}}`;
- "generic", for a template without tool support (SmolLM2): the hermes form, taught by a system prompt
  this module writes (`GENERIC_TOOL_PROMPT`), with tool results rendered as user turns.

`tool_choice` "required" or a named function compiles the form into a grammar (llguidance Lark with the
function's parameter schema inline), so the reply is a valid call; "auto" lets the model choose, and the
reader parses whatever calls it wrote. The same :class:`ToolCallReader` serves a whole reply and a
streamed one, so streamed deltas reassemble to the non-streamed calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from runtime.errors import DFlashError
from runtime.options import TOOL_NAME as _NAME

# JSON written the way chat templates render it (Python's json.dumps: ", " and ": "), so a forced call
# reads like the calls in the template's examples
_TOOL_JSON = {"whitespace_flexible": False, "coerce_one_of": True, "item_separator": ", ", "key_separator": ": "}

GENERIC_TOOL_PROMPT = (
    "You can call functions. Their JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call, holding a JSON object with its name and arguments:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>'
)


# ---- the forms -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates writes tool calls (see the module docstring).

    Attributes:
        name: "hermes", "xml", "llama3_json" or "generic".
        native: the chat template renders `tools` and tool turns itself.
    """

    name: str
    native: bool

    # -- the prompt
    def prompt_messages(self, messages: list[dict], tools: tuple[dict, ...]) -> list[dict]:
        """The checked messages as the chat template should see them (`runtime.text.tokenizer.check_messages`'s
        output): native templates get tool calls' arguments as objects, as Hugging Face passes them; the
        generic form gets its system prompt and tool turns as text."""
        if self.native:
            return [_arguments_as_objects(m) for m in messages]
        out = []
        for m in messages:
            if m["role"] == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            elif m.get("tool_calls"):
                calls = "\n".join(_hermes_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
                out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + calls})
            else:
                out.append({"role": m["role"], "content": m["content"]})
        if tools:
            listing = GENERIC_TOOL_PROMPT.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
            else:
                out.insert(0, {"role": "system", "content": listing})
        return out

    # -- the grammar
    def grammar(self, tools: tuple[dict, ...], choice: str, parallel: bool) -> str:
        """The llguidance grammar of a reply that is only calls: one call of the named function, or
        (`choice` "required") one or more calls (one when not `parallel`) of any of `tools`.

        Raises:
            DFlashError: a parameter schema llguidance cannot compile (named by the Constraint).
        """
        import llguidance

        defs: dict = {}
        chosen = [{**t["function"], "parameters": _hoisted(i, t["function"]["parameters"], defs)}
                  for i, t in enumerate(tools) if choice == "required" or t["function"]["name"] == choice]
        many = parallel and choice == "required"
        extra = {"$defs": defs} if defs else {}
        if self.name == "llama3_json":
            schema = {"anyOf": [_call_schema(f, "parameters") for f in chosen], **extra, "x-guidance": _TOOL_JSON}
            return llguidance.grammar_from("json_schema", json.dumps(schema))
        start = 'start: call ("\\n" call)*\n' if many else "start: call\n"
        if self.name == "xml":
            return llguidance.grammar_from("lark", start + _xml_rules(chosen, defs))
        schema = {"anyOf": [_call_schema(f, "arguments") for f in chosen], **extra, "x-guidance": _TOOL_JSON}
        return llguidance.grammar_from("lark", start + f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n')


def tool_format(chat_template: str | None) -> ToolFormat:
    """The form the model's chat template teaches (see the module docstring)."""
    t = chat_template or ""
    if "<function=" in t:
        return ToolFormat("xml", native=True)
    if "<tool_call>" in t:
        return ToolFormat("hermes", native=True)
    if "<|python_tag|>" in t or ("ipython" in t and "tools" in t):
        return ToolFormat("llama3_json", native=True)
    return ToolFormat("generic", native=False)


def _arguments_as_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        args = c["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass  # (a template prints a string as it is)
        calls.append({**c, "function": {**c["function"], "arguments": args}})
    return {**message, "tool_calls": calls}


def _hermes_call(name: str, arguments: str | dict) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def _hoisted(index: int, params: dict, defs: dict) -> dict:
    """`params` (function `index`'s parameter schema) with its `$defs` / `definitions` moved into `defs`
    (the call schema's root, under names prefixed `f<index>_`) and its `$ref`s rewritten to them (`#`,
    the parameters themselves, too): inside the call schema the parameters are no longer the root."""
    local = {f"#/{key}/{name}": f"#/$defs/f{index}_{name}"
             for key in ("$defs", "definitions") for name in (params.get(key) or {})}
    root = f"#/$defs/f{index}__root"
    used_root = False

    def rewrite(node):
        nonlocal used_root
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):  # (other refs: llguidance names them)
                hit = next((new + v[len(p):] for p, new in local.items() if v == p or v.startswith(p + "/")), None)
                if hit is None:  # a pointer into the parameters themselves
                    used_root, hit = True, root + v[1:]
                v = hit
            out[k] = rewrite(v)
        return out

    body = rewrite({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
    for key in ("$defs", "definitions"):
        for name, schema in (params.get(key) or {}).items():
            defs[f"f{index}_{name}"] = rewrite(schema)
    if used_root:
        defs[f"f{index}__root"] = body
    return body


def _call_schema(fn: dict, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: fn["parameters"]},
            "required": ["name", key], "additionalProperties": False}


def _xml_rules(functions: list[dict], defs: dict) -> str:
    """Lark rules of the xml form: per function its parameters in schema order (required ones always,
    the others optional); string values are text without "</" (so `</parameter>` ends them), others JSON."""
    rules = ["call: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        props = fn["parameters"].get("properties", {}) or {}
        required = set(fn["parameters"].get("required", []) or [])
        parts = []
        for j, (pname, pschema) in enumerate(props.items()):
            if not isinstance(pname, str) or not _NAME.fullmatch(pname):
                raise DFlashError(f"function {fn['name']!r}: parameter name {pname!r:.80} cannot be written in the xml "
                                  "tool-call form (letters, digits, '_', '-' or '.')")
            value = f"V{i}_{j}"
            if isinstance(pschema, dict) and pschema.get("type") == "string" and not {"enum", "const", "pattern"} & set(pschema):
                rules.append(f'{value}: /([^<]|<[^\\/])*\\n<\\/parameter>\\n/')
                body = value
            else:
                own = {**(pschema if isinstance(pschema, dict) else {}), **({"$defs": defs} if defs else {}), "x-guidance": _TOOL_JSON}
                rules.append(f"v{i}_{j}: %json {json.dumps(own)}")
                body = f'v{i}_{j} "\\n</parameter>\\n"'
            part = f'"<parameter={pname}>\\n" {body}'
            parts.append(f"({part})" if pname in required else f"({part})?")
        rules.append(f'fn{i}: "<tool_call>\\n<function={fn["name"]}>\\n" {" ".join(parts)} "</function>\\n</tool_call>"')
    return "\n".join(rules) + "\n"


# ---- reading calls back ---------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """One streamed piece of a call: its header (`id`, `name`) the first time, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        """OpenAI's `delta.tool_calls[]` entry."""
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


_START, _END = "<tool_call>", "</tool_call>"
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


@dataclass
class ToolCallReader:
    """Splits a reply, as it arrives, into content and tool calls.

    Feed it text deltas (`feed`), then `finish()`; each returns (content delta, [ToolCallDelta]).
    `calls` holds the OpenAI `tool_calls` read so far. A call whose function is not in `tools`, or whose
    head does not parse, stays in the content; once its name is out, a call stands, and its arguments
    are the text written (OpenAI's: they may not parse, e.g. cut by max_tokens).

    Args:
        form: the ToolFormat.
        tools: the request's checked tools.
        forced: a forced call (tool_choice "required" or named): text outside calls (an unfinished
            marker cut by max_tokens) is dropped, never content.
    """

    form: ToolFormat
    tools: tuple[dict, ...]
    forced: bool = False  # tool_choice "required" or named: the reply is calls only, other text is dropped
    calls: list[dict] = field(default_factory=list)
    content: str = ""
    _buffer: str = ""  # text not yet given out
    _inside: bool = False  # within a call's markers (or, llama3_json, a reply that may be a call)
    _emitted: int = 0  # arguments characters of the open call already given out
    _space: str = ""  # whitespace content held back until more content follows

    def __post_init__(self):
        self._names = {t["function"]["name"]: t["function"] for t in self.tools}

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Add a text delta."""
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the reply: an open call is closed as it stands; held-back text is given out."""
        content, deltas = self._advance(final=True)
        if self._inside:
            c, d = self._close(self._buffer, closed=False)
            content, deltas = content + c, deltas + d
            self._buffer, self._inside = "", False
        if not self.calls:
            content += self._space
            self.content += self._space
        self._space = ""
        return content, deltas

    def result(self) -> tuple[str | None, list[dict]]:
        """(the content, None when it is only whitespace beside calls or the call was forced; the calls)."""
        if self.forced or self.calls and not self.content.strip():
            return None, self.calls
        return self.content, self.calls

    # -- internals
    def _advance(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        while True:
            if not self._inside:
                if self.form.name == "llama3_json":
                    if not self.content.strip() and self._buffer.lstrip().startswith("{"):
                        self._inside = True
                        continue
                    if not self.content.strip() and not self._buffer.strip() and not final:
                        return content, deltas  # (only whitespace so far: a call may still start)
                    content += self._content(self._buffer)
                    self._buffer = ""
                    return content, deltas
                at = self._buffer.find(_START)
                if at < 0:
                    keep = 0 if final else _partial_marker(self._buffer, _START)
                    content += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return content, deltas
                content += self._content(self._buffer[:at])
                self._buffer, self._inside, self._emitted = self._buffer[at + len(_START):], True, 0
                continue
            if self.form.name == "llama3_json":
                return content, deltas  # (read whole at finish)
            end = self._call_end(self._buffer, final)
            if end < 0:
                deltas += self._open_call(self._buffer)
                return content, deltas
            c, d = self._close(self._buffer[:end], closed=True)
            content, deltas = content + c, deltas + d
            self._buffer, self._inside = self._buffer[end + len(_END):], False

    def _call_end(self, body: str, final: bool) -> int:
        """Where the end marker of the open call is (-1: not yet): after its JSON object where the body
        is one (a `</tool_call>` inside a string argument does not end the call)."""
        start = len(body) - len(body.lstrip())
        if self.form.name == "xml" or not body[start:start + 1] == "{":
            return body.find(_END)
        done = start + _json_value_end(body[start:])
        return body.find(_END, done) if done < len(body) or final else -1

    def _content(self, text: str) -> str:
        """Content out, whitespace held back until something else follows (so the newlines between
        calls never become content; a forced call's reply has none)."""
        if self.forced:
            return ""
        body = text.rstrip()
        if not body:
            self._space += text
            return ""
        out, self._space = self._space + body, text[len(body):]
        self.content += out
        return out

    def _open_call(self, body: str) -> list[ToolCallDelta]:
        """Deltas of the call being written: the header once its name is known (hermes and generic: and
        the arguments as far as they are written; xml: at its close)."""
        if self.form.name == "xml":
            m = _XML_FUNCTION.match(body)
            if m and m.group(1) in self._names and self._emitted == 0 and body[m.end():]:
                self._emitted = -1  # header out; arguments at the close
                return [self._header(m.group(1))]
            return []
        m = _HERMES_HEAD.match(body)
        if not m or m.group(1) not in self._names:
            return []
        out = [] if self._emitted else [self._header(m.group(1))]
        self._emitted = self._emitted or -1
        args = body[m.end():]
        written = args[: _json_value_end(args)]
        done = max(self._emitted, 0)
        if len(written) > done:
            out.append(ToolCallDelta(len(self.calls) - 1, arguments=written[done:]))
            self.calls[-1]["function"]["arguments"] += written[done:]
            self._emitted = len(written)
        return out

    def _close(self, body: str, closed: bool) -> tuple[str, list[ToolCallDelta]]:
        """A call's whole text: finish the open call, or read it now; text that is no call is content."""
        deltas = [] if self.form.name in ("xml", "llama3_json") else self._open_call(body)
        if self._emitted != 0 and self.form.name != "xml":  # hermes/generic: header and arguments as written
            self._emitted = 0
            return "", deltas
        started = self._emitted != 0
        if self.form.name == "xml":
            parsed = self._xml_call(body)
        elif self.form.name == "llama3_json":
            parsed = _json_call(body, ("parameters", "arguments"))
        else:
            parsed = _json_call(body, ("arguments", "parameters"))
        if started:  # (xml: the header is out; the arguments come whole, at the close)
            if parsed is not None:
                self.calls[-1]["function"]["arguments"] = parsed[1]
                deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=parsed[1]))
        elif parsed is not None and parsed[0] in self._names:
            deltas += [self._header(parsed[0]), ToolCallDelta(len(self.calls) - 1, arguments=parsed[1])]
            self.calls[-1]["function"]["arguments"] = parsed[1]
        else:  # not a call: its text is content
            text = (_START + body + (_END if closed else "")) if self.form.name != "llama3_json" else body
            return self._content(text), []
        self._emitted = 0
        return "", deltas

    def _header(self, name: str) -> ToolCallDelta:
        call_id = "call_" + uuid.uuid4().hex[:24]
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        return ToolCallDelta(len(self.calls) - 1, id=call_id, name=name)

    def _xml_call(self, body: str) -> tuple[str, str] | None:
        m = _XML_FUNCTION.match(body)
        if not m or m.group(1) not in self._names:
            return None
        props = self._names[m.group(1)]["parameters"].get("properties", {}) or {}
        args = {}
        for name, value in _XML_PARAM.findall(body[m.end():]):
            schema = props.get(name, {})
            if isinstance(schema, dict) and schema.get("type") == "string":
                args[name] = value
            else:
                try:
                    args[name] = json.loads(value)
                except ValueError:
                    args[name] = value
        return m.group(1), json.dumps(args, ensure_ascii=False)


def _json_call(body: str, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of `{"name": ..., "<key>": {...}}`, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _json_value_end(text: str) -> int:
    """Where the JSON value at the start of `text` ends (its length so far while it is still open): an
    object or array at its closing bracket, a string at its closing quote, a number or literal before
    the first character that cannot continue it."""
    lead = len(text) - len(text.lstrip())
    first = text[lead:lead + 1]
    if first and first not in '{["':
        rest = text[lead:]
        return lead + next((i for i, ch in enumerate(rest) if ch in ",}] \n\t\r"), len(rest))
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: a call may be starting)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def read_tool_calls(text: str, form: ToolFormat, tools: tuple[dict, ...],
                    forced: bool = False) -> tuple[str | None, list[dict]]:
    """A whole reply's (content, tool calls), as a streamed reader would give them."""
    reader = ToolCallReader(form, tools, forced)
    reader.feed(text)
    reader.finish()
    return reader.result()


def with_tool_calls(result, form: ToolFormat, opts):
    """`result` (a GenerationResult with text) with its `tool_calls` and `content` read (`opts`: the
    request's GenerationOptions), and finish_reason "tool_calls" where it holds calls, ended by itself
    (a stop token or the grammar's end) and every call's arguments parse as a JSON object."""
    if result.text is None:
        return result
    result.content, result.tool_calls = read_tool_calls(result.text, form, opts.tools, opts.forces_tool_call)
    if result.tool_calls and result.finish_reason == "stop" and all(_object(c) for c in result.tool_calls):
        result.finish_reason = "tool_calls"
    return result


def _object(call: dict) -> bool:
    try:
        return isinstance(json.loads(call["function"]["arguments"]), dict)
    except ValueError:
        return False
