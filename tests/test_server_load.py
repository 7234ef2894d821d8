"""The server under concurrency: the FIFO queue and its 429, clients that hang up (streamed or
waiting), and a bounded load test (8 clients x 25 requests) with a memory check.

Test doubles wrap `Session.stream` to hold a generation at a chosen step; the tests wait on the
worker's condition variable, never on sleeps. See serve_fixtures for the setup.
"""

from __future__ import annotations

import gc
import logging
import http.client
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.register_assert_rewrite("serve_fixtures")  # its helpers assert

import runtime  # noqa: E402
from runtime.serve.run import ServerThread  # noqa: E402
from runtime.serve.app import create_app  # noqa: E402
from runtime.serve.worker import Job  # noqa: E402
from serve_fixtures import (FIXED, MODEL, MSGS, PATHS, chat_body, chat_text, comp_body, completion_text,  # noqa: E402
                            expect_error, make_client, post)

pytest_plugins = ["serve_fixtures"]  # its fixtures: chat_art, ref, served, client


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
    conn.request("POST", PATHS["comp"], body=json.dumps(comp_body(stream=True, temperature=0, max_tokens=50, stop=None,
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
            leaver.request("POST", PATHS["chat"], body=json.dumps(chat_body(max_tokens=6)))
            wait_for(worker, lambda: len(worker.pending) == 1)
            status, headers, out = post(srv, PATHS["chat"], chat_body(max_tokens=2))
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


def test_stopping_the_worker_answers_what_waits_with_503(chat_art):
    """What the lifespan's shutdown does: a running job stops at its next step, waiting ones leave, and
    every one of them gets a 503 event (not silence)."""
    import asyncio

    from runtime.serve.worker import Worker

    release = threading.Event()
    with runtime.load(chat_art) as sess:
        sess.stream = Probe(sess, 1, lambda: release.wait(30))
        worker = Worker(sess, queue_size=4)
        worker.start()

        async def run() -> list:
            loop = asyncio.get_running_loop()
            jobs = [Job(loop, [5, 6, 7], {"max_new_tokens": 20, "stop_token_ids": []}) for _ in range(3)]
            for job in jobs:
                worker.submit(job)
            wait_for(worker, lambda: worker.current is jobs[0] and len(worker.pending) == 2)
            threading.Thread(target=worker.stop).start()  # it waits for the running step
            wait_for(worker, lambda: not worker.pending)
            release.set()
            last = []
            for job in jobs:
                event = await asyncio.wait_for(job.events.get(), 30)
                while event[0] == "chunk":
                    event = await asyncio.wait_for(job.events.get(), 30)
                last.append(event)
            return last

        last = asyncio.run(run())
    assert [(kind, err.status, err.code) for kind, err in last] == [("error", 503, "shutting_down")] * 3


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def _raw(srv, path: str, body: dict):
    """(status, body bytes) of a raw POST, read to its end."""
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type"), resp.read()
    conn.close()
    return out


def test_shutdown_answers_the_requests_in_flight_with_503(chat_art):
    """Stopping the server with a stream running and two requests waiting: the worker stops first, so
    the stream ends with a 503 shutting_down event and `data: [DONE]`, the waiting ones get a 503 body,
    nothing is cancelled by uvicorn (no 500, no traceback), and it takes well under uvicorn's 3 s grace."""
    logs = _Records()
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "runtime.serve.app")]
    for lg in loggers:
        lg.addHandler(logs)
    try:
        with runtime.load(chat_art) as sess:
            real_run = sess.backend.run

            def slow_run(*a, **kw):  # a slow device: 50 ms per graph call
                time.sleep(0.05)
                return real_run(*a, **kw)

            sess.backend.run = slow_run
            app = create_app(sess, model_name=MODEL)
            worker = app.state.api.worker
            # the running generation holds after its first chunk until the stop cancels it
            sess.stream = Probe(sess, 1, lambda: worker.current.cancelled.wait(10))
            srv = ServerThread(app).__enter__()
            try:
                with ThreadPoolExecutor(3) as pool:
                    long = dict(max_tokens=50, stop=None, temperature=0, **FIXED)
                    running = pool.submit(_raw, srv, PATHS["comp"], comp_body(stream=True, **long))
                    wait_for(worker, lambda: worker.current is not None)
                    waiting = [pool.submit(_raw, srv, PATHS["chat"], chat_body(stream=True, **long)),
                               pool.submit(_raw, srv, PATHS["comp"], comp_body(**long))]
                    wait_for(worker, lambda: len(worker.pending) == 2)
                    start = time.perf_counter()
                    srv.__exit__(None, None, None)
                    elapsed = time.perf_counter() - start
                    status, ctype, raw = running.result(30)
                    rest = [f.result(30) for f in waiting]
            finally:
                srv.__exit__(None, None, None)
    finally:
        for lg in loggers:
            lg.removeHandler(logs)
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]", events
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["type"]) == ("shutting_down", "server_error"), err
    assert any(json.loads(e).get("choices") for e in events[:-2])  # the chunks before it came through
    for st, ct, body in rest:
        assert st == 503 and ct == "application/json", (st, ct, body)
        expect_error(st, json.loads(body), 503)
        assert json.loads(body)["error"]["code"] == "shutting_down"
    assert elapsed < 2.0, f"shutdown took {elapsed:.2f} s"
    assert not [r.getMessage() for r in logs.records if r.levelno >= logging.ERROR]
