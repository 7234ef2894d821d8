"""Continuous (in-flight) batching: one scheduler thread runs every active generation on the batched target
graph, several sequences per call.

Requests join and leave at step boundaries. Each scheduler step runs at most one prefill call (up to
`prefill_chunk` rows: the prompts of newly joined sequences, a long one a chunk at a time, so running
streams wait at most one chunk) and one decoding call with one row per running sequence. A sequence's
output does not depend on what else is in the batch (`dflash_export.nn.batched`): greedy output equals
its batch-1 output, and a seed gives the same sampled reply at any batch size (one uniform per output
position, drawn up front from the seed, as `runtime.loop` does). Where the artifact allows it, a
decoding call also verifies each sequence's draft or lookup proposals (`runtime.batching.speculating`);
that never changes a reply.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Sequence

import numpy as np

from runtime.backends.base import Backend
from runtime.backends.profiles import MAX_BLOCK_SIZE
from runtime.backends.select import make_backend
from runtime.batching.calls import BatchedCalls
from runtime.batching.drafts import draft_graph
from runtime.batching.lone import LONE_GRAPH, LoneCalls, lone_graph_fits
from runtime.batching.requests import BatchedGeneration, BatchedSequence
from runtime.batching.slots import SlotTable
from runtime.batching.speculating import BatchSpeculation
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
from runtime.results import GenerationResult, StreamChunk
from runtime.speculation.sampling import HostSampler, verify_chain
from runtime.text.prompts import PromptEncoding
from runtime.text.tokenizer import load_tokenizer
from runtime.text.tools import with_tool_calls

log = logging.getLogger("runtime.batching")


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
        lone_graph: run the calls of a lone sequence on the one-sequence target graph
            (`runtime.batching.lone`: a single client about as fast as on the one-at-a-time path, for
            the one-sequence graph's weights loaded a second time). Default (None): on with the
            onnxruntime CPU backend ("ort"), off on GPUs (device memory); never with a loaded `backend`.

    Use it as a context manager (or call :meth:`close`). :meth:`stream` and :meth:`generate` may be
    called from any number of threads; each request takes a slot when one is free.

    Raises:
        DFlashError: an artifact without the batched graph, or bad arguments.
    """

    def __init__(self, artifact_dir: str | Path, max_batch: int = DEFAULT_MAX_BATCH, threads: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, int4_accuracy_level: int | None = None,
                 backend: str | Backend = "ort", speculation: bool = True, lone_graph: bool | None = None):
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
        graphs = (BATCHED_GRAPH, draft_graph(m)) if self.speculates else (BATCHED_GRAPH,)
        # a lone sequence's calls on the one-sequence target graph (`runtime.batching.lone`)
        lone = (backend == "ort" if lone_graph is None else bool(lone_graph)) and lone_graph_fits(m) \
            and not isinstance(backend, Backend)
        graphs += (LONE_GRAPH,) if lone else ()
        self.backend = backend if isinstance(backend, Backend) else make_backend(
            backend, self.artifact_dir, m, threads, int4_accuracy_level, graphs=graphs)
        dtype = np.dtype(DTYPES[m["dtype"]])
        rows = max(prefill_chunk, 2 * max_batch)
        if self.speculates:
            rows = max(rows, max_batch * self.block_size)  # (a verify step: every sequence a whole block)
        self.calls = BatchedCalls(self.backend, m, max_batch, rows, dtype, features=self.speculates)
        self.calls.decide_row_padding()  # (before any slot holds a sequence: the probe writes slot 0)
        if lone:  # (after the batched graph's probe, which runs on that graph; the lone graph probes its own)
            self.calls.lone = LoneCalls(self.calls, m, dtype)
            self.calls.lone.decide_row_padding()
        self.speculation = BatchSpeculation(self.calls, m, self.artifact_dir, max_batch, prefill_chunk, dtype) \
            if self.speculates else None
        for slot in range(max_batch):  # (the probes above wrote the slots: a hybrid's states start from zero)
            self.calls.forget(slot)
        # a sequence's prompt rows per prefill call (a hybrid's delta rule takes at most max_call_rows)
        self.sequence_chunk = min(prefill_chunk, self.calls.sequence_rows or prefill_chunk)
        self.slots = SlotTable(max_batch)
        self.cond = threading.Condition()
        self.waiting: deque[BatchedSequence] = deque()
        self.active: list[BatchedSequence] = []
        self.steps = 0  # decoding calls run (read by tests and /health)
        self.speculative_steps = 0  # decoding calls that verified proposals (read by tests and /health)
        self.last_call_s = 0.0  # seconds of the last batched call (the policy's observation)
        # seconds of prefill calls and of decoding steps (proposals, call, commits), the prompt rows prefilled
        # and the tokens decoding steps gave: decode throughput apart from prompt processing (/health)
        self.prefill_seconds = self.decode_seconds = 0.0
        self.prefill_rows = self.decoded_tokens = 0
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="dflash-batch", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int] | None = None, *, messages=None, chat: bool = False,
               enable_thinking: bool | None = None, on_event=None, **options) -> BatchedGeneration:
        """Queue a generation; returns its :class:`BatchedGeneration` at once.

        Args: as :meth:`runtime.Session.stream` (prompt or messages, chat, enable_thinking, and the
            :class:`runtime.options.GenerationOptions` fields). `verify_len`: "auto" (default: the
            engine's policy), an integer or "all"; a tree "L+A" verifies its chain of L.
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
        tools = opts.tools if opts.uses_tools else None
        ids = self.encode(prompt, chat=chat, enable_thinking=enable_thinking, tools=tools) if messages is None \
            else self.encode_messages(messages, enable_thinking, tools)
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
        constraint = self.constraint(opts)  # (compiled here, in the caller's thread: a bad grammar changes nothing)
        with self.cond:
            if self.closed:
                raise DFlashError("this BatchEngine is closed; load the artifact again")
            self.waiting.append(BatchedSequence(handle, ids, opts, stops, decode, self.block_size if self.speculates else 1,
                                                constraint))
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
        encoded = [self.encode(p, chat=chat, tools=opts.tools if opts.uses_tools else None) for p in prompts]
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
        `--max-batch`), prompt + max_new_tokens beyond max_seq_len, stop ids or top_k outside the vocabulary, stop strings
        without a tokenizer."""
        if opts.drafter == "mtp":
            raise DFlashError('drafter "mtp" is not supported by the BatchEngine yet; use a Session (`runtime.load`, '
                              "or serve with --max-batch 1)")
        fixed = fixed_draft_block(self.manifest)
        check_speculation_options(opts, int(self.manifest["draft"]["block_size"]),
                                  fixed or max(MAX_BLOCK_SIZE, int(self.manifest["draft"]["block_size"])),
                                  limit_note=" (the draft's graph is fixed to its block)" if fixed else "")
        if len(ids) + opts.max_new_tokens > self.max_seq_len:
            raise DFlashError(f"prompt ({len(ids)} tokens) + max_new_tokens ({opts.max_new_tokens}) exceeds the KV "
                              f"buffers' max_seq_len {self.max_seq_len}; ask for at most "
                              f"{max(self.max_seq_len - len(ids), 0)} new tokens or shorten the prompt")
        check_vocabulary_options(opts, int(self.manifest["target"]["vocab_size"]), self.tokenizer is not None)

    def status(self) -> dict:
        """{"waiting", "running", "slots", "steps", "speculative_steps", "decoded_tokens", "decode_seconds",
        "prefill_rows", "prefill_seconds"} now (steps: decoding calls run so far; speculative_steps: those that
        verified proposals; decoded_tokens / decode_seconds: what decoding steps gave and their seconds, host
        work included: the decode throughput, prompt processing apart; prefill_rows / prefill_seconds: the prompt
        rows prefill calls took and their seconds)."""
        with self.cond:
            waiting = sum(not s.handle.cancelled.is_set() for s in self.waiting)  # (cancelled ones leave at the next step)
            return {"waiting": waiting, "running": len(self.active), "slots": self.max_batch, "steps": self.steps,
                    "speculative_steps": self.speculative_steps, "decoded_tokens": self.decoded_tokens,
                    "decode_seconds": round(self.decode_seconds, 6), "prefill_rows": self.prefill_rows,
                    "prefill_seconds": round(self.prefill_seconds, 6)}

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
            seq.reused = self.calls.keep(seq.slot, seq.reused)
            seq.cached = seq.reused
            if self.speculation is not None:
                self.speculation.drafts.reset(seq.slot, seq.reused)
            self.active.append(seq)

    def _leave(self, seq: BatchedSequence) -> None:
        """Free `seq`'s slot, which keeps the ids whose K/V it holds for a later prompt to reuse."""
        self.active.remove(seq)
        cached = (seq.prompt + seq.reply.out)[:seq.cached]
        self.slots.release(seq.slot, cached)
        self.cond.notify_all()  # (callers may wait on `cond` for the engine to go idle)

    def _fail(self, seqs: list[BatchedSequence], exc: Exception) -> None:
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

    def _step(self, active: list[BatchedSequence]) -> None:
        """One prefill call (the joining sequences' next prompt chunks, shortest first, at most
        `prefill_chunk` rows with padding) and one decoding call (every other running sequence, each
        with the proposals its draft made where the step speculates)."""
        prefilling = sorted((s for s in active if s.prefilling), key=lambda s: len(s.prompt) - s.cached)
        batch: list[BatchedSequence] = []
        for seq in prefilling:
            rows = min(len(seq.prompt) - seq.cached, self.sequence_chunk)
            if batch and (len(batch) + 1) * rows > self.prefill_chunk:  # each sequence is padded to the longest
                break
            batch.append(seq)
        if batch:
            t0, rows = time.perf_counter(), sum(min(len(s.prompt) - s.cached, self.sequence_chunk) for s in batch)
            self._call(batch, [((), None)] * len(batch), self.sequence_chunk)
            self.prefill_seconds += time.perf_counter() - t0
            self.prefill_rows += rows
        decoding = [s for s in self.active if not s.prefilling and s not in batch]
        if decoding:
            spec, t0 = self.speculation, time.perf_counter()
            before = sum(len(s.reply.out) for s in decoding)
            proposals, drafts = spec.propose(decoding) if spec is not None else ([((), None)] * len(decoding), [])
            proposals = [_grammar_proposals(s, p) for s, p in zip(decoding, proposals)]
            outcomes = self._call(decoding, proposals, 1)
            self.speculative_steps += bool(outcomes)
            if spec is not None:  # (the step's whole time: its host work differs between plain and speculative steps)
                spec.observe(len(decoding), self.last_call_s, drafts, outcomes, time.perf_counter() - t0)
            self.steps += 1
            self.decoded_tokens += sum(len(s.reply.out) for s in decoding) - before
            self.decode_seconds += time.perf_counter() - t0

    def _call(self, seqs: list[BatchedSequence], proposals: list, chunk: int) -> list[tuple[int, int, float]]:
        """One graph call for `seqs` (prefill chunks, or each sequence's last token and its (proposals,
        probabilities) of `proposals`); commits and emits each sequence's new tokens, keeps their taps and
        anchor for the draft, and lets finished ones leave. Returns (proposals verified, accepted, draft
        probability of the first) of each sequence that verified any. A failing call fails the
        generations in it (their slots are freed)."""
        rows = [s.next_rows(chunk, p[0]) for s, p in zip(seqs, proposals)]
        prefill = [s.prefilling for s in seqs]
        host = any(s.opts.on_host for s, r in zip(seqs, rows) if r.wanted)
        t0 = time.perf_counter()
        ids = self.calls.run(rows, keep_logits=host)
        self.last_call_s = time.perf_counter() - t0
        t, k, outcomes = self.calls.rows_per_sequence, 0, []
        for i, (seq, r, (props, probs)) in enumerate(zip(seqs, rows, proposals)):
            posterior, base = ids[k:k + r.wanted], k
            k += r.wanted
            sampler = HostSampler(seq.opts.temperature, seq.opts.top_k, seq.opts.top_p,
                                  lambda j, base=base: self.calls.read_logits(base + j), seq.constraint,
                                  seq.logprobs) if seq.opts.on_host else None
            if prefill[i]:
                committed_rows, tokens = len(r.ids), []
                if r.wanted:
                    tokens = [int(posterior[0]) if sampler is None else sampler.sample(0, r.uniforms[0])]
                acc = 0
            else:
                seq.verify_s += self.last_call_s
                n = len(props)
                acc, bonus = verify_chain(np.asarray(props, np.int64), posterior, np.asarray(r.uniforms, np.float32), sampler)
                committed_rows, tokens = 1 + acc, [*props[:acc], bonus]
                if n:
                    seq.acceptance.append(acc + 1)
                    outcomes.append((n, acc, None if probs is None else float(probs[0])))
            seq.cached += committed_rows
            self.calls.commit(i, committed_rows)
            if self.speculation is not None:  # (the graph's posterior row acc embeds its id: the anchor)
                anchor = self.calls.next_embeddings.rows(base + acc, 1) if tokens else None
                self.speculation.keep(seq, self.calls.taps.rows(i * t, committed_rows), committed_rows, anchor,
                                      bool(tokens) and tokens[-1] == int(posterior[acc]))
            if tokens:
                self._emit(seq, tokens)
        return outcomes

    def _emit(self, seq: BatchedSequence, tokens: list[int]) -> None:
        """Commit `tokens` to `seq`'s reply and emit them; a finished or cancelled sequence leaves."""
        if seq.t_first is None:
            seq.t_first = time.perf_counter()
        cancelled = seq.handle.cancelled.is_set()
        if not cancelled:
            start = len(seq.reply.out)
            chunk = seq.reply.commit(tokens)
            if seq.logprobs is not None:
                chunk.logprobs = seq.logprobs.entries[start:start + len(chunk.token_ids)]
            if seq.constraint is not None and seq.constraint.finished:  # the grammar is complete: the reply ends
                seq.reply.finish_reason = "stop"
            if seq.lookup is not None:
                seq.lookup.extend(chunk.token_ids)
            seq.handle.emit("chunk", chunk)
        if seq.finished or seq.handle.cancelled.is_set():
            if not seq.handle.cancelled.is_set():
                tail = seq.reply.finish()
                if tail:
                    seq.handle.emit("chunk", StreamChunk(tail, []))
                result = seq.result(seq.policy_name(self.speculates))
                if seq.opts.uses_tools:
                    with_tool_calls(result, self.tool_format, seq.opts)
                seq.handle.emit("done", result)
            with self.cond:
                self._leave(seq)


def _grammar_proposals(seq: BatchedSequence, proposal: tuple) -> tuple:
    """A constrained sequence's proposals: the draft's cut where the grammar forbids one (never verified),
    or the tokens the grammar forces where they are more (free proposals, verified like any)."""
    if seq.constraint is None:
        return proposal
    ids, probs = proposal
    ids = list(ids)[:seq.constraint.valid_prefix(list(ids))] if len(ids) else []
    room = seq.opts.max_new_tokens - len(seq.reply.out) - 1
    forced = seq.constraint.forced(min(max(seq.block_size - 1, 0), room)) if seq.block_size > 1 else []
    if len(forced) > len(ids):
        return tuple(forced), None
    return tuple(ids), probs if len(ids) else None
