"""The batched speculation policy (`runtime.speculation.batched`): its arithmetic on fixed call costs and
hand-made acceptance. It drafts where the rows it adds to the whole call pay, decodes plainly where they
do not (a large batch on a CPU), chooses the verify length from the proposals' chances, probes with a
doubling gap, and follows what it observes."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.speculation.batched import BatchedCallCosts, BatchedLength
from runtime.speculation.policy import AcceptanceEstimate


def _costs() -> BatchedCallCosts:
    """Calls of 1 sequence cost 10 ms + 1 ms per extra row; of 8 sequences 40 ms + 35 ms per extra row of
    every sequence (rows are nearly free alone, costly in a full batch: compute-bound). A draft call: 2 ms
    for one block row, 5 ms for 15."""
    rows = (1, 2, 4, 8, 16)
    one = [0.010 + 0.001 * (t - 1) for t in rows]
    eight = [0.040 + 0.035 * (t - 1) for t in rows]
    return BatchedCallCosts((1, 8), rows, np.array([one, eight]), (1, 15), np.array([[0.002, 0.005]]))


def _policy(prior: float, **kw) -> BatchedLength:
    return BatchedLength(_costs(), AcceptanceEstimate(prior, 15), **kw)


def test_costs_interpolate_between_measured_shapes():
    c = _costs()
    assert c.call_s(1, 1) == pytest.approx(0.010)
    assert c.call_s(8, 3) == pytest.approx(0.040 + 0.035 * 2)  # between rows 2 and 4
    assert c.call_s(4, 1) == pytest.approx(0.010 + (0.040 - 0.010) * 3 / 7)  # between batches 1 and 8
    assert c.call_s(16, 32) == pytest.approx(c.call_s(8, 16))  # clamped at the measured ends
    assert c.draft_s(8) == pytest.approx(0.002 + 0.003 * 7 / 14)
    assert c.draft_s(8, sequences=3) == pytest.approx(3 * c.draft_s(8))  # one draft call per sequence


def test_a_batched_draft_call_is_priced_as_one_call_and_the_model_counts_it_once():
    """With draft calls measured at 1 and 8 sequences (one batched call), drafting for 4 sequences costs
    the interpolated call, not four calls; a step's model adds it once, for the most rows any drafts."""
    c = _costs()
    batched = BatchedCallCosts(c.batches, c.rows, c.seconds, (1, 15), np.array([[0.002, 0.005], [0.009, 0.030]]), (1, 8))
    assert batched.draft_s(1, sequences=4) == pytest.approx(0.002 + (0.009 - 0.002) * 3 / 7)
    assert batched.draft_s(15, sequences=8) == pytest.approx(0.030)
    policy = BatchedLength(batched, AcceptanceEstimate(0.7, 15))
    per_sequence = BatchedLength(c, AcceptanceEstimate(0.7, 15))
    _, seconds = policy.step_model([3, 0, 2, 3], 3)
    _, each = per_sequence.step_model([3, 0, 2, 3], 3)
    calls = policy.call_seconds(4, 3)
    assert seconds[0] == pytest.approx(calls[0])  # no proposals: no draft call
    assert seconds[2] - calls[2] == pytest.approx(batched.draft_s(2, sequences=3))
    assert each[2] - calls[2] == pytest.approx(3 * c.draft_s(2))


def test_kept_predictions_follow_the_scales_and_cannot_be_changed():
    """The costs keep the predictions they made (the policy asks for the same ones every step); the step
    model still scales them by what the policy observed since, and nobody can write into a kept one."""
    policy = _policy(0.7)
    policy.step_model([3, 2], 3)
    policy.plain_scale, policy.spec_scale, policy.draft_scale = 1.5, 2.0, 0.5
    _, seconds = policy.step_model([3, 2], 3)
    calls = policy.costs.calls_s(2, np.arange(1, 5))
    drafts = policy.costs.drafts_s(np.array([1, 2, 3]), 2)
    assert seconds[0] == pytest.approx(1.5 * calls[0])
    assert seconds[1:] == pytest.approx(2.0 * calls[1:] + 0.5 * drafts)
    with pytest.raises(ValueError):
        policy.costs.calls_upto(2, 3)[0] = 1.0


def test_drafts_alone_and_decodes_plainly_in_a_full_batch():
    """Acceptance 0.7: at batch 1 extra rows are nearly free and drafting wins; at batch 8 each extra row
    costs 35 ms for the 8 sequences, more than the tokens they bring: plain, no draft call."""
    policy = _policy(0.7)
    assert policy.speculates([15]) and policy.draft_rows([15]) == 2  # the rows the draft computes start at 2
    assert not _policy(0.7).speculates([15] * 8)
    assert not policy.speculates([0, 0])  # nobody can draft: plain


