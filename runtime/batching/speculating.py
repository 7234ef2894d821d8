"""Speculation in batched steps: each decoding sequence's proposals (its lookup continuation or its draft's),
the verify length of the call the policy (`runtime.speculation.batched`) chooses, and what the policy
learns from each step. The engine (`runtime.batching.engine`) runs the batched call between
:meth:`BatchSpeculation.propose` and :meth:`BatchSpeculation.observe`, and hands each sequence's committed
rows to :meth:`BatchSpeculation.keep`.
"""

from __future__ import annotations

import time

import numpy as np

from runtime.backends.base import View
from runtime.backends.profiles import draft_pending_rows
from runtime.batching.calls import BatchedCalls, SequenceRows
from runtime.batching.drafts import SlotDrafts
from runtime.batching.requests import BatchedSequence
from runtime.speculation.batched import MEASURED_ROWS, BatchedCallCosts, BatchedLength
from runtime.speculation.policy import (
    TRAINED_DRAFT_PRIOR,
    UNTRAINED_DRAFT_PRIOR,
    AcceptanceEstimate,
)

Proposed = tuple  # (proposal ids, the draft's probability of each or None for a lookup): ((), None) = none


class BatchSpeculation:
    """Each slot's draft (:class:`SlotDrafts`) and the batched policy, on an engine's batched calls.

    Args:
        calls: the engine's batched calls (their graph outputs the draft's inputs).
        manifest, artifact_dir: the artifact (its draft proposes ids).
        slots: cache slots.
        prefill_chunk: the most prompt rows one prefill call takes (a slot's pending taps hold one chunk
            and two blocks).
        dtype: numpy dtype of the draft's K/V and features.

    Start-up measures the call costs the policy starts from (:meth:`_measure_costs`): it runs before any
    slot holds a sequence.
    """

    def __init__(self, calls: BatchedCalls, manifest: dict, artifact_dir, slots: int, prefill_chunk: int, dtype):
        self.calls, self.slots = calls, int(slots)
        self.block_size = int(manifest["draft"]["block_size"])
        self.drafts = SlotDrafts(calls.backend, manifest, artifact_dir, slots, dtype,
                                 pending_rows=draft_pending_rows(manifest, prefill_chunk))
        prior = TRAINED_DRAFT_PRIOR if manifest["draft"].get("trained") else UNTRAINED_DRAFT_PRIOR
        self.policy = BatchedLength(self._measure_costs(), AcceptanceEstimate(prior, self.block_size - 1))

    # ---- a step --------------------------------------------------------------------------------
    def propose(self, seqs: list[BatchedSequence]) -> tuple[list[Proposed], list[tuple[int, float]]]:
        """Each decoding sequence's (proposals, the draft's probability of each or None for a lookup) for
        this step (empty: it decodes one row), and the draft calls' (block rows, seconds). A sequence with
        a fixed verify length drafts and verifies that many; the others, where the policy speculates this
        step, take their lookup continuation or draft the rows it asks for, and verify the length it
        chooses from their chances (or more, where a fixed one pads the call's rows anyway)."""
        policy = self.policy
        limits = [s.draft_limit() for s in seqs]
        # lookups cost no draft call: offered every step (unless they measured slower than plain steps at
        # this batch size), verified where they beat a plain call, as the one-sequence policy takes them;
        # drafts only where the policy speculates
        looks = policy.offers_lookups(len(seqs))
        offers = [s.lookup.propose(lim) if looks and s.lookup is not None and lim > 0 and s.fixed is None else []
                  for s, lim in zip(seqs, limits)]
        if not policy.speculates([lim if s.fixed is None else 0 for s, lim in zip(seqs, limits)]):
            limits = [lim if s.fixed is not None else 0 for s, lim in zip(seqs, limits)]
        elif policy.probing:  # a probe measures the draft: its sequences draft rather than look up
            offers = [[] for _ in seqs]
        rows = policy.draft_rows([lim if s.fixed is None and not o else 0 for s, lim, o in zip(seqs, limits, offers)])
        wanted = [lim if seq.fixed is not None else (0 if offer else min(rows, lim)) for seq, lim, offer in zip(seqs, limits, offers)]
        drafts: list[tuple[int, int, float]] = []
        proposed = self._draft(seqs, wanted, drafts)
        drafted = [proposed[i] if k > 0 else (offer, None) if offer else None
                   for i, (k, offer) in enumerate(zip(wanted, offers))]
        n = self._auto_length(seqs, drafted, rows, bool(any(offers)))
        cut = [d if d is None or s.fixed is not None else (d[0][:n], None if d[1] is None else d[1][:n])
               for s, d in zip(seqs, drafted)]
        return [d if d is not None else ((), None) for d in cut], drafts

    def keep(self, seq: BatchedSequence, taps: View, rows: int, anchor: View | None, anchor_valid: bool) -> None:
        """After a call: `seq`'s first `rows` rows of `taps` were committed (its draft reads them next), and,
        where it committed a token, `anchor` (`[1, d]`) embeds the graph's posterior of that position,
        which is the committed token iff `anchor_valid` (a host sample may be another)."""
        self.drafts.append(seq.slot, taps, rows)
        if anchor is not None:
            self.drafts.set_anchor(seq.slot, anchor)
            seq.anchor_valid = anchor_valid

    def observe(self, batch: int, call_s: float, drafts: list[tuple[int, int, float]],
                outcomes: list[tuple[int, int, float | None]], step_s: float) -> None:
        """What the policy learns from a decoding step of `batch` sequences (its call's seconds, the draft
        calls, the (verified, accepted, first probability) of each sequence that verified any, and the
        step's seconds from its proposals to its emitted tokens)."""
        committed = sum(1 + acc for _, acc, _ in outcomes) + batch - len(outcomes)
        # a step that verified lookups only (no draft call) joins neither rate: the speculative rate decides
        # whether to draft, and a lookup's 3-4 tokens a step counted there had the draft run on nearly
        # every other step at one sequence (1.4 tokens a step, slower than plain); beside drafts in a
        # step, a lookup's sequence counts one token, as a plain row would
        lookups_only = not drafts and any(n > 0 for n, _, _ in outcomes)
        if drafts:
            committed -= sum(acc for n, acc, first in outcomes if n > 0 and first is None)
        self.policy.observe(batch, self.calls.rows_per_sequence, call_s, drafts, outcomes, committed, step_s,
                            counted=not lookups_only)

    def _draft(self, seqs: list[BatchedSequence], wanted: list[int], drafts: list) -> dict[int, Proposed]:
        """The draft calls for sequence i's `wanted[i]` proposals (0: none), one per block size (one in
        all, with the batched draft graph), timed into `drafts` as (sequences, block rows, seconds).
        Returns {i: (ids, probabilities)}."""
        out: dict[int, Proposed] = {}
        for block in dict.fromkeys(s.block_size for s, k in zip(seqs, wanted) if k > 0):
            group = [i for i, (s, k) in enumerate(zip(seqs, wanted)) if k > 0 and s.block_size == block]
            rows = max(wanted[i] for i in group)
            t0 = time.perf_counter()
            results = self.drafts.propose([(seqs[i].slot, seqs[i].reply.out[-1]) for i in group], rows, block)
            seconds = time.perf_counter() - t0
            drafts.append((len(group), rows, seconds))
            for i, (ids, probs) in zip(group, results):
                seqs[i].draft_s += seconds / len(group)
                out[i] = (ids[:wanted[i]].tolist(), probs[:wanted[i]])
        return out

    def _auto_length(self, seqs: list[BatchedSequence], drafted: list, rows: int, offered: bool) -> int:
        """The verify length of the call: the policy's, from the automatic sequences' proposal chances
        (0: they verify nothing), at least the longest fixed request's where the policy verifies any."""
        policy = self.policy
        chances = [None if s.fixed is not None or d is None else
                   policy.draft_confidence(d[1]) if d[1] is not None else policy.lookup_confidence(len(d[0]))
                   for s, d in zip(seqs, drafted)]
        if all(c is None for c in chances):
            return 0
        drafted_rows = rows if any(c is not None and d[1] is not None for c, d in zip(chances, drafted)) else 0
        n = policy.verify_length(chances, drafted_rows, offered)
        fixed = max((len(d[0]) for s, d in zip(seqs, drafted) if s.fixed is not None and d is not None), default=0)
        return max(n, fixed) if n else 0

    # ---- start-up ------------------------------------------------------------------------------
    def _measure_costs(self) -> BatchedCallCosts:
        """Time batched calls of 1 (on the one-sequence graph, where the engine runs lone sequences there),
        slots / 2 and slots sequences x :data:`MEASURED_ROWS` rows (the faster
        of two, after 64 cached rows of zeros; beyond 4 rows per sequence only for one sequence,
        extrapolated for more: the start-up cost stays a few calls) and draft calls of 1 and block - 1
        rows (for one sequence and, with the batched draft graph, for every slot): the policy's cost
        curve, which the observed step times then scale. It writes slots' rows, which no one reads."""
        calls, drafts = self.calls, self.drafts
        batches = tuple(sorted({1, max(self.slots // 2, 1), self.slots}))
        rows = tuple(t for t in MEASURED_ROWS if t <= self.block_size) or (1,)
        past = min(64, calls.max_seq_len - rows[-1])
        seconds = np.zeros((len(batches), len(rows)))
        for i, b in enumerate(batches):
            for j, t in enumerate(rows):
                if b > 1 and j >= 3:  # a whole block at several sequences: extrapolated (they rarely pay)
                    seconds[i, j] = seconds[i, j - 1] + (seconds[i, j - 1] - seconds[i, j - 2]) * \
                        (t - rows[j - 1]) / (rows[j - 1] - rows[j - 2])
                    continue
                batch = [SequenceRows(slot, past, [1] * t, wanted=t) for slot in range(b)]
                seconds[i, j] = min(_timed(lambda: calls.run(batch)) for _ in range(2))  # (a new shape's first call is slower)
        draft_rows = tuple(sorted({1, max(self.block_size - 1, 1)}))
        draft_batches = tuple(sorted({1, self.slots})) if drafts.batched else (1,)
        draft_s = np.zeros((len(draft_batches), len(draft_rows)))
        for i, b in enumerate(draft_batches):
            for j, r in enumerate(draft_rows):
                draft_s[i, j] = min(self._timed_draft(b, r) for _ in range(2))  # (a new shape's first call is slower)
        return BatchedCallCosts(batches, rows, seconds, draft_rows, draft_s, draft_batches)

    def _timed_draft(self, sequences: int, rows: int) -> float:
        """Seconds of a draft call of `rows` block rows for slots 0..sequences - 1, each after two
        committed rows (the slots are reset after it)."""
        calls, drafts = self.calls, self.drafts
        calls.run([SequenceRows(slot, 0, [1, 2]) for slot in range(sequences)])  # (one batched call writes them all)
        for slot in range(sequences):
            drafts.append(slot, calls.taps.rows(slot * calls.rows_per_sequence, 2), 2)
            drafts.set_anchor(slot, calls.next_embeddings.rows(slot, 1))
        seconds = _timed(lambda: drafts.propose([(slot, 1) for slot in range(sequences)], rows))
        for slot in range(sequences):
            drafts.reset(slot, 0)
        return seconds


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
