"""The server's generation worker: one thread runs one generation at a time on the Session (batch 1),
taking jobs from a bounded FIFO queue (no server library here: it is plain threading).

The Session's calls block for the whole generation, so they run in this thread, never on the event
loop; each committed chunk is handed to the request's asyncio queue with `call_soon_threadsafe`. A job
cancelled while it waits leaves the queue at once; one cancelled while it runs stops at the next
decoding step (its stream is closed, which frees the Session for the next job).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any

from runtime.errors import DFlashError
from runtime.serve.params import ApiError

log = logging.getLogger("runtime.serve.app")


COUNTERS = ("decoded_tokens", "decode_seconds", "prefill_rows", "prefill_seconds")  # (a batched engine's)


class QueueFull(Exception):
    """The queue holds its maximum of waiting jobs."""


class ShuttingDown(QueueFull):
    """The worker is stopping: it takes no more jobs."""


class Job:
    """One request's generation: its prompt ids and options in, events out.

    Events on `events` (an asyncio.Queue of the loop that created the job), as (kind, payload):
    ("chunk", StreamChunk) per step, then ("done", GenerationResult) or ("error", exception).

    Args:
        loop: the event loop the request is served on.
        ids: prompt token ids (already checked against the KV buffers).
        options: GenerationOptions keyword arguments.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, ids: list[int], options: dict[str, Any]):
        self.loop, self.ids, self.options = loop, ids, options
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.steps = 0  # chunks generated (read by tests and /health)

    def emit(self, kind: str, payload: Any) -> None:
        """Hand an event to the request's coroutine (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is shutting down, nobody is listening
            self.cancelled.set()


class Worker:
    """Runs jobs one at a time, in arrival order, on `session`.

    Args:
        session: the loaded :class:`runtime.Session` (used only from the worker thread while serving).
        queue_size: jobs that may wait while one runs; one more is refused with :class:`QueueFull`.

    `cond` (a Condition over the queue) is notified on every change of `pending` / `current`: tests
    and callers wait on it instead of sleeping.
    """

    def __init__(self, session, queue_size: int = 16):
        if queue_size < 1:
            raise DFlashError(f"queue size must be at least 1 (got {queue_size})")
        self.session, self.queue_size = session, queue_size
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.current: Job | None = None
        self.served = 0  # jobs finished (done, stopped or failed)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dflash-generate", daemon=True)

    def start(self) -> None:
        """Start the worker thread."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job (from any thread).

        Raises:
            QueueFull: `queue_size` jobs are already waiting.
        """
        with self.cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self.pending) >= self.queue_size:
                raise QueueFull(f"{len(self.pending)} requests are already waiting")
            self.pending.append(job)
            self.cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Drop a waiting job, or stop a running one at its next step (no-op once it finished)."""
        job.cancelled.set()
        with self.cond:
            try:
                self.pending.remove(job)
            except ValueError:
                return
            self.cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel every job and end the thread (waits up to `timeout` for the running step). Waiting
        jobs, and the running one at its next step, get a 503 error event."""
        with self.cond:
            self._stopping = True
            for job in self.pending:
                job.cancelled.set()
                job.emit("error", stopped_error())
            self.pending.clear()
            if self.current is not None:
                self.current.cancelled.set()
            self.cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def status(self) -> dict:
        """{"waiting", "running", "queue_size", "served"} for /health."""
        with self.cond:
            return {"waiting": len(self.pending), "running": self.current is not None,
                    "queue_size": self.queue_size, "served": self.served}

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.pending or self._stopping)
                if self._stopping:
                    return
                job = self.current = self.pending.popleft()
                self.cond.notify_all()
            try:
                self._generate(job)
            finally:
                with self.cond:
                    self.current = None
                    self.served += 1
                    self.cond.notify_all()
            del job  # not kept (with its reply) while waiting for the next

    def _generate(self, job: Job) -> None:
        """Run one job, emitting its chunks; never raises (errors become the job's "error" event)."""
        if job.cancelled.is_set():  # its client left between leaving the queue and now
            return
        try:
            with self.session.stream(job.ids, **job.options) as stream:
                for chunk in stream:
                    job.steps += 1
                    job.emit("chunk", chunk)
                    if job.cancelled.is_set():
                        break  # leaving the `with` closes the stream: the generation stops here
                else:
                    job.emit("done", stream.result)
                    return
        except DFlashError as exc:
            job.emit("error", exc)
            return
        except Exception as exc:  # a bug or a backend failure: logged here, answered 500, next job runs
            log.exception("generation failed")
            job.emit("error", exc)
            return
        job.emit("error", stopped_error())  # read only when the server stops (a client that left reads nothing)


def stopped_error() -> ApiError:
    """What a job gets when the server stops before its reply is done (503 shutting_down)."""
    return ApiError(503, "the generation was stopped: the server is shutting down", type="server_error",
                    code="shutting_down")


class BatchWorker:
    """The :class:`Worker` interface over a :class:`runtime.batching.BatchEngine`: jobs run together, up to
    the engine's slots, joining and leaving at step boundaries; `queue_size` jobs may wait for a slot."""

    def __init__(self, engine, queue_size: int = 16):
        if queue_size < 1:
            raise DFlashError(f"queue size must be at least 1 (got {queue_size})")
        self.engine, self.queue_size = engine, queue_size
        self.cond = threading.Condition()
        self.jobs: dict[Job, Any] = {}  # job -> its engine handle, while it runs or waits
        self.served = 0
        self._stopping = False

    def start(self) -> None:
        """Nothing to start: the engine's scheduler thread runs already."""

    def submit(self, job: Job) -> None:
        """Hand a job to the engine (from any thread).

        Raises:
            QueueFull: `queue_size` jobs already wait for a slot.
        """
        from runtime.options import GenerationOptions

        with self.cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            status = self.engine.status()  # (a waiting request with a free slot takes it at the next step)
            if status["waiting"] - (status["slots"] - status["running"]) >= self.queue_size:
                raise QueueFull(f"all {status['slots']} slots are busy and {self.queue_size} requests wait for one")
            self.jobs[job] = self.engine.submit(job.ids, GenerationOptions(**job.options),
                                                on_event=lambda kind, payload: self._event(job, kind, payload))
            self.cond.notify_all()

    def _event(self, job: Job, kind: str, payload) -> None:
        if kind == "chunk":
            job.steps += 1
        job.emit(kind, payload)
        if kind != "chunk":
            self._forget(job)

    def _forget(self, job: Job) -> None:
        with self.cond:
            if self.jobs.pop(job, None) is not None:
                self.served += 1
            self.cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop a job at the next step boundary (waiting or running; no-op once it finished)."""
        job.cancelled.set()
        with self.cond:
            handle = self.jobs.get(job)
        if handle is not None:
            handle.cancel()
            self._forget(job)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every job (each gets a 503 error event) and the engine's scheduler."""
        with self.cond:
            self._stopping = True
            jobs = list(self.jobs)
        for job in jobs:
            self.cancel(job)
            job.emit("error", stopped_error())
        self.engine.close()

    def status(self) -> dict:
        """{"waiting", "running", "queue_size", "served", "slots", "steps", "speculative_steps"} for /health, and
        a batched engine's decode and prefill counters (`BatchEngine.status`)."""
        engine = self.engine.status()
        with self.cond:
            return {"waiting": engine["waiting"], "running": engine["running"] > 0, "streams": engine["running"],
                    "queue_size": self.queue_size, "served": self.served, "slots": engine["slots"],
                    "steps": engine["steps"], "speculative_steps": engine["speculative_steps"],
                    **{k: engine[k] for k in COUNTERS if k in engine}}
