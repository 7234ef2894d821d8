"""Shared by the server's tests (test_server, test_server_load, test_serve_cli): the tiny chat artifact,
its fixtures, and raw-HTTP and openai-client helpers.

The server runs in the test process (uvicorn in a thread, on a free 127.0.0.1 port) over the tiny qwen
artifact with a chat template. Replies are compared with a separate in-process Session: greedy output
does not depend on KV reuse, and `verify_len: "all"` keeps the verify lengths fixed, so texts are equal.
"""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path

import openai
import pytest

import runtime
import runtime_fixtures as rf
from runtime.serve.run import ServerThread
from runtime.serve.app import create_app

# turns as "t3 <role word> content t4", then "t5" (the word-level test tokenizer's words)
CHAT_TEMPLATE = (
    "{% for m in messages %}t3 {% if m.role == 'system' %}t6{% elif m.role == 'user' %}t7{% else %}t8{% endif %} "
    "{{ m.content }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
)
FIXED = {"verify_len": "all"}  # the server's extension; the reference sessions use the same
MSGS = [{"role": "system", "content": "t9 t10"}, {"role": "user", "content": "t11 t12 t13"}]
MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[1]
PATHS = {"chat": "/v1/chat/completions", "comp": "/v1/completions"}
_ART: list[Path] = []


def chat_artifact(tmp_path_factory) -> Path:
    """The tiny qwen artifact (max_seq_len 64) with a chat template in its manifest (made once)."""
    if not _ART:
        qwen = rf.artifact("qwen3", tmp_path_factory)
        art = tmp_path_factory.mktemp("serve") / "art"
        shutil.copytree(qwen.artifact, art)
        m = json.loads((art / "manifest.json").read_text())
        m["chat_template"] = CHAT_TEMPLATE
        (art / "manifest.json").write_text(json.dumps(m))
        _ART.append(art)
    return _ART[0]


# fixtures: a test module imports the ones it uses (each module gets its own instances)
@pytest.fixture(scope="module")
def chat_art(tmp_path_factory) -> Path:
    return chat_artifact(tmp_path_factory)


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
    """(status, decoded JSON body) of a raw GET."""
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
    """(text, finish_reason, usage) of one completion, streamed or not."""
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
    """The usage counts of a reply equal the Session's result."""
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        res.prompt_tokens, len(res.output_ids), res.prompt_tokens + len(res.output_ids))
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def chat_body(**kw) -> dict:
    """A chat request body (MSGS) with `kw` on top."""
    return {"model": MODEL, "messages": MSGS, **kw}


def comp_body(**kw) -> dict:
    """A completions request body with `kw` on top."""
    return {"model": MODEL, "prompt": "t5 t6", **kw}


def expect_error(status: int, body: dict, code: int, param=None, phrase: str | None = None) -> dict:
    """An OpenAI error body with this status (and param, and a phrase of its message); returns it."""
    assert status == code, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    assert err["param"] == param
    if phrase is not None:
        assert phrase in err["message"], err["message"]
    return err


class ActAfter:
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
