"""Tool calls without a model (`runtime.text.tools`): checking `tools` / `tool_choice`, the form read off a
chat template, the reader that splits a reply into content and calls (whole or streamed piece by piece,
with the same result), the prompt of the generic form, and the grammars that force a call (run on a
byte-level tokenizer, so every string has one tokenization)."""

from __future__ import annotations

import json

import pytest

from runtime.errors import DFlashError
from runtime.options import GenerationOptions
from runtime.text.tools import ToolCallReader, ToolFormat, read_tool_calls, tool_format

pytest.importorskip("llguidance")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = GenerationOptions(tools=[WEATHER, TIME]).tools
HERMES, XML, LLAMA, GENERIC = (ToolFormat("hermes", True), ToolFormat("xml", True), ToolFormat("llama3_json", True),
                               ToolFormat("generic", False))


# ---- checking ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, match", [
    ("get_weather", "tools must be a list"),
    ([{"type": "retrieval"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "bad name!"}}], r"tools\[0\].function.name must be"),
    ([WEATHER, WEATHER], r"tools\[1\].function.name 'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], 'of type "object"'),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "description must be a string"),
    ([{"type": "function", "function": {"name": "f", "extra": 1}}], r"unknown fields \['extra'\]"),
])
def test_malformed_tools_are_named(tools, match):
    with pytest.raises(DFlashError, match=match):
        GenerationOptions(tools=tools)


@pytest.mark.parametrize("choice, want", [(None, "auto"), ("none", "none"), ("required", "required"),
                                          ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
                                          ("get_time", "get_time")])
def test_tool_choice_is_normalised(choice, want):
    assert GenerationOptions(tools=[WEATHER, TIME], tool_choice=choice).tool_choice == want
    assert GenerationOptions().tool_choice == "none"


@pytest.mark.parametrize("kwargs, match", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools \\(get_weather\\)"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), 'tool_choice must be "none"'),
    (dict(tool_choice="required"), "needs tools"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "forces a tool call"),
    (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls must be true or false"),
])
def test_bad_tool_choices_are_named(kwargs, match):
    with pytest.raises(DFlashError, match=match):
        GenerationOptions(**kwargs)


def test_the_form_is_read_off_the_template():
    assert tool_format("{% if tools %}<tool_call>\n{{ x }}</tool_call>{% endif %}").name == "hermes"
    assert tool_format("<tool_call>\n<function=name>\n<parameter=p>").name == "xml"
    assert tool_format("{{- '<|python_tag|>' }}{% if tools %}ipython{% endif %}").name == "llama3_json"
    assert tool_format("{{ '<|im_start|>' + message['role'] }}").name == "generic"
    assert tool_format(None).name == "generic"


# ---- reading calls ----------------------------------------------------------------------------------
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
                '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def _streamed(text: str, form: ToolFormat, step: int):
    """Feed `text` `step` characters at a time; returns (content, calls rebuilt from the deltas)."""
    reader, content, calls = ToolCallReader(form, TOOLS), "", []
    pieces = [reader.feed(text[i:i + step]) for i in range(0, len(text), step)] + [reader.finish()]
    for c, deltas in pieces:
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls)
                calls.append({"id": d.id, "name": d.name, "arguments": d.arguments})
            else:
                calls[d.index]["arguments"] += d.arguments
    return content, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_streamed_reply_gives_the_calls_of_the_whole_reply(step):
    content, calls = read_tool_calls(HERMES_REPLY, HERMES, TOOLS)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    streamed, deltas = _streamed(HERMES_REPLY, HERMES, step)
    assert streamed.strip() == content
    assert [(d["name"], d["arguments"]) for d in deltas] == [(c["function"]["name"], c["function"]["arguments"])
                                                              for c in calls]
    if step == 1:  # arguments arrive in fragments as they are written, not at the close
        reader = ToolCallReader(HERMES, TOOLS)
        reader.feed(HERMES_REPLY[:HERMES_REPLY.index('"days"')])
        assert reader.calls[0]["function"]["arguments"] == '{"city": "Paris", '


@pytest.mark.parametrize("text, content", [
    ("Just text, <tool_ and a < sign.", "Just text, <tool_ and a < sign."),  # a held-back marker start is content
    ('<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # not one of the tools
     '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'),
    ("<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok"),
])
def test_text_that_is_no_call_stays_content(text, content):
    assert read_tool_calls(text, HERMES, TOOLS) == (content, [])
    assert _streamed(text, HERMES, 2) == (content, [])


