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

import numpy as np

from runtime.speculation.confidence import ConfidenceTrim
from runtime.speculation.lookup import LOOKUP_PRIOR, LookupLength
from runtime.graphs.tree import VerifyTree, verify_tree

# Prior acceptance of the first proposal. Trained: the shipped SmolLM2 draft's first-position
# acceptance, greedy, held-out models/prompts/eval.jsonl (`python -m dflash_export bench ARTIFACT
# --limit 2 --policies 15`: positional_acceptance[0] in bench.json). Untrained (random) drafts: start
# plain and let the probes find out.
TRAINED_DRAFT_PRIOR = 0.45
UNTRAINED_DRAFT_PRIOR = 0.02
# Prior of the draft's rank-r candidate for block position 1 being the target's token when ranks < r
# were not (r = 1, 2, 3: the verify tree's alternatives, `runtime.graphs.tree`). Trained: the shipped SmolLM2
# draft on held-out prompts (`python scripts/draft_ranks.py --per-category 3`: top-1..4 coverage 0.407,
# 0.532, 0.594, 0.643, so 0.125 / 0.593, 0.062 / 0.468, 0.049 / 0.406).
TRAINED_ALTERNATIVE_PRIOR = (0.21, 0.13, 0.12)
UNTRAINED_ALTERNATIVE_PRIOR = (0.01, 0.01, 0.01)


class Policy(ABC):
    """Chooses the number of proposals to verify each step (0 = a plain step, no draft call)."""

    name = "abstract"

    def start(self) -> None:
        """A new generate call begins (a new prompt)."""

    @abstractmethod
    def proposals(self, limit: int) -> int:
        """Proposals to verify this step, 0..`limit` (`limit` = what the block and the remaining
        token budget allow; 0 means only a plain step is possible)."""

    uses_lookup = False  # whether `lookup` may return more than 0 (the loop then keeps an n-gram index)

    def lookup(self, limit: int, available: int, choice: int | VerifyTree) -> int:
        """Where the request's own text offers `available` >= 1 tokens that followed its last n-gram
        before (`runtime.speculation.lookup.NgramLookup`, which repeats a loop to fill `limit`, so usually
        `available` = `limit`): how many of them to verify this step instead of
        `choice` (what :meth:`proposals` returned), without a draft call; 0 keeps `choice`. This
        default never does (explicit verify lengths, plain decoding)."""
        return 0

    def trim(self, choice: int | VerifyTree, probs: np.ndarray) -> int | VerifyTree:
        """After the draft call, where the draft proposes (`Session.draft_proposes`): what to verify
        given the draft's probabilities `probs` (fp32 `[R, K]`: its top-K candidates for block
        positions 1..R, R the chain length of `choice`). Returns `choice` or a smaller shape (0: a
        plain target call). This default keeps `choice` (explicit verify lengths are kept)."""
        return choice

    def observe(self, verified: int, accepted: int, seconds: float, catch_up: bool = False,
                tree: VerifyTree | None = None, first_rank: int | None = None, drafted: bool = False,
                draft_seconds: float = 0.0, lookup: bool = False) -> None:
        """The step verified `verified` proposals, accepted `accepted` of them and took `seconds`
        (draft call, target call and the loop's host work). `catch_up`: the draft call first read
        many context rows (the prompt, a run of plain steps), so the step cost more than the
        verify length alone does. `tree`: the verify tree the step ran (None: a chain, also where a
        tree choice ran as its chain), and `first_rank` the draft's rank of its accepted first
        proposal (None: none accepted). `drafted`: a draft call ran (also where `trim` then chose
        to verify nothing), taking `draft_seconds` of the step. `lookup`: the proposals were a lookup
        continuation (:meth:`lookup`), not the draft's."""


class FixedLength(Policy):
    """Always verify `n` proposals (or fewer when the limit says so); `n = 0` is plain decoding."""

    name = "fixed"

    def __init__(self, n: int):
        self.n = int(n)

    def proposals(self, limit: int) -> int:
        return min(self.n, limit)


class FixedTree(Policy):
    """Always verify `tree` (`verify_len="L+A"`), or a chain of what the limit allows when it is shorter."""

    name = "fixed-tree"

    def __init__(self, tree: VerifyTree):
        self.tree = tree

    def proposals(self, limit: int) -> int | VerifyTree:
        return self.tree if limit >= self.tree.length else max(limit, 0)


