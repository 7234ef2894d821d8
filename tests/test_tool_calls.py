"""Tool calls on the real pair (SmolLM2's template has no tool support: the generic form,
`runtime.text.tools`): "required" and a named function give valid calls whose arguments follow the
function's schema, equal to constrained plain decoding greedy and per seed; the openai client gets
`message.tool_calls` and streamed deltas that reassemble to the same calls; a follow-up with the tool's
result goes through the template; bad tools are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from runtime.errors import DFlashError

pytestmark = pytest.mark.slow  # the real pair (SmolLM2 export, shared with the other real-model tests)
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]  # (the test artifact's KV buffers hold 256 tokens: the prompt stays near 200)
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def sess(smollm2_artifact):
    import runtime

    with runtime.load(smollm2_artifact) as s:
        yield s


def _valid(calls, names=("get_weather", "get_time")):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])


def _calls(result):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in result.tool_calls]


def test_required_and_named_calls_are_valid_and_equal_plain(sess):
    for choice, names in (("required", ("get_weather", "get_time")), ("get_weather", ("get_weather",))):
        kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_new_tokens=48)
        got = sess.generate(record_steps=True, **kw)
        plain = sess.generate(block_size=1, **kw)
        assert got.finish_reason == plain.finish_reason == "tool_calls"
        assert got.output_ids == plain.output_ids and _calls(got) == _calls(plain)
        assert len(got.tool_calls) == 1 and got.content is None
        _valid(got.tool_calls, names)
        assert any(s["source"] == "grammar" for s in got.steps)  # the call's fixed text came as free proposals
    many = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_new_tokens=56)
    got, plain = sess.generate(**many), sess.generate(block_size=1, **many)
    assert got.output_ids == plain.output_ids and _calls(got) == _calls(plain) and got.tool_calls
    assert got.finish_reason in ("tool_calls", "length")  # (several calls may run past 56 tokens)
    _valid(got.tool_calls if got.finish_reason == "tool_calls" else got.tool_calls[:-1])


def test_seeded_sampled_calls_are_the_same_with_and_without_speculation(sess):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_new_tokens=48, temperature=0.9, seed=7,
              parallel_tool_calls=False)
    got, plain = sess.generate(**kw), sess.generate(block_size=1, **kw)
    assert got.output_ids == plain.output_ids
    _valid(got.tool_calls)


def test_auto_none_and_the_tool_result_turn(sess):
    auto = sess.generate(messages=ASK, tools=TOOLS, max_new_tokens=48)
    assert auto.tool_calls is not None  # (read from what the model chose to write: calls or none)
    _valid(auto.tool_calls)
    if not auto.tool_calls:
        assert auto.content == auto.text and auto.finish_reason in ("stop", "length")
    none = sess.generate(messages=ASK, tools=TOOLS, tool_choice="none", max_new_tokens=8)
    assert none.tool_calls is None and none.output_ids == sess.generate(messages=ASK, max_new_tokens=8).output_ids
    follow = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    ids = sess.encode_messages(follow, tools=[WEATHER])
    text = sess.tokenizer.decode(ids)
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert '"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}' in text
    assert sess.generate(messages=follow, tools=[WEATHER], max_new_tokens=4).output_ids
    with pytest.raises(DFlashError, match="tools are offered through the chat template"):
        sess.generate("Weather?", tools=TOOLS)


def test_the_openai_client_gets_tool_calls_whole_and_streamed(smollm2_artifact):
    """Through `runtime serve`: a required call arrives as `message.tool_calls` with finish_reason
    "tool_calls"; streamed, its deltas (id and name first, then argument fragments) reassemble to the same
    call; a malformed tool, an unknown named function and a schema that does not compile are 400s naming
    the field, and the server keeps answering."""
    openai = pytest.importorskip("openai")
    from serve_fixtures import make_client

    import runtime
    from runtime.serve.app import create_app
    from runtime.serve.run import ServerThread

    with runtime.load(smollm2_artifact) as sess, ServerThread(create_app(sess)) as srv:
        c = make_client(srv)
        kw = dict(model=c.models.list().data[0].id, messages=ASK, temperature=0, max_tokens=48, tools=TOOLS,
                  parallel_tool_calls=False)
        whole = c.chat.completions.create(tool_choice="required", **kw)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        _valid([t.model_dump() for t in choice.message.tool_calls])
        streamed, finish, first_fragments = {}, None, []
        for chunk in c.chat.completions.create(tool_choice="required", stream=True, **kw):
            ch = chunk.choices[0]
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                if d.id is not None:
                    streamed[d.index] = [d.function.name, d.function.arguments or ""]
                else:
                    streamed[d.index][1] += d.function.arguments
                    first_fragments.append(d.index)
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls and finish == "tool_calls"
        assert len(first_fragments) > 1  # the arguments came in pieces
        bad = [({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
               ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
               ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                   "type": "object", "properties": {"x": {"$ref": "#/missing"}}}}}]}, "tools")]
        for extra, param in bad:
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(**{**kw, **extra})
            assert err.value.body["param"] == param, err.value.body
        assert c.chat.completions.create(**kw).choices[0].finish_reason  # still serving