def test_a_call_cut_by_the_length_limit_keeps_what_was_written():
    content, calls = read_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro', HERMES, TOOLS)
    assert content is None and calls[0]["function"]["arguments"] == '{"city": "Ro'  # (OpenAI: arguments may not parse)


def test_xml_and_llama_forms_are_read():
    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>")
    content, calls = read_tool_calls(xml, XML, TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "New York", "days": 3}
    assert [(d["name"], json.loads(d["arguments"])) for d in _streamed(xml, XML, 2)[1]] == [
        ("get_weather", {"city": "New York", "days": 3})]
    llama = ' {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert json.loads(read_tool_calls(llama, LLAMA, TOOLS)[1][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert read_tool_calls("The weather is fine.", LLAMA, TOOLS) == ("The weather is fine.", [])


# ---- the generic prompt ------------------------------------------------------------------------------
def test_the_generic_form_teaches_the_call_and_renders_tool_turns_as_text():
    from runtime.text.tokenizer import check_messages

    messages = check_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}])
    out = GENERIC.prompt_messages(messages, TOOLS)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {"role": "assistant",
                      "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    native = HERMES.prompt_messages(messages, TOOLS)  # a native template gets the arguments as an object
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(DFlashError, match="only assistant turns carry tool calls"):
        check_messages([{"role": "user", "content": "x", "tool_calls": []}])


def test_the_chat_template_compiles_once_and_a_broken_one_is_named(tmp_path):
    """The template is compiled on the first request and kept; one that does not compile fails every request
    with the same clear error (nothing half-made is kept)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from runtime.text.tokenizer import ChatTokenizer

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1, "there": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
    chat = ChatTokenizer(tmp_path / "tokenizer.json", "{% for m in messages %}{{ m['content'] }} {% endfor %}", {})
    assert chat.apply_chat_template(messages) == [1, 2]
    compiled = chat._compiled_template()
    assert chat.apply_chat_template(messages[:1]) == [1] and chat._compiled_template() is compiled
    broken = ChatTokenizer(tmp_path / "tokenizer.json", "{% for m in messages %}", {})
    for _ in range(2):
        with pytest.raises(DFlashError, match="chat template cannot be rendered"):
            broken.apply_chat_template(messages)


# ---- grammars -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A byte-level tokenizer.json (256 byte tokens and an end token, id 256): one tokenization per string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from runtime.text.constraints import GrammarTokenizer

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<end>"])
    path = tmp_path_factory.mktemp("bytetok") / "tokenizer.json"
    tok.save(str(path))
    return GrammarTokenizer(path, 257, [256]), tok


def _follows(byte_tokenizer, grammar: str, text: str) -> bool:
    """The grammar takes `text` whole and then only the end token."""
    from runtime.text.constraints import Constraint

    gt, tok = byte_tokenizer
    c = Constraint(gt, grammar)
    try:
        for t in tok.encode(text, add_special_tokens=False).ids:
            c.commit(t)
    except DFlashError:
        return False
    return bool(c.allowed()[256])


@pytest.mark.parametrize("form, good, bad", [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     ['<tool_call>\n{"name": "get_weather", "arguments": {"days": 3}}\n</tool_call>',  # city is required
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 9}}\n</tool_call>',  # maximum 7
      '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', "Sure!"]),
    (GENERIC, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     ['<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>x']),
    (XML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n<parameter=unit>\n"
          '"celsius"\n</parameter>\n</function>\n</tool_call>',
     ["<tool_call>\n<function=get_weather>\n<parameter=unit>\n\"celsius\"\n</parameter>\n</function>\n</tool_call>",
      "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
      "</function>\n</tool_call>"]),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     ['{"name": "get_weather", "arguments": {"city": "Oslo"}}']),
])
def test_required_calls_follow_the_form_and_the_parameter_schema(byte_tokenizer, form, good, bad):
    grammar = form.grammar(TOOLS, "required", parallel=True)
    assert _follows(byte_tokenizer, grammar, good)
    for text in bad:
        assert not _follows(byte_tokenizer, grammar, text), text
    assert read_tool_calls(good, form, TOOLS)[1], "what the grammar forces, the reader reads"


def test_parallel_and_named_choices(byte_tokenizer):
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>'
    assert _follows(byte_tokenizer, HERMES.grammar(TOOLS, "required", parallel=True), two)
    assert not _follows(byte_tokenizer, HERMES.grammar(TOOLS, "required", parallel=False), two)
    assert _follows(byte_tokenizer, HERMES.grammar(TOOLS, "required", parallel=False), one)
    named = HERMES.grammar(TOOLS, "get_weather", parallel=True)  # a named function: one call of it
    assert not _follows(byte_tokenizer, named, one)
    assert _follows(byte_tokenizer, named, two[len(one) + 1:])


# ---- what a hostile client tried (each was a bug) ------------------------------------------------------
def test_parameter_schemas_with_defs_and_refs_compile(byte_tokenizer):
    """Nested models (`$defs` / `$ref`, as pydantic writes them) and a recursive `#` work inside the call
    schema, where the parameters are no longer the root."""
    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
    nested = {"type": "function", "function": {"name": "trip", "parameters": {
        "$defs": {"Loc": loc}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Loc"}}, "required": ["to"],
        "additionalProperties": False}}}
    tree = {"type": "function", "function": {"name": "node", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["kids"], "additionalProperties": False}}}
    tools = GenerationOptions(tools=[nested, tree]).tools
    grammar = HERMES.grammar(tools, "required", parallel=False)
    assert _follows(byte_tokenizer, grammar, '<tool_call>\n{"name": "trip", "arguments": {"to": {"city": "Oslo"}}}\n</tool_call>')
    assert not _follows(byte_tokenizer, grammar, '<tool_call>\n{"name": "trip", "arguments": {"to": {"town": "Oslo"}}}\n</tool_call>')
    assert _follows(byte_tokenizer, grammar, '<tool_call>\n{"name": "node", "arguments": {"kids": [{"kids": []}]}}\n</tool_call>')
    for form in (XML, LLAMA):
        assert form.grammar(tools, "required", parallel=True)


@pytest.mark.parametrize("form, text", [
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    (XML, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"),
    (HERMES, '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>'),  # (name last)
])
def test_a_call_read_whole_streams_its_arguments_at_its_own_index(form, text):
    content, calls = _streamed(text, form, 10_000)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_an_end_marker_inside_a_string_argument_does_not_end_the_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>'
    whole = read_tool_calls(text, HERMES, TOOLS)
    assert whole[0] is None and json.loads(whole[1][0]["function"]["arguments"]) == {"city": "a</tool_call>b"}
    for step in (1, 4):
        content, calls = _streamed(text, HERMES, step)
        assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "a</tool_call>b"}')]
    scalar = '<tool_call>\n{"name": "get_time", "arguments": 5}\n</tool_call>'  # (not an object: kept as written)
    assert read_tool_calls(scalar, HERMES, TOOLS)[1][0]["function"]["arguments"] == "5"
    assert _streamed(scalar, HERMES, 1)[1][0]["arguments"] == "5"


def test_a_forced_call_cut_short_leaves_no_markup_in_the_content():
    for cut in ("<", "<tool_call>", '<tool_call>\n{"name": "get_weather", "'):
        assert read_tool_calls(cut, HERMES, TOOLS, forced=True)[0] is None
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name":'
    content, calls = read_tool_calls(two, HERMES, TOOLS, forced=True)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tools=[{"type": "function", "function": {"name": "ab\n"}}]), r"tools\[0\].function.name must be"),
    (dict(tools=[{"type": "function", "function": {"name": "none"}}]), "one of tool_choice's modes"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}, "foo": 1}]), r"tools\[0\] has unknown fields \['foo'\]"),
    (dict(tools=[WEATHER], tool_choice="required", stop=["}"]), "a stop string would cut"),
])
def test_more_malformed_tools_are_named(kwargs, match):
    with pytest.raises(DFlashError, match=match):
        GenerationOptions(**kwargs)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "x", "tool_call_id": "c1"}], "only tool turns answer a tool call"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"type": "retrieval", "function": {"name": "f"}}]}],
     r'tool_calls\[0\].type must be "function"'),
    ([{"role": "assistant", "content": "x", "tool_calls": False}], "tool_calls must be a list"),
])
def test_malformed_tool_turns_are_named(messages, match):
    from runtime.text.tokenizer import check_messages

    with pytest.raises(DFlashError, match=match):
        check_messages(messages)