class AcceptanceEstimate:
    """Running estimate of conditional acceptance by block position.

    p_0 = (hits_0 + w * prior) / (trials_0 + w) and p_j = (hits_j + w * carry * p_(j-1)) / (trials_j + w):
    a position without evidence is taken to accept a little less than the one before it (the shipped
    SmolLM2 draft's conditional acceptance by position, held-out prompts: 0.45, 0.34, 0.34, 0.19,
    0.33), so one accepted long probe lifts the whole curve and deep positions are tried once the
    shallow ones earn it. A step that verified n proposals and
    accepted a counts a trial at positions 0..min(a, n-1) and a hit at 0..a-1. Evidence decays by
    `decay` per observed step (about 1 / (1 - decay) steps of memory), so the estimate follows the
    text being written.

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

    A plain step wins unless some n is predicted `margin` times faster (estimates are noisy, and a
    wrong plain step costs nothing against plain decoding). A plain step is predicted to take
    `plain_scale * S(0)` and a step verifying n > 0 proposals `spec_scale * S(n)`, S from the measured
    step costs (`runtime.graphs.costs.CallCosts`) and each scale a running ratio of observed to
    predicted times of that kind of step: they absorb the growing past and other load, and correct a
    disturbed first measurement of what speculation costs relative to plain decoding (a 2-round
    measurement on a noisy machine can be 30% off) without changing the curve's shape. When plain
    decoding wins, a speculative step is still tried after `probe_gap` plain steps so a draft that
    starts to fit the text is noticed (a probe verifies one proposal, and its time updates
    `spec_scale`); each probe after which plain decoding still wins doubles the gap (up to
    `max_probe_gap`). A probe costs more than a plain step (a draft call with its catch-up on the
    context the plain steps added, and a longer target call: about 0.45 of a plain step on SmolLM2
    INT4, 2 cores) but commits its accepted token too, so its cost is counted net of what it
    committed beyond a plain step's one token, as a running mean, and the gap is also at least what
    keeps that net cost within `probe_budget` of the plain decoding time. The gap may grow to 128
    plain steps: on an artifact where speculation never pays (SmolLM2 INT4 on 2 cores) each
    probe is a small loss, and a 128-token reply then pays for one, not two (replayed on 50 held-out
    prompts, `scripts/policy_replay.py`: 0.992x -> 0.996x plain, fp32 unchanged). One
    instance lives as long as its Session, so what it learned carries over to the next generate
    call: a new prompt starts at half the gap it had reached, not at `probe_gap`.

    With `confidence` (a draft that returns its proposals' probabilities), the length is chosen
    after the draft call instead (`trim`, :class:`runtime.speculation.confidence.ConfidenceTrim`), and whether to
    call the draft at all follows the measured rate of such steps: committed tokens per second over
    the recent drafted steps (a decayed sum, the model's best fixed length as its prior), against
    plain decoding's, with the same margin and probes. The draft computes `draft_rows` rows, one
    more than the last step verified when it used them all, one fewer when it used two fewer.

    With `lookup` (confidence mode: a target that takes proposal ids), a step may instead verify a
    continuation of the request's own text (`runtime.speculation.lookup`) without calling the draft: the length
    with the most expected tokens per second (its own running acceptance by position, the measured
    target-call costs), taken where it beats plain decoding by the margin, or the drafted rate where
    the draft would run. Probes stay draft steps. Setting `uses_lookup = False` turns this off.

    Args:
        costs: step costs measured for this artifact on this device.
        acceptance: the session's running acceptance estimate.
        confidence: choose the verify shape from the draft's probabilities (`trim`).
        lookup: also verify n-gram lookup continuations (needs `confidence`).
    """

    name = "auto"

    def __init__(self, costs, acceptance: AcceptanceEstimate, probe_gap: int = 4, max_probe_gap: int = 128,
                 scale_smoothing: float = 0.2, probe_smoothing: float = 0.5, margin: float = 1.03,
                 probe_budget: float = 0.02, alternatives: int = 0, confidence: bool = False, lookup: bool = False):
        self.costs = costs
        self.alternatives = min(int(alternatives), len(acceptance.alternative_prior))
        self.margin = margin  # speculate only when it is predicted this much faster: estimates are noisy
        self.acceptance = acceptance
        self.first_probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        self.smoothing = scale_smoothing
        self.probe_smoothing = probe_smoothing  # probes are rare: each measured time counts more
        self.plain_scale = self.spec_scale = 1.0
        self._step_s = costs.step_s(np.arange(len(acceptance.trials) + 1))  # the measured curve, once
        self.probe_budget = probe_budget
        self.probe_extra_s = None  # running mean of what a probe costs beyond a plain step
        self.probe_gap = self.first_probe_gap
        self._cached = None  # (key, best speculative shape): see _best_speculative
        self.trimmer = None
        if confidence:
            nodes = np.arange(len(acceptance.trials) + self.alternatives + 1)
            self._verify_s = costs.verify_s(nodes)
            self._draft_s = max(float(self._step_s[1] - self._verify_s[1]), 0.0)
            self.trimmer = ConfidenceTrim(self._verify_s, self.alternatives)
            self.draft_rows = 2
            self.drafted_prior_steps = 2.0  # what the model's prior rate is worth, in drafted steps
            self.draft_mean_s = self._draft_s  # running mean of a drafted step's draft time (no catch-up)
            self.drafted_tokens = self.drafted_seconds = 0.0  # decayed sums over drafted steps
        self.lookups = None
        if confidence and lookup:
            self.lookups = LookupLength(self._verify_s, AcceptanceEstimate(LOOKUP_PRIOR, len(acceptance.trials)))
        self.uses_lookup = self.lookups is not None
        self.start()

    def start(self) -> None:
        if self.trimmer is not None:
            self.drafted_tokens *= 0.5
            self.drafted_seconds *= 0.5
        self.acceptance.forget(0.5)
        if self.lookups is not None:
            self.lookups.start()
        self.probe_gap = max(self.first_probe_gap, self.probe_gap // 2)
        self.plain_run, self.probing = 0, False

    def _min_probe_gap(self) -> int:
        """Plain steps between probes that keep their net extra cost within `probe_budget` (0 when probes pay)."""
        plain = self.plain_scale * float(self._step_s[0])
        if self.probe_extra_s is None or plain <= 0 or self.probe_extra_s <= 0:
            return 0
        return int(np.ceil(self.probe_extra_s / (self.probe_budget * plain) - 1e-6))

    def step_seconds(self, limit: int) -> np.ndarray:
        """Predicted seconds of a step verifying n = 0..limit proposals."""
        t = self.spec_scale * self._step_s[: limit + 1]
        t[0] = self.plain_scale * self._step_s[0]
        return t

    def _best_shape(self, limit: int) -> tuple[int, int]:
        """(chain length, alternatives) with the most expected tokens per second; (0, 0): plain."""
        rate, shape = self._best_speculative(limit)
        return shape if rate > self.margin / (self.plain_scale * float(self._step_s[0])) else (0, 0)

    def _best_speculative(self, limit: int) -> tuple[float, tuple[int, int]]:
        """(expected tokens per second, (chain length, alternatives)) of the best speculative shape.
        Kept until the acceptance estimate, the speculative costs or the limit change: a run of plain
        steps changes none of them, and the search cost 0.13 ms a step in the loop (1.5% of a
        SmolLM2 INT4 step)."""
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

    def _speculative_choice(self, limit: int) -> int | VerifyTree:
        """What a speculative step asks of the draft where speculation wins; 0 where plain decoding does."""
        if self.trimmer is not None:
            plain_s = self.plain_scale * float(self._step_s[0])
            return min(limit, self.draft_rows) if self.drafted_rate(limit) * plain_s > self.margin else 0
        best, alternatives = self._best_shape(limit)
        return verify_tree(best, alternatives) if alternatives else best

    def drafted_rate(self, limit: int) -> float:
        """Committed tokens per second of the recent drafted steps (confidence mode), with the model's
        best fixed shape as a prior worth `drafted_prior_steps` steps."""
        prior_rate, _ = self._best_speculative(limit)
        t1 = self.spec_scale * float(self._step_s[1])
        w = self.drafted_prior_steps
        return (self.drafted_tokens + w * prior_rate * t1) / (self.drafted_seconds + w * t1)

    def proposals(self, limit: int) -> int | VerifyTree:
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
        return 1 if self.trimmer is None else min(limit, self.draft_rows)

    def lookup(self, limit: int, available: int, choice: int | VerifyTree) -> int:
        if self.lookups is None or not self.uses_lookup or self.probing:
            return 0
        if choice:  # the draft would run: the lookup must beat what drafted steps commit per second
            threshold = self.drafted_rate(limit)
        else:
            threshold = self.margin / (self.plain_scale * float(self._step_s[0]))
        return self.lookups.choose(min(available, limit), self.plain_scale, threshold)

    def trim(self, choice: int | VerifyTree, probs: np.ndarray) -> int | VerifyTree:
        if self.trimmer is None:
            return choice
        rows = len(probs)
        plain_s = self.plain_scale * float(self._step_s[0])
        length, alternatives = self.trimmer.choose(probs, plain_s, self.spec_scale, least=int(self.probing))
        if length >= rows >= self.draft_rows:  # used every row it asked for (not a limit's cut)
            self.draft_rows = min(self.draft_rows + 1, len(self.acceptance.trials))
        elif length < rows - 1:
            self.draft_rows = max(self.draft_rows - 1, 1)
        return verify_tree(length, alternatives) if alternatives else length

    def observe(self, verified: int, accepted: int, seconds: float, catch_up: bool = False,
                tree: VerifyTree | None = None, first_rank: int | None = None, drafted: bool = False,
                draft_seconds: float = 0.0, lookup: bool = False) -> None:
        if lookup:  # its own acceptance and timing only: the draft's estimates and the step-cost scales stay
            n = min(verified, len(self._verify_s) - 1)
            self.lookups.observe(verified, accepted, seconds, self.plain_scale * float(self._verify_s[n]))
            return
        if self.probing and seconds > 0:  # net of the tokens it committed beyond a plain step's one
            extra = seconds - (1 + accepted) * self.plain_scale * float(self._step_s[0])
            last = extra if self.probe_extra_s is None else self.probe_extra_s
            self.probe_extra_s = last + self.probe_smoothing * (extra - last)
        drafted = drafted or verified > 0
        if self.trimmer is not None and drafted:
            self._observe_drafted(verified, accepted, seconds, catch_up, draft_seconds, first_rank)
        if catch_up or (drafted and not verified):  # not a step cost the curve models
            seconds = 0.0
        predicted = float(self._step_s[min(verified, len(self._step_s) - 1)])
        if predicted > 0 and seconds > 0:  # a spike moves a scale at most 2x at a time
            scale = self.spec_scale if verified else self.plain_scale
            weight = self.probe_smoothing if self.probing else self.smoothing
            scale += weight * (min(max(seconds / predicted, 0.5 * scale), 2.0 * scale) - scale)
            if verified:
                self.spec_scale = scale
            else:
                self.plain_scale = scale
        if verified and tree is None:
            self.acceptance.observe(verified, accepted)
        elif verified:
            self.acceptance.observe(tree.length, accepted, tree.alternatives, first_rank)
        if self.probing and drafted:  # the gap shrinks back only once speculation wins again (see proposals)
            self.probe_gap = min(2 * self.probe_gap, self.max_probe_gap)
            self.probing = False

    def _observe_drafted(self, verified: int, accepted: int, seconds: float, catch_up: bool, draft_seconds: float,
                         first_rank: int | None, decay: float = 0.95) -> None:
        """Confidence mode: a drafted step's committed tokens and time join the drafted rate, and its
        first proposal's outcome the trimmer's calibration. Both rates are measured in the same loop
        (no cost model between them: a model's error of a few percent decides break-even cases the
        wrong way). A catch-up step's draft call read the rows of the plain steps before it: it counts
        at the usual draft time instead (a running mean), as that extra is the plain steps' debt."""
        if catch_up or seconds <= 0:
            seconds = max(seconds - draft_seconds, 0.0) + self.draft_mean_s
        elif draft_seconds > 0:
            self.draft_mean_s += self.smoothing * (draft_seconds - self.draft_mean_s)
        self.drafted_tokens = decay * self.drafted_tokens + 1 + accepted
        self.drafted_seconds = decay * self.drafted_seconds + seconds
        if verified:
            self.trimmer.observe(accepted > 0 and first_rank in (None, 0))
