"""Running the server's app: a listening socket made before uvicorn starts, uvicorn's settings (its h11
protocol with a deadline on a request's headers and an OpenAI error body for the connection limit), and
a background-thread server for tests and benchmarks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import h11
import uvicorn
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.errors import DFlashError
from runtime.serve.app import READ_TIMEOUT_S
from runtime.serve.params import ApiError


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one), so clients may connect before uvicorn starts.

    Raises:
        DFlashError: the address cannot be bound (in use, not local, no permission).
    """
    sock = None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, addr = infos[0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on such sockets, and without it a
        # kept-alive connection waits ~40 ms (Nagle against delayed ACK) for each response's body
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise DFlashError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
    return sock


DEFAULT_MAX_CONNECTIONS = 64
RETRY_AFTER_S = 1  # what the connection limit's 503 suggests


def uvicorn_server(app, log_level: str = "info", max_connections: int = DEFAULT_MAX_CONNECTIONS,
                   read_timeout: float | None = None):
    """A uvicorn.Server for `app`: the pure-Python h11 protocol (with the two additions of
    :class:`DeadlineH11Protocol`), no websockets, and a short grace period on shutdown. On shutdown the
    app's generation worker stops first (see :class:`DFlashServer`).

    `max_connections` (uvicorn's limit_concurrency): connections beyond it are answered 503 at once,
    with an OpenAI error body. `read_timeout` (None: the app's `read_timeout`, else READ_TIMEOUT_S):
    a connection whose request headers have not all arrived this many seconds after it opened (or after
    the previous response on it) is closed, with a 408 if part of a request came; the app bounds the
    body's arrival the same way (:func:`runtime.serve.app.create_app`). So clients that send half a
    request and stall hold a connection for at most that long, and cannot lock the others out beyond
    it; exposed beyond localhost, put a reverse proxy with per-client limits in front."""
    api = getattr(getattr(app, "state", None), "api", None)
    if read_timeout is None:
        read_timeout = getattr(api, "read_timeout", READ_TIMEOUT_S)
    if not read_timeout > 0:
        raise DFlashError(f"the request read timeout must be a positive number of seconds (got {read_timeout!r})")
    protocol = type("DeadlineH11Protocol", (DeadlineH11Protocol,), {"read_timeout": float(read_timeout)})
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="on", log_level=log_level,
                            # uvicorn refuses when the open connections, the new one included, reach the limit
                            timeout_graceful_shutdown=3, limit_concurrency=max_connections + 1)
    return DFlashServer(config, before_shutdown=getattr(getattr(api, "worker", None), "stop", None))


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on a request's headers and an OpenAI-style 503 at the
    connection limit (uvicorn's own is `text/plain`).

    uvicorn (0.55) has no timeout on receiving a request: `timeout_keep_alive` is armed only after a
    response, and any byte received cancels it, so a client sending half a request (or nothing)
    holds its connection, and its place under the limit, until it disconnects. Here a timer is armed
    when the connection opens and after each response, and cancelled when a request's headers are
    complete (h11 has parsed the request line and every header): a client that has not sent them
    `read_timeout` seconds later (trickling bytes does not extend it) gets a 408 with an OpenAI error
    body, or, if it sent nothing, the connection is closed silently (as uvicorn's keep-alive timeout
    does: a pooled idle connection is not a failed request). The body's deadline is the app's: only
    it knows when it reads a body (a 408 from :meth:`OpenAIApi._read_json`); a body that the app never
    reads (a GET route's, or one a client keeps sending after its response) runs into the next
    request's header deadline instead.

    Attributes:
        read_timeout: seconds (set by :func:`uvicorn_server` on a subclass).
    """

    read_timeout: float = READ_TIMEOUT_S

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # uvicorn's check (before the app) answers text/plain; the same check in _limited answers JSON
        self._limit, self.limit_concurrency = self.limit_concurrency, None
        self._app, self.app = self.app, self._limited
        self._deadline: asyncio.TimerHandle | None = None

    # ---- the connection limit -----------------------------------------------------------------
    async def _limited(self, scope, receive, send) -> None:
        # (the request's task is in self.tasks already, where uvicorn counts it before creating it)
        if self._limit is not None and (len(self.connections) >= self._limit or len(self.tasks) > self._limit):
            self.logger.warning("Exceeded concurrency limit.")
            err = ApiError(503, f"the server has {self._limit - 1} connections open, its limit (--max-connections); "
                                "retry later", type="server_error", code="too_many_connections",
                           headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)
            return
        await self._app(scope, receive, send)

    # ---- the header deadline ------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_deadline()

    def data_received(self, data: bytes) -> None:
        if getattr(self, "_lingering", False):
            return  # answered (408) and closing: what the client still sends is read and dropped
        super().data_received(data)
        self._disarm_once_a_request_runs()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_deadline()  # for the next request's headers
            self._disarm_once_a_request_runs()  # (a pipelined one may have started already)

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def _arm_deadline(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _disarm_once_a_request_runs(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_deadline()

    def _read_timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        partial = bool(self.conn.trailing_data[0])
        if partial and self.conn.our_state is h11.IDLE:
            self.logger.warning("Request headers not received within %g s; closing the connection.", self.read_timeout)
            err = ApiError(408, f"the request's headers did not arrive within {self.read_timeout:g} s",
                           code="request_timeout")
            body = json.dumps(err.body()).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
                out += self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
                self.transport.write(out)
            except h11.LocalProtocolError:  # (no state to answer in: just close)
                pass
            else:
                # a lingering close: closing at once while the client still sends (a trickling header)
                # makes the kernel answer its bytes with a reset, which can destroy the 408 before the
                # client reads it; send FIN, drop what still arrives, and close a moment later
                self._lingering = True
                if self.transport.can_write_eof():
                    self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
                return
        else:
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()


LINGER_S = 1.0  # how long a connection answered with a 408 still reads (and drops) what its client sends


class DFlashServer(uvicorn.Server):
    """uvicorn's server, stopping the generation worker before uvicorn closes the connections.

    uvicorn's own shutdown waits for the requests in flight (up to the grace period), cancels them
    (500 text/plain, tracebacks, a stream cut without an end) and only then runs the lifespan's
    shutdown. Stopping the worker first answers every running and waiting job with its 503
    `shutting_down` event, so each request ends normally (a stream with an error event and
    `data: [DONE]`) and uvicorn's wait for them ends within a step.

    Args:
        config: the uvicorn.Config.
        before_shutdown: called (in a thread: it may block) when shutdown starts; None: nothing.
    """

    def __init__(self, config, before_shutdown=None):
        super().__init__(config)
        self._before_shutdown = before_shutdown

    async def shutdown(self, sockets=None) -> None:
        if self._before_shutdown is not None and not self.force_exit:
            # before the sockets close: requests that arrive meanwhile get their 503 too
            await asyncio.get_running_loop().run_in_executor(None, self._before_shutdown)
        await super().shutdown(sockets=sockets)


class ServerThread:
    """`app` served by uvicorn in a background thread (tests and the benchmark); a context manager.

    Attributes:
        url: e.g. "http://127.0.0.1:40123".
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, read_timeout: float | None = None):
        self._sock = listen_socket(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self.server = uvicorn_server(app, log_level, max_connections, read_timeout)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()
