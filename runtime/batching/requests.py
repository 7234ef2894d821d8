"""A batched request's two sides: the handle its caller iterates (:class:`BatchedGeneration`) and its state
in the engine's scheduler (:class:`BatchedSequence`: prompt, slot, reply so far, speculation state)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Iterator

import numpy as np

from runtime.batching.calls import SequenceRows
from runtime.options import GenerationOptions
from runtime.results import GenerationResult, StreamChunk
from runtime.speculation.lookup import NgramLookup
from runtime.speculation.sampling import TokenLogprobs
from runtime.text.reply import ReplyText

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


class BatchedSequence:
    """A request in the engine: its prompt, options, slot, reply so far and speculation state."""

    def __init__(self, handle: BatchedGeneration, prompt: list[int], opts: GenerationOptions, stop_ids: set[int],
                 decode, block_size: int, constraint=None):
        self.handle, self.prompt, self.opts = handle, prompt, opts
        self.constraint = constraint  # its output constraint (`runtime.text.constraints`), None without one
        self.logprobs = TokenLogprobs(opts.top_logprobs) if opts.logprobs else None
        self.reply = ReplyText(decode, opts.stop, stop_ids)
        self.uniforms = np.random.default_rng(opts.seed).random(opts.max_new_tokens, dtype=np.float32)
        self.slot = -1
        self.cached = 0  # rows of this sequence's slot holding its K/V (prompt, then committed ids)
        self.reused = 0
        self.t_start = time.perf_counter()
        self.t_first: float | None = None
        # speculation: the block the draft fills, a fixed verify length (None: the engine's policy chooses)
        self.block_size = 1 if opts.block_size == 1 else min(opts.block_size or block_size, block_size)
        v = opts.verify_len
        self.fixed = None if v in (None, "auto") else (self.block_size - 1 if v == "all" else
                                                       int(str(v).split("+")[0]))
        self.anchor_valid = False  # whether the slot's kept anchor embedding is the last committed token's
        # the request's text, indexed for lookup proposals where the engine's policy chooses (auto)
        self.lookup = NgramLookup(prompt) if self.block_size > 1 and self.fixed is None else None
        self.acceptance: list[int] = []
        self.draft_s = self.verify_s = 0.0

    @property
    def prefilling(self) -> bool:
        return self.cached < len(self.prompt)

    @property
    def finished(self) -> bool:
        out = self.reply.out
        return self.reply.finish_reason == "stop" or len(out) >= self.opts.max_new_tokens

    def draft_limit(self) -> int:
        """The most proposals this sequence may verify next step: 0 where its draft cannot run (plain
        requests, no valid anchor) or the reply has no room for more than one token."""
        if not self.anchor_valid or self.block_size <= 1:
            return 0
        room = self.opts.max_new_tokens - len(self.reply.out) - 1
        return max(min(self.block_size - 1, room, self.fixed if self.fixed is not None else room), 0)

    def next_rows(self, chunk: int, proposals=()) -> SequenceRows:
        """This sequence's rows in the next call: up to `chunk` prompt rows, or its last committed token and
        the `proposals` to verify after it."""
        opts, k = self.opts, len(self.reply.out)
        if self.prefilling:
            ids = self.prompt[self.cached:self.cached + chunk]
            wanted = int(self.cached + len(ids) == len(self.prompt))
        else:
            ids = [self.reply.out[-1], *proposals]
            wanted = len(ids)
        host = opts.on_host
        last = len(self.uniforms) - 1
        return SequenceRows(self.slot, self.cached, list(ids), wanted=wanted,
                            temperature=0.0 if host else opts.temperature,
                            uniforms=tuple(float(self.uniforms[min(k + j, last)]) for j in range(wanted)))

    def policy_name(self, speculates: bool) -> str:
        """Its result's `policy`: "batched-plain", "batched-auto" or "batched-fixed"."""
        if not speculates or self.block_size <= 1:
            return "batched-plain"
        return "batched-auto" if self.fixed is None else "batched-fixed"

    def result(self, policy: str) -> GenerationResult:
        """Its :class:`GenerationResult` now (after its last token)."""
        t_end = time.perf_counter()
        total, first = t_end - self.t_start, (self.t_first or t_end)
        out = self.reply.out
        decode = t_end - first
        return GenerationResult(
            output_ids=list(out), text=self.reply.text if self.reply.has_text else None,
            finish_reason=self.reply.finish_reason, acceptance_lengths=list(self.acceptance),
            tokens_per_s=len(out) / total if total > 0 else 0.0,
            decode_tokens_per_s=(len(out) - 1) / decode if decode > 0 and len(out) > 1 else 0.0,
            prefill_s=first - self.t_start, draft_s=self.draft_s, verify_s=self.verify_s,
            host_s=max(decode - self.draft_s - self.verify_s, 0.0), policy=policy,
            prompt_tokens=len(self.prompt), reused_tokens=self.reused,
            logprobs=self.logprobs.entries[:len(out)] if self.logprobs is not None else None)
