"""The OpenAI-compatible server (`python -m runtime serve`) and the terminal chat (`python -m runtime chat`).

The server runs in this process (uvicorn in a thread, on a free 127.0.0.1 port) over the tiny qwen
artifact with a chat template, and is driven with the official `openai` client; raw HTTP (the standard
library's http.client) checks what that client cannot send (malformed JSON, missing auth, oversize
bodies, a client that disconnects). Replies are compared with a separate in-process Session: greedy
output does not depend on KV reuse, and `verify_len: "all"` keeps the verify lengths fixed, so the
texts must be equal.
"""

from __future__ import annotations

import gc
import http.client
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import runtime  # noqa: E402
import runtime_fixtures as rf  # noqa: E402
from runtime.chat_cli import run_chat  # noqa: E402
from runtime.server import ServerThread, create_app  # noqa: E402
from runtime.serve_worker import Job  # noqa: E402

# turns as "t3 <role word> content t4", then "t5" (the word-level test tokenizer's words)
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.role == 'system' %}t6{% elif m.role == 'user' %}t7{% else %}t8{% endif %} "
    "{{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)
FIXED = {"verify_len": "all"}  # the server's extension; the reference sessions use the same
MSGS = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12 t13"}]
MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def chat_art(tmp_path_factory) -> Path:
    """The tiny qwen artifact (max_seq_len 64) with a chat template in its manifest."""
    qwen = rf.artifact("qwen3", tmp_path_factory)
    art = tmp_path_factory.mktemp("serve") / "art"
    shutil.copytree(qwen.artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["chat_template"] = CHAT_TEMPLATE
    (art / "manifest.json").write_text(json.dumps(m))
    return art


@pytest.fixture(scope="module")
def ref(chat_art):
    """A session of its own for expected replies."""
    with runtime.load(chat_art) as s:
        yield s


@pytest.fixture(scope="module")
def served(chat_art):
    """(server, the Session it serves, its OpenAIApi) without an API key."""
    with runtime.load(chat_art) as sess:
        app = create_app(sess, model_name=MODEL)
        with ServerThread(app) as srv:
            yield srv, sess, app.state.api


@pytest.fixture(scope="module")
def client(served):
    return make_client(served[0])


def make_client(srv, key: str = "none") -> "openai.OpenAI":
    # no retries: a 429 or 500 must reach the test, not be retried behind its back
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def post(srv, path: str, body, headers: dict | None = None, raw: bytes | None = None):
    """(status, headers, decoded JSON body) of a raw POST."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else json.dumps(body).encode()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(text) if text else None


def get(srv, path: str, headers: dict | None = None):
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def chat_text(client, stream: bool, **kw):
    """(text, finish_reason, usage) of one chat completion, streamed or not."""
    kw = {"model": MODEL, "messages": MSGS, "temperature": 0, "extra_body": FIXED, **kw}
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    parts, finish, usage = [], None, None
    for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    return "".join(parts), finish, usage


def completion_text(client, stream: bool, prompt, **kw):
    kw = {"model": MODEL, "prompt": prompt, "temperature": 0, "extra_body": FIXED, **kw}
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    parts, finish, usage = [], None, None
    for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            parts.append(ch.text)
            finish = ch.finish_reason or finish
    return "".join(parts), finish, usage


def expect_usage(usage, res) -> None:
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        res.prompt_tokens, len(res.output_ids), res.prompt_tokens + len(res.output_ids))
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


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
def _chat(**kw):
    return {"model": MODEL, "messages": MSGS, **kw}


def _comp(**kw):
    return {"model": MODEL, "prompt": "t5 t6", **kw}


BAD_REQUESTS = [  # (path, body, param, a phrase of the message)
    ("chat", _chat(temperature="hot"), "temperature", "finite number"),
    ("chat", _chat(temperature=-1), "temperature", ">= 0"),
    ("chat", _chat(max_tokens=0), "max_tokens", "at least 1"),
    ("chat", _chat(max_tokens=True), "max_tokens", "integer"),
    ("chat", _chat(top_p=2), "top_p", "(0, 1]"),
    ("chat", _chat(top_k=-3), "top_k", ">= 0"),
    ("chat", _chat(seed="x"), "seed", "integer"),
    ("chat", _chat(stop=5), "stop", "string"),
    ("chat", _chat(stop=["ok", 3]), "stop", "string"),
    ("chat", _chat(verify_len="some"), "verify_len", "auto"),
    ("chat", _chat(stream="yes"), "stream", "true or false"),
    ("chat", _chat(stream_options={"include_usage": True}), "stream_options", "only allowed"),
    ("chat", _chat(enable_thinking="no"), "enable_thinking", "true or false"),
    ("chat", _chat(max_tokens=5, max_completion_tokens=6), "max_tokens", "differ"),
    ("chat", {"model": MODEL}, "messages", "required"),
    ("chat", _chat(messages=[{"role": "robot", "content": "t9"}]), "messages", "role must be one of"),
    ("chat", _chat(messages="t9"), "messages", "non-empty list"),
    ("chat", _chat(wibble=1), "wibble", "unrecognized"),
    ("chat", _chat(model=3), "model", "string"),
    ("comp", _comp(prompt=["t5", "t6"]), "prompt", "2 prompts"),
    ("comp", _comp(prompt=[[5, 6], [7]]), "prompt", "2 prompts"),
    ("comp", _comp(prompt=[]), "prompt", "empty"),
    ("comp", _comp(prompt=5), "prompt", "string or a list of token ids"),
    ("comp", _comp(prompt=[5, 9999]), "prompt", "outside the vocabulary"),
    ("comp", _comp(prompt="   "), "prompt", "empty"),
    ("comp", _comp(enable_thinking=True), "enable_thinking", "unrecognized"),
    ("comp", {"model": MODEL}, "prompt", "required"),
    ("comp", _comp(top_k=97, temperature=1), "top_k", "vocabulary size 96"),
    ("comp", _comp(verify_len=8), "verify_len", "between 1 and block_size - 1 = 7"),
    # beyond the KV buffers (max_seq_len 64): the limit is named
    ("comp", _comp(prompt="t5 " * 70), "prompt", "max_seq_len"),
    ("comp", _comp(max_tokens=100), "max_tokens", "max_seq_len 64"),
    ("chat", _chat(max_tokens=60), "max_tokens", "max_seq_len 64"),
]
UNSUPPORTED = [  # (path, body, param): refused with 400, never ignored
    ("chat", _chat(n=2), "n"), ("chat", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    ("chat", _chat(tool_choice="auto"), "tool_choice"), ("chat", _chat(functions=[{"name": "f"}]), "functions"),
    ("chat", _chat(function_call="auto"), "function_call"), ("chat", _chat(logprobs=True), "logprobs"),
    ("chat", _chat(top_logprobs=2), "top_logprobs"), ("chat", _chat(response_format={"type": "json_object"}), "response_format"),
    ("chat", _chat(frequency_penalty=0.5), "frequency_penalty"), ("chat", _chat(presence_penalty=-1), "presence_penalty"),
    ("chat", _chat(logit_bias={"5": 10}), "logit_bias"), ("comp", _comp(best_of=2), "best_of"),
    ("comp", _comp(echo=True), "echo"), ("comp", _comp(suffix="t9"), "suffix"), ("comp", _comp(logprobs=1), "logprobs"),
    ("comp", _comp(n=3), "n"),
]
PATHS = {"chat": "/v1/chat/completions", "comp": "/v1/completions"}


def expect_error(status: int, body: dict, code: int, param=None, phrase: str | None = None) -> dict:
    assert status == code, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["param"] == param
    if phrase is not None:
        assert phrase in err["message"], err["message"]
    return err


@pytest.mark.parametrize("path,body,param,phrase", BAD_REQUESTS, ids=[f"{p}-{q}-{i}" for i, (p, _, q, _) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_400(served, path, body, param, phrase):
    status, _, out = post(served[0], PATHS[path], body)
    err = expect_error(status, out, 400, param, phrase)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=[f"{p}-{q}" for p, _, q in UNSUPPORTED])
def test_unsupported_parameters_get_400(served, path, body, param):
    status, _, out = post(served[0], PATHS[path], body)
    err = expect_error(status, out, 400, param, "not supported")
    assert err["code"] == "unsupported_parameter"


def test_no_op_values_of_unsupported_parameters_are_accepted(served):
    body = _chat(max_tokens=2, n=1, logprobs=False, frequency_penalty=0, presence_penalty=0.0, logit_bias={},
                 response_format={"type": "text"}, tools=[], tool_choice="none", user="u1", top_k=-1,
                 chat_template_kwargs={"enable_thinking": False}, seed=None, metadata={"a": "b"})
    status, _, out = post(served[0], PATHS["chat"], body)
    assert status == 200, out
    status, _, out = post(served[0], PATHS["comp"], _comp(max_tokens=2, best_of=1, echo=False, suffix=None, logprobs=None))
    assert status == 200, out


def test_malformed_unknown_and_oversize_requests(served, client):
    srv = served[0]
    surrogate = json.dumps(_chat(messages=[{"role": "user", "content": "t5 \ud800"}])).encode()  # escaped: valid JSON
    for raw in (b"{bad", b"", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, surrogate):
        status, _, out = post(srv, PATHS["chat"], None, raw=raw)
        assert expect_error(status, out, 400)["code"] == "invalid_json"
    status, _, out = post(srv, PATHS["chat"], [1, 2])
    expect_error(status, out, 400, None, "JSON object")
    status, _, out = post(srv, PATHS["chat"], _chat(model="gpt-4"))
    assert expect_error(status, out, 404, "model")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=MSGS)
    assert exc.value.code == "model_not_found"
    status, _, out = post(srv, PATHS["chat"], _chat(messages=[{"role": "user", "content": "t5 " * 400000}]))
    assert expect_error(status, out, 413)["code"] == "request_too_large"
    status, _, out = post(srv, "/v1/embeddings", {})
    expect_error(status, out, 404, None, "Not Found")
    status, body = get(srv, PATHS["chat"])
    expect_error(status, body, 405)
    with pytest.raises(openai.BadRequestError) as exc:  # through the client: the body reaches it
        client.chat.completions.create(model=MODEL, messages=MSGS, n=2)
    assert exc.value.param == "n"


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
            status, hdrs, out = post(srv, PATHS["chat"], _chat(max_tokens=2), headers=headers)
            assert expect_error(status, out, 401)["code"] == "invalid_api_key"
            assert get(srv, "/v1/models", headers)[0] == 401
        with pytest.raises(openai.AuthenticationError):
            make_client(srv, "wrong").chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
        good = make_client(srv, "s3cret")
        assert good.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).usage.completion_tokens >= 1
        assert [m.id for m in good.models.list().data] == [MODEL]
        assert get(srv, "/health")[0] == 200  # a liveness probe needs no key


def test_unexpected_error_is_500_and_the_server_keeps_serving(served, client, monkeypatch):
    srv, sess, api = served

    def broken(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(sess, "stream", broken)
    status, _, out = post(srv, PATHS["chat"], _chat(max_tokens=3))
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

    monkeypatch.setattr(sess, "stream", lambda *a, **kw: _ActAfter(real(*a, **kw), 2, fail))
    got = []
    with pytest.raises(openai.APIError, match="device lost"):
        for c in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                                stream=True, extra_body=FIXED):
            got.append(c)
    assert len(got) >= 2  # the headers and first chunks were out: the error came as an event
    monkeypatch.undo()
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3).usage.completion_tokens >= 1


# ---- the queue, disconnects, load ---------------------------------------------------------------
class Probe:
    """Wraps `Session.stream` to count the chunks generated and, after `hold_after` chunks of a
    generation, wait for `gate()` before the next (so a test decides how far a generation gets)."""

    def __init__(self, sess, hold_after: int, gate):
        self.real, self.hold_after, self.gate = sess.stream, hold_after, gate
        self.streams: list[ProbedStream] = []

    def __call__(self, *args, **kw):
        st = ProbedStream(self.real(*args, **kw), self)
        self.streams.append(st)
        return st


class ProbedStream:
    def __init__(self, stream, probe: Probe):
        self.stream, self.probe, self.chunks, self.closed = stream, probe, 0, False

    def __iter__(self):
        return self

    def __next__(self):
        if self.chunks == self.probe.hold_after:
            self.probe.gate()  # (on a timeout it goes on: the test then sees a generation that ran on)
        chunk = next(self.stream)
        self.chunks += 1
        return chunk

    @property
    def result(self):
        return self.stream.result

    def close(self):
        self.closed = True
        self.stream.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for(worker, predicate, timeout: float = 30.0) -> None:
    with worker.cond:
        assert worker.cond.wait_for(predicate, timeout), "the worker never reached the expected state"


def test_client_disconnect_stops_the_generation(served, client, monkeypatch):
    srv, sess, api = served
    worker = api.worker
    # the 4th step waits until the job is cancelled (or 10 s): without a detected disconnect the
    # generation would run on to 50 tokens
    probe = Probe(sess, 3, lambda: worker.current.cancelled.wait(10))
    monkeypatch.setattr(sess, "stream", probe)
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", PATHS["comp"], body=json.dumps(_comp(stream=True, temperature=0, max_tokens=50, stop=None,
                                                              **FIXED)), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 2:  # read two chunks, then hang up
        line = resp.fp.readline()
        events += line.startswith(b"data: ")
    conn.sock.shutdown(socket.SHUT_RDWR)
    resp.close()
    conn.close()
    wait_for(worker, lambda: worker.current is None and worker.served > 0)
    (st,) = probe.streams
    # stopped at the step after the hang-up (the 3rd or 4th: the client saw two), not after 50 tokens
    assert st.closed and st.result is None and 2 <= st.chunks <= 4, (st.closed, st.result, st.chunks)
    monkeypatch.undo()
    start = time.perf_counter()
    assert client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=3).usage.completion_tokens >= 1
    assert time.perf_counter() - start < 10  # the session was free


def test_full_queue_answers_429_and_a_client_leaving_frees_its_place(chat_art, ref):
    release = threading.Event()
    with runtime.load(chat_art) as sess:
        probe = Probe(sess, 1, lambda: release.wait(30))
        sess.stream = probe
        app = create_app(sess, model_name=MODEL, queue_size=1)
        worker = app.state.api.worker
        with ServerThread(app) as srv, ThreadPoolExecutor(2) as pool:
            c = make_client(srv)
            ask = lambda: chat_text(c, False, max_tokens=6)  # noqa: E731
            running = pool.submit(ask)  # held after its first step
            wait_for(worker, lambda: worker.current is not None)
            host, port = srv.url.removeprefix("http://").split(":")
            leaver = http.client.HTTPConnection(host, int(port), timeout=60)  # waits, then hangs up
            leaver.request("POST", PATHS["chat"], body=json.dumps(_chat(max_tokens=6)))
            wait_for(worker, lambda: len(worker.pending) == 1)
            status, headers, out = post(srv, PATHS["chat"], _chat(max_tokens=2))
            err = expect_error(status, out, 429)
            assert err["code"] == "queue_full" and int(headers["retry-after"]) >= 1
            with pytest.raises(openai.RateLimitError):
                c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
            leaver.sock.shutdown(socket.SHUT_RDWR)
            leaver.close()
            wait_for(worker, lambda: len(worker.pending) == 0)  # its place is free at once
            waiting = pool.submit(ask)
            wait_for(worker, lambda: len(worker.pending) == 1)
            release.set()
            want = ref.chat(MSGS, max_new_tokens=6, **FIXED).text
            assert running.result(60)[0] == waiting.result(60)[0] == want
            assert chat_text(c, True, max_tokens=6)[0] == want
            assert len(probe.streams) == 3  # the request that left never generated


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the RSS from /proc")
def test_load_8_clients(served, ref):
    """8 concurrent clients x 25 requests: none fails, every greedy reply equals the single-request one,
    no job is left behind and the RSS stays put (after a warm-up round)."""
    srv, sess, api = served
    prompts = [("chat", [{"role": "user", "content": f"t{10 + i} t{20 + i} t{30 + i}"}]) for i in range(3)]
    prompts += [("comp", f"t{40 + i} t{50 + i}") for i in range(3)]
    want = [(ref.chat(p, max_new_tokens=8, **FIXED) if k == "chat" else ref.generate(p, max_new_tokens=8, **FIXED)).text
            for k, p in prompts]

    def client_run(seed: int, n: int) -> list[str]:
        c = make_client(srv)
        bad = []
        for r in range(n):
            i = (seed + r) % len(prompts)
            kind, p = prompts[i]
            stream = (seed + r) % 2 == 0
            if kind == "chat":
                text = chat_text(c, stream, messages=p, max_tokens=8)[0]
            else:
                text = completion_text(c, stream, p, max_tokens=8)[0]
            if text != want[i]:
                bad.append(f"{kind} {p!r}: {text!r} != {want[i]!r}")
        c.close()
        return bad

    def round_(n: int) -> list[str]:
        with ThreadPoolExecutor(8) as pool:
            return [b for f in [pool.submit(client_run, s, n) for s in range(8)] for b in f.result(120)]

    assert round_(3) == []  # warm-up: allocator pools, client connections, code paths
    gc.collect()
    before, start = _rss_bytes(), time.perf_counter()
    assert round_(25) == []
    elapsed = time.perf_counter() - start
    gc.collect()
    after = _rss_bytes()
    assert elapsed < 120, f"200 requests took {elapsed:.1f} s"
    assert after - before < 24 << 20, f"RSS grew by {(after - before) / 2**20:.1f} MiB"
    assert api.worker.status()["waiting"] == 0 and api.worker.current is None
    left = [o for o in gc.get_objects() if type(o) is Job]  # (type(): no lazy module's __class__ lookup)
    assert not left, f"{len(left)} jobs were not freed"


# ---- the command line --------------------------------------------------------------------------------
def run_cli(*args, stdin: str = "", timeout: float = 120, env: dict | None = None):
    return subprocess.run([sys.executable, "-m", "runtime", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_cli_usage_and_bad_directories(tmp_path):
    for args in ([], ["frobnicate"]):
        r = run_cli(*args)
        assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr
    for cmd in ("serve", "chat"):
        r = run_cli(cmd, str(tmp_path / "missing"), *(["--port", "0"] if cmd == "serve" else []))
        assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    r = run_cli("serve", str(tmp_path), "--port", "70000")
    assert r.returncode == 2 and r.stderr.startswith("error: --port")


def test_serve_without_the_extra_names_the_pip_command(tmp_path):
    blocker = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('starlette', 'uvicorn'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runtime.__main__ as m\n"
        "sys.exit(m.main(sys.argv[1:]))\n"
    )
    r = subprocess.run([sys.executable, "-c", blocker, "serve", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "pip install 'dflash_export[serve]'" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_serve_command_end_to_end(chat_art, ref):
    """`python -m runtime serve DIR --port 0`: prints its address, answers, exits 0 on Ctrl-C."""
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "serve", str(chat_art), "--port", "0", "--model-name",
                             MODEL, "--queue-size", "4"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, cwd=ROOT)
    try:
        lines = [proc.stderr.readline() for _ in range(1)]
        while not lines[-1].startswith("serving") and lines[-1] and len(lines) < 50:  # past any library warning
            lines.append(proc.stderr.readline())
        line = lines[-1]
        assert line.startswith("serving 'tiny' on http://127.0.0.1:"), lines
        url = line.split(" on ")[1].split(" ")[0]
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, extra_body=FIXED)
        assert r.choices[0].message.content == ref.chat(MSGS, max_new_tokens=8, **FIXED).text
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # uvicorn shuts down, then re-raises the signal: Ctrl-C's status
        rest = proc.stderr.read()
        assert "Application shutdown complete" in rest and "Traceback" not in rest
    finally:
        proc.kill()
        proc.wait()


def test_chat_command_multi_turn(chat_art, ref):
    r = run_cli("chat", str(chat_art), "--max-tokens", "6", "--verify-len", "all", stdin="t11 t12\nt13\n\n/reset\nt11 t12\n/bogus\n/exit\nt40\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    turn1 = [{"role": "user", "content": "t11 t12"}]
    a = ref.chat(turn1, max_new_tokens=6, **FIXED).text
    turn2 = turn1 + [{"role": "assistant", "content": a}, {"role": "user", "content": "t13"}]
    b = ref.chat(turn2, max_new_tokens=6, **FIXED).text
    assert replies == [a, b, a]  # after /reset the conversation starts again; nothing after /exit
    assert "(conversation cleared)" in r.stderr and "unknown command /bogus" in r.stderr


def test_chat_ctrl_c_stops_the_reply_and_the_chat_goes_on(chat_art, ref):
    """SIGINT during a reply stops it at the next step; the shown part stays in the conversation."""
    with runtime.load(chat_art) as sess:
        real = sess.stream
        interrupted = []

        def stream(*a, **kw):
            st = real(*a, **kw)
            if not interrupted:
                interrupted.append(True)
                return _ActAfter(st, 2, lambda: os.kill(os.getpid(), signal.SIGINT))  # as Ctrl-C does
            return st

        sess.stream = stream
        out, notes = io.StringIO(), io.StringIO()
        assert run_chat(sess, io.StringIO("t11 t12\nt13\n"), out, notes, max_tokens=30, stop_token_ids=[]) == 0
    first, second = out.getvalue().splitlines()
    full = ref.chat([{"role": "user", "content": "t11 t12"}], max_new_tokens=30, stop_token_ids=[]).text
    assert "(stopped)" in notes.getvalue() and first and full.startswith(first) and len(first) < len(full)
    msgs = [{"role": "user", "content": "t11 t12"}, {"role": "assistant", "content": first}, {"role": "user", "content": "t13"}]
    assert second == ref.chat(msgs, max_new_tokens=30, stop_token_ids=[]).text


class _ActAfter:
    """A stream that calls `action` (send SIGINT, raise) after `n` chunks."""

    def __init__(self, stream, n: int, action):
        self.stream, self.n, self.action = stream, n, action

    @property
    def result(self):
        return self.stream.result

    def __iter__(self):
        for i, chunk in enumerate(self.stream):
            if i == self.n:
                self.action()
            yield chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()


def test_chat_drops_the_oldest_turns_to_fit(chat_art):
    with runtime.load(chat_art) as sess:
        out, notes = io.StringIO(), io.StringIO()
        lines = "".join(f"t{10 + i} t{20 + i} t{30 + i} t{40 + i}\n" for i in range(8)) + ("t5 " * 80) + "\nt9\n"
        assert run_chat(sess, io.StringIO(lines), out, notes, max_tokens=8) == 0
        assert len(out.getvalue().splitlines()) == 9  # every turn but the one too long alone
        assert "dropped the oldest turn" in notes.getvalue() and "max_seq_len 64" in notes.getvalue()


# ---- the real model ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_server_streams_what_it_answers(tmp_path_factory):
    """A byte-level BPE model with non-ASCII text: streamed deltas (never half a character) join to
    the non-streamed reply, and usage matches the Session's count."""
    from dflash_export.build import build

    art = tmp_path_factory.mktemp("smollm2_serve") / "art"
    build(None, None, art, max_seq_len=256, quiet=True)
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
