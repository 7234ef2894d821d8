"""Choosing the verify shape after the draft call, from the draft's own confidence.

Where the draft graph ends in the proposal head (`runtime.manifest.draft_proposes`), each draft call
returns, per block row it computed, its top candidates and their probabilities. The draft's top-1
probability predicts whether the target accepts that proposal: the shipped draft's is close to
calibrated on held-out prompts (figures: docs/performance.md#the-drafts-confidence-2026-12-03).
Acceptance itself comes in short bursts only (the step after an accepted first proposal accepts its
first about as often as any step: docs/speculation.md#speculation-that-never-loses---verify-len-auto),
so a policy that reads only past acceptance cannot tell a good step from a bad one; the draft's
probabilities can.

So the step verifies the shape with the most expected committed tokens net of what its rows cost,
the draft's cost being already paid: verifying a chain of L proposals with calibrated probabilities
q_1..q_L commits 1 + sum_k prod_{j<=k} q_j tokens on average (each proposal counts only if every one
before it was accepted), and costs `verify_s(L)`, worth `verify_s(L) / plain_step_s` tokens of plain
decoding. A verify tree's alternatives for block position 1 (ranks 1..A) add their probabilities.
This is the confidence rule of BiLD (Kim et al., "Speculative Decoding with Big Little Decoder",
NeurIPS 2023: the small model hands over when its top probability falls below a threshold) and
SpecDec++ (Huang et al., 2024: stop proposing once the predicted chance of a rejection outweighs the
cost of verifying more), applied once to the rows of one parallel DFlash draft call instead of token
by token, with the threshold derived from the measured verify costs.

The probabilities are calibrated online: one running ratio of the first proposals accepted to the
probability the draft gave them (prior 1.0: the shipped draft is calibrated), so an over- or
under-confident draft is corrected within tens of steps.
"""

from __future__ import annotations

import numpy as np


class ConfidenceTrim:
    """The verify shape after a proposing draft call (see module docstring).

    Args:
        verify_s: predicted seconds of the target call verifying n = 0..M nodes once the draft ran
            (`runtime.graphs.costs.CallCosts.verify_s`; n = 0 is a plain target call).
        alternatives: the most rank-1.. candidates a verify tree may add for block position 1 (0: chains).
        prior_weight: pseudo-observations the prior calibration (1.0) is worth.
        decay: per-observation decay of the calibration evidence.
    """

    def __init__(self, verify_s: np.ndarray, alternatives: int = 0, prior_weight: float = 8.0, decay: float = 0.98):
        self.verify_s = np.asarray(verify_s, np.float64)
        self.alternatives = int(alternatives)
        self.weight, self.decay = float(prior_weight), float(decay)
        self.hits = self.mass = 0.0
        self.first_prob = None  # the verified first proposal's probability, until observed

    @property
    def calibration(self) -> float:
        """Accepted first proposals per unit of the probability the draft gave them (running)."""
        return (self.hits + self.weight) / (self.mass + self.weight)

    def choose(self, probs: np.ndarray, plain_step_s: float, cost_scale: float = 1.0, least: int = 0) -> tuple[int, int]:
        """(chain length L, alternatives A) to verify; (0, 0) is a plain target call.

        Args:
            probs: fp32 `[R, K]`, the draft's probabilities of its top-K candidates for block
                positions 1..R (rank order); L <= R.
            plain_step_s: seconds of a plain decoding step (what one token is worth).
            cost_scale: the running ratio of observed to predicted speculative step times.
            least: the shortest chain to verify (1 on a probe: the calibration learns only from
                verified proposals, so a draft it has written off can earn its way back).
        """
        probs = np.asarray(probs, np.float64)
        rows = min(probs.shape[0], len(self.verify_s) - 1)
        q = np.clip(self.calibration * probs[:rows, 0], 0.0, 1.0)
        tokens = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(q))])  # L = 0..rows
        cost = self.verify_s * cost_scale / max(plain_step_s, 1e-9)
        cost[0] = 1.0  # a plain call after the draft is one plain step (its draft call is already paid)
        alts = min(self.alternatives, probs.shape[1] - 1)
        extra = np.cumsum(np.clip(self.calibration * probs[0, 1:alts + 1], 0.0, 1.0)) if alts and rows else []
        shape = self._best(tokens, cost, extra, rows, 0)
        if shape[0] < least <= rows:
            shape = self._best(tokens, cost, extra, rows, least)
        self.first_prob = float(probs[0, 0]) if shape[0] else None
        return shape

    @staticmethod
    def _best(tokens, cost, extra, rows: int, least: int) -> tuple[int, int]:
        """The shape (L >= least) with the most expected tokens net of cost."""
        value = tokens - cost[: rows + 1]
        value[:least] = -np.inf
        length = int(np.argmax(value))
        best, shape = float(value[length]), (length, 0)
        for length in range(max(least, 1), rows + 1):
            for a in range(1, min(len(extra), len(cost) - 1 - length) + 1):
                v = tokens[length] + extra[a - 1] - cost[length + a]
                if v > best:
                    best, shape = v, (length, a)
        return shape

    def observe(self, first_accepted: bool) -> None:
        """Whether the top-1 proposal for block position 1 of the last chosen shape was accepted."""
        if self.first_prob is None:
            return
        self.hits = self.decay * self.hits + float(first_accepted)
        self.mass = self.decay * self.mass + self.first_prob
        self.first_prob = None


