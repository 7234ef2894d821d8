"""The OpenAI-compatible server (`python -m runtime serve`): replies, usage, and every error.

Driven with the official `openai` client; raw HTTP (the standard library's http.client) sends what
that client cannot (malformed JSON, missing auth, oversize bodies). See serve_fixtures for the setup.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.register_assert_rewrite("serve_fixtures")  # its helpers assert

import runtime  # noqa: E402
from runtime.serve.run import ServerThread  # noqa: E402
from runtime.serve.app import create_app  # noqa: E402
from serve_fixtures import (FIXED, MODEL, MSGS, PATHS, ActAfter, chat_body, chat_text, comp_body,  # noqa: E402
                            completion_text, expect_error, expect_usage, get, make_client, post)

pytest_plugins = ["serve_fixtures"]  # its fixtures: chat_art, ref, served, client


# ---- replies -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_the_session(client, ref, stream):
    want = ref.chat(MSGS, max_new_tokens=12, **FIXED)
    text, finish, usage = chat_text(client, stream, max_tokens=12)
    assert (text, finish) == (want.text, want.finish_reason)
    assert want.prompt_tokens == len(ref.encode_messages(MSGS))
    expect_usage(usage, want)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", ["t5 t6 t7", [1, 40, 33, 12], ["t8 t9"], [[7, 8, 9]]])
def test_completions_equal_the_session(client, ref, stream, prompt):
    inner = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt
    want = ref.generate(inner, max_new_tokens=10, **FIXED)
    text, finish, usage = completion_text(client, stream, prompt, max_tokens=10)
    assert (text, finish) == (want.text, want.finish_reason)
    assert want.prompt_tokens == len(ref.encode(inner))
    expect_usage(usage, want)


def test_streams_in_chunks_and_max_completion_tokens(served, client, ref):
    want = ref.chat(MSGS, max_new_tokens=16, **FIXED)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, temperature=0, stream=True,
                                                 max_completion_tokens=16, extra_body=FIXED))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks[1:-1]]
    assert len(texts) > 2 and all(texts) and "".join(texts) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason and chunks[-1].usage is None
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, ref, stream):
    full = ref.chat(MSGS, max_new_tokens=20, stop_token_ids=[], **FIXED)
    words = full.text.split(" ")
    assert len(words) > 5
    stop = " " + words[3]
    cut = full.text[: full.text.index(stop)]
    text, finish, usage = chat_text(client, stream, max_tokens=20, stop=[stop, "never"])
    want = ref.chat(MSGS, max_new_tokens=20, stop=[stop, "never"], **FIXED)
    assert (text, finish) == (cut, "stop") == (want.text, want.finish_reason)
    expect_usage(usage, want)
    assert chat_text(client, stream, max_tokens=20, stop=stop)[0] == cut  # a single string


def test_finish_reason_length_and_the_default_length(client, ref):
    prompt = "t5 t6 t7"
    text, finish, usage = completion_text(client, False, prompt, max_tokens=1)
    want = ref.generate(prompt, max_new_tokens=1, **FIXED)
    assert (text, finish, usage.completion_tokens) == (want.text, "length", 1)
    # no max_tokens: what fits in max_seq_len 64
    room = ref.max_seq_len - len(ref.encode(prompt))
    text, finish, usage = completion_text(client, False, prompt)
    want = ref.generate(prompt, max_new_tokens=room, **FIXED)
    assert (text, finish) == (want.text, want.finish_reason)
    assert usage.completion_tokens == len(want.output_ids) <= room
    assert usage.total_tokens <= ref.max_seq_len


def test_sampling_parameters_are_accepted(client):
    """temperature > 0 with top_p / top_k / seed: a seeded sample repeats; default temperature is 1."""
    kw = dict(model=MODEL, messages=MSGS, max_tokens=8, temperature=0.9, top_p=0.9, seed=3,
              extra_body={"top_k": 20, **FIXED})
    a = client.chat.completions.create(**kw).choices[0].message.content
    assert a == client.chat.completions.create(**kw).choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body={"enable_thinking": False})
    assert r.usage.completion_tokens >= 1


def test_kv_reuse_is_reported_and_can_be_turned_off(client):
    """usage.prompt_tokens_details.cached_tokens: the prompt rows reused from the previous request."""
    kw = dict(model=MODEL, messages=MSGS, max_tokens=4, temperature=0, extra_body=FIXED)
    first = client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    off = client.chat.completions.create(**{**kw, "extra_body": {**FIXED, "reuse_prefix": False}})
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert first.choices[0].message.content == again.choices[0].message.content == off.choices[0].message.content


def test_models_and_health(served, client):
    srv, sess, api = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    status, body = get(srv, "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == MODEL
    assert body["queue_size"] == 16 and body["waiting"] == 0


# ---- errors --------------------------------------------------------------------------------------
BAD_REQUESTS = [  # (path, body, param, a phrase of the message)
    ("chat", chat_body(temperature="hot"), "temperature", "finite number"),
    ("chat", chat_body(temperature=-1), "temperature", ">= 0"),
    ("chat", chat_body(max_tokens=0), "max_tokens", "at least 1"),
    ("chat", chat_body(max_tokens=True), "max_tokens", "integer"),
    ("chat", chat_body(top_p=2), "top_p", "(0, 1]"),
    ("chat", chat_body(top_k=-3), "top_k", ">= 0"),
    ("chat", chat_body(seed="x"), "seed", "integer"),
    ("chat", chat_body(stop=5), "stop", "string"),
    ("chat", chat_body(stop=["ok", 3]), "stop", "string"),
    ("chat", chat_body(verify_len="some"), "verify_len", "auto"),
    ("chat", chat_body(stream="yes"), "stream", "true or false"),
    ("chat", chat_body(stream_options={"include_usage": True}), "stream_options", "only allowed"),
    ("chat", chat_body(enable_thinking="no"), "enable_thinking", "true or false"),
    ("chat", chat_body(max_tokens=5, max_completion_tokens=6), "max_tokens", "differ"),
    ("chat", {"model": MODEL}, "messages", "required"),
    ("chat", chat_body(messages=[{"role": "robot", "content": "t9"}]), "messages", "role must be one of"),
    ("chat", chat_body(messages="t9"), "messages", "non-empty list"),
    ("chat", chat_body(messages=[{"role": "user", "content": "t9", "name": 5}]), "messages", "name must be a string"),
    ("chat", chat_body(wibble=1), "wibble", "unrecognized"),
    ("chat", chat_body(model=3), "model", "string"),
    ("comp", comp_body(prompt=["t5", "t6"]), "prompt", "2 prompts"),
    ("comp", comp_body(prompt=[[5, 6], [7]]), "prompt", "2 prompts"),
    ("comp", comp_body(prompt=[]), "prompt", "empty"),
    ("comp", comp_body(prompt=5), "prompt", "string or a list of token ids"),
    ("comp", comp_body(prompt=[5, 9999]), "prompt", "outside the vocabulary"),
    ("comp", comp_body(prompt="   "), "prompt", "empty"),
    ("comp", comp_body(enable_thinking=True), "enable_thinking", "unrecognized"),
    ("comp", {"model": MODEL}, "prompt", "required"),
    ("comp", comp_body(top_k=97, temperature=1), "top_k", "vocabulary size 96"),
    ("comp", comp_body(verify_len=8), "verify_len", "between 1 and block_size - 1 = 7"),
    ("comp", comp_body(block_size=0), "block_size", "between 1 and"),
    ("comp", comp_body(block_size=1, verify_len=3), "block_size", "omit verify_len"),
    ("comp", comp_body(block_size="x"), "block_size", "integer"),
    # beyond the KV buffers (max_seq_len 64): the limit is named
    ("comp", comp_body(prompt="t5 " * 70), "prompt", "max_seq_len"),
    ("comp", comp_body(max_tokens=100), "max_tokens", "max_seq_len 64"),
    ("chat", chat_body(max_tokens=60), "max_tokens", "max_seq_len 64"),
    # output constraints: types and shapes, and a tokenizer llguidance cannot map to bytes (this word-level one)
    ("chat", chat_body(response_format={"type": "xml"}), "response_format", "must be one of text, json_object, json_schema"),
    ("chat", chat_body(response_format="json"), "response_format", "must be an object"),
    ("chat", chat_body(response_format={"type": "json_object"}), "response_format", "cannot drive output constraints"),
    ("comp", comp_body(grammar=5), "grammar", "must be a string"),
    ("comp", comp_body(regex="[0-9]+", grammar="start: \"a\""), "grammar", "at most one of"),
    # log-probabilities: OpenAI's ranges (chat top_logprobs 0..20, completions logprobs 0..5)
    ("chat", chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "from 0 to 20"),
    ("chat", chat_body(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
    ("chat", chat_body(logprobs=1), "logprobs", "true or false"),
    ("comp", comp_body(logprobs=6), "logprobs", "from 0 to 5"),
    # tools: OpenAI's shapes, a named choice among them (runtime.text.tools)
    ("chat", chat_body(tools=[{"type": "function", "function": {"name": "no spaces"}}]), "tools", "tools[0].function.name"),
    ("chat", chat_body(tools={"name": "f"}), "tools", "must be a list"),
    ("chat", chat_body(tool_choice="auto"), "tool_choice", "needs tools"),
    ("chat", chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"), "tool_choice", "must be"),
    ("chat", chat_body(tools=[{"type": "function", "function": {"name": "f"}}], parallel_tool_calls=1), "parallel_tool_calls",
     "true or false"),
    ("chat", chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                       response_format={"type": "json_object"}), "tool_choice", "forces a tool call"),
    ("comp", comp_body(tools=[]), "tools", "unrecognized request argument"),
]
UNSUPPORTED = [  # (path, body, param): refused with 400, never ignored
    ("chat", chat_body(n=2), "n"), ("chat", chat_body(functions=[{"name": "f"}]), "functions"),
    ("chat", chat_body(function_call="auto"), "function_call"),
    ("chat", chat_body(frequency_penalty=0.5), "frequency_penalty"), ("chat", chat_body(presence_penalty=-1), "presence_penalty"),
    ("chat", chat_body(logit_bias={"5": 10}), "logit_bias"), ("comp", comp_body(best_of=2), "best_of"),
    ("comp", comp_body(echo=True), "echo"), ("comp", comp_body(suffix="t9"), "suffix"),
    ("comp", comp_body(n=3), "n"),
]


@pytest.mark.parametrize("path,body,param,phrase", BAD_REQUESTS, ids=[f"{p}-{q}-{i}" for i, (p, _, q, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_400(served, path, body, param, phrase):
    status, _, out = post(served[0], PATHS[path], body)
    err = expect_error(status, out, 400, param, phrase)
    assert err["type"] == "invalid_request_error"


def test_context_length_errors_name_the_limit_not_a_rebuild(served):
    """An API client cannot rebuild the artifact: the 400 says what to send instead."""
    for path, body, param in (("comp", comp_body(prompt=[5] * 10, max_tokens=60), "max_tokens"),
                              ("comp", comp_body(prompt=[5] * 63, max_tokens=2), "max_tokens"),
                              ("comp", comp_body(prompt=[5] * 64), "prompt"), ("chat", chat_body(max_tokens=62), "max_tokens")):
        status, _, out = post(served[0], PATHS[path], body)
        err = expect_error(status, out, 400, param, "max_seq_len")
        assert err["code"] == "context_length_exceeded" and "rebuild" not in err["message"], err


def test_connections_beyond_the_limit_get_503_at_once(chat_art):
    """Clients that never finish their request hold at most --max-connections sockets; the next
    connection is answered 503 at once, and a slot frees when one of them leaves."""
    import socket

    with runtime.load(chat_art) as sess, ServerThread(create_app(sess, model_name=MODEL, queue_size=2),
                                                      max_connections=4) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        stalled = []
        for _ in range(4):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            stalled.append(s)
        time.sleep(0.3)

        def health() -> tuple[int, str | None, dict]:
            conn = http.client.HTTPConnection(host, int(port), timeout=10)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            out = resp.status, resp.getheader("content-type"), json.loads(resp.read())
            conn.close()
            return out
        status, ctype, body = health()  # an OpenAI error body, as every other error (not uvicorn's text/plain)
        assert (status, ctype) == (503, "application/json")
        assert body == {"error": {"message": "the server has 4 connections open, its limit (--max-connections); "
                                             "retry later", "type": "server_error", "param": None,
                                  "code": "too_many_connections"}}
        stalled.pop().close()
        time.sleep(0.3)
        assert health()[0] == 200
        for s in stalled:
            s.close()


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=[f"{p}-{q}" for p, _, q in UNSUPPORTED])
def test_unsupported_parameters_get_400(served, path, body, param):
    status, _, out = post(served[0], PATHS[path], body)
    err = expect_error(status, out, 400, param, "not supported")
    assert err["code"] == "unsupported_parameter"


def test_no_op_values_of_unsupported_parameters_are_accepted(served):
    body = chat_body(max_tokens=2, n=1, logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                 response_format={"type": "text"}, tools=[], tool_choice="none", user="u1", top_k=-1,
                 chat_template_kwargs={"enable_thinking": False}, seed=None, metadata={"a": "b"})
    status, _, out = post(served[0], PATHS["chat"], body)
    assert status == 200, out
    status, _, out = post(served[0], PATHS["comp"], comp_body(max_tokens=2, best_of=1, echo=False, suffix=None, logprobs=None))
    assert status == 200, out


def test_malformed_unknown_and_oversize_requests(served, client):
    srv = served[0]
    surrogate = json.dumps(chat_body(messages=[{"role": "user", "content": "t5 \ud800"}])).encode()  # escaped: valid JSON
    for raw in (b"{bad", b"", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, surrogate):
        status, _, out = post(srv, PATHS["chat"], None, raw=raw)
        assert expect_error(status, out, 400)["code"] == "invalid_json"
    status, _, out = post(srv, PATHS["chat"], [1, 2])
    expect_error(status, out, 400, None, "JSON object")
    status, _, out = post(srv, PATHS["chat"], chat_body(model="gpt-4"))
    assert expect_error(status, out, 404, "model")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=MSGS)
    assert exc.value.code == "model_not_found"
    status, _, out = post(srv, PATHS["chat"], chat_body(messages=[{"role": "user", "content": "t5 " * 400000}]))
    assert expect_error(status, out, 413)["code"] == "request_too_large"
    status, _, out = post(srv, "/v1/embeddings", {})
    expect_error(status, out, 404, None, "Not Found")
    status, body = get(srv, PATHS["chat"])
    expect_error(status, body, 405)
    with pytest.raises(openai.BadRequestError) as exc:  # through the client: the body reaches it
        client.chat.completions.create(model=MODEL, messages=MSGS, n=2)
    assert exc.value.param == "n"


def test_huge_numbers_are_not_echoed_in_full(served):
    """`1e308` is an integer to JSON's reader: the error shows it in scientific notation, and a long
    bad value is cut."""
    for body in (chat_body(max_tokens=1e308), chat_body(max_tokens=10 ** 300), chat_body(top_k=10 ** 300),
                 chat_body(seed=-10 ** 300)):
        status, _, out = post(served[0], PATHS["chat"], body)
        err = expect_error(status, out, 400, next(k for k in ("max_tokens", "top_k", "seed") if k in body))
        assert "e+30" in err["message"] and len(err["message"]) < 300 and "0" * 30 not in err["message"], err["message"]
    status, _, out = post(served[0], PATHS["chat"], chat_body(temperature="x" * 100000))
    err = expect_error(status, out, 400, "temperature")
    assert len(err["message"]) < 300 and "characters)" in err["message"], err["message"]


def test_chunked_oversize_body_gets_413(served):
    host, port = served[0].url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    chunks = (b"x" * 65536 for _ in range(20))  # no Content-Length: counted as it arrives
    conn.request("POST", PATHS["chat"], body=chunks, headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()


def test_api_key(chat_art):
    with runtime.load(chat_art) as sess, ServerThread(create_app(sess, model_name=MODEL, api_key="s3cret")) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
            status, hdrs, out = post(srv, PATHS["chat"], chat_body(max_tokens=2), headers=headers)
            assert expect_error(status, out, 401)["code"] == "invalid_api_key"
            assert get(srv, "/v1/models", headers)[0] == 401
        with pytest.raises(openai.AuthenticationError):
            make_client(srv, "wrong").chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        good = make_client(srv, "s3cret")
        assert good.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).usage.completion_tokens >= 1
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert get(srv, "/health")[0] == 200  # a liveness probe needs no key
        # a body over the size limit without the key: the 401 (its body read first), not a reset
        big = chat_body(messages=[{"role": "user", "content": "t5 " * 700000}])  # ~2 MiB
        for path in PATHS.values():
            status, _, out = post(srv, path, big)
            assert expect_error(status, out, 401)["code"] == "invalid_api_key"


def test_a_refused_body_is_read_before_the_answer(served):
    """A 401 or 413 is sent only after the request body was read (up to the drain limit): answering a
    client still sending and closing would reset its connection before it reads the answer. At the ASGI
    level, so it does not depend on socket buffer sizes."""
    import asyncio

    app = create_app(served[1], model_name=MODEL, api_key="s3cret")  # (its worker is never started)
    for headers, size, status in (([], 20 << 16, 401), ([(b"authorization", b"Bearer s3cret")], 20 << 16, 413)):
        events = []

        async def receive(n=[20]):
            n[0] -= 1
            events.append("chunk")
            return {"type": "http.request", "body": b"x" * 65536, "more_body": n[0] > 0}

        async def send(message):
            events.append(message["type"] + (f" {message['status']}" if "status" in message else ""))

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": PATHS["chat"], "raw_path": PATHS["chat"].encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(size).encode()),
                             *headers], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        asyncio.run(app(scope, receive, send))
        assert events[:21] == ["chunk"] * 20 + [f"http.response.start {status}"], events


def test_unexpected_error_is_500_and_the_server_keeps_serving(served, client, monkeypatch):
    srv, sess, api = served

    def broken(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(sess, "stream", broken)
    status, _, out = post(srv, PATHS["chat"], chat_body(max_tokens=3))
    err = expect_error(status, out, 500)
    assert err["type"] == "server_error" and "boom" in err["message"]
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
    monkeypatch.undo()
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3).usage.completion_tokens >= 1


def test_error_mid_stream_ends_it_with_an_error_event(served, client, monkeypatch):
    srv, sess, api = served
    real = sess.stream

    def fail(*a, **kw):
        raise RuntimeError("device lost")

    monkeypatch.setattr(sess, "stream", lambda *a, **kw: ActAfter(real(*a, **kw), 2, fail))
    got = []
    with pytest.raises(openai.APIError, match="device lost"):
        for c in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                stream=True, extra_body=FIXED):
            got.append(c)
    assert len(got) >= 2  # the headers and first chunks were out: the error came as an event
    monkeypatch.undo()
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3).usage.completion_tokens >= 1


# ---- the real model ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_server_streams_what_it_answers(smollm2_artifact):
    """A byte-level BPE model with non-ASCII text: streamed deltas (never half a character) join to
    the non-streamed reply, and usage matches the Session's count."""
    art = smollm2_artifact
    msgs = [{"role": "user", "content": "Écris une phrase sur le café ☕ et les crêpes."}]
    with runtime.load(art) as sess, ServerThread(create_app(sess)) as srv:
        c = make_client(srv)
        model = c.models.list().data[0].id
        assert model == "SmolLM2-135M-Instruct"
        kw = dict(model=model, messages=msgs, temperature=0, max_tokens=48, extra_body=FIXED)
        full = c.chat.completions.create(**kw)
        deltas = [ch.choices[0].delta.content for ch in c.chat.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(d or "" for d in deltas) == full.choices[0].message.content
        assert not any("\ufffd" in (d or "") for d in deltas)
        assert full.usage.prompt_tokens == len(sess.encode_messages(msgs))


def test_block_size_1_asks_for_plain_decoding_with_the_same_reply(served):
    """`block_size` is a request extension as in the Python API: 1 decodes plainly, and the reply is the
    default (speculative) one."""
    default = post(served[0], PATHS["comp"], comp_body(max_tokens=12, temperature=0))
    plain = post(served[0], PATHS["comp"], comp_body(max_tokens=12, temperature=0, block_size=1))
    assert default[0] == plain[0] == 200
    assert plain[2]["choices"][0]["text"] == default[2]["choices"][0]["text"]


def test_logprobs_come_with_each_token_streamed_or_not(served, client):
    """Chat `logprobs` + `top_logprobs` and completions `logprobs`: one entry per generated token, the
    token's own log-probability the largest of its row's top list under greedy decoding, and the streamed
    entries the same as the whole reply's."""
    body = chat_body(max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    status, _, out = post(served[0], PATHS["chat"], body)
    assert status == 200
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["logprob"] == e["top_logprobs"][0]["logprob"] <= 0
        assert e["bytes"] == list(e["token"].encode())
    chunks = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=2, stream=True, extra_body=FIXED)
    streamed = [e.model_dump() for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e["token"], e["logprob"]) for e in streamed] == [(e["token"], e["logprob"]) for e in content]
    status, _, out = post(served[0], PATHS["comp"], comp_body(max_tokens=6, temperature=0, logprobs=3))
    lp = out["choices"][0]["logprobs"]
    assert status == 200 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == out["usage"]["completion_tokens"]
    assert all(len(t) == 3 and max(t.values()) == v for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
