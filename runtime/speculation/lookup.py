"""Proposals without a draft call: continuations of the request's own text (n-gram lookup).

A reply often repeats its prompt or itself (code that reuses names, a list, a quoted passage, the
loops small models fall into). Where the last `n` committed tokens occurred before, the tokens that
followed them then are a free guess of what follows now. Verifying that guess costs only the extra
target rows (no draft call), a fraction of a draft call on a CPU. This is prompt lookup
decoding (Saxena, "Prompt Lookup Decoding", 2023) and llama.cpp's n-gram speculation
(`common/ngram-cache`); the policy (`runtime.speculation.policy.AdaptiveLength.lookup`) verifies such a
guess on the steps where it would not call the draft, at the length its own running acceptance
says pays.

A simulation on greedy replies to held-out prompts, run before building it, found such continuations
on many steps and mostly accepted (figures, and the step costs:
docs/performance.md#lookup-steps-costs-and-a-simulation-2026-12-03).
"""

from __future__ import annotations

import numpy as np

# Prior acceptance of a lookup continuation's first token: a little under the simulated rate
# (docs/performance.md#lookup-steps-costs-and-a-simulation-2026-12-03).
LOOKUP_PRIOR = 0.7


class NgramLookup:
    """The continuation of the longest recent n-gram match in a token sequence.

    Each n-gram (min_n <= n <= max_n) maps to the position right after its latest occurrence that
    has a following token, so a lookup is one dict probe per n and extending by one token is one
    insert per n.

    Args:
        ids: the sequence so far (prompt, then committed tokens).
        min_n, max_n: the n-gram lengths tried, longest first (2 and 3: a single repeated token
            predicts poorly, 0.49 against 0.74 for n >= 2 in the measurement above).
    """

    def __init__(self, ids=(), min_n: int = 2, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = int(min_n), int(max_n)
        self.seq: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}
        self.extend(ids)

    def extend(self, ids) -> None:
        """Append tokens (ints) to the sequence."""
        seq, after = self.seq, self.after
        for t in ids:
            end = len(seq)  # the new token's position: every n-gram ending just before it now has a follower
            for n in range(self.min_n, min(self.max_n, end) + 1):
                after[tuple(seq[end - n:end])] = end
            seq.append(int(t))

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the latest earlier occurrence of the sequence's longest matching
        suffix ([] where no suffix of min_n..max_n tokens occurred before). Where they would run
        past the end of the sequence, the text since that occurrence repeats (a loop of period
        end - start goes on)."""
        seq, end = self.seq, len(self.seq)
        if k <= 0:
            return []
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self.after.get(tuple(seq[end - n:]))
            if start is not None:
                out = seq[start:start + k]
                while len(out) < k:
                    out.append(out[len(out) - (end - start)])
                return out
        return []


class LookupLength:
    """How many lookup tokens a step verifies: the length with the most expected committed tokens per
    second, from a running acceptance estimate by position (prior `LOOKUP_PRIOR`) and the measured
    target-call costs; 0 when no length beats `threshold` tokens per second.

    Args:
        verify_s: predicted seconds of a target call verifying n = 0..M proposals
            (`runtime.graphs.costs.CallCosts.verify_s`).
        acceptance: a `runtime.speculation.policy.AcceptanceEstimate` for lookup tokens by position (its
            length: the most a step verifies), prior `LOOKUP_PRIOR`.
    """

    def __init__(self, verify_s: np.ndarray, acceptance, smoothing: float = 0.2, decline_decay: float = 0.99):
        self.verify_s = np.asarray(verify_s, np.float64)
        self.acceptance = acceptance
        self.smoothing, self.decline_decay = float(smoothing), float(decline_decay)
        self.time_scale = 1.0  # running observed / predicted time of lookup steps (their host work too)

    def choose(self, available: int, scale: float, threshold: float) -> int:
        """Tokens to verify out of the `available` a lookup offers, with call times scaled by `scale`
        (the load now) and by the observed/predicted time of past lookup steps (`observe`).

        Declining an offered continuation decays the evidence by `decline_decay` toward the prior:
        only lookup steps bring new evidence, so without it a few early rejections (about 8) would
        rule lookups out for the rest of the request however repetitive it became. With it, where
        every lookup fails, about one offer in 11 is still verified (one token: a small loss each, one
        extra target row; figures: docs/performance.md#lookup-steps-costs-and-a-simulation-2026-12-03),
        and once they are accepted again lookups are back within 3 offers (`tests/test_lookup.py`)."""
        n = min(int(available), len(self.verify_s) - 1, len(self.acceptance.trials))
        if n <= 0:
            return 0
        rate = self.acceptance.expected_tokens(n)[1:] / (scale * self.time_scale * self.verify_s[1:n + 1])
        best = int(np.argmax(rate))
        if rate[best] > threshold:
            return best + 1
        self.acceptance.forget(self.decline_decay)
        return 0

    def observe(self, verified: int, accepted: int, seconds: float = 0.0, predicted: float = 0.0) -> None:
        """A lookup step verified `verified` tokens, accepted the first `accepted` and took `seconds`
        where the load-scaled cost curve predicted `predicted` (either 0: no timing)."""
        self.acceptance.observe(verified, accepted)
        self.observe_time(seconds, predicted)

    def observe_time(self, seconds: float, predicted: float) -> None:
        """A target call verifying proposals (a lookup step's, or a drafted step's after its draft call)
        took `seconds` where the load-scaled cost curve predicted `predicted` (either 0: no timing). Drafted
        steps teach it too: a cost table that overprices verifying would otherwise keep lookups from ever
        running, and so from ever correcting it."""
        if seconds > 0 and predicted > 0:  # a spike moves the scale at most 2x at a time
            ratio = min(max(seconds / predicted, 0.5 * self.time_scale), 2.0 * self.time_scale)
            self.time_scale += self.smoothing * (ratio - self.time_scale)

    def start(self) -> None:
        """A new request: its own text decides, the last one's counts for half."""
        self.acceptance.forget(0.5)
