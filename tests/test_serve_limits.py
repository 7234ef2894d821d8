"""The server's limits on clients: the read deadline on a request's headers and body (clients that send
half a request and stall), the connection limit's 503 body, and request checks that need the model
(`n`, `stop_token_ids`). Raw sockets send what no HTTP client sends: half a request. See serve_fixtures
for the setup.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.register_assert_rewrite("serve_fixtures")  # its helpers assert

import runtime  # noqa: E402
from runtime.serve.app import create_app  # noqa: E402
from runtime.serve.run import DEFAULT_MAX_CONNECTIONS, ServerThread  # noqa: E402
from serve_fixtures import FIXED, MODEL, PATHS, chat_body, comp_body, completion_text, make_client, post  # noqa: E402

pytest_plugins = ["serve_fixtures"]  # its fixtures: chat_art, ref, served, client

DEADLINE = 2.0  # the read deadline of these tests' servers (seconds)
SLACK = 3.0  # how late a deadline may fire on a loaded test machine


def address(srv) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").split(":")
    return host, int(port)


def read_reply(sock: socket.socket, timeout: float = 15.0) -> bytes:
    """Everything the server sends until it closes the connection (b"" if it closed without a word)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def split_reply(raw: bytes) -> tuple[int, dict, dict]:
    """(status, lower-cased headers, decoded JSON body) of one raw HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def health(srv) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of GET /health on a new connection (what a liveness probe does)."""
    s = socket.create_connection(address(srv), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = split_reply(read_reply(s))
    s.close()
    return out


def error(message: str, code: str, type: str = "invalid_request_error", param=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


HEADER_TIMEOUT = error(f"the request's headers did not arrive within {DEADLINE:g} s", "request_timeout")
BODY_TIMEOUT = error(f"the request body did not arrive within {DEADLINE:g} s of its headers", "request_timeout")


def too_many(limit: int) -> dict:
    return error(f"the server has {limit} connections open, its limit (--max-connections); retry later",
                 "too_many_connections", "server_error")


@pytest.fixture(scope="module")
def deadline_server(chat_art):
    """A server with the default connection limit and a DEADLINE-second read deadline, whose graph calls
    take 50 ms each (so a reply takes longer than the deadline)."""
    with runtime.load(chat_art) as sess:
        real_run = sess.backend.run

        def slow_run(*a, **kw):
            time.sleep(0.05)
            return real_run(*a, **kw)

        sess.backend.run = slow_run
        with ServerThread(create_app(sess, model_name=MODEL, read_timeout=DEADLINE)) as srv:
            yield srv


# ---- (a) clients that send half a request and stall ----------------------------------------------
def test_64_stalled_clients_are_cut_off_at_the_read_deadline(deadline_server):
    """64 clients (the default limit) send half a request's headers and stall: while they hold every
    place, the next connection gets the JSON 503 at once; each stalled one gets a 408 with an OpenAI
    error body DEADLINE seconds after it connected (not when it gives up), and /health answers again."""
    srv = deadline_server
    stalled = []
    for _ in range(DEFAULT_MAX_CONNECTIONS):
        s = socket.create_connection(address(srv), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")  # headers never finished
        stalled.append((time.perf_counter(), s))
    status, headers, body = health(srv)
    assert (status, body) == (503, too_many(DEFAULT_MAX_CONNECTIONS))
    assert headers["content-type"] == "application/json" and headers["retry-after"] == "1"
    assert time.perf_counter() - stalled[0][0] < DEADLINE  # (else the 503 above proves nothing)
    for connected, s in stalled:
        status, headers, body = split_reply(read_reply(s))  # ends when the server closes the connection
        waited = time.perf_counter() - connected
        assert (status, body) == (408, HEADER_TIMEOUT)
        assert headers["connection"] == "close"
        assert DEADLINE - 0.05 <= waited < DEADLINE + SLACK, waited
        s.close()
    status, _, body = health(srv)
    assert status == 200 and body["status"] == "ok"


def test_trickling_headers_do_not_extend_the_deadline(deadline_server):
    """A byte every 0.25 s (uvicorn's keep-alive timer restarts on each byte): cut off at the deadline."""
    s = socket.create_connection(address(deadline_server), timeout=10)
    start = time.perf_counter()
    s.sendall(b"GET /health HTTP/1.1\r\n")
    s.settimeout(0.25)
    got = b""
    for byte in b"X-Slow: " + b"a" * 100:  # 25 s of bytes if it never ends
        try:
            s.sendall(bytes([byte]))
            got = s.recv(65536)
        except TimeoutError:  # (socket.timeout)
            continue
        except OSError:  # (the server closed while we were sending)
            break
        if got:
            break
    got += read_reply(s)
    waited = time.perf_counter() - start
    status, _, body = split_reply(got)
    assert (status, body) == (408, HEADER_TIMEOUT)
    assert DEADLINE - 0.05 <= waited < DEADLINE + SLACK, waited
    s.close()


def test_a_stalled_body_gets_408_and_the_connection_closes(deadline_server):
    """Headers complete, 10 of 100 body bytes, then nothing: 408 DEADLINE seconds later, connection closed."""
    s = socket.create_connection(address(deadline_server), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\":")
    start = time.perf_counter()
    status, headers, body = split_reply(read_reply(s))
    waited = time.perf_counter() - start
    assert (status, body) == (408, BODY_TIMEOUT)
    assert headers["connection"] == "close"
    assert DEADLINE - 0.05 <= waited < DEADLINE + SLACK, waited
    s.close()


def test_the_deadline_is_per_request_on_a_kept_alive_connection(deadline_server):
    """A request, its reply, then half of the next request: 408 DEADLINE seconds after the first reply;
    a connection that sends nothing is closed silently (it is not a failed request)."""
    s = socket.create_connection(address(deadline_server), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    s.settimeout(10)
    first = s.recv(65536)
    start = time.perf_counter()
    assert first.startswith(b"HTTP/1.1 200 ")
    s.sendall(b"GET /health HTTP/1.1\r\nHo")
    status, _, body = split_reply(read_reply(s))
    assert (status, body) == (408, HEADER_TIMEOUT)
    assert DEADLINE - 0.05 <= time.perf_counter() - start < DEADLINE + SLACK
    s.close()
    idle = socket.create_connection(address(deadline_server), timeout=10)
    start = time.perf_counter()
    assert read_reply(idle) == b""
    assert DEADLINE - 0.05 <= time.perf_counter() - start < DEADLINE + SLACK
    idle.close()


def test_replies_longer_than_the_deadline_are_not_cut(deadline_server, ref):
    """The deadline covers receiving a request only: a reply that takes longer (50 ms per graph call)
    streams to its end, and the next request on the same connection is answered."""
    c = make_client(deadline_server)
    want = ref.generate("t5 t6", max_new_tokens=40, **FIXED)
    start = time.perf_counter()
    text, finish, usage = completion_text(c, True, "t5 t6", max_tokens=40)
    assert time.perf_counter() - start > DEADLINE + 0.5
    assert (text, finish, usage.completion_tokens) == (want.text, "length", 40)
    assert completion_text(c, False, "t5 t6", max_tokens=2)[2].completion_tokens == 2
    c.close()


# ---- (d) request checks -------------------------------------------------------------------------
@pytest.mark.parametrize("path,name,value", [("chat", "n", 0), ("comp", "n", -1), ("chat", "n", 1.5),
                                              ("chat", "n", "1"), ("comp", "best_of", 0)])
def test_a_count_below_one_is_refused_as_such(served, path, name, value):
    """`n: 0` is not "n > 1": the 400 says what to send."""
    body = (chat_body if path == "chat" else comp_body)(**{name: value})
    status, _, out = post(served[0], PATHS[path], body)
    assert (status, out) == (400, error(f"{name} must be a positive integer (got {value!r}); this server generates "
                                        f"one choice per request: pass {name} 1 or leave it out", None, param=name))


def test_n_above_one_is_still_unsupported(served):
    status, _, out = post(served[0], PATHS["chat"], chat_body(n=2))
    assert (status, out) == (400, error("n > 1 is not supported: the server generates one choice per request",
                                        "unsupported_parameter", param="n"))


@pytest.mark.parametrize("ids,bad", [([96], 96), ([5, -1], -1), ([10 ** 30], 10 ** 30)])
def test_stop_token_ids_outside_the_vocabulary_are_refused(served, ids, bad):
    status, _, out = post(served[0], PATHS["comp"], comp_body(stop_token_ids=ids, max_tokens=2))
    shown = "1.000e+30" if bad == 10 ** 30 else bad
    assert (status, out) == (400, error(f"stop_token_ids holds {shown}, which is not a token id of this model: ids "
                                        "are 0 to 95 (vocabulary size 96)", None, param="stop_token_ids"))


@pytest.mark.parametrize("ids", [5, [5, "6"], [True], [1.0]])
def test_stop_token_ids_must_be_a_list_of_ids(served, ids):
    status, _, out = post(served[0], PATHS["chat"], chat_body(stop_token_ids=ids))
    assert status == 400 and out["error"]["param"] == "stop_token_ids"
    assert out["error"]["message"].startswith("stop_token_ids must be a list of token ids"), out


def test_stop_token_ids_stop_the_reply_as_well_as_the_models(served, ref):
    """vLLM's `stop_token_ids`: the reply ends at the first of them (committed, as a model stop id is),
    and the model's own stop ids still apply."""
    prompt = "t5 t6 t7"
    full = ref.generate(prompt, max_new_tokens=12, stop_token_ids=[], **FIXED).output_ids
    i = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # a first occurrence, not the first id
    stop = full[i]
    want = ref.generate(prompt, max_new_tokens=12, stop_token_ids=[*ref.stop_token_ids, stop], **FIXED)
    assert want.finish_reason == "stop" and want.output_ids[-1] in (stop, *ref.stop_token_ids)
    status, _, out = post(served[0], PATHS["comp"], comp_body(prompt=prompt, max_tokens=12, stop_token_ids=[stop],
                                                              temperature=0, **FIXED))
    assert status == 200, out
    assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == (want.text, "stop")
    assert out["usage"]["completion_tokens"] == len(want.output_ids) <= i + 1


def test_the_session_refuses_negative_stop_token_ids(ref):
    from runtime.errors import DFlashError

    with pytest.raises(DFlashError, match=r"^stop_token_ids holds -3, which is not a token id \(ids are >= 0\)$"):
        ref.generate("t5", max_new_tokens=2, stop_token_ids=[4, -3])

