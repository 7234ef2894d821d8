"""Speculation policies: how many of the draft's proposals the target verifies at each step.

The decoding loop asks its policy once per step (`proposals`) and reports what happened
(`observe`); it does not care which policy runs (the shape of llama.cpp's common/speculative.cpp).

- :class:`FixedLength`: always `n` proposals (`verify_len=n`; `n = 0` is plain decoding).
- :class:`FixedTree`: always one verify tree (`verify_len="L+A"`, `runtime.graphs.tree`).
- :class:`AdaptiveLength` (the default): per step, the length with the most expected committed tokens
  per second, from the measured cost of a target call by proposal count (:mod:`runtime.graphs.costs`)
  and a running estimate of acceptance by block position; 0 (a plain step without a draft call) when
  no length wins.

The choice follows the expected-tokens analysis of Leviathan et al., "Fast Inference from Transformers
via Speculative Decoding" (ICML 2023, section 3: with acceptance a, verifying n proposals commits
(1 - a^(n+1)) / (1 - a) tokens on average, and the best n maximises that over the step's cost), made
per position and online as in SmartSpec (Liu et al., "Optimizing Speculative Decoding for Serving
Large Language Models Using Goodput", arXiv 2406.14066: the proposal length maximising goodput =
expected accepted tokens / measured batch time, with acceptance as a moving average). DFlash drafts
the whole block in one pass whatever n is, so n changes only the verify cost, and the draft's cost is
paid or skipped as a whole.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from runtime.graphs.tree import VerifyTree, verify_tree
from runtime.speculation.confidence import DraftConfidence
from runtime.speculation.lookup import LOOKUP_PRIOR, LookupLength
from runtime.speculation.proposals import Choice, Proposal, Shape, StepRecord

# Prior acceptance of the first proposal. Trained: the shipped SmolLM2 draft's first-position
# acceptance, greedy, held-out models/prompts/eval.jsonl (`python -m dflash_export bench ARTIFACT
# --limit 2 --policies 15`: positional_acceptance[0] in bench.json). Untrained (random) drafts: start
# plain and let the probes find out.
TRAINED_DRAFT_PRIOR = 0.45
UNTRAINED_DRAFT_PRIOR = 0.02
# Prior of the draft's rank-r candidate for block position 1 being the target's token when ranks < r
# were not (r = 1, 2, 3: the verify tree's alternatives, `runtime.graphs.tree`). Trained: the shipped SmolLM2
# draft's top-1..4 coverage on held-out prompts as first measured (docs/performance.md: that measurement
# gave the draft one position too many; `bench ART --draft-ranks` measures it as decoding runs).
TRAINED_ALTERNATIVE_PRIOR = (0.21, 0.13, 0.12)
UNTRAINED_ALTERNATIVE_PRIOR = (0.01, 0.01, 0.01)


def budget_spacing(extra_s: float | None, budget: float, step_s: float | None) -> int:
    """Steps of `step_s` seconds between two tries that each cost `extra_s` seconds more than the step they
    replace, so that the tries cost at most `budget` (a fraction) of the time; 0 while either is unknown or
    the tries pay for themselves."""
    if extra_s is None or not step_s or step_s <= 0 or extra_s <= 0:
        return 0
    return int(np.ceil(extra_s / (budget * step_s) - 1e-6))


class Policy(ABC):
    """Chooses what each step verifies, from the proposals it is offered and the measured costs, and
    learns from one :class:`StepRecord` per step.

    Per step the loop asks :meth:`choose` (with any proposal a cheap proposer such as the n-gram
    lookup offers before the draft runs), runs the draft for the chosen shape, asks :meth:`refine`
    where the draft returned its probabilities, verifies, and reports the step to :meth:`observe`.
    """

    name = "abstract"
    uses_lookup = False  # whether the loop should offer lookup proposals (it then keeps an n-gram index)

    def start(self) -> None:
        """A new generate call begins (a new prompt)."""

    @abstractmethod
    def proposals(self, limit: int) -> Shape:
        """The draft shape to verify this step: 0..`limit` top-1 proposals (0: a plain step without a
        draft call; `limit`: what the block and the remaining token budget allow) or a verify tree."""

    def choose(self, limit: int, offers: Sequence[Proposal] = (), draft_ready: bool = True) -> Choice:
        """This step's choice: the first ids of an offered proposal where :meth:`take_offer` takes
        them, else the draft shape of :meth:`proposals` (0 without asking it where not `draft_ready`:
        the block's first embedding is not the committed token's, after a host sample)."""
        shape = self.proposals(limit) if draft_ready else 0
        for offer in offers:
            n = self.take_offer(limit, offer, shape)
            if n:
                return Choice(n, offer)
        return Choice(shape)

    def take_offer(self, limit: int, offer: Proposal, shape: Shape) -> int:
        """How many of `offer`'s ids (a lookup continuation) to verify instead of the draft `shape`; 0
        keeps the shape. This default never takes one (explicit verify lengths, plain decoding)."""
        return 0

    def take_lookup(self, limit: int, offer: Proposal, threshold: float) -> int:
        """How many of a lookup `offer`'s ids to verify where they must beat `threshold` committed tokens
        per second (another drafter's measured rate); this default takes none."""
        return 0

    def refine(self, shape: Shape, proposal: Proposal) -> Shape:
        """After the draft call, where it returned probabilities (`proposal.probs`, fp32 `[R, K]`: its
        top-K candidates for block positions 1..R, R the chain length of `shape`): what to verify.
        Returns `shape` or a smaller one (0: a plain target call). This default keeps `shape`."""
        return shape

    def observe(self, record: StepRecord) -> None:
        """Learn from what the last step did (:class:`StepRecord`). This default learns nothing."""


class FixedLength(Policy):
    """Always verify `n` proposals (or fewer when the limit says so); `n = 0` is plain decoding."""

    def __init__(self, n: int):
        self.n = int(n)
        self.name = "plain" if self.n == 0 else "fixed"  # (GenerationResult.policy)

    def proposals(self, limit: int) -> Shape:
        return min(self.n, limit)


class FixedTree(Policy):
    """Always verify `tree` (`verify_len="L+A"`), or a chain of what the limit allows when it is shorter."""

    name = "fixed-tree"

    def __init__(self, tree: VerifyTree):
        self.tree = tree

    def proposals(self, limit: int) -> Shape:
        return self.tree if limit >= self.tree.length else max(limit, 0)


class AcceptanceEstimate:
    """Running estimate of conditional acceptance by block position.

    p_0 = (hits_0 + w * prior) / (trials_0 + w) and p_j = (hits_j + w * carry * p_(j-1)) / (trials_j + w):
    a position without evidence is taken to accept a little less than the one before it (as the shipped
    draft's conditional acceptance by position roughly does; figures:
    docs/performance.md#step-cost-measurement-and-acceptance-by-position-2026-12-01), so one accepted
    long probe lifts the whole curve and deep positions are tried once the shallow ones earn it. A step
    that verified n proposals and accepted a counts a trial at positions 0..min(a, n-1) and a hit at
    0..a-1. Evidence decays by `decay` per observed step (about 1 / (1 - decay) steps of memory), so the
    estimate follows the text being written.

    Args:
        prior: prior acceptance of the first proposal, in [0, 1].
        positions: the most proposals a step can verify (block_size - 1).
        prior_weight: pseudo-trials the prior is worth.
        decay: per-step evidence decay, in (0, 1].
        carry: a position's prior as a fraction of the estimate before it.
    """

    def __init__(self, prior: float, positions: int, prior_weight: float = 2.0, decay: float = 0.95, carry: float = 0.85,
                 alternative_prior: tuple[float, ...] = UNTRAINED_ALTERNATIVE_PRIOR):
        self.prior = min(max(float(prior), 0.0), 1.0)
        self.carry = float(carry)
        self.weight = float(prior_weight)
        self.decay = float(decay)
        self.trials = np.zeros(positions)
        self.hits = np.zeros(positions)
        # the verify tree's alternatives for position 1: P(rank r is the target's token | ranks < r are not)
        self.alternative_prior = np.clip(np.asarray(alternative_prior, np.float64), 0.0, 1.0)
        self.alt_trials = np.zeros(len(self.alternative_prior))
        self.alt_hits = np.zeros(len(self.alternative_prior))
        self.version = 0  # counts the changes of the evidence (a policy caches what it derived from it)

    def rates(self, n: int | None = None) -> np.ndarray:
        """p_j for positions 0..n-1 (default: all)."""
        n = len(self.trials) if n is None else n
        hits, trials = self.hits[:n].tolist(), self.trials[:n].tolist()  # plain floats: this runs every step
        out, prior, w = [], self.prior, self.weight
        for h, t in zip(hits, trials):
            out.append((h + w * prior) / (t + w))
            prior = self.carry * out[-1]
        return np.asarray(out)

    def expected_tokens(self, n: int | None = None) -> np.ndarray:
        """E[tokens committed] when verifying 0..n proposals: 1 + sum_k prod_{j<k} p_j (`[n + 1]`)."""
        out, alive = [1.0], 1.0
        for p in self.rates(n).tolist():
            alive *= p
            out.append(out[-1] + alive)
        return np.asarray(out)

    def alternative_tokens(self, n: int) -> np.ndarray:
        """E[accepted alternative] given that the top-1 first proposal failed, when also verifying the
        rank 1..a candidates for position 1, for a = 0..n (`[n + 1]`, 0 at a = 0)."""
        q = (self.alt_hits[:n] + self.weight * self.alternative_prior[:n]) / (self.alt_trials[:n] + self.weight)
        out, missed = [0.0], 1.0
        for rate in q.tolist():
            out.append(out[-1] + missed * rate)
            missed *= 1.0 - rate
        return np.asarray(out)

    def observe(self, verified: int, accepted: int, alternatives: int = 0, first_rank: int | None = None) -> None:
        """Count one speculative step: a chain of `verified` >= 1 top-1 proposals of which `accepted`
        were, plus, on a verify-tree step, `alternatives` more candidates for position 1, of which the
        rank-`first_rank` one was accepted (None: none was)."""
        self.version += 1
        self.trials *= self.decay
        self.hits *= self.decay
        self.alt_trials *= self.decay
        self.alt_hits *= self.decay
        top1 = first_rank in (None, 0)
        chain_accepted = accepted if top1 else 0
        self.trials[: min(chain_accepted + 1, verified)] += 1.0
        self.hits[:chain_accepted] += 1.0
        if alternatives and not chain_accepted:  # the alternatives were tried in rank order
            tried = alternatives if first_rank is None else first_rank
            self.alt_trials[:tried] += 1.0
            if first_rank is not None:
                self.alt_hits[first_rank - 1] += 1.0

    def forget(self, keep: float) -> None:
        """Scale the evidence by `keep` (a new prompt: the prior and the last text both count)."""
        self.version += 1
        self.trials *= keep
        self.hits *= keep
        self.alt_trials *= keep
        self.alt_hits *= keep


class AdaptiveLength(Policy):
    """Verify the length with the most expected committed tokens per second (see module docstring).

    A plain step wins unless some n is predicted `margin` times faster (estimates are noisy, and a wrong
    plain step costs nothing against plain decoding). A plain step is predicted to take
    `plain_scale * S(0)` and a step verifying n > 0 proposals `spec_scale * S(n)`, S from the measured
    step costs (`runtime.graphs.costs.CallCosts`) and each scale a running ratio of observed to
    predicted times of that kind of step: they absorb the growing past and other load, and correct a
    disturbed first measurement of what speculation costs relative to plain decoding (a 2-round
    measurement on a noisy machine can be far off:
    docs/performance.md#step-cost-measurement-and-acceptance-by-position-2026-12-01) without changing
    the curve's shape. When plain decoding wins, a speculative step is still tried after `probe_gap`
    plain steps so a draft that starts to fit the text is noticed (a probe verifies one proposal, and
    its time updates `spec_scale`); each probe after which plain decoding still wins doubles the gap (up
    to `max_probe_gap`). A probe costs more than a plain step (a draft call with its catch-up on the
    context the plain steps added, and a longer target call) but commits its accepted token too, so its
    cost is counted net of what it committed beyond a plain step's one token, as a running mean, and the
    gap is also at least what keeps that net cost within `probe_budget` of the plain decoding time. The
    gap may grow to 128 plain steps: on an artifact where speculation never pays each probe is a small
    loss, and a 128-token reply then pays for one, not two (a probe's cost and what the replay showed:
    docs/speculation.md#speculation-that-never-loses---verify-len-auto). One instance lives as long as
    its Session, so what it learned carries over to the next generate call: a new prompt starts at half
    the gap it had reached, not at `probe_gap`, and the plain steps since the last probe still count (so
    the budget holds over many short replies, not only within one: counting afresh per reply had every
    44-token reply probe once, 4-7% of its time where the draft never paid).

    The policy is composed of parts, each optional beyond the first:

    - the acceptance history (:class:`AcceptanceEstimate`) and the measured costs: the shape chosen
      before the draft runs;
    - `confidence` (:class:`runtime.speculation.confidence.DraftConfidence`, for a draft that returns
      its proposals' probabilities): the shape is chosen after the draft call instead (`refine`), and
      whether to call the draft at all follows the measured rate of drafted steps against plain
      decoding's, with the same margin and probes;
    - `lookups` (:class:`runtime.speculation.lookup.LookupLength`, with `confidence`: a target that
      takes proposal ids): a step may instead verify a continuation of the request's own text without
      calling the draft, where it beats plain decoding by the margin, or the drafted rate where the
      draft would run. Probes stay draft steps.

    :func:`auto_policy` assembles the parts an artifact supports.

    Args:
        costs: step costs measured for this artifact on this device.
        acceptance: the session's running acceptance estimate.
        alternatives: verify-tree alternatives for block position 1 the policy may add (0: chains).
        confidence: the draft-confidence part, or None.
        lookups: the lookup part, or None (needs `confidence`).
    """

    name = "auto"

    def __init__(self, costs, acceptance: AcceptanceEstimate, probe_gap: int = 4, max_probe_gap: int = 128,
                 scale_smoothing: float = 0.2, probe_smoothing: float = 0.5, margin: float = 1.03,
                 probe_budget: float = 0.01, alternatives: int = 0, confidence: DraftConfidence | None = None,
                 lookups: LookupLength | None = None):
        self.costs = costs
        self.alternatives = min(int(alternatives), len(acceptance.alternative_prior))
        self.margin = margin  # speculate only when it is predicted this much faster: estimates are noisy
        self.acceptance = acceptance
        self.first_probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        self.smoothing = scale_smoothing
        self.probe_smoothing = probe_smoothing  # probes are rare: each measured time counts more
        self.plain_scale = self.spec_scale = 1.0
        self._step_s = costs.step_s(np.arange(len(acceptance.trials) + 1))  # the measured curve, once
        self._verify_s = costs.verify_s(np.arange(len(self._step_s)))  # its target calls' part
        self.probe_budget = probe_budget
        self.probe_extra_s = None  # running mean of what a probe costs beyond a plain step
        self.probe_gap = self.first_probe_gap
        self.plain_run = 0  # plain steps since the last speculative step or probe, across generate calls
        self._cached = None  # (key, best speculative shape): see _best_speculative
        self.confidence = confidence
        self.lookups = lookups if confidence is not None else None
        self.start()

    @property
    def uses_lookup(self) -> bool:
        return self.lookups is not None

    def start(self) -> None:
        if self.confidence is not None:
            self.confidence.start()
        self.acceptance.forget(0.5)
        if self.lookups is not None:
            self.lookups.start()
        self.probe_gap = max(self.first_probe_gap, self.probe_gap // 2)
        self.probing = False

    def _plain_s(self) -> float:
        return self.plain_scale * float(self._step_s[0])

    def _min_probe_gap(self) -> int:
        """Plain steps between probes that keep their net extra cost within `probe_budget` (0 when probes pay)."""
        return budget_spacing(self.probe_extra_s, self.probe_budget, self._plain_s())

    def step_seconds(self, limit: int) -> np.ndarray:
        """Predicted seconds of a step verifying n = 0..limit proposals."""
        t = self.spec_scale * self._step_s[: limit + 1]
        t[0] = self.plain_scale * self._step_s[0]
        return t

    def _best_shape(self, limit: int) -> tuple[int, int]:
        """(chain length, alternatives) with the most expected tokens per second; (0, 0): plain."""
        rate, shape = self._best_speculative(limit)
        return shape if rate > self.margin / self._plain_s() else (0, 0)

    def _best_speculative(self, limit: int) -> tuple[float, tuple[int, int]]:
        """(expected tokens per second, (chain length, alternatives)) of the best speculative shape,
        kept until the acceptance estimate, the speculative costs or the limit change (a run of plain
        steps changes none of them, and the search runs in the loop)."""
        a = self.acceptance
        key = (limit, a.version, a.prior, self.spec_scale)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, self._search(limit))
        return self._cached[1]

    def _search(self, limit: int) -> tuple[float, tuple[int, int]]:
        nodes = min(limit + self.alternatives, len(self._step_s) - 1)
        seconds = self.step_seconds(nodes)
        chain = self.acceptance.expected_tokens(limit)
        rate = chain[1:] / seconds[1: limit + 1]
        best, shape = float(rate.max()), (int(np.argmax(rate)) + 1, 0)
        if self.alternatives:
            miss_first = 1.0 - float(self.acceptance.rates(1)[0])
            alt = self.acceptance.alternative_tokens(self.alternatives)
            for length in range(1, limit + 1):
                for a in range(1, min(self.alternatives, nodes - length) + 1):
                    r = (chain[length] + miss_first * alt[a]) / seconds[length + a]
                    if r > best:
                        best, shape = r, (length, a)
        return best, shape

    def _speculative_choice(self, limit: int) -> Shape:
        """What a speculative step asks of the draft where speculation wins; 0 where plain decoding does."""
        if self.confidence is not None:
            return min(limit, self.confidence.rows) if self.drafted_rate(limit) * self._plain_s() > self.margin else 0
        best, alternatives = self._best_shape(limit)
        return verify_tree(best, alternatives) if alternatives else best

    def drafted_rate(self, limit: int) -> float:
        """Committed tokens per second of the recent drafted steps (with `confidence`), with the model's
        best fixed shape as the prior."""
        prior_rate, _ = self._best_speculative(limit)
        return self.confidence.rate(prior_rate, self.spec_scale * float(self._step_s[1]))

    def proposals(self, limit: int) -> Shape:
        if limit <= 0:
            return 0
        choice = self._speculative_choice(limit)
        if choice:
            self.plain_run, self.probing, self.probe_gap = 0, False, self.first_probe_gap
            return choice
        self.plain_run += 1
        if self.plain_run < min(max(self.probe_gap, self._min_probe_gap()), self.max_probe_gap):
            return 0
        # a probe verifies one proposal, the cheapest speculative step (an accepted one also lifts the
        # deeper positions' prior, see AcceptanceEstimate); with confidence, what the draft's rows earn
        self.plain_run, self.probing = 0, True
        return 1 if self.confidence is None else min(limit, self.confidence.rows)

    def take_offer(self, limit: int, offer: Proposal, shape: Shape) -> int:
        if offer.source == "grammar":  # the only continuation the output constraint admits: the target
            return min(len(offer.ids), limit)  # rejects it only where it tokenizes the text otherwise
        if self.lookups is None or self.probing or offer.source != "lookup":
            return 0
        if shape:  # the draft would run: the lookup must beat what drafted steps commit per second
            threshold = self.drafted_rate(limit)
        else:
            threshold = self.margin / self._plain_s()
        return self.lookups.choose(min(len(offer.ids), limit), self.plain_scale, threshold)

    def take_lookup(self, limit: int, offer: Proposal, threshold: float) -> int:
        """How many of a lookup `offer`'s ids to verify where they must beat `threshold` committed tokens
        per second (another drafter's measured rate); 0: none (no lookup part, or a probe is due)."""
        if self.lookups is None or self.probing:
            return 0
        return self.lookups.choose(min(len(offer.ids), limit), self.plain_scale, threshold)

    def refine(self, shape: Shape, proposal: Proposal) -> Shape:
        if self.confidence is None or proposal.probs is None:
            return shape
        length, alternatives = self.confidence.trim(proposal.probs, self._plain_s(), self.spec_scale,
                                                    least=int(self.probing))
        return verify_tree(length, alternatives) if alternatives else length

    def _verify_prediction(self, verified: int) -> float:
        """Predicted seconds of the target call verifying `verified` proposals, at the plain steps' load."""
        n = min(verified, len(self.confidence.verify_s) - 1)
        return self.plain_scale * float(self.confidence.verify_s[n])

    def observe(self, record: StepRecord) -> None:
        r = record
        verified, accepted, seconds = r.verified, r.accepted, r.seconds
        if r.lookup:  # its own acceptance and timing only: the draft's estimates and the step-cost scales stay
            self.lookups.observe(verified, accepted, seconds, self._verify_prediction(verified))
            return
        if self.probing and seconds > 0:  # net of the tokens it committed beyond a plain step's one
            extra = seconds - (1 + accepted) * self._plain_s()
            last = extra if self.probe_extra_s is None else self.probe_extra_s
            self.probe_extra_s = last + self.probe_smoothing * (extra - last)
        drafted = r.drafted or verified > 0
        k = min(verified, len(self._step_s) - 1)
        verify_part = seconds - r.draft_seconds if verified and seconds > r.draft_seconds > 0 else 0.0
        if self.lookups is not None and verify_part:
            # the verify part of a drafted step prices lookups too (the same target call, after a draft)
            self.lookups.observe_time(verify_part, self._verify_prediction(verified))
        if self.confidence is not None and drafted:
            self.confidence.observe(verified, accepted, seconds, r.catch_up, r.draft_seconds, r.first_rank,
                                    self.smoothing)
        if r.catch_up and verify_part:
            # the draft call caught up on many context rows (not a cost the curve models), but the target call
            # after it verified as any step does: the step counts as that call plus the draft part the curve
            # predicts. A probe after a run of plain steps always catches up, and a cost table that overprices
            # speculation would otherwise never be corrected, however often probes ran.
            seconds = verify_part + self.spec_scale * float(self._step_s[k] - self._verify_s[k])
        elif r.catch_up or (drafted and not verified):  # not a step cost the curve models
            seconds = 0.0
        predicted = float(self._step_s[k])
        if predicted > 0 and seconds > 0:  # a spike moves a scale at most 2x at a time
            scale = self.spec_scale if verified else self.plain_scale
            weight = self.probe_smoothing if self.probing else self.smoothing
            scale += weight * (min(max(seconds / predicted, 0.5 * scale), 2.0 * scale) - scale)
            if verified:
                self.spec_scale = scale
            else:
                self.plain_scale = scale
        if verified and r.tree is None:
            self.acceptance.observe(verified, accepted)
        elif verified:
            self.acceptance.observe(r.tree.length, accepted, r.tree.alternatives, r.first_rank)
        if self.probing and drafted:  # the gap shrinks back only once speculation wins again (see proposals)
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            self.probing = False


def auto_policy(costs, acceptance: AcceptanceEstimate, alternatives: int = 0, draft_probabilities: bool = False,
                lookups: bool = False, **tuning) -> AdaptiveLength:
    """The adaptive policy with the parts an artifact supports: `alternatives` verify-tree
    alternatives (a target that verifies trees), the draft-confidence part where the draft returns
    its probabilities (`draft_probabilities`), and the lookup part (`lookups`, needs them).
    `tuning`: AdaptiveLength's keyword arguments (probe_gap, margin, ...)."""
    positions = len(acceptance.trials)
    alternatives = min(int(alternatives), len(acceptance.alternative_prior))
    confidence = DraftConfidence(costs, positions, alternatives) if draft_probabilities else None
    lookup = None
    if confidence is not None and lookups:
        lookup = LookupLength(confidence.verify_s, AcceptanceEstimate(LOOKUP_PRIOR, positions))
    return AdaptiveLength(costs, acceptance, alternatives=alternatives, confidence=confidence, lookups=lookup, **tuning)
