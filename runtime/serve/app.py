"""OpenAI-compatible HTTP server over one :class:`runtime.Session` (`python -m runtime serve DIR`).

Endpoints: POST /v1/chat/completions and /v1/completions (`stream` true or false; server-sent events
`data: {json}` ending with `data: [DONE]`), GET /v1/models, /v1/models/{id} and /health.

Library: Starlette on uvicorn (the `serve` extra). Both are pure Python without their optional extras
(uvicorn's h11 protocol; no uvloop/httptools build on a Jetson), support Python 3.10, are widely used
and maintained (Starlette is what FastAPI is built on), and give what this server needs and little
more: async streaming responses, detection of a client that disconnects mid-stream (the stream task
is cancelled, which stops the generation) and a lifespan hook to start and stop the worker thread.
FastAPI would add pydantic (a compiled dependency) for request models that the runtime's own checks
already cover; aiohttp needs C extensions; the standard library's http.server has no async streaming
or disconnect detection. The import is lazy (`runtime/__main__.py` checks for the extra), so
`import runtime` never needs them.

Serving model: over a Session, batch 1: generations run one at a time in a worker thread
(runtime/serve/worker.py), with speculative decoding; over a `runtime.batching.BatchEngine` (`serve
--max-batch N`), up to N at once, joining and leaving the batch at step boundaries. Either way,
requests are checked and tokenized first (400 at once for a bad one), then wait in a bounded FIFO
queue (429 with Retry-After when full). A request's headers, then its body, must each arrive within
`read_timeout` seconds (default 10; 408 otherwise: a client that sends half a request and stalls holds
its connection no longer). On shutdown the worker stops first, so requests in flight get a
503 `shutting_down` (a stream: an error event, then `data: [DONE]`). Request bodies are parsed by runtime/serve_params.py, replies
made by runtime/serve_replies.py; runtime/serve_run.py runs the app on uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.batching import BatchEngine
from runtime.errors import DFlashError
from runtime.options import DEFAULT_MAX_TOKENS, GenerationOptions
from runtime.serve.params import ApiError, ParsedRequest, parse_request
from runtime.serve.replies import Reply, as_api_error, sse
from runtime.serve.worker import (
    BatchWorker,
    Job,
    QueueFull,
    ShuttingDown,
    Worker,
    stopped_error,
)
from runtime.text.tools import ToolCallReader

log = logging.getLogger("runtime.serve.app")

MAX_BODY_BYTES = 1 << 20  # larger request bodies get 413
DRAIN_LIMIT = 16 << 20  # a declared body up to this size is read (and dropped) before its 413
DEFAULT_QUEUE_SIZE = 16
# seconds a request's headers (from the connection opening, or the previous response: the server's
# protocol, runtime/serve/run.py) and then its body (from the headers: read here) may take to arrive
READ_TIMEOUT_S = 10.0
RETRY_AFTER_S = 1  # what a 429 suggests: about one short generation


def create_app(session, model_name: str | None = None, api_key: str | None = None,
               queue_size: int = DEFAULT_QUEUE_SIZE, max_body: int = MAX_BODY_BYTES,
               read_timeout: float = READ_TIMEOUT_S) -> Starlette:
    """The ASGI app serving `session` (its worker thread starts and stops with the app's lifespan).

    Args:
        session: a loaded :class:`runtime.Session` with a tokenizer; the server owns it while serving.
        model_name: the model id clients name (default: :func:`default_model_name`).
        api_key: if set, /v1 requests must send `Authorization: Bearer <api_key>` (else 401).
        queue_size: requests that may wait while one generates (one more gets 429).
        max_body: request bodies above this many bytes get 413.
        read_timeout: a request body not all received this many seconds after its headers gets 408 (and
            the connection is closed); the server run by runtime/serve/run.py gives the headers as long.

    Raises:
        DFlashError: the artifact has no tokenizer, queue_size < 1 or read_timeout <= 0.
    """
    api = OpenAIApi(session, model_name or default_model_name(session), api_key, queue_size, max_body, read_timeout)
    routes = [
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=api.lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    app.state.api = api
    return app


def default_model_name(session) -> str:
    """The target checkpoint's name from the manifest, else the artifact directory's name."""
    name = session.manifest.get("sources", {}).get("target", {}).get("name")
    return name if isinstance(name, str) and name else session.artifact_dir.resolve().name


class OpenAIApi:
    """The endpoints' handlers and the state they share (the session, its worker, the settings)."""

    def __init__(self, session, model_name: str, api_key: str | None, queue_size: int, max_body: int,
                 read_timeout: float = READ_TIMEOUT_S):
        if session.tokenizer is None:
            raise DFlashError("this artifact has no tokenizer; the server needs one to read and write text")
        if isinstance(read_timeout, bool) or not isinstance(read_timeout, (int, float)) or not read_timeout > 0:
            raise DFlashError(f"read_timeout must be a positive number of seconds (got {read_timeout!r})")
        self.session, self.model_name, self.api_key, self.max_body = session, model_name, api_key, max_body
        self.read_timeout = float(read_timeout)
        self.worker = BatchWorker(session, queue_size) if isinstance(session, BatchEngine) else Worker(session, queue_size)
        self.created = int(time.time())
        # one thread checks, tokenizes and queues requests in arrival order, off the event loop
        self._prepare = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dflash-prepare")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        self.worker.start()
        try:
            yield
        finally:
            self.worker.stop()
            self._prepare.shutdown(wait=False)

    # ---- endpoints ------------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def models(self, request: Request) -> Response:
        return await _answer(self._models, request)

    async def model(self, request: Request) -> Response:
        return await _answer(self._model, request)

    async def health(self, request: Request) -> Response:
        """Not behind the API key: a liveness probe needs no secret (as vLLM's /health)."""
        return JSONResponse({"status": "ok", "model": self.model_name, **self.worker.status()})

    async def _models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dflash_export",
                "max_model_len": self.session.max_seq_len}

    # ---- generation -----------------------------------------------------------------------------
    async def _generate(self, request: Request, kind: str) -> Response:
        return await _answer(self._generate_checked, request, kind)

    async def _generate_checked(self, request: Request, kind: str) -> Response:
        try:
            self._authorize(request)
        except ApiError:
            await _drain(request, self.read_timeout)  # else a client still sending its body sees a reset, not the 401
            raise
        req = parse_request(await self._read_json(request), kind)
        self._check_model(req.model)
        if kind == "chat" and not self.session.tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions", param="messages")
        loop = asyncio.get_running_loop()
        job = await loop.run_in_executor(self._prepare, self._prepare_job, req, loop)
        tools = _tool_options(req)
        reader = ToolCallReader(self.session.tool_format, tools.tools, tools.forces_tool_call) if tools.uses_tools else None
        reply = Reply(req, self.model_name, self.session.tokenizer.decode, reader)
        handed_over = False
        try:
            async with _DisconnectWatch(request) as watch:
                first = await watch.next_event(job)
                if first is None:
                    return Response(status_code=499)  # the client is gone; nobody reads this
                if first[0] == "error":
                    raise as_api_error(first[1])
                if not req.stream:
                    body = await self._collect(watch, job, first, reply)
                    return Response(status_code=499) if body is None else JSONResponse(body)
            handed_over = True  # the response's stream now owns the job
            return _EventStream(self._events(job, first, reply), job, self.worker)
        finally:
            if not handed_over:
                self.worker.cancel(job)  # no-op when it finished

    def _prepare_job(self, req: ParsedRequest, loop) -> Job:
        """Tokenize, fit to the KV buffers and queue (in the prepare thread, in arrival order)."""
        ids = self._encode(req)
        job = Job(loop, ids, self._fit(ids, req))
        try:
            self.worker.submit(job)
        except ShuttingDown:
            raise stopped_error() from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy ({exc}; it queues at most {self.worker.queue_size}); retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return job

    def _encode(self, req: ParsedRequest) -> list[int]:
        try:
            if req.kind == "chat":
                tools = _tool_options(req)
                return self.session.encode_messages(req.messages, req.enable_thinking,
                                                    tools.tools if tools.uses_tools else None)
            return self.session.encode(req.prompt)
        except DFlashError as exc:
            raise ApiError(400, str(exc), param="messages" if req.kind == "chat" else "prompt") from None

    def _fit(self, ids: list[int], req: ParsedRequest) -> dict:
        """The options with max_new_tokens filled in (what fits, capped), checked against the buffers."""
        opts = dict(req.options)
        if "stop_token_ids" in opts:
            opts["stop_token_ids"] = self._stop_ids(opts["stop_token_ids"])
        limit, n = self.session.max_seq_len, len(ids)
        where = "messages" if req.kind == "chat" else "prompt"
        if "max_new_tokens" not in opts:
            if n >= limit:
                raise ApiError(400, f"the prompt is {n} tokens; this model's max_seq_len (its KV buffers) is {limit} "
                                    "tokens, prompt and reply together: shorten the prompt", param=where,
                               code="context_length_exceeded")
            opts["max_new_tokens"] = min(DEFAULT_MAX_TOKENS, limit - n)
        if opts["max_new_tokens"] > limit and n < limit:  # (not the runtime's "rebuild with a larger" hint)
            raise ApiError(400, f"max_tokens {opts['max_new_tokens']} exceeds this model's max_seq_len {limit} (its KV "
                                f"buffers hold the prompt and the reply together); pass at most {limit - n} for "
                                f"this {n}-token prompt", param="max_tokens", code="context_length_exceeded")
        if n + opts["max_new_tokens"] > limit:  # an API client cannot rebuild: no "rebuild with" hint
            raise ApiError(400, f"the prompt ({n} tokens) plus max_tokens {opts['max_new_tokens']} exceeds this model's "
                                f"max_seq_len {limit} (its KV buffers hold the prompt and the reply together); "
                                + (f"pass max_tokens at most {limit - n}" if n < limit else "shorten the prompt"),
                           param="max_tokens" if n < limit else where, code="context_length_exceeded")
        try:
            # the same check Session.stream makes, before the request waits in the queue
            self.session.check_request(ids, GenerationOptions(**opts))
        except DFlashError as exc:
            message = str(exc).replace("max_new_tokens", "max_tokens")
            # the artifact's limits on options: their messages start with the option's name
            first = message.split(" ", 1)[0]
            named = first if first in ("top_k", "verify_len", "block_size", "tool_choice", "drafter") else None
            raise ApiError(400, message, param=named) from None
        constrained = next((name for name in ("response_format", "grammar", "regex", "tools") if name in opts), None)
        if constrained is not None:
            self._check_constraint(opts, constrained)
        return opts

    def _check_constraint(self, opts: dict, name: str) -> None:
        """Compile the request's output constraint once before it queues, so a bad schema or grammar is
        a 400 naming the field (the Session compiles it again for the run: milliseconds)."""
        options = GenerationOptions(**opts)
        if options.uses_tools and not options.constrained:
            # "auto": no grammar runs, but the tools' parameter schemas must compile as "required" would
            options = GenerationOptions(**{**opts, "tool_choice": "required"})
        if not options.constrained:
            return
        try:  # (its first mask too: a grammar that matches nothing, or one too large to parse, fails here,
            self.session.constraint(options).allowed()  # named, off the generation worker)
        except DFlashError as exc:
            raise ApiError(400, self._which_tool(options, exc) if name == "tools" else str(exc), param=name) from None

    def _which_tool(self, options: GenerationOptions, exc: DFlashError) -> str:
        """A tools grammar's compile error, naming the first tool whose parameters fail alone (llguidance's
        message cut to its first line, at most 300 characters)."""
        first = str(exc).splitlines()[0][:300]
        for i, tool in enumerate(options.tools):
            try:
                self.session.constraint(GenerationOptions(tools=[tool], tool_choice="required"))
            except DFlashError as alone:
                return f"tools[{i}].function.parameters: {str(alone).splitlines()[0][:300]}"
        return first

    def _stop_ids(self, extra: list[int]) -> list[int]:
        """The model's stop ids and a request's `stop_token_ids` (vLLM's: ids that stop the reply as well
        as the model's end-of-turn ids), each checked against the vocabulary."""
        vocab = int(self.session.manifest["target"]["vocab_size"])
        for t in extra:
            if not 0 <= t < vocab:
                raise ApiError(400, f"stop_token_ids holds {t}, which is not a token id of this model: ids are 0 to "
                                    f"{vocab - 1} (vocabulary size {vocab})", param="stop_token_ids")
        return sorted({*self.session.stop_token_ids, *extra})

    async def _collect(self, watch: "_DisconnectWatch", job: Job, event, reply: Reply) -> dict | None:
        """The whole reply (chunks skipped: the result holds the text); None if the client left."""
        while event[0] == "chunk":
            event = await watch.next_event(job)
            if event is None:
                return None
        if event[0] == "error":
            raise as_api_error(event[1])
        return reply.full(event[1])

    async def _events(self, job: Job, event, reply: Reply):
        """The server-sent events of a streamed reply, from its first event on."""
        if reply.kind == "chat":
            yield sse(reply.chunk(role=True))
        while True:
            kind, payload = event
            if kind == "chunk":
                for out in reply.text_chunks(payload.text, payload.logprobs):
                    yield sse(out)
            elif kind == "done":
                for out in reply.text_chunks(None):
                    yield sse(out)
                yield sse(reply.chunk(finish=payload.finish_reason))
                if reply.include_usage:
                    yield sse(reply.usage_chunk(payload))
                yield b"data: [DONE]\n\n"
                return
            else:  # headers are sent: the error goes in the stream, as OpenAI does, then the end
                yield sse(as_api_error(payload).body())
                yield b"data: [DONE]\n\n"
                return
            event = await job.events.get()

    # ---- checks -------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _read_json(self, request: Request):
        length = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the request body exceeds {self.max_body} bytes", code="request_too_large")
        if length.isdigit() and int(length) > self.max_body:
            await _drain(request, self.read_timeout)
            raise too_big
        try:  # (a client that stalls mid-body would hold its connection and the handler for ever)
            raw = await asyncio.wait_for(self._read_body(request, too_big), self.read_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.read_timeout:g} s of its headers",
                           code="request_timeout", headers={"Connection": "close"}) from None
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
        try:  # JSON may escape a lone UTF-16 surrogate ("\ud800"): not text the tokenizer can take
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"the request body holds a lone surrogate ({exc.object[exc.start:exc.end]!r}), "
                                "which is not valid Unicode text", code="invalid_json") from None
        return body

    async def _read_body(self, request: Request, too_big: ApiError) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():  # counted as it arrives: chunked bodies have no length
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


