"""Running the server's app: a listening socket made before uvicorn starts, uvicorn's settings, and a
background-thread server for tests and benchmarks."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from runtime.errors import DFlashError


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


def uvicorn_server(app, log_level: str = "info", max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """A uvicorn.Server for `app`: the pure-Python h11 protocol, no websockets, and a short grace
    period on shutdown. On shutdown the app's generation worker stops first (see :class:`DFlashServer`).

    `max_connections` (uvicorn's limit_concurrency): connections beyond it are answered 503 at once,
    so clients that never finish sending a request (uvicorn has no header-read deadline) hold a bounded
    number of sockets; exposed beyond localhost, put a reverse proxy with read timeouts in front."""
    config = uvicorn.Config(app, http="h11", ws="none", lifespan="on", log_level=log_level,
                            # uvicorn refuses when the open connections, the new one included, reach the limit
                            timeout_graceful_shutdown=3, limit_concurrency=max_connections + 1)
    api = getattr(getattr(app, "state", None), "api", None)
    return DFlashServer(config, before_shutdown=getattr(getattr(api, "worker", None), "stop", None))


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
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self._sock = listen_socket(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        self.server = uvicorn_server(app, log_level, max_connections)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()
