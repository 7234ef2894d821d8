"""The verify length of a batched step: how many draft proposals each running sequence's rows carry in
the one target call that decodes them all (`runtime.batching`).

A batched call runs B sequences of T rows each (padding included), so its cost is set by (B, T): a
sequence that drafted verifies up to T - 1 proposals, one that did not only pads. Each step decides
twice, as the one-sequence adaptive policy does with a proposing draft
(`runtime.speculation.confidence`):

1. Before the draft calls (:meth:`BatchedLength.speculates`): whether the step verifies proposals at
   all. It does when the measured rate of speculative steps at this batch size (committed tokens per
   second, each step's whole time with its draft calls; a model's best drafted step is its prior) beats
   the measured rate of plain steps at this batch size by `margin`; otherwise no draft call runs (a
   sequence's lookup continuation is still verified where it beats a plain call, as the one-sequence
   policy takes them, unless steps that verified lookups only measured slower than plain steps at this
   batch size: :meth:`BatchedLength.offers_lookups`), and a speculative step is still tried after a gap (per batch size) that doubles
   while plain decoding keeps winning. Sequences with a lookup continuation take it (no draft call); the
   others draft :meth:`BatchedLength.draft_rows` block rows, in one batched draft call where the
   artifact has the batched draft graph. The speculative rate counts the steps that ran a draft call
   only: a lookup-only step's tokens say nothing about what drafting earns.
2. After them (:meth:`BatchedLength.verify_length`): the verify length n with the most expected
   committed tokens per second of the call, the draft calls being paid:

       sum_i (1 + sum_{k <= min(n, R_i)} prod_{j <= k} q_ij) / call(B, 1 + n)

   with q_ij sequence i's draft probability of its proposal j, calibrated online (accepted first
   proposals per unit of probability, as `ConfidenceTrim`), and n = 0 a plain call.

Call costs are measured at engine start for B in {1, slots / 2, slots} and T in {1, 2, 4, 8, 16} (interpolated
between), and scaled by the running ratio of observed to predicted seconds of plain and of speculative
calls. Both rates are measured in the same engine, so a cost model's error of a few percent cannot keep
a losing choice: where speculation does not pay (B = 8 on a CPU, where rows cost about what they earn)
its measured rate stays below plain decoding's and the steps decode plainly, probes aside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from runtime.graphs.costs import least_later
from runtime.speculation.lookup import LOOKUP_PRIOR
from runtime.speculation.policy import AcceptanceEstimate

# Rows per sequence at which batched call costs are measured (interpolated linearly between).
MEASURED_ROWS = (1, 2, 4, 8, 16)


@dataclass
class BatchedCallCosts:
    """Measured seconds of batched target calls and of draft calls.

    Attributes:
        batches: the measured batch sizes (ascending, e.g. (1, 4, 8)).
        rows: the measured rows per sequence (ascending, :data:`MEASURED_ROWS`).
        seconds: `[len(batches), len(rows)]` seconds of a target call.
        draft_rows: block rows a measured draft call computed (ascending, e.g. (1, 15)).
        draft_seconds: `[len(draft_batches), len(draft_rows)]` seconds of those draft calls (a step's
            few context rows per sequence).
        draft_batches: sequences of the measured draft calls (ascending; (1,) where each sequence runs
            its own draft call: then a step's draft calls cost the sum of theirs).
    """

    batches: tuple[int, ...]
    rows: tuple[int, ...]
    seconds: np.ndarray
    draft_rows: tuple[int, ...]
    draft_seconds: np.ndarray
    draft_batches: tuple[int, ...] = (1,)
    # predictions already made, by arguments: the policy asks for the same few every step (a step's
    # numpy interpolations were about 0.1 ms of host work at 8 sequences), and the measurements stay
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self):
        # monotone in rows and in sequences (a time slowed by other load counts as the least later one)
        self.seconds = least_later(least_later(np.asarray(self.seconds, np.float64), axis=1), axis=0)
        draft = least_later(np.atleast_2d(np.asarray(self.draft_seconds, np.float64)), axis=1)
        self.draft_seconds = least_later(draft, axis=0)

    def _kept(self, key: tuple, make):
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = make()
            if isinstance(got, np.ndarray):
                got.setflags(write=False)
        return got

    def call_s(self, batch: int, rows: int) -> float:
        """Predicted seconds of a call of `batch` sequences x `rows` rows (linear interpolation, clamped
        at the measured ends)."""
        return self._kept(("call", batch, rows), lambda: float(self.calls_s(batch, np.array([rows]))[0]))

    def calls_upto(self, batch: int, top: int) -> np.ndarray:
        """:meth:`calls_s` of `batch` sequences at 1 .. top + 1 rows (`[top + 1]`, read-only)."""
        return self._kept(("calls", batch, top), lambda: self.calls_s(batch, np.arange(1, top + 2)))

    def drafts_upto(self, top: int, most: int, sequences: int) -> np.ndarray:
        """:meth:`drafts_s` of `sequences` sequences at min(n, most) block rows, n = 1 .. top (`[top]`,
        read-only): a step whose drafting sequences draft up to `most` rows."""
        return self._kept(("drafts", top, most, sequences),
                          lambda: self.drafts_s(np.minimum(np.arange(1, top + 1), most), sequences))

    def calls_s(self, batch: int, rows: np.ndarray) -> np.ndarray:
        """:meth:`call_s` of `batch` sequences for each entry of `rows` (`[N]`)."""
        per_batch = np.array([np.interp(rows, self.rows, s) for s in self.seconds])  # [batches, N]
        return _between(batch, self.batches, per_batch)

    def draft_s(self, rows: int, sequences: int = 1) -> float:
        """Predicted seconds of drafting `rows` block rows for `sequences` sequences: one batched call
        (interpolated between the measured numbers of sequences), or one call each."""
        return self._kept(("draft", rows, sequences), lambda: float(self.drafts_s(np.array([rows]), sequences)[0]))

    def drafts_s(self, rows: np.ndarray, sequences: int) -> np.ndarray:
        """:meth:`draft_s` of `sequences` sequences for each entry of `rows` (`[N]`)."""
        per_batch = np.array([np.interp(rows, self.draft_rows, s) for s in np.atleast_2d(self.draft_seconds)])
        if len(self.draft_batches) == 1:
            return sequences * per_batch[0]
        return _between(sequences, self.draft_batches, per_batch)


def _between(batch: int, batches: tuple[int, ...], per_batch: np.ndarray) -> np.ndarray:
    """Rows of `per_batch` (`[len(batches), N]`, measured at `batches`) interpolated linearly at `batch`
    (clamped at the measured ends)."""
    w = np.interp(batch, batches, np.arange(len(batches), dtype=np.float64))
    lo = int(np.floor(w))
    hi = min(lo + 1, len(batches) - 1)
    return per_batch[lo] + (w - lo) * (per_batch[hi] - per_batch[lo])


class BatchedLength:
    """Chooses what each batched step drafts and verifies (see the module docstring).

    Args:
        costs: the measured call costs.
        acceptance: the engine's running acceptance estimate by block position (the drafted rate's prior).
        margin: draft only when predicted this much faster than plain batched decoding.
        probe_gap / max_probe_gap: plain steps before a drafted probe, and the most, per batch size (the gap
            doubles after each probe plain decoding still wins).
        smoothing: weight of one step in the running cost scales.
        prior_steps: steps the prior of a batch size's speculative rate is worth (the speculative / plain
            ratio measured at the nearest batch size, or, before any, the model's best drafted step).
        decay: per-step decay of the drafted-rate and calibration evidence.
    """

    def __init__(self, costs: BatchedCallCosts, acceptance: AcceptanceEstimate, margin: float = 1.03,
                 probe_gap: int = 8, max_probe_gap: int = 128, smoothing: float = 0.2, prior_steps: float = 2.0,
                 decay: float = 0.95):
        self.costs, self.acceptance = costs, acceptance
        self.margin, self.smoothing, self.prior_steps, self.decay = margin, smoothing, prior_steps, decay
        self.first_probe_gap, self.max_probe_gap = int(probe_gap), int(max_probe_gap)
        # batch size -> plain steps before its next probe (doubling while probes lose), plain steps since one
        self.probe_gaps: dict[int, int] = {}
        self.plain_runs: dict[int, int] = {}
        self.plain_scale = self.spec_scale = self.draft_scale = 1.0
        self.rows = 2  # block rows the draft calls compute (one more after a step that used them all)
        self.probing = False
        self._after_speculative: int | None = None  # the batch size of the last step, where it speculated
        # batch size -> decayed [committed tokens, seconds] of speculative steps (draft calls included) and
        # of plain steps: the rates the decision to speculate compares
        self.speculative: dict[int, list[float]] = {}
        self.plain: dict[int, list[float]] = {}
        self.hits = self.mass = 0.0  # calibration evidence: accepted first proposals, their probabilities
        self._tokens = None  # ((acceptance version, top), expected tokens): recomputed when the evidence changes
        # acceptance of lookup continuations (`runtime.speculation.lookup`) by position: proposals without a draft call
        self.lookup_acceptance = AcceptanceEstimate(LOOKUP_PRIOR, len(acceptance.trials))
        self.decline_decay = 0.99  # evidence decay per declined lookup offer (LookupLength's rule)
        # batch size -> decayed [committed tokens, seconds] of steps that verified lookups only, and the plain
        # steps before lookups are offered again where they measured slower than plain decoding (see offers_lookups)
        self.lookup_only: dict[int, list[float]] = {}
        self.lookup_gaps: dict[int, int] = {}
        self.lookup_waits: dict[int, int] = {}

    # ---- predictions ------------------------------------------------------------------------------
    def call_seconds(self, batch: int, top: int) -> np.ndarray:
        """Predicted seconds of a call of `batch` sequences x (1 + n) rows, n = 0..top (`[top + 1]`), scaled
        by what plain (n = 0) and speculative calls were observed to take."""
        s = self.costs.calls_upto(batch, top)
        return np.concatenate([[self.plain_scale * s[0]], self.spec_scale * s[1:]])

    def step_model(self, limits: Sequence[int], top: int) -> tuple[np.ndarray, np.ndarray]:
        """(expected committed tokens, predicted seconds) of a step where sequence i drafts and verifies
        min(n, limits[i]) proposals (limits[i] = 0: one row, no draft call), n = 0..top (`[top + 1]`
        each), from the acceptance estimate and the costs (it runs every step: one pass)."""
        a = self.acceptance
        if self._tokens is None or self._tokens[0] != (a.version, top):
            self._tokens = ((a.version, top), a.expected_tokens(top))
        lims = np.asarray(limits)
        upto = np.minimum(np.arange(top + 1)[:, None], lims[None, :])  # [top + 1, B]
        committed = self._tokens[1][upto].sum(axis=1)
        drafting = int((lims > 0).sum())
        drafts = np.zeros(top + 1)
        if drafting:  # one draft call computing the most rows any sequence drafts: min(n, the largest limit)
            drafts[1:] = self.draft_scale * self.costs.drafts_upto(top, int(lims.max()), drafting)
        return committed, self.call_seconds(len(limits), top) + drafts

    @property
    def calibration(self) -> float:
        """Accepted first proposals per unit of the probability the draft gave them (prior 1.0, worth 8)."""
        return (self.hits + 8.0) / (self.mass + 8.0)

    # ---- the two decisions ----------------------------------------------------------------------------
    def speculates(self, limits: Sequence[int]) -> bool:
        """Whether this step may verify proposals at all (lookups, drafts), for sequences that may verify up
        to `limits[i]` proposals (0 where one cannot: a plain request, no anchor, the reply ends): where
        the measured rate of speculative steps at this batch size (a model's best drafted step is its
        prior) beats the measured rate of plain steps by `margin`, or on a probe."""
        top = max(limits, default=0)
        if top <= 0:
            return False
        b = len(limits)
        committed, seconds = self.step_model(limits, top)
        best = int(np.argmax(committed[1:] / seconds[1:])) + 1
        w = self.prior_steps
        tokens, plain_s = self.plain.get(b, (0.0, 0.0))
        plain_rate = (tokens + w * b) / (plain_s + w * seconds[0])
        expected, prior_s = committed[best], seconds[best]  # the model's best speculative step
        gain = self._measured_gain(b)  # what speculation measured at the nearest batch size, where it has run
        if gain is not None:
            prior_s = float(expected / max(gain * plain_rate, 1e-12))
        tokens, spec_s = self.speculative.get(b, (0.0, 0.0))
        rate = (tokens + w * expected) / (spec_s + w * prior_s)
        if rate > self.margin * plain_rate:
            self.plain_runs[b], self.probing, self.probe_gaps[b] = 0, False, self.first_probe_gap
            return True
        self.plain_runs[b] = self.plain_runs.get(b, 0) + 1
        if self.plain_runs[b] < self._probe_gap(b):
            return False
        self.plain_runs[b], self.probing = 0, True
        return True

    def _probe_gap(self, batch: int) -> int:
        """Plain steps between probes at `batch`: its own gap, or, at a batch size not probed yet, the gap
        reached at the nearest one (probes that lost there would lose here too: rows cost more)."""
        if batch not in self.probe_gaps:
            near = min(self.probe_gaps, key=lambda b: (abs(b - batch), b), default=None)
            self.probe_gaps[batch] = self.first_probe_gap if near is None else self.probe_gaps[near]
        return self.probe_gaps[batch]

    def _measured_gain(self, batch: int) -> float | None:
        """Speculative over plain rate measured at the batch size nearest `batch` that has both (None:
        none has): the prior of a batch size not seen yet, as streams join and leave."""
        seen = [b for b in self.speculative if b in self.plain and b != batch]
        if not seen:
            return None
        near = min(seen, key=lambda b: (abs(b - batch), b))
        (st, ss), (pt, ps) = self.speculative[near], self.plain[near]
        return (st / ss) / (pt / ps) if ss > 0 and ps > 0 and pt > 0 else None

    def offers_lookups(self, batch: int) -> bool:
        """Whether this step at `batch` sequences may verify their lookup continuations. Each is verified
        where the cost model predicts it beats a plain call; what the steps that verified lookups only
        then measured guards that prediction (at several sequences every sequence's rows pad to the
        longest continuation): where their rate (committed tokens per second) fell below plain decoding's
        at this batch size, lookups wait `probe_gap` steps, a wait that doubles (up to `max_probe_gap`)
        while the next such step still loses."""
        looked, plain = self.lookup_only.get(batch), self.plain.get(batch)
        if not looked or not plain or min(looked[1], plain[0], plain[1]) <= 0:
            return True
        gap = self.lookup_gaps.get(batch, self.first_probe_gap)
        if looked[0] / looked[1] >= plain[0] / plain[1]:
            self.lookup_gaps[batch] = self.first_probe_gap
            return True
        waited = self.lookup_waits[batch] = self.lookup_waits.get(batch, 0) + 1
        if waited < gap:
            return False
        self.lookup_waits[batch], self.lookup_gaps[batch] = 0, min(2 * gap, self.max_probe_gap)
        return True

    def draft_rows(self, limits: Sequence[int]) -> int:
        """Block rows the draft calls of a speculating step compute for sequences that may draft up to
        `limits[i]` proposals (0: not at all): one more than the last drafted step verified when it used
        them all (see :meth:`verify_length`), at least one."""
        return min(self.rows, max(limits, default=0))

    def draft_confidence(self, probs: np.ndarray) -> np.ndarray:
        """Acceptance chances of a draft's proposals from its probabilities (fp32 `[R]`), calibrated."""
        return np.clip(self.calibration * np.asarray(probs, np.float64), 0.0, 1.0)

    def lookup_confidence(self, k: int) -> np.ndarray:
        """Conditional acceptance chances of a lookup continuation's first `k` tokens."""
        return self.lookup_acceptance.rates(min(k, len(self.lookup_acceptance.trials)))

    def verify_length(self, chances: Sequence[np.ndarray | None], drafted_rows: int = 0, lookups: bool = False) -> int:
        """The verify length n once the proposals are known: `chances[i]` is the chance that sequence i's
        proposal j is accepted given those before it were (`[R_i]`: :meth:`draft_confidence`,
        :meth:`lookup_confidence`), None where it has none. On a probe n >= 1. `drafted_rows`: the rows
        this step's draft calls computed (the next step's draft one more where n used them all, one fewer
        where it left two). Where `lookups` were offered and n = 0, their evidence decays toward the prior
        (only verified lookups bring evidence)."""
        b = len(chances)
        top = max((len(q) for q in chances if q is not None), default=0)
        tokens = np.full(top + 1, float(b))
        for q in chances:
            if q is not None and len(q):
                gain = np.concatenate([[0.0], np.cumsum(np.cumprod(q))])
                tokens += np.concatenate([gain, np.full(top - len(q), gain[-1])])
        rate = tokens / self.call_seconds(b, top)
        if self.probing and top:
            rate[0] = -np.inf
        n = int(np.argmax(rate))
        if rate[n] < self.margin * rate[0]:  # (verifying must beat a plain call by the margin)
            n = 0 if not self.probing else n
        if drafted_rows and n >= drafted_rows:
            self.rows = min(self.rows + 1, len(self.acceptance.trials))
        elif n < drafted_rows - 1:
            self.rows = max(self.rows - 1, 1)
        if lookups and n == 0:
            self.lookup_acceptance.forget(self.decline_decay)
        return n

    # ---- learning ---------------------------------------------------------------------------------------
    def _moved(self, scale: float, observed: float, predicted: float) -> float:
        """A running observed / predicted ratio after one more observation (a spike moves it at most 2x)."""
        if predicted <= 0 or observed <= 0:
            return scale
        return scale + self.smoothing * (min(max(observed / predicted, 0.5 * scale), 2.0 * scale) - scale)

    def observe(self, batch: int, rows: int, call_s: float, drafts: Sequence[tuple[int, int, float]],
                outcomes: Sequence[tuple[int, int, float | None]], committed: int, step_s: float | None = None,
                counted: bool = True) -> None:
        """Learn from one batched step: its call (`batch` x `rows`, `call_s` seconds), its draft calls'
        (sequences, block rows, seconds) (empty: no draft call), each verifying sequence's (proposals
        verified, accepted, the draft's probability of its first proposal, or None for a lookup
        continuation), the tokens the step committed in all, and the step's whole seconds (host work
        included; default: its call and draft calls), which the speculative and plain rates count (a plain
        step right after a speculative one at the same batch size passes its excess over the plain rate
        to the speculative rate). `counted` False: a step that verified lookups only (no draft call): its
        call cost and the lookups' acceptance count, but it joins neither rate (the speculative rate is
        the drafting steps', what `speculates` decides on), and a probe it ended tested nothing; it joins
        the lookup-only rate instead (:meth:`offers_lookups`)."""
        if rows == 1:
            self.plain_scale = self._moved(self.plain_scale, call_s, self.costs.call_s(batch, rows))
        else:
            self.spec_scale = self._moved(self.spec_scale, call_s, self.costs.call_s(batch, rows))
        for sequences, draft_rows, seconds in drafts:
            self.draft_scale = self._moved(self.draft_scale, seconds, self.costs.draft_s(draft_rows, sequences))
        speculative = bool(drafts) or any(n > 0 for n, _, _ in outcomes)
        seconds = step_s if step_s is not None else call_s + sum(s for _, _, s in drafts)
        if not counted:
            for n, accepted, _ in outcomes:
                if n > 0:
                    self.lookup_acceptance.observe(n, accepted)
            looked = self.lookup_only.setdefault(batch, [0.0, 0.0])
            looked[0], looked[1] = self.decay * looked[0] + committed, self.decay * looked[1] + seconds
            self._after_speculative, self.probing = None, False
            return
        plain = self.plain.get(batch)
        if not speculative and self._after_speculative == batch and plain and plain[0] > 0 and batch in self.speculative:
            # the first plain step after a speculative one runs slower (another call shape ran between):
            # its excess over the plain rate is the speculative step's cost
            excess = max(0.0, seconds - committed * plain[1] / plain[0])
            self.speculative[batch][1] += excess
            seconds -= excess
        self._after_speculative = batch if speculative else None
        d = (self.speculative if speculative else self.plain).setdefault(batch, [0.0, 0.0])
        d[0] = self.decay * d[0] + committed
        d[1] = self.decay * d[1] + seconds
        for n, accepted, first_prob in outcomes:
            if n > 0 and first_prob is None:
                self.lookup_acceptance.observe(n, accepted)
            elif n > 0:
                self.acceptance.observe(n, accepted)
                self.hits = self.decay * self.hits + float(accepted > 0)
                self.mass = self.decay * self.mass + float(first_prob)
        if self.probing and speculative:  # the gap shrinks back only once speculating wins again (see speculates)
            self.probe_gaps[batch] = min(2 * self._probe_gap(batch), self.max_probe_gap)
            self.probing = False