def test_the_verify_length_follows_the_proposals_chances():
    """After the draft calls: confident proposals are verified deep, unlikely ones not at all; a sequence
    without proposals pads; the draft's next rows grow when all were used and shrink when two were left."""
    policy = _policy(0.7)
    sure, doubtful = np.array([0.95, 0.9, 0.9]), np.array([0.05, 0.05, 0.05])
    assert policy.verify_length([policy.draft_confidence(sure)], drafted_rows=3) == 3
    assert policy.rows == 3
    assert policy.verify_length([policy.draft_confidence(doubtful)], drafted_rows=3) == 0
    assert policy.rows == 2
    # beside a sequence without proposals (one row, padded) at batch 2, a row costs 6 ms: only the first pays
    assert policy.verify_length([None, policy.draft_confidence(sure)], drafted_rows=3) == 1


def test_declined_lookups_decay_toward_the_prior_and_verified_ones_teach():
    policy = _policy(0.5)
    before = policy.lookup_confidence(3).copy()
    for _ in range(5):
        policy.observe(1, 4, 0.013, [], [(3, 0, None)], 1)  # lookups verified, first rejected every time
    low = policy.lookup_confidence(3)
    assert low[0] < 0.5 * before[0]
    assert policy.verify_length([low] + [None] * 7, lookups=True) == 0  # (at batch 8 a row costs 35 ms)
    after = policy.lookup_confidence(3)
    assert after[0] > low[0]  # a declined offer moved the evidence back toward the prior
    assert policy.hits == 0 and policy.mass == 0  # lookups do not touch the draft's calibration


def test_low_acceptance_decodes_plainly_and_probes_with_a_doubling_gap():
    policy = _policy(0.01, probe_gap=4, max_probe_gap=16)
    assert [policy.speculates([15]) for _ in range(4)] == [False] * 3 + [True]  # a probe after 4 plain steps
    assert policy.verify_length([policy.draft_confidence(np.array([0.01, 0.01]))], drafted_rows=2) >= 1  # verified
    policy.observe(1, 2, 0.011, [(1, 2, 0.002)], [(1, 0, 0.01)], 1)  # the probe: rejected
    assert policy.probe_gaps[1] == 8
    assert [policy.speculates([15]) for _ in range(8)] == [False] * 7 + [True]
    for _ in range(3):
        policy.probing = True
        policy.observe(1, 2, 0.011, [(1, 1, 0.002)], [(1, 0, 0.01)], 1)
    assert policy.probe_gaps[1] == 16  # capped at max_probe_gap
    # a new batch size starts from the gap reached at the nearest one, and keeps its own from then on
    assert [policy.speculates([15, 15]) for _ in range(16)] == [False] * 15 + [True]
    policy.probe_gaps[1] = 4  # (speculating won again at batch 1)
    assert policy.probe_gaps[2] == 16


def test_observed_costs_and_outcomes_move_the_decisions():
    """Speculative steps measured 3x slower than predicted and committing one token each turn a batch-1
    policy that speculated to plain decoding (the measured rates decide, not the model); the scales move
    at most 2x per step; the draft's calibration follows its accepted first proposals."""
    policy = _policy(0.7, probe_gap=1000)
    assert policy.speculates([15])
    policy.observe(1, 3, 3 * policy.costs.call_s(1, 3), [(1, 2, 0.002)], [(2, 0, 0.9)], 1)
    assert policy.spec_scale == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))  # the 3x was clamped to 2x
    for _ in range(30):
        policy.observe(1, 3, 3 * policy.costs.call_s(1, 3), [(1, 2, 0.004)], [(2, 0, 0.9)], 1)
    assert policy.spec_scale > 2.5 and policy.draft_scale > 1.5
    assert policy.calibration < 0.5  # confident proposals that were all rejected
    assert not policy.speculates([15])
    policy.observe(1, 1, 0.5 * policy.costs.call_s(1, 1), [], [], 1)
    assert policy.plain_scale == pytest.approx(0.9)


def test_a_new_batch_size_starts_from_what_the_nearest_one_measured():
    """Speculation measured at half the plain rate at batch 3 keeps batch 2 (never seen) plain, though the
    model alone would speculate there."""
    policy = _policy(0.9, probe_gap=1000)
    assert policy.speculates([15] * 2)  # (the model: acceptance 0.9)
    for _ in range(20):
        policy.observe(3, 1, 0.02, [], [], 3)  # plain: 150 tok/s
        policy.observe(3, 3, 0.04, [(3, 2, 0.003)], [(2, 0, 0.9)] * 3, 3)  # speculative: 70 tok/s
    assert policy._measured_gain(2) == pytest.approx((3 / 0.043) / (3 / 0.02))
    assert not policy.speculates([15] * 2)