async def _drain(request: Request, timeout: float) -> None:
    """Read and drop a request's body (up to DRAIN_LIMIT bytes, for at most `timeout` seconds) before an
    error answers it: closing with unread data resets the connection, and a client still sending (most
    do not wait for 100-continue) would never see the error. A client waiting for 100-continue sends
    nothing."""
    if "100-continue" in request.headers.get("expect", "").lower():
        return
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > DRAIN_LIMIT:
        return

    async def drop() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > DRAIN_LIMIT:
                return

    with contextlib.suppress(asyncio.TimeoutError):  # (then the error goes out anyway)
        await asyncio.wait_for(drop(), timeout)


class _DisconnectWatch:
    """Waits for a job's next event while watching for the client to disconnect (before a response
    is started, nothing else would notice: a queued or non-streamed request would run for nobody)."""

    def __init__(self, request: Request):
        self._receive = request.receive

    async def __aenter__(self) -> "_DisconnectWatch":
        self._task = asyncio.ensure_future(self._wait())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()

    async def _wait(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass

    async def next_event(self, job: Job):
        """The job's next event, or None if the client disconnected first."""
        get = asyncio.ensure_future(job.events.get())
        done, _ = await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        return None


class _EventStream(StreamingResponse):
    """A text/event-stream response that cancels its job however it ends (finished, client gone,
    server shutting down), so a disconnected client's generation stops at its next step."""

    def __init__(self, content, job: Job, worker: Worker):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job, self._worker = job, worker

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._worker.cancel(self._job)
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


def _tool_options(req: ParsedRequest) -> GenerationOptions:
    """The request's tool fields alone as GenerationOptions (checked when the body was parsed; the other
    options are checked against the artifact later, by `_fit`)."""
    return GenerationOptions(**{k: req.options[k] for k in ("tools", "tool_choice", "parallel_tool_calls")
                                if k in req.options})


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _answer(handler, request: Request, *args) -> Response:
    """Run a handler: ApiError -> its status and body; a bug -> 500 with a body (logged), and the
    server keeps serving."""
    try:
        return await handler(request, *args)
    except ApiError as err:
        return _error_response(err)
    except ClientDisconnect:
        return Response(status_code=499)
    except Exception as exc:
        log.exception("request failed")
        return _error_response(as_api_error(exc))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (404 unknown path, 405 wrong method) with an OpenAI error body."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _error_response(as_api_error(exc))


