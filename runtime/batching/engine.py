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
from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.backends.select import make_backend
from runtime.batching.calls import BatchedCalls, SequenceRows
from runtime.batching.drafts import SlotDrafts
from runtime.batching.slots import SlotTable
from runtime.errors import DFlashError
from runtime.manifest import (
    BATCHED_GRAPH,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    DTYPES,
    batched_feeds_draft,
    check_batched_graph,
    draft_proposes,
    fixed_draft_block,
    load_manifest,
)
from runtime.options import (
    GenerationOptions,
    check_speculation_options,
    check_vocabulary_options,
    refuse_unknown_options,
)
from runtime.results import GenerationResult, StreamChunk, accepted_prefix
from runtime.speculation.batched import MEASURED_ROWS, BatchedCallCosts, BatchedLength
from runtime.speculation.lookup import NgramLookup
from runtime.speculation.policy import (
    TRAINED_DRAFT_PRIOR,
    UNTRAINED_DRAFT_PRIOR,
    AcceptanceEstimate,
)
from runtime.speculation.sampling import HostSampler
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
    """A request in the engine: its prompt, options, slot, reply so far and speculation state."""

    def __init__(self, handle: BatchedGeneration, prompt: list[int], opts: GenerationOptions, stop_ids: set[int],
                 decode, block_size: int):
        self.handle, self.prompt, self.opts = handle, prompt, opts
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
        host = opts.samples_on_host
        last = len(self.uniforms) - 1
        return SequenceRows(self.slot, self.cached, list(ids), wanted=wanted,
                            temperature=0.0 if host else opts.temperature,
                            uniforms=tuple(float(self.uniforms[min(k + j, last)]) for j in range(wanted)))

    def result(self, policy: str) -> GenerationResult:
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
            the batched graph (and the draft graph, with `speculation`).
        speculation: verify each sequence's draft proposals in the batched calls where the policy
            (`runtime.speculation.batched`) predicts it pays, or where a request asks for a verify
            length. It needs an artifact whose batched graph feeds the draft (built by this version's
            `build --batched`) and whose draft proposes ids; elsewhere every step decodes plainly.

    Use it as a context manager (or call :meth:`close`). :meth:`stream` and :meth:`generate` may be
    called from any number of threads; each request takes a slot when one is free.

    Raises:
        DFlashError: an artifact without the batched graph, or bad arguments.
    """

    def __init__(self, artifact_dir: str | Path, max_batch: int = DEFAULT_MAX_BATCH, threads: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, int4_accuracy_level: int | None = None,
                 backend: str | Backend = "ort", speculation: bool = True):
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
        self.block_size = int(m["draft"]["block_size"])
        # batched speculation: where the batched graph feeds the draft and the draft proposes ids
        self.speculates = bool(speculation) and batched_feeds_draft(m) and draft_proposes(m)
        graphs = (BATCHED_GRAPH, "draft") if self.speculates else (BATCHED_GRAPH,)
        self.backend = backend if isinstance(backend, Backend) else make_backend(
            backend, self.artifact_dir, m, threads, int4_accuracy_level, graphs=graphs)
        dtype = np.dtype(DTYPES[m["dtype"]])
        self.drafts: SlotDrafts | None = None
        self.policy: BatchedLength | None = None
        rows = max(prefill_chunk, 2 * max_batch)
        if self.speculates:
            self.drafts = SlotDrafts(self.backend, m, self.artifact_dir, max_batch, dtype,
                                     pending_rows=prefill_chunk + 2 * self.block_size)
            rows = max(rows, max_batch * self.block_size)  # (a verify step: every sequence a whole block)
        self.calls = BatchedCalls(self.backend, m, max_batch, rows, dtype, features=self.speculates)
        self.calls.decide_row_padding()  # (before any slot holds a sequence: the probe writes slot 0)
        if self.speculates:
            prior = TRAINED_DRAFT_PRIOR if m["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
            self.policy = BatchedLength(self._measure_costs(), AcceptanceEstimate(prior, self.block_size - 1))
        self.slots = SlotTable(max_batch)
        self.cond = threading.Condition()
        self.waiting: deque[_Sequence] = deque()
        self.active: list[_Sequence] = []
        self.steps = 0  # decoding calls run (read by tests and /health)
        self.speculative_steps = 0  # decoding calls that verified proposals (read by tests and /health)
        self.last_call_s = 0.0  # seconds of the last batched call (the policy's observation)
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-batch", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int] | None = None, *, messages=None, chat: bool = False,
               enable_thinking: bool | None = None, on_event=None, **options) -> BatchedGeneration:
        """Queue a generation; returns its :class:`BatchedGeneration` at once.

        Args: as :meth:`runtime.Session.stream` (prompt or messages, chat, enable_thinking, and the
            :class:`runtime.options.GenerationOptions` fields). `verify_len`: "auto" (default: the
            engine's policy), 0 (plain), an integer or "all"; a tree "L+A" verifies its chain of L.
            `block_size` 1 decodes plainly. Speculation never changes the output. `on_event`: see
            :class:`BatchedGeneration`.

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
            self.waiting.append(_Sequence(handle, ids, opts, stops, decode, self.block_size if self.speculates else 1))
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
        """Raise DFlashError where a request does not fit: block_size or verify_len out of range (as
        :meth:`runtime.Session.check_request` says: a request is refused or run alike whatever
        `--max-batch`), prompt + max_new_tokens beyond max_seq_len, stop ids or top_k outside the vocabulary."""
        fixed = fixed_draft_block(self.manifest)
        check_speculation_options(opts, int(self.manifest["draft"]["block_size"]),
                                  fixed or max(MAX_BLOCK_SIZE, int(self.manifest["draft"]["block_size"])),
                                  limit_note=" (the draft's graph is fixed to its block)" if fixed else "")
        if len(ids) + opts.max_new_tokens > self.max_seq_len:
            raise DFlashError(f"prompt ({len(ids)} tokens) + max_new_tokens ({opts.max_new_tokens}) exceeds the KV "
                              f"buffers' max_seq_len {self.max_seq_len}; ask for at most "
                              f"{max(self.max_seq_len - len(ids), 0)} new tokens or shorten the prompt")
        check_vocabulary_options(opts, int(self.manifest["target"]["vocab_size"]))

    def status(self) -> dict:
        """{"waiting", "running", "slots", "steps", "speculative_steps"} now (steps: decoding calls run so
        far; speculative_steps: those that verified proposals)."""
        with self.cond:
            waiting = sum(not s.handle.cancelled.is_set() for s in self.waiting)  # (cancelled ones leave at the next step)
            return {"waiting": waiting, "running": len(self.active), "slots": self.max_batch, "steps": self.steps,
                    "speculative_steps": self.speculative_steps}

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
            if self.drafts is not None:
                self.drafts.reset(seq.slot, seq.reused)
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
        `prefill_chunk` rows with padding) and one decoding call (every other running sequence, each
        with the proposals its draft made where the step speculates)."""
        prefilling = sorted((s for s in active if s.prefilling), key=lambda s: len(s.prompt) - s.cached)
        batch: list[_Sequence] = []
        for seq in prefilling:
            rows = min(len(seq.prompt) - seq.cached, self.prefill_chunk)
            if batch and (len(batch) + 1) * rows > self.prefill_chunk:  # each sequence is padded to the longest
                break
            batch.append(seq)
        if batch:
            self._call(batch, [((), None)] * len(batch), self.prefill_chunk)
        decoding = [s for s in self.active if not s.prefilling and s not in batch]
        if decoding:
            proposals, drafts = self._propose(decoding)
            outcomes = self._call(decoding, proposals, 1)
            self.speculative_steps += bool(outcomes)
            if self.policy is not None:
                committed = sum(1 + acc for _, acc, _ in outcomes) + len(decoding) - len(outcomes)
                self.policy.observe(len(decoding), self.calls.rows_per_sequence, self.last_call_s, drafts, outcomes,
                                    committed)
            self.steps += 1

    def _propose(self, seqs: list[_Sequence]) -> tuple[list[tuple], list[tuple[int, float]]]:
        """Each decoding sequence's (proposals, the draft's probability of each or None for a lookup) for
        this step (empty: it decodes one row), and the draft calls' (block rows, seconds). A sequence with
        a fixed verify length drafts and verifies that many; the others, where the policy speculates this
        step, take their lookup continuation or draft the rows it asks for, and verify the length it
        chooses from their chances (or more, where a fixed one pads the call's rows anyway)."""
        if self.drafts is None:
            return [((), None) for _ in seqs], []
        limits = [s.draft_limit() for s in seqs]
        if not self.policy.speculates([lim if s.fixed is None else 0 for s, lim in zip(seqs, limits)]):
            limits = [lim if s.fixed is not None else 0 for s, lim in zip(seqs, limits)]
        offers = [s.lookup.propose(lim) if s.lookup is not None and lim > 0 else [] for s, lim in zip(seqs, limits)]
        rows = self.policy.draft_rows([lim if s.fixed is None and not o else 0 for s, lim, o in zip(seqs, limits, offers)])
        drafted, drafts = [], []
        for seq, lim, offer in zip(seqs, limits, offers):
            k = lim if seq.fixed is not None else (0 if offer else min(rows, lim))
            drafted.append(self._draft(seq, k, drafts) if k > 0 else (offer, None) if offer else None)
        n = self._auto_length(seqs, drafted, rows, bool(any(offers)))
        cut = [d if d is None or s.fixed is not None else (d[0][:n], None if d[1] is None else d[1][:n])
               for s, d in zip(seqs, drafted)]
        return [d if d is not None else ((), None) for d in cut], drafts

    def _draft(self, seq: _Sequence, rows: int, drafts: list) -> tuple[list[int], np.ndarray]:
        """`seq`'s draft call for `rows` proposals, timed into `drafts`: (ids, probabilities)."""
        t0 = time.perf_counter()
        ids, probs = self.drafts.propose(seq.slot, seq.reply.out[-1], rows, seq.block_size)
        drafts.append((rows, time.perf_counter() - t0))
        seq.draft_s += drafts[-1][1]
        return ids.tolist(), probs

    def _auto_length(self, seqs: list[_Sequence], drafted: list, rows: int, offered: bool) -> int:
        """The verify length of the call: the policy's, from the automatic sequences' proposal chances
        (0: they verify nothing), at least the longest fixed request's where the policy verifies any."""
        chances = [None if s.fixed is not None or d is None else
                   self.policy.draft_confidence(d[1]) if d[1] is not None else self.policy.lookup_confidence(len(d[0]))
                   for s, d in zip(seqs, drafted)]
        if all(c is None for c in chances):
            return 0
        drafted_rows = rows if any(c is not None and d[1] is not None for c, d in zip(chances, drafted)) else 0
        n = self.policy.verify_length(chances, drafted_rows, offered)
        fixed = max((len(d[0]) for s, d in zip(seqs, drafted) if s.fixed is not None and d is not None), default=0)
        return max(n, fixed) if n else 0

    def _call(self, seqs: list[_Sequence], proposals: list, chunk: int) -> list[tuple[int, int, float]]:
        """One graph call for `seqs` (prefill chunks, or each sequence's last token and its (proposals,
        probabilities) of `proposals`); commits and emits each sequence's new tokens, keeps their taps and
        anchor for the draft, and lets finished ones leave. Returns (proposals verified, accepted, draft
        probability of the first) of each sequence that verified any. A failing call fails the
        generations in it (their slots are freed)."""
        rows = [s.next_rows(chunk, p[0]) for s, p in zip(seqs, proposals)]
        prefill = [s.prefilling for s in seqs]
        host = any(s.opts.samples_on_host for s, r in zip(seqs, rows) if r.wanted)
        t0 = time.perf_counter()
        ids = self.calls.run(rows, keep_logits=host)
        self.last_call_s = time.perf_counter() - t0
        t, k, outcomes = self.calls.rows_per_sequence, 0, []
        for i, (seq, r, (props, probs)) in enumerate(zip(seqs, rows, proposals)):
            posterior, base = ids[k:k + r.wanted], k
            k += r.wanted
            sampler = HostSampler(seq.opts.temperature, seq.opts.top_k, seq.opts.top_p,
                                  lambda j, base=base: self.calls.read_logits(base + j)) if seq.opts.samples_on_host else None
            if prefill[i]:
                committed_rows, tokens = len(r.ids), []
                if r.wanted:
                    tokens = [int(posterior[0]) if sampler is None else sampler.sample(0, r.uniforms[0])]
                acc = 0
            else:
                seq.verify_s += self.last_call_s
                n = len(props)
                if sampler is None:
                    acc = accepted_prefix(np.asarray(props, np.int64), posterior)
                    bonus = int(posterior[acc])
                else:
                    acc, bonus = sampler.verify(np.asarray(props, np.int64), np.asarray(r.uniforms, np.float32))
                committed_rows, tokens = 1 + acc, [*props[:acc], bonus]
                if n:
                    seq.acceptance.append(acc + 1)
                    outcomes.append((n, acc, None if probs is None else float(probs[0])))
            seq.cached += committed_rows
            if self.drafts is not None:
                self.drafts.append(seq.slot, self.calls.taps.rows(i * t, committed_rows), committed_rows)
                if tokens:  # the graph's posterior row acc embeds its id; a host sample may be another token
                    self.drafts.set_anchor(seq.slot, self.calls.next_embeddings.rows(base + acc, 1))
                    seq.anchor_valid = tokens[-1] == int(posterior[acc])
            if tokens:
                self._emit(seq, tokens)
        return outcomes

    def _emit(self, seq: _Sequence, tokens: list[int]) -> None:
        """Commit `tokens` to `seq`'s reply and emit them; a finished or cancelled sequence leaves."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
        cancelled = seq.handle.cancelled.is_set()
        if not cancelled:
            chunk = seq.reply.commit(tokens)
            if seq.lookup is not None:
                seq.lookup.extend(chunk.token_ids)
            seq.handle.emit("chunk", chunk)
        if seq.finished or seq.handle.cancelled.is_set():
            if not seq.handle.cancelled.is_set():
                tail = seq.reply.finish()
                if tail:
                    seq.handle.emit("chunk", StreamChunk(tail, []))
                seq.handle.emit("done", seq.result(self._policy_name(seq)))
            with self.cond:
                self._leave(seq)

    def _policy_name(self, seq: _Sequence) -> str:
        if not self.speculates or seq.block_size <= 1:
            return "batched-plain"
        return "batched-auto" if seq.fixed is None else "batched-fixed"

    def _measure_costs(self) -> BatchedCallCosts:
        """Time batched calls of 1, max_batch / 2 and max_batch sequences x :data:`MEASURED_ROWS` rows (the
        faster of two, after 64 cached rows of zeros; beyond 4 rows per sequence only for one sequence, extrapolated
        for more: the start-up cost stays a few calls) and draft calls: the policy's cost curve, which
        the observed step times then scale. Runs before any slot holds a sequence (it writes slots' rows,
        which no one reads)."""
        batches = tuple(sorted({1, max(self.max_batch // 2, 1), self.max_batch}))
        rows = tuple(t for t in MEASURED_ROWS if t <= self.block_size) or (1,)
        past = min(64, self.max_seq_len - rows[-1])
        seconds = np.zeros((len(batches), len(rows)))
        for i, b in enumerate(batches):
            for j, t in enumerate(rows):
                if b > 1 and j >= 3:  # a whole block at several sequences: extrapolated (they rarely pay)
                    seconds[i, j] = seconds[i, j - 1] + (seconds[i, j - 1] - seconds[i, j - 2]) * \
                        (t - rows[j - 1]) / (rows[j - 1] - rows[j - 2])
                    continue
                batch = [SequenceRows(slot, past, [1] * t, wanted=t) for slot in range(b)]
                seconds[i, j] = min(self._timed(lambda: self.calls.run(batch)) for _ in range(2))  # (a new shape's first call is slower)
        draft_rows = tuple(sorted({1, max(self.block_size - 1, 1)}))
        draft_s = []
        for r in draft_rows:
            self.calls.run([SequenceRows(0, 0, [1, 2])])
            self.drafts.append(0, self.calls.taps.rows(0, 2), 2)
            self.drafts.set_anchor(0, self.calls.next_embeddings.rows(0, 1))
            draft_s.append(self._timed(lambda: self.drafts.propose(0, 1, r)))
        self.drafts.reset(0, 0)
        return BatchedCallCosts(batches, rows, seconds, draft_rows, tuple(draft_s))

    @staticmethod
    def _timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
