"""The verify length of a batched step: how many draft proposals each running sequence's rows carry in
the one target call that decodes them all (`runtime.batching`).

A batched call runs B sequences of T rows each (padding included), so its cost is set by (B, T): a
sequence that drafted verifies up to T - 1 proposals, one that did not only pads. Each step decides
twice, as the one-sequence adaptive policy does with a proposing draft
(`runtime.speculation.confidence`):

1. Before the draft calls (:meth:`BatchedLength.draft_rows`): whether the sequences draft at all, and
   how many block rows their draft calls compute. They draft when the measured rate of drafted steps at
   this batch size (committed tokens per second, draft calls included; a model's best fixed length is
   its prior) beats plain batched decoding's B / call(B, 1) by `margin`; otherwise they decode plainly,
   and a drafted step is still tried after a gap that doubles while plain decoding keeps winning.
2. After them (:meth:`BatchedLength.verify_length`): the verify length n with the most expected
   committed tokens per second of the call, the draft calls being paid:

       sum_i (1 + sum_{k <= min(n, R_i)} prod_{j <= k} q_ij) / call(B, 1 + n)

   with q_ij sequence i's draft probability of its proposal j, calibrated online (accepted first
   proposals per unit of probability, as `ConfidenceTrim`), and n = 0 a plain call.

Call costs are measured at engine start for B in {1, slots / 2, slots} and T in {1, 2, 4, 8, 16} (interpolated
between), and scaled by the running ratio of observed to predicted seconds of plain and of speculative
calls. Where speculation does not pay (B = 8 on a CPU, where rows cost about what they earn) the
drafted rate stays below plain decoding's and the steps decode plainly, probes aside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from runtime.speculation.lookup import LOOKUP_PRIOR
from runtime.speculation.policy import AcceptanceEstimate

# Rows per sequence at which batched call costs are measured (interpolated linearly between).
MEASURED_ROWS = (1, 2, 4, 8, 16)


@dataclass
class BatchedCallCosts:
    """Measured seconds of batched target calls and of one sequence's draft call.

    Attributes:
        batches: the measured batch sizes (ascending, e.g. (1, 4, 8)).
        rows: the measured rows per sequence (ascending, :data:`MEASURED_ROWS`).
        seconds: `[len(batches), len(rows)]` seconds of a target call.
        draft_rows: block rows a measured draft call computed (ascending, e.g. (1, 15)).
        draft_seconds: seconds of those draft calls (a step's few context rows).
    """

    batches: tuple[int, ...]
    rows: tuple[int, ...]
    seconds: np.ndarray
    draft_rows: tuple[int, ...]
    draft_seconds: tuple[float, ...]

    def call_s(self, batch: int, rows: int) -> float:
        """Predicted seconds of a call of `batch` sequences x `rows` rows (linear interpolation, clamped
        at the measured ends)."""
        per_batch = [float(np.interp(rows, self.rows, s)) for s in self.seconds]
        return float(np.interp(batch, self.batches, per_batch))

    def draft_s(self, rows: int) -> float:
        """Predicted seconds of one draft call computing `rows` block rows."""
        return float(np.interp(rows, self.draft_rows, self.draft_seconds))


class BatchedLength:
    """Chooses what each batched step drafts and verifies (see the module docstring).

    Args:
        costs: the measured call costs.
        acceptance: the engine's running acceptance estimate by block position (the drafted rate's prior).
        margin: draft only when predicted this much faster than plain batched decoding.
        probe_gap / max_probe_gap: plain steps before a drafted probe, and the most (the gap doubles after
            each probe plain decoding still wins).
        smoothing: weight of one step in the running cost scales.
        prior_steps: drafted steps the model's prior rate is worth.
        decay: per-step decay of the drafted-rate and calibration evidence.
    """

    name = "batched-auto"

    def __init__(self, costs: BatchedCallCosts, acceptance: AcceptanceEstimate, margin: float = 1.03,
                 probe_gap: int = 8, max_probe_gap: int = 128, smoothing: float = 0.2, prior_steps: float = 2.0,
                 decay: float = 0.95):
        self.costs, self.acceptance = costs, acceptance
        self.margin, self.smoothing, self.prior_steps, self.decay = margin, smoothing, prior_steps, decay
        self.first_probe_gap = self.probe_gap = int(probe_gap)
        self.max_probe_gap = int(max_probe_gap)
        self.plain_scale = self.spec_scale = self.draft_scale = 1.0
        self.rows = 2  # block rows the draft calls compute (one more after a step that used them all)
        self.plain_run, self.probing = 0, False
        self.drafted: dict[int, list[float]] = {}  # batch size -> decayed [committed tokens, seconds] of drafted steps
        self.hits = self.mass = 0.0  # calibration evidence: accepted first proposals, their probabilities
        # acceptance of lookup continuations (`runtime.speculation.lookup`) by position: proposals without a draft call
        self.lookup_acceptance = AcceptanceEstimate(LOOKUP_PRIOR, len(acceptance.trials))
        self.decline_decay = 0.99  # evidence decay per declined lookup offer (LookupLength's rule)

    # ---- predictions ------------------------------------------------------------------------------
    def predicted_s(self, batch: int, rows: int) -> float:
        """Seconds predicted for a call of `batch` sequences x `rows` rows, scaled by what was observed."""
        scale = self.plain_scale if rows == 1 else self.spec_scale
        return scale * self.costs.call_s(batch, rows)

    def model_rate(self, limits: Sequence[int], n: int) -> float:
        """Committed tokens per second the acceptance estimate predicts for a step where sequence i drafts
        and verifies min(n, limits[i]) proposals (limits[i] = 0: one row, no draft call)."""
        tokens = self.acceptance.expected_tokens(max(max(limits), n, 1))
        committed = sum(float(tokens[min(n, lim)]) for lim in limits)
        drafts = sum(self._draft_s(min(n, lim)) for lim in limits if lim > 0 and n > 0)
        return committed / (self.predicted_s(len(limits), 1 + n) + drafts)

    def _draft_s(self, rows: int) -> float:
        return self.draft_scale * self.costs.draft_s(rows)

    @property
    def calibration(self) -> float:
        """Accepted first proposals per unit of the probability the draft gave them (prior 1.0, worth 8)."""
        return (self.hits + 8.0) / (self.mass + 8.0)

    # ---- the two decisions ----------------------------------------------------------------------------
    def draft_rows(self, limits: Sequence[int]) -> int:
        """Block rows this step's draft calls compute (0: a plain step, no draft call), for sequences that
        may verify up to `limits[i]` proposals (0 where one cannot: its reply ends, or it has no anchor)."""
        top = max(limits, default=0)
        if top <= 0:
            return 0
        b = len(limits)
        plain_rate = b / self.predicted_s(b, 1)
        rates = [self.model_rate(limits, n) for n in range(1, top + 1)]
        best = int(np.argmax(rates)) + 1
        prior_rate = rates[best - 1]
        prior_s = self.predicted_s(b, 1 + best) + sum(self._draft_s(min(best, lim)) for lim in limits if lim > 0)
        tokens, seconds = self.drafted.get(b, (0.0, 0.0))
        w = self.prior_steps
        rate = (tokens + w * prior_rate * prior_s) / (seconds + w * prior_s)
        if rate > self.margin * plain_rate:
            self.plain_run, self.probing, self.probe_gap = 0, False, self.first_probe_gap
            return min(self.rows, top)
        self.plain_run += 1
        if self.plain_run < self.probe_gap:
            return 0
        self.plain_run, self.probing = 0, True
        return min(self.rows, top)

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
        seconds = np.array([self.predicted_s(b, 1 + n) for n in range(top + 1)])
        rate = tokens / seconds
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
    def observe(self, batch: int, rows: int, call_s: float, drafts: Sequence[tuple[int, float]],
                outcomes: Sequence[tuple[int, int, float | None]], committed: int) -> None:
        """Learn from one batched step: its call (`batch` x `rows`, `call_s` seconds), its draft calls'
        (block rows, seconds) (empty: no draft call), each verifying sequence's (proposals verified,
        accepted, the draft's probability of its first proposal, or None for a lookup continuation) and
        the tokens the step committed in all."""
        predicted = self.costs.call_s(batch, rows)
        if predicted > 0 and call_s > 0:  # a spike moves a scale at most 2x at a time
            scale = self.plain_scale if rows == 1 else self.spec_scale
            scale += self.smoothing * (min(max(call_s / predicted, 0.5 * scale), 2.0 * scale) - scale)
            if rows == 1:
                self.plain_scale = scale
            else:
                self.spec_scale = scale
        for draft_rows, seconds in drafts:
            predicted = self.costs.draft_s(draft_rows)
            if predicted > 0 and seconds > 0:
                scale = self.draft_scale
                self.draft_scale += self.smoothing * (min(max(seconds / predicted, 0.5 * scale), 2.0 * scale) - scale)
        if drafts:
            d = self.drafted.setdefault(batch, [0.0, 0.0])
            d[0] = self.decay * d[0] + committed
            d[1] = self.decay * d[1] + call_s + sum(seconds for _, seconds in drafts)
        for n, accepted, first_prob in outcomes:
            if n > 0 and first_prob is None:
                self.lookup_acceptance.observe(n, accepted)
            elif n > 0:
                self.acceptance.observe(n, accepted)
                self.hits = self.decay * self.hits + float(accepted > 0)
                self.mass = self.decay * self.mass + float(first_prob)
        if self.probing and drafts:  # the gap shrinks back only once drafting wins again (see draft_rows)
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            self.probing = False
