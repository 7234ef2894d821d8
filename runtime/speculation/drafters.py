"""Choosing the drafter per step where an artifact has two: the DFlash draft (with the policy's lookups
and plain steps) and the target's own MTP head (`drafter="auto"`).

Which one pays depends on the text (DFlash leads on code, MTP on prose, in other runtimes' measurements)
and on the device (on small parts MTP's chain of calls can lose). So neither is assumed: each step's
committed tokens per second are measured for the drafter that ran it, as a running (exponentially
weighted) rate, and the step asks the faster one. The other is tried again every 8 steps, an interval
that doubles (up to 64) while those tries keep losing, so a change in the text or the load is noticed
without paying a losing try every few steps; and never more often than keeps what the tries cost beyond
the faster side within 1% of the time (up to 256 steps apart): with the DFlash side's own probes (1%),
about 2% where neither drafter pays. The rates last the session (`Session.drafter_choices`):
a reply of a few steps then starts with the side that has been winning instead of trying both. The policy behind the DFlash side still decides its
own verify lengths, lookups and plain steps, and keeps its "never slower than plain" guard.
"""

from __future__ import annotations

from runtime.speculation.policy import budget_spacing

DRAFTER_SIDES = ("mtp", "policy")


class MTPChain:
    """How many chained proposals of the MTP head a step verifies where `verify_len` does not fix it:
    two more after a step that accepted all it asked, one fewer after any other (the "heuristic"
    schedule of transformers' assisted generation), between 1 and `longest`. Each chained proposal
    costs a head call and the head's acceptance follows the text, so the chain follows what is
    accepted; whether the head pays at all is measured by :class:`DrafterChoice`.

    Args:
        longest: the most proposals a step verifies (the block's last position, block_size - 1).
        start: the first length (MTP_DEFAULT_LENGTH).
    """

    def __init__(self, longest: int, start: int = 3):
        self.longest = max(int(longest), 1)
        self.n = min(max(int(start), 1), self.longest)

    def length(self, limit: int) -> int:
        """This step's chain length: the current one, cut to `limit` (what the token budget allows)."""
        return max(min(self.n, limit), 0)

    def observe(self, verified: int, accepted: int) -> None:
        """A step verified `verified` chained proposals and accepted `accepted` of them (a chain cut
        by the token budget grows nothing)."""
        if accepted >= verified >= self.n:
            self.n = min(self.n + 2, self.longest)
        elif accepted < verified:
            self.n = max(self.n - 1, 1)


class DrafterChoice:
    """The per-step choice between the MTP chain ("mtp") and the policy's step ("policy").

    Args:
        probe_every: steps of the faster side between two tries of the other, at first.
        decay: weight of a side's previous rate in its running rate (0: the last step only).
        max_probe_every: the longest interval: each try of the other side that does not make it the
            faster doubles the interval up to this; one that does resets it to `probe_every` (a probe
            costs most where the sides differ most, and there it keeps losing).
        budget: the share of the time the tries may cost beyond what the faster side would have taken
            for the tokens they committed; the interval is at least what keeps them within it, up to
            `max_budget_every` steps.
    """

    def __init__(self, probe_every: int = 8, decay: float = 0.7, max_probe_every: int = 64, budget: float = 0.01,
                 max_budget_every: int = 256):
        self.probe_every, self.decay, self.max_probe_every = int(probe_every), float(decay), int(max_probe_every)
        self.budget, self.max_budget_every = float(budget), int(max_budget_every)
        self.interval = self.probe_every
        self.rates: dict[str, float | None] = {side: None for side in DRAFTER_SIDES}
        self.step_s: dict[str, float | None] = {side: None for side in DRAFTER_SIDES}  # running mean per side
        self.try_extra_s: float | None = None  # running mean of a try's time beyond the faster side's
        self.since_probe = 0
        self.trying = False  # whether the last choice tries a side that is not the faster (a first try, a probe)
        self.new_text = False  # a new prompt began: the other side is tried first where the budget allows

    def start(self) -> None:
        """A new prompt: its text may suit the other side (code after prose), so its first step tries that
        side once `probe_every` steps passed since the last try and the budget allows (the doubled
        interval is not waited for)."""
        self.new_text = True

    @property
    def best(self) -> str | None:
        """The side with the higher running rate (None until both ran)."""
        if any(r is None for r in self.rates.values()):
            return None
        return max(DRAFTER_SIDES, key=lambda side: self.rates[side])

    def choose(self) -> str:
        """The side the next step runs: an untried one first, else the faster, the other every
        :attr:`interval` steps."""
        self.trying = True
        for side in DRAFTER_SIDES:
            if self.rates[side] is None:
                return side
        best = self.best
        interval = min(self.probe_every, self.interval) if self.new_text else self.interval
        self.new_text = False
        if self.since_probe >= min(max(interval, self._budget_interval(best)), self.max_budget_every):
            return next(side for side in DRAFTER_SIDES if side != best)
        self.trying = False
        return best

    def _budget_interval(self, best: str) -> int:
        """Steps of the faster side between tries that keep their extra cost within `budget` (0 until known)."""
        return budget_spacing(self.try_extra_s, self.budget, self.step_s[best])

    def observe(self, side: str, committed: int, seconds: float) -> None:
        """A step of `side` committed `committed` tokens in `seconds` (its proposer's time included)."""
        before = self.best
        if before is not None and side != before and self.rates[before]:  # a try: its time beyond the faster side's
            extra = seconds - committed / self.rates[before]
            last = extra if self.try_extra_s is None else self.try_extra_s
            self.try_extra_s = last + 0.5 * (extra - last)
        rate = committed / max(seconds, 1e-9)
        old = self.rates[side]
        self.rates[side] = rate if old is None else self.decay * old + (1.0 - self.decay) * rate
        old = self.step_s[side]
        self.step_s[side] = seconds if old is None else self.decay * old + (1.0 - self.decay) * seconds
        after = self.best
        if before is not None and side != before:  # a probe: it won (back to short intervals) or lost (longer)
            self.interval = self.probe_every if after == side else min(2 * self.interval, self.max_probe_every)
        self.since_probe = 0 if side != after else self.since_probe + 1
