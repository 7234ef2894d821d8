"""The batched verify-length policy (`runtime.speculation.batched`): its arithmetic on fixed call costs and
hand-made acceptance. It speculates where the rows it adds to the whole call pay, decodes plainly where
they do not (a large batch on a CPU), probes with a doubling gap, and follows what it observes."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.speculation.batched import BatchedCallCosts, BatchedLength
from runtime.speculation.policy import AcceptanceEstimate


def _costs(draft_s: float = 0.002) -> BatchedCallCosts:
    """Calls of 1 sequence cost 10 ms + 1 ms per extra row; of 8 sequences 40 ms + 35 ms per extra row of every
    sequence (rows are nearly free alone, costly in a full batch: compute-bound)."""
    rows = (1, 2, 4, 8, 16)
    one = [0.010 + 0.001 * (t - 1) for t in rows]
    eight = [0.040 + 0.035 * (t - 1) for t in rows]
    return BatchedCallCosts((1, 8), rows, np.array([one, eight]), draft_s)


def _policy(prior: float, **kw) -> BatchedLength:
    return BatchedLength(_costs(), AcceptanceEstimate(prior, 15), **kw)


def test_costs_interpolate_between_measured_shapes():
    c = _costs()
    assert c.call_s(1, 1) == pytest.approx(0.010)
    assert c.call_s(8, 3) == pytest.approx(0.040 + 0.035 * 2)  # between rows 2 and 4
    assert c.call_s(4, 1) == pytest.approx(0.010 + (0.040 - 0.010) * 3 / 7)  # between batches 1 and 8
    assert c.call_s(16, 32) == pytest.approx(c.call_s(8, 16))  # clamped at the measured ends


def test_speculates_alone_and_decodes_plainly_in_a_full_batch():
    """Acceptance 0.7: at batch 1 the rows are nearly free (a long verify wins); at batch 8 each extra row
    costs 35 ms for the 8 sequences, more than the tokens they bring: plain."""
    policy = _policy(0.7)
    n = policy.choose([15])
    assert n >= 2
    expected = policy.rate([15], n)
    assert expected > 1.03 * policy.rate([15], 0)
    busy = _policy(0.7)
    assert busy.choose([15] * 8) == 0


def test_low_acceptance_decodes_plainly_and_probes_with_a_doubling_gap():
    policy = _policy(0.01, probe_gap=4, max_probe_gap=16)
    choices = [policy.choose([15]) for _ in range(4)]
    assert choices == [0, 0, 0, 1]  # a probe of one proposal after 4 plain steps
    policy.observe(1, 2, 0.011, [0.002], [(1, 0)])  # the probe: rejected
    assert policy.probe_gap == 8
    choices = [policy.choose([15]) for _ in range(8)]
    assert choices == [0] * 7 + [1]
    for _ in range(3):
        policy.observe(1, 2, 0.011, [0.002], [(1, 0)])
        policy.probing = True
    assert policy.probe_gap == 16  # capped at max_probe_gap


def test_sequences_that_cannot_draft_pad_but_count_one_token():
    """A sequence with limit 0 (no valid anchor, or plain) adds a token and no draft call."""
    policy = _policy(0.5)
    tokens = policy.acceptance.expected_tokens(15)
    seconds = policy.predicted_s(2, 3) + 1 * policy.draft_s
    assert policy.rate([15, 0], 2) == pytest.approx((tokens[2] + 1.0) / seconds)
    assert policy.choose([0, 0]) == 0


def test_observed_costs_and_acceptance_move_the_choice():
    """Speculative calls observed 3x slower than measured, and proposals never accepted, turn a batch-1
    policy that speculated to plain decoding; the scales move at most 2x per step."""
    policy = _policy(0.7, probe_gap=1000)
    assert policy.choose([15]) > 0
    policy.observe(1, 8, 3 * policy.costs.call_s(1, 8), [0.002], [(7, 0)])
    assert policy.spec_scale == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))  # the 3x was clamped to 2x
    for _ in range(30):
        policy.observe(1, 8, 3 * policy.costs.call_s(1, 8), [0.004], [(7, 0)])
    assert policy.spec_scale > 2.5 and policy.draft_s == pytest.approx(0.004, rel=0.01)
    assert policy.choose([15]) == 0
    policy.observe(1, 1, 0.5 * policy.costs.call_s(1, 1), [], [])
    assert policy.plain_scale == pytest.approx(0.9)