class DraftConfidence:
    """The adaptive policy's part for a draft that returns its probabilities: the verify shape is
    chosen after the draft call (:class:`ConfidenceTrim`), the draft computes `rows` rows (one more
    than the last step verified when it used them all, one fewer when it used two fewer), and
    whether to call the draft at all follows the measured rate of drafted steps: committed tokens
    per second over the recent ones (decayed sums), with the model's best fixed shape as a prior
    worth `prior_steps` steps.

    Args:
        costs: the artifact's measured step costs (`runtime.graphs.costs.CallCosts`).
        positions: the most proposals a step verifies (block_size - 1).
        alternatives: verify-tree alternatives the policy may add for block position 1.
    """

    def __init__(self, costs, positions: int, alternatives: int = 0, prior_steps: float = 2.0):
        self.verify_s = costs.verify_s(np.arange(positions + alternatives + 1))
        one_step_s = float(costs.step_s(np.arange(2))[1])
        self.trimmer = ConfidenceTrim(self.verify_s, alternatives)
        self.positions = int(positions)
        self.rows = 2
        self.prior_steps = float(prior_steps)
        self.draft_mean_s = max(one_step_s - float(self.verify_s[1]), 0.0)  # running mean of a draft call (no catch-up)
        self.tokens = self.seconds = 0.0  # decayed sums over drafted steps

    def start(self) -> None:
        """A new request: the last one's drafted steps count for half."""
        self.tokens *= 0.5
        self.seconds *= 0.5

    def rate(self, prior_rate: float, prior_step_s: float) -> float:
        """Committed tokens per second of the recent drafted steps, with `prior_rate` (tokens per
        second) worth `prior_steps` steps of `prior_step_s` seconds each."""
        w = self.prior_steps
        return (self.tokens + w * prior_rate * prior_step_s) / (self.seconds + w * prior_step_s)

    def trim(self, probs: np.ndarray, plain_step_s: float, cost_scale: float, least: int) -> tuple[int, int]:
        """(chain length, alternatives) to verify given the draft's probabilities `probs` (fp32
        `[R, K]`), adapting the rows the next draft call computes."""
        rows = len(probs)
        length, alternatives = self.trimmer.choose(probs, plain_step_s, cost_scale, least=least)
        if length >= rows >= self.rows:  # used every row it asked for (not a limit's cut)
            self.rows = min(self.rows + 1, self.positions)
        elif length < rows - 1:
            self.rows = max(self.rows - 1, 1)
        return length, alternatives

    def observe(self, verified: int, accepted: int, seconds: float, catch_up: bool, draft_seconds: float,
                first_rank: int | None, smoothing: float, decay: float = 0.95) -> None:
        """A drafted step's committed tokens and time join the drafted rate, and its first proposal's
        outcome the trimmer's calibration. Both rates are measured in the same loop (no cost model
        between them: a model's error of a few percent decides break-even cases the wrong way). A
        catch-up step's draft call read the rows of the plain steps before it: it counts at the usual
        draft time instead (a running mean), as that extra is the plain steps' debt."""
        if catch_up or seconds <= 0:
            seconds = max(seconds - draft_seconds, 0.0) + self.draft_mean_s
        elif draft_seconds > 0:
            self.draft_mean_s += smoothing * (draft_seconds - self.draft_mean_s)
        self.tokens = decay * self.tokens + 1 + accepted
        self.seconds = decay * self.seconds + seconds
        if verified:
            self.trimmer.observe(accepted > 0 and first_rank in (None, 0))
