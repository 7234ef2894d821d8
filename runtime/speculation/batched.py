"""The verify length of a batched step: how many draft proposals each running sequence's rows carry in
the one target call that decodes them all (`runtime.batching`).

A batched call runs B sequences of T rows each (padding included), so its cost is set by (B, T): every
sequence that drafts verifies up to T - 1 proposals, and one that does not only pads. The policy
chooses T per step to maximise expected committed tokens per second over the whole batch:

    rate(n) = sum_i E_i[tokens | min(n, limit_i)] / (call(B, 1 + n) + drafts(n) x draft call)

against plain batched decoding's B / call(B, 1), with the acceptance estimate by block position of
`runtime.speculation.policy.AcceptanceEstimate` (one for the engine, fed by every sequence's steps) and
the Leviathan et al. expected-tokens model that the one-sequence policy uses. Call costs are measured at
engine start for B in {1, slots} and T in {1, 2, 4, 8, 16} (interpolated between), and scaled by the
running ratio of observed to predicted seconds of plain and of speculative calls, as the one-sequence
policy scales its curve. Plain batched decoding wins unless speculation is predicted `margin` times
faster, and is probed (one proposal) after a gap that doubles while plain decoding keeps winning, so a
batch where speculation does not pay (B = 8 on a CPU) stays within a small fraction of plain batched
decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from runtime.speculation.policy import AcceptanceEstimate

# Rows per sequence at which batched call costs are measured (interpolated linearly between).
MEASURED_ROWS = (1, 2, 4, 8, 16)


@dataclass
class BatchedCallCosts:
    """Seconds of a batched target call by (sequences, rows per sequence), measured at two batch sizes.

    Attributes:
        batches: the measured batch sizes (ascending, e.g. (1, 8)).
        rows: the measured rows per sequence (ascending, :data:`MEASURED_ROWS`).
        seconds: `[len(batches), len(rows)]` measured seconds.
        draft_s: seconds of one sequence's draft call (a step's few context rows).
    """

    batches: tuple[int, ...]
    rows: tuple[int, ...]
    seconds: np.ndarray
    draft_s: float

    def call_s(self, batch: int, rows: int) -> float:
        """Predicted seconds of a call of `batch` sequences x `rows` rows (linear interpolation, clamped
        at the measured ends)."""
        per_batch = [float(np.interp(rows, self.rows, s)) for s in self.seconds]
        return float(np.interp(batch, self.batches, per_batch))


@dataclass
class BatchedLength:
    """Chooses each batched step's verify length (see the module docstring).

    Args:
        costs: the measured call costs.
        acceptance: the engine's running acceptance estimate by block position.
        margin: speculate only when predicted this much faster than plain batched decoding.
        probe_gap / max_probe_gap: plain steps before a probe, and the most (the gap doubles after each
            probe plain decoding still wins).
        smoothing: weight of one step in the running scales.
    """

    costs: BatchedCallCosts
    acceptance: AcceptanceEstimate
    margin: float = 1.03
    probe_gap: int = 8
    max_probe_gap: int = 128
    smoothing: float = 0.2
    plain_scale: float = field(default=1.0, init=False)
    spec_scale: float = field(default=1.0, init=False)
    draft_s: float = field(default=0.0, init=False)
    probing: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.first_probe_gap = self.probe_gap
        self.plain_run = 0
        self.draft_s = self.costs.draft_s

    def predicted_s(self, batch: int, rows: int) -> float:
        """Seconds predicted for a call of `batch` sequences x `rows` rows, scaled by what was observed."""
        scale = self.plain_scale if rows == 1 else self.spec_scale
        return scale * self.costs.call_s(batch, rows)

    def rate(self, limits: Sequence[int], n: int) -> float:
        """Expected committed tokens per second of a step where sequence i verifies min(n, limits[i])
        proposals (limits[i] = 0: it decodes one row, no draft call)."""
        tokens = self.acceptance.expected_tokens(max(max(limits), n, 1))
        committed = sum(float(tokens[min(n, lim)]) for lim in limits)
        drafts = sum(1 for lim in limits if lim > 0 and n > 0)
        return committed / (self.predicted_s(len(limits), 1 + n) + drafts * self.draft_s)

    def choose(self, limits: Sequence[int]) -> int:
        """The step's verify length n (0: plain) for sequences that may verify up to `limits[i]`
        proposals each (0 where one cannot: its reply ends, or its draft has no valid anchor)."""
        top = max(limits, default=0)
        if top <= 0:
            return 0
        plain = self.rate(limits, 0)
        rates = [self.rate(limits, n) for n in range(1, top + 1)]
        best = int(np.argmax(rates)) + 1
        if rates[best - 1] > self.margin * plain:
            self.plain_run, self.probing, self.probe_gap = 0, False, self.first_probe_gap
            return best
        self.plain_run += 1
        if self.plain_run < self.probe_gap:
            return 0
        self.plain_run, self.probing = 0, True
        return 1

    def observe(self, batch: int, rows: int, call_s: float, draft_s: Sequence[float],
                verified: Sequence[tuple[int, int]]) -> None:
        """Learn from one batched step: its call (`batch` x `rows`, `call_s` seconds), its draft calls'
        seconds, and each drafting sequence's (proposals verified, accepted)."""
        predicted = self.costs.call_s(batch, rows)
        if predicted > 0 and call_s > 0:  # a spike moves a scale at most 2x at a time
            scale = self.plain_scale if rows == 1 else self.spec_scale
            scale += self.smoothing * (min(max(call_s / predicted, 0.5 * scale), 2.0 * scale) - scale)
            if rows == 1:
                self.plain_scale = scale
            else:
                self.spec_scale = scale
        for s in draft_s:
            self.draft_s += self.smoothing * (s - self.draft_s)
        for n, accepted in verified:
            if n > 0:
                self.acceptance.observe(n, accepted)
        if self.probing and verified:  # the gap shrinks back only once speculation wins again (see choose)
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            self.probing = False
