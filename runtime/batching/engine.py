"""Continuous (in-flight) batching: one scheduler thread runs every active generation on the batched target
graph, several sequences per call.

Requests join and leave at step boundaries. Each scheduler step runs at most one prefill call (up to
`prefill_chunk` rows: the prompts of newly joined sequences, a long one a chunk at a time, so running
streams wait at most one chunk) and one decoding call with one row per running sequence. A sequence's
output does not depend on what else is in the batch (`dflash_export.nn.batched`): greedy output equals
its batch-1 output, and a seed gives the same sampled reply at any batch size (one uniform per output
position, drawn up front from the seed, as `runtime.loop` does). The batched graph decodes plainly:
no draft calls (measured: docs/performance.md#batched-serving).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from runtime.backends.base import Backend
from runtime.backends.select import make_backend
from runtime.batching.calls import BatchedCalls, SequenceRows
from runtime.batching.slots import SlotTable
from runtime.errors import DFlashError
from runtime.manifest import (
    BATCHED_GRAPH,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    DTYPES,
    check_batched_graph,
    load_manifest,
)
from runtime.options import GenerationOptions, refuse_unknown_options
from runtime.results import GenerationResult, StreamChunk
from runtime.speculation.sampling import processed_distribution, sample_index
from runtime.text.prompts import PromptEncoding
from runtime.text.reply import ReplyText
from runtime.text.tokenizer import load_tokenizer

log = logging.getLogger("runtime.batching")


class BatchedGeneration:
    """One request's handle: iterate it for :class:`StreamChunk` s as they are committed; `result` is the
    :class:`GenerationResult` after the last (None if it was cancelled or failed). `cancel()` (or
    `close()`, or leaving a `with` block) frees its slot at the next step boundary. Errors of its graph
    calls are raised from the iteration.

    Args:
        on_event: if given, called from the scheduler thread with ("chunk", StreamChunk), then
            ("done", GenerationResult) or ("error", exception), instead of queueing them for iteration.
    """

    def __init__(self, on_event: Callable[[str, object], None] | None = None):
        self.result: GenerationResult | None = None
        self.cancelled = threading.Event()
        self._events: queue.Queue = queue.Queue()
        self._on_event = on_event or (lambda kind, payload: self._events.put((kind, payload)))
        self._done = False

    def emit(self, kind: str, payload) -> None:
        """Hand an event to the caller (from the scheduler thread). A callback that raises cancels its own
        generation and is logged; the scheduler and the other generations go on."""
        if kind == "done":
            self.result = payload
        try:
            self._on_event(kind, payload)
        except Exception:
            log.exception("an on_event callback raised; its generation is cancelled")
            self.cancelled.set()

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        if self._done:
            raise StopIteration
        kind, payload = self._events.get()
        if kind == "chunk":
            return payload
        self._done = True
        if kind == "error":
            raise payload
        raise StopIteration

    def cancel(self) -> None:
        """Stop the generation at the next step boundary (no more chunks are emitted)."""
        self.cancelled.set()
        self._events.put(("cancelled", None))

    close = cancel

    def __enter__(self) -> "BatchedGeneration":
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            self.cancel()


class _Sequence:
    """A request in the engine: its prompt, options, slot and reply so far."""

    def __init__(self, handle: BatchedGeneration, prompt: list[int], opts: GenerationOptions, stop_ids: set[int],
                 decode):
        self.handle, self.prompt, self.opts = handle, prompt, opts
        self.reply = ReplyText(decode, opts.stop, stop_ids)
        self.uniforms = np.random.default_rng(opts.seed).random(opts.max_new_tokens, dtype=np.float32)
        self.slot = -1
        self.cached = 0  # rows of this sequence's slot holding its K/V (prompt, then committed ids)
        self.reused = 0
        self.t_start = time.perf_counter()
        self.t_first: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)

    @property
    def finished(self) -> bool:
        out = self.reply.out
        return self.reply.finish_reason == "stop" or len(out) >= self.opts.max_new_tokens

    def next_rows(self, chunk: int) -> SequenceRows:
        """This sequence's rows in the next call: up to `chunk` prompt rows, or its last committed token."""
        opts, k = self.opts, len(self.reply.out)
        if self.prefilling:
            ids = self.prompt[self.cached:self.cached + chunk]
            last = self.cached + len(ids) == len(self.prompt)
        else:
            ids, last = [self.reply.out[-1]], True
        host = opts.samples_on_host
        return SequenceRows(self.slot, self.cached, list(ids), logits=last,
                            temperature=0.0 if host else opts.temperature, uniform=float(self.uniforms[min(k, len(self.uniforms) - 1)]))

    def result(self) -> GenerationResult:
        t_end = time.perf_counter()
        total, first = t_end - self.t_start, (self.t_first or t_end)
        out = self.reply.out
        decode = t_end - first
        return GenerationResult(
            output_ids=list(out), text=self.reply.text if self.reply.has_text else None,
            finish_reason=self.reply.finish_reason, acceptance_lengths=[],
            tokens_per_s=len(out) / total if total > 0 else 0.0,
            decode_tokens_per_s=(len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0,
            prefill_s=first - self.t_start, draft_s=0.0, verify_s=0.0, host_s=0.0, policy="batched-plain",
            prompt_tokens=len(self.prompt), reused_tokens=self.reused)


class BatchEngine(PromptEncoding):
    """An artifact's batched target graph serving several generations at once (thread-safe).

    Args:
        artifact_dir: an artifact built with `python -m dflash_export build --batched`.
        max_batch: cache slots: the most sequences decoding at once (more requests wait for a slot).
        threads: onnxruntime intra-op threads (default: all cores).
        prefill_chunk: the most prompt rows one prefill call takes (all joining sequences together).
        int4_accuracy_level: as :class:`runtime.Session`'s.
        backend: "ort" (onnxruntime CPU), "ort-cuda", "trt" (TensorRT engines built with `engine
            --max-batch` equal to `max_batch`), or a loaded :class:`runtime.backends.base.Backend` holding
            the batched graph.

    Use it as a context manager (or call :meth:`close`). :meth:`stream` and :meth:`generate` may be
    called from any number of threads; each request takes a slot when one is free.

    Raises:
        DFlashError: an artifact without the batched graph, or bad arguments.
    """

    def __init__(self, artifact_dir: str | Path, max_batch: int = DEFAULT_MAX_BATCH, threads: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, int4_accuracy_level: int | None = None,
                 backend: str | Backend = "ort"):
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DFlashError(f"{name} must be a positive integer (got {value!r})")
        self.artifact_dir = Path(artifact_dir)
        self.manifest = m = load_manifest(self.artifact_dir)
        check_batched_graph(m, self.artifact_dir)
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.max_seq_len = int(m["max_seq_len"])
        self.stop_token_ids = tuple(int(t) for t in m.get("stop_token_ids", []))
        self.tokenizer = load_tokenizer(self.artifact_dir, m)
        trt = m.get("trt")
        if backend == "trt" and trt and (trt.get("max_batch") != max_batch or prefill_chunk > trt.get("prefill_chunk", 0)):
            raise DFlashError(f"this artifact's TensorRT engines take {trt.get('max_batch')} sequences and prefill chunks of "
                              f"{trt.get('prefill_chunk')} rows; serve with max_batch {trt.get('max_batch')}, or rebuild "
                              f"them: `python -m dflash_export engine {self.artifact_dir} --max-batch {max_batch}`")
        self.backend = backend if isinstance(backend, Backend) else make_backend(
            backend, self.artifact_dir, m, threads, int4_accuracy_level, graphs=(BATCHED_GRAPH,))
        rows = max(prefill_chunk, 2 * max_batch)
        self.calls = BatchedCalls(self.backend, m, max_batch, rows, np.dtype(DTYPES[m["dtype"]]))
        self.calls.decide_row_padding()  # (before any slot holds a sequence: the probe writes slot 0)
        self.slots = SlotTable(max_batch)
        self.cond = threading.Condition()
        self.waiting: deque[_Sequence] = deque()
        self.active: list[_Sequence] = []
        self.steps = 0  # decoding calls run (read by tests and /health)
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-batch", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int] | None = None, *, messages=None, chat: bool = False,
               enable_thinking: bool | None = None, on_event=None, **options) -> BatchedGeneration:
        """Queue a generation; returns its :class:`BatchedGeneration` at once.

        Args: as :meth:`runtime.Session.stream` (prompt or messages, chat, enable_thinking, and the
            :class:`runtime.options.GenerationOptions` fields). `block_size` and `verify_len` are
            accepted and do not apply: the batched graph decodes plainly, and speculation never changes
            the output. `on_event`: see :class:`BatchedGeneration`.

        Raises:
            DFlashError: bad prompt or options, a request beyond the KV buffers, a closed engine.
        """
        if self.closed:
            raise DFlashError("this BatchEngine is closed; load the artifact again")
        refuse_unknown_options(options)
        opts = GenerationOptions(**options)
        if (prompt is None) == (messages is None):
            raise DFlashError("pass either a prompt or messages (exactly one)")
        ids = self.encode(prompt, chat=chat, enable_thinking=enable_thinking) if messages is None \
            else self.encode_messages(messages, enable_thinking)
        self.check_request(ids, opts)
        return self._queue(ids, opts, on_event)

    def submit(self, ids: list[int], opts: GenerationOptions, on_event=None) -> BatchedGeneration:
        """Queue a request: prompt ids (checked against the vocabulary) and options (checked by
        :meth:`check_request`).

        Raises:
            DFlashError: an empty prompt, ids outside the vocabulary, a request beyond the KV buffers.
        """
        ids = self.encode(list(ids))
        self.check_request(ids, opts)
        return self._queue(ids, opts, on_event)

    def _queue(self, ids: list[int], opts: GenerationOptions, on_event=None) -> BatchedGeneration:
        """Queue a request already checked (ids and options)."""
        handle = BatchedGeneration(on_event)
        stops = set(self.stop_token_ids if opts.stop_token_ids is None else opts.stop_token_ids)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        with self.cond:
            if self.closed:
                raise DFlashError("this BatchEngine is closed; load the artifact again")
            self.waiting.append(_Sequence(handle, ids, opts, stops, decode))
            self.cond.notify_all()
        return handle

    def generate(self, prompts: Sequence[str | Sequence[int]], *, chat: bool = False, **options) -> list[GenerationResult]:
        """Generate a reply for each prompt of the list `prompts` (texts, optionally as one-turn chats with
        `chat`, or token-id lists), all of them batched; returns their results in order. Every prompt is
        checked before any runs.

        Raises:
            DFlashError: `prompts` is not a list of prompts, as :meth:`stream`, or a failed graph call.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
            raise DFlashError("generate takes a non-empty list of prompts (texts or token-id lists), e.g. "
                              "engine.generate([prompt]); for one streamed reply use engine.stream(prompt)")
        refuse_unknown_options(options)
        opts = GenerationOptions(**options)
        encoded = [self.encode(p, chat=chat) for p in prompts]
        for ids in encoded:
            self.check_request(ids, opts)
        handles = [self._queue(ids, opts) for ids in encoded]
        try:
            for h in handles:
                for _ in h:
                    pass
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return [h.result for h in handles]

    def check_request(self, ids: list[int], opts: GenerationOptions) -> None:
        """Raise DFlashError where a request does not fit: prompt + max_new_tokens beyond max_seq_len,
        or stop ids outside the vocabulary."""
        if len(ids) + opts.max_new_tokens > self.max_seq_len:
            raise DFlashError(f"prompt ({len(ids)} tokens) + max_new_tokens ({opts.max_new_tokens}) exceeds the KV "
                              f"buffers' max_seq_len {self.max_seq_len}; ask for at most "
                              f"{max(self.max_seq_len - len(ids), 0)} new tokens or shorten the prompt")
        vocab = int(self.manifest["target"]["vocab_size"])
        bad = [t for t in (opts.stop_token_ids or ()) if not 0 <= t < vocab]
        if bad:
            raise DFlashError(f"stop_token_ids holds {bad[0]}, which is not a token id of this model (vocabulary {vocab})")

    def status(self) -> dict:
        """{"waiting", "running", "slots"} now."""
        with self.cond:
            waiting = sum(not s.handle.cancelled.is_set() for s in self.waiting)  # (cancelled ones leave at the next step)
            return {"waiting": waiting, "running": len(self.active), "slots": self.max_batch}

    def close(self) -> None:
        """Stop the scheduler (requests in flight get a DFlashError) and release the graph."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        if threading.current_thread() is not self._thread:  # (from an on_event callback: it ends after this step)
            self._thread.join(30)

    def __enter__(self) -> "BatchEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the scheduler --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or self.waiting or self.active)
                closing, ending = self.closed, [*self.waiting, *self.active]
                if closing:
                    self.waiting.clear()
                    self.active.clear()
            if closing:
                for seq in ending:  # (outside the lock, as every event)
                    seq.handle.emit("error", DFlashError("the engine was closed before this generation finished"))
                self.backend.close()  # (here, after the last call: close() may come from a callback)
                return
            with self.cond:
                self._drop_cancelled()
                self._admit()
                active = list(self.active)
            if active:
                try:
                    self._step(active)
                except Exception as exc:  # a backend failure or a bug: these generations end, the engine goes on
                    self._fail([s for s in active if s in self.active], exc)

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.handle.cancelled.is_set()]:
            self.waiting.remove(seq)
        for seq in [s for s in self.active if s.handle.cancelled.is_set()]:
            self._leave(seq)

    def _admit(self) -> None:
        while self.waiting and self.slots.free:
            seq = self.waiting.popleft()
            seq.slot, seq.reused = self.slots.take(seq.prompt, seq.opts.reuse_prefix)
            seq.cached = seq.reused
            self.active.append(seq)

    def _leave(self, seq: _Sequence) -> None:
        """Free `seq`'s slot, which keeps the ids whose K/V it holds for a later prompt to reuse."""
        self.active.remove(seq)
        cached = (seq.prompt + seq.reply.out)[:seq.cached]
        self.slots.release(seq.slot, cached)
        self.cond.notify_all()  # (callers may wait on `cond` for the engine to go idle)

    def _fail(self, seqs: list[_Sequence], exc: Exception) -> None:
        """End `seqs` with `exc` (a failed graph call, or a bug): their slots are freed (and forget what they
        held), the other generations go on. Events are emitted outside the lock (a caller's handler may
        take its own lock, which it may hold while asking for `status`)."""
        if not isinstance(exc, DFlashError):
            log.exception("a batched step failed; its generations end with the error")
        with self.cond:
            for seq in seqs:
                if seq in self.active:
                    seq.cached = 0  # (a half-written step: nothing of it is reused)
                    self._leave(seq)
        for seq in seqs:
            seq.handle.emit("error", exc)

    def _step(self, active: list[_Sequence]) -> None:
        """One prefill call (the joining sequences' next prompt chunks, shortest first, at most
        `prefill_chunk` rows with padding) and one decoding call (every other running sequence)."""
        prefilling = sorted((s for s in active if s.prefilling), key=lambda s: len(s.prompt) - s.cached)
        batch: list[_Sequence] = []
        for seq in prefilling:
            rows = min(len(seq.prompt) - seq.cached, self.prefill_chunk)
            if batch and (len(batch) + 1) * rows > self.prefill_chunk:  # each sequence is padded to the longest
                break
            batch.append(seq)
        if batch:
            self._call(batch, self.prefill_chunk)
        decoding = [s for s in self.active if not s.prefilling and s not in batch]
        if decoding:
            self._call(decoding, 1)
            self.steps += 1

    def _call(self, seqs: list[_Sequence], chunk: int) -> None:
        """One graph call for `seqs`; commits and emits each sequence's new token, and lets finished
        ones leave. A failing call fails the generations in it (their slots are freed)."""
        rows = [s.next_rows(chunk) for s in seqs]
        host = any(s.opts.samples_on_host for s, r in zip(seqs, rows) if r.logits)
        ids = self.calls.run(rows, keep_logits=host)
        k = 0
        for seq, r in zip(seqs, rows):
            seq.cached += len(r.ids)
            if not r.logits:
                continue
            token = int(ids[k])
            if seq.opts.samples_on_host:
                cand, probs = processed_distribution(self.calls.read_logits(k), seq.opts.temperature, seq.opts.top_k,
                                                     seq.opts.top_p)
                token = int(cand[sample_index(probs, r.uniform)])
            k += 1
            if seq.t_first is None:
                seq.t_first = time.perf_counter()
            if not seq.handle.cancelled.is_set():
                seq.handle.emit("chunk", seq.reply.commit([token]))
            if seq.finished or seq.handle.cancelled.is_set():
                if not seq.handle.cancelled.is_set():
                    tail = seq.reply.finish()
                    if tail:
                        seq.handle.emit("chunk", StreamChunk(tail, []))
                    seq.handle.emit("done", seq.result())
                with self.cond:
                    self._leave(seq)