def test_the_plain_step_after_a_speculative_one_charges_its_excess_to_speculation():
    """A plain step right after a speculative one at the same batch size runs slower (another call shape ran
    between): its time beyond the plain rate counts against speculation, not against plain decoding."""
    policy = _policy(0.7, probe_gap=1000)
    for _ in range(5):
        policy.observe(4, 1, 0.02, [], [], 4, 0.02)  # plain: 200 tok/s
    policy.observe(4, 3, 0.04, [(4, 2, 0.004)], [(2, 1, 0.9)] * 4, 12, 0.044)  # speculative
    spec_before = list(policy.speculative[4])
    plain_before = list(policy.plain[4])
    policy.observe(4, 1, 0.025, [], [], 4, 0.025)  # 5 ms slower than the plain rate says
    assert policy.speculative[4][1] == pytest.approx(spec_before[1] + 0.005)
    assert policy.plain[4][1] == pytest.approx(policy.decay * plain_before[1] + 0.020)
    policy.observe(4, 1, 0.025, [], [], 4, 0.025)  # a second plain step: its own
    assert policy.speculative[4][1] == pytest.approx(spec_before[1] + 0.005)


def test_a_call_time_slowed_by_other_load_counts_as_the_least_later_one():
    """Start-up measures the batched calls once: a time above that of a call of more rows or more
    sequences was disturbed (another job), and counts as the least later one, so one slow point cannot
    make the policy think speculation costs more than it does."""
    rows = (1, 2, 4, 8, 16)
    seconds = np.array([[0.010, 0.011, 0.050, 0.013, 0.015],   # 4 rows at batch 1 slowed 4x
                        [0.020, 0.021, 0.022, 0.023, 0.030]])
    costs = BatchedCallCosts((1, 8), rows, seconds, (1, 15), np.array([[0.009, 0.005]]))
    assert costs.call_s(1, 4) == pytest.approx(0.013) and costs.call_s(1, 16) == pytest.approx(0.015)
    assert costs.call_s(8, 4) == pytest.approx(0.022)
    assert costs.draft_s(1) == pytest.approx(0.005)


def test_lookup_only_steps_do_not_make_drafting_look_faster():
    """A step that verified a lookup continuation (no draft call) counts its acceptance and its call cost,
    not the rates that decide whether to draft: at one sequence, lookups' 3-4 tokens a step counted as
    speculative had the draft run on nearly every other step, at 1.4 tokens a step (slower than plain)."""
    policy = _policy(0.1)
    for _ in range(20):
        assert not policy.speculates([15]) or policy.probing
        policy.observe(1, 1, 0.010, [], [], 1)  # plain steps: 100 tokens/s
    spec_before, plain_before = dict(policy.speculative), {b: list(v) for b, v in policy.plain.items()}
    trials = policy.lookup_acceptance.trials.copy()
    for _ in range(10):  # lookups committing 5 tokens in 15 ms each
        policy.observe(1, 5, 0.015, [], [(4, 4, None)], 5, counted=False)
    assert policy.speculative == spec_before and policy.plain == plain_before
    assert policy.lookup_acceptance.trials[0] > trials[0] and not policy.probing
    assert policy.spec_scale != 1.0  # (the call's cost still scales the curve)
    assert not policy.speculates([15])  # the draft's own rate (its prior: acceptance 0.1) still loses


def test_lookups_that_measure_slower_than_plain_steps_wait_with_a_doubling_gap():
    """At 8 sequences the lookup-only steps commit 9 tokens in 90 ms (100 tokens/s: one sequence's
    continuation pads every row) where plain steps commit 8 in 40 ms (200 tokens/s): lookups are no longer
    offered, then offered again after probe_gap steps, then after twice that; at one sequence, where they
    measure faster, they stay offered."""
    policy = _policy(0.1, probe_gap=4)
    assert policy.offers_lookups(8)  # (nothing measured yet)
    for _ in range(5):
        policy.observe(8, 1, 0.040, [], [], 8)
        policy.observe(8, 2, 0.090, [], [(1, 1, None)], 9, counted=False)
    offered = [policy.offers_lookups(8) for _ in range(12)]
    assert offered == [False, False, False, True] + [False] * 7 + [True]
    for _ in range(5):
        policy.observe(1, 1, 0.010, [], [], 1)
        policy.observe(1, 5, 0.015, [], [(4, 4, None)], 5, counted=False)
    assert all(policy.offers_lookups(1) for _ in range(10))
    for _ in range(30):  # lookups that win again at 8 sequences reset the wait
        policy.observe(8, 2, 0.030, [], [(1, 1, None)], 9, counted=False)
    assert policy.offers_lookups(8) and policy.lookup_gaps[8] == 4
