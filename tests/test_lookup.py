"""Lookup proposals: continuations of the request's own text verified without a draft call.

`runtime.speculation.lookup.NgramLookup` finds them, `LookupLength` and `AdaptiveLength.lookup` decide how many
a step verifies; the loop writes them as the target's proposal ids (artifacts whose draft proposes).
The arithmetic runs on fixed costs; the graphs on the tiny proposing pairs.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from runtime.graphs import costs as call_costs
from runtime.speculation.lookup import LOOKUP_PRIOR, LookupLength, NgramLookup
from runtime.speculation.proposals import Proposal, StepRecord
from runtime.speculation.policy import UNTRAINED_DRAFT_PRIOR, AcceptanceEstimate, auto_policy

COSTS = rf.proposing_costs()  # plain 30 ms; draft + verify n: 40 + 2n ms (verify 32 + 2n)


@pytest.fixture(scope="module")
def ctxfree(tmp_path_factory) -> rf.Pair:
    return rf.proposing_artifact("ctxfree", tmp_path_factory)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.proposing_artifact("qwen3", tmp_path_factory)


# ---- finding continuations -------------------------------------------------------------------------
def test_lookup_proposes_what_followed_the_latest_match():
    look = NgramLookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert look.propose(3) == [7, 5, 2]  # (5, 2, 3) never occurred; (2, 3) last came before 7
    look.extend([7, 5])
    assert look.propose(2) == [2, 3]  # (7, 5) occurred once, followed by 2, 3
    assert look.propose(0) == []


def test_lookup_prefers_the_longest_match():
    look = NgramLookup([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3])
    assert look.propose(1) == [4]  # (1, 2, 3) -> 4 beats the later (2, 3) -> 5
    assert NgramLookup([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], max_n=2).propose(1) == [5]


def test_lookup_needs_min_n_tokens_of_match():
    assert NgramLookup([4, 1, 4]).propose(2) == []  # only (4) repeats: below min_n = 2
    assert NgramLookup([4, 1, 4], min_n=1).propose(2) == [1, 4]
    assert NgramLookup([7]).propose(4) == [] and NgramLookup().propose(4) == []
    assert NgramLookup([5, 5, 5]).propose(4) == [5, 5, 5, 5]  # past the end of the text, the loop goes on
    assert NgramLookup([1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]
    with pytest.raises(ValueError, match="min_n"):
        NgramLookup(min_n=3, max_n=2)


# ---- how many to verify ----------------------------------------------------------------------------
def _sure(p: float) -> AcceptanceEstimate:
    return AcceptanceEstimate(p, 15, prior_weight=1e9, carry=1.0)  # p at every position, whatever happens


def test_lookup_length_maximises_tokens_per_second():
    """p = 0.7 per position: E(L) = 1.7, 2.19, 2.53, 2.77, 2.94, 3.06; over 34 + 2(L - 1) ms that is
    50.0, 60.8, 66.7, 69.3, 70.0, 69.5 tokens/s: L = 5."""
    verify_s = np.array([30, 34, 36, 38, 40, 42, 44, 46]) / 1000
    length = LookupLength(verify_s, _sure(0.7))
    plain_rate = 1 / 0.030
    assert length.choose(7, 1.0, plain_rate) == 5
    assert length.choose(3, 1.0, plain_rate) == 3  # only 3 tokens found
    assert length.choose(7, 1.0, 71.0) == 0  # nothing beats 71 tokens/s
    assert length.choose(7, 2.2, plain_rate) == 0  # 2.2x the load: 31.8 tokens/s at best
    assert LookupLength(verify_s, _sure(0.1)).choose(7, 1.0, plain_rate) == 0  # 1.1 / 34 ms < 1 / 30 ms


def test_rejected_lookups_are_retried_and_recover():
    """Only lookup steps bring evidence, so declining an offer decays it toward the prior: where every
    lookup fails a few offers are still tried, and lookups are back soon after the text repeats."""
    verify_s = np.array([30, 34, 36, 38, 40, 42, 44, 46]) / 1000
    length = LookupLength(verify_s, AcceptanceEstimate(LOOKUP_PRIOR, 7))
    threshold = 1.03 / 0.030
    rejected = 0
    while length.choose(7, 1.0, threshold):
        length.observe(3, 0)
        rejected += 1
    assert rejected == 8
    tried = 0
    for _ in range(1000):
        n = length.choose(7, 1.0, threshold)
        if n:
            assert n == 1  # a retry verifies the cheapest length
            length.observe(n, 0)
            tried += 1
    assert tried == 89  # about one offer in 11
    offers = 0
    while length.choose(7, 1.0, threshold) < 2:  # now every lookup is accepted
        offers += 1
        n = length.choose(7, 1.0, threshold)
        if n:
            length.observe(n, n)
    assert offers <= 3


def test_lookup_timing_scales_its_costs():
    """A lookup step that took twice its predicted time moves the lookup's own time scale by the
    smoothing (0.2): 1.0 -> 1.2, and a 10x spike by at most 2x the scale per step."""
    length = LookupLength(np.array([30, 34, 36]) / 1000, AcceptanceEstimate(LOOKUP_PRIOR, 2))
    length.observe(1, 1, seconds=0.068, predicted=0.034)
    assert length.time_scale == pytest.approx(1.2)
    length.observe(1, 1, seconds=0.34, predicted=0.034)
    assert length.time_scale == pytest.approx(1.2 + 0.2 * (2.4 - 1.2))
    length.observe(1, 1)  # untimed: the scale stays
    assert length.time_scale == pytest.approx(1.44)


def _lookup_offer(n: int) -> Proposal:
    """A lookup proposal of n ids (the policy decides on its length only)."""
    return Proposal("lookup", ids=np.arange(n, dtype=np.int64))


def test_auto_looks_up_where_it_would_not_draft():
    policy = auto_policy(COSTS, AcceptanceEstimate(0.02, 15), draft_probabilities=True, lookups=True)
    assert policy.uses_lookup and policy.lookups.acceptance.prior == LOOKUP_PRIOR
    assert policy.proposals(15) == 0  # the draft does not pay
    assert policy.take_offer(15, _lookup_offer(4), 0) >= 2  # a lookup at 0.7 does: no draft call, 2 ms a row
    assert policy.take_offer(2, _lookup_offer(4), 0) <= 2  # never past the limit
    spec_scale, drafted = policy.spec_scale, policy.confidence.seconds
    for _ in range(30):
        policy.observe(StepRecord(3, 0, 0.040, source="lookup"))  # every continuation rejected
    assert policy.take_offer(15, _lookup_offer(4), 0) == 0
    assert policy.spec_scale == spec_scale and policy.confidence.seconds == drafted  # the draft's record is its own
    policy.lookups = None
    assert policy.take_offer(15, _lookup_offer(4), 0) == 0
    assert not auto_policy(COSTS, AcceptanceEstimate(0.02, 15), lookups=True).uses_lookup  # needs proposal ids


def test_probes_stay_draft_steps():
    policy = auto_policy(COSTS, AcceptanceEstimate(0.02, 15), draft_probabilities=True, lookups=True)
    choices = [policy.proposals(15) for _ in range(4)]
    assert choices[-1] > 0 and policy.probing
    assert policy.take_offer(15, _lookup_offer(4), choices[-1]) == 0


def test_a_lookup_beats_the_heads_chain_only_where_it_is_faster():
    """Beside the MTP head (`drafter="auto"`), a lookup is verified instead of the head's chain where the
    lookup part predicts more tokens per second than the head's measured rate, and never during a probe."""
    policy = auto_policy(COSTS, AcceptanceEstimate(0.02, 15), draft_probabilities=True, lookups=True)
    n = policy.take_lookup(15, _lookup_offer(6), threshold=40.0)  # the head at 40 tokens/s: 1.2 plain steps a token
    assert 2 <= n <= 6 and policy.take_lookup(3, _lookup_offer(6), 40.0) <= 3
    assert policy.take_lookup(15, _lookup_offer(6), threshold=500.0) == 0  # the head commits 15 per plain step
    policy.probing = True
    assert policy.take_lookup(15, _lookup_offer(6), threshold=1.0) == 0
    policy.probing, policy.lookups = False, None
    assert policy.take_lookup(15, _lookup_offer(6), threshold=1.0) == 0


# ---- the loop ----------------------------------------------------------------------------------------
def _fixed_costs(monkeypatch):
    monkeypatch.setattr(call_costs, "load_or_measure", lambda sess: (COSTS, "fixed"))


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_lookup_steps_commit_the_repeated_text_without_draft_calls(ctxfree, monkeypatch):
    """The context-free pair's reply repeats one id: from the third token on, the text's own 2-grams
    predict it. With the draft written off (a pessimistic prior), auto verifies those lookups, no
    draft call runs on their steps, and the output equals plain decoding."""
    _fixed_costs(monkeypatch)
    sess = runtime.load(ctxfree.artifact)
    sess.acceptance_prior = UNTRAINED_DRAFT_PRIOR
    policy = sess.policy(ctxfree.block_size)
    policy.smoothing = policy.probe_smoothing = 0.0
    draft_calls = []
    run_draft = sess.run_draft
    monkeypatch.setattr(sess, "run_draft", lambda *a, **k: (draft_calls.append(1), run_draft(*a, **k))[1])
    prompt = [5, 7, ctxfree.mask_id]
    n = ctxfree.max_seq_len - len(prompt)
    plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1)
    assert not draft_calls
    auto = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True)
    assert auto.output_ids == plain.output_ids
    lookups = [s for s in auto.steps if s["lookup"]]
    assert auto.lookup_steps == len(lookups)
    assert len(lookups) >= 5 and sum(s["accepted"] for s in lookups) >= 2 * len(lookups)
    drafted = [s for s in auto.steps if s["proposed"] and not s["lookup"]]
    assert len(draft_calls) <= len(drafted) + 1  # (+1: a probe's catch-up may take two calls)
    assert auto.tau >= 2.0


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_explicit_lengths_and_plain_decoding_never_look_up(ctxfree):
    sess = runtime.load(ctxfree.artifact)
    prompt = [5, 7, ctxfree.mask_id]
    for kw in ({"verify_len": 2}, {"block_size": 1}, {"verify_len": "all"}):
        r = sess.generate(prompt, max_new_tokens=20, stop_token_ids=[], record_steps=True, **kw)
        assert not any(s["lookup"] for s in r.steps), kw


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_lookups_keep_the_output_of_plain_decoding(qwen, monkeypatch):
    """On the random Qwen3-shaped pair (whose greedy replies loop), auto with lookups gives plain
    decoding's ids. Its drafted steps are written off (their measured microseconds would beat any
    fixed cost), so the steps are plain, lookups and probes: each probe's draft call catches up on
    the rows lookup steps committed."""
    _fixed_costs(monkeypatch)
    sess = runtime.load(qwen.artifact)
    policy = sess.policy(qwen.block_size)
    monkeypatch.setattr(policy, "drafted_rate", lambda limit: 0.0)
    looked_up, probes = 0, 0
    for prompt in ([5, 6, 7], [1, 40, 33, 12, 90, 7, 61, 18]):
        plain = sess.generate(prompt, block_size=1, max_new_tokens=48, stop_token_ids=[])
        auto = sess.generate(prompt, record_steps=True, max_new_tokens=48, stop_token_ids=[])
        assert auto.output_ids == plain.output_ids
        looked_up += sum(s["accepted"] for s in auto.steps if s["lookup"])
        probes += sum(1 for s in auto.steps if s["proposed"] and not s["lookup"])
    assert looked_up > 0 and probes > 0


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_sampled_lookups_keep_the_sampled_output(ctxfree, monkeypatch):
    """A seeded sample with lookups equals the same seed's plain sample (a lookup token is accepted
    iff it equals the position's sample), and the lookups were accepted (drafted steps written off
    as above)."""
    _fixed_costs(monkeypatch)
    sess = runtime.load(ctxfree.artifact)
    monkeypatch.setattr(sess.policy(ctxfree.block_size), "drafted_rate", lambda limit: 0.0)
    prompt = [5, 7, ctxfree.mask_id]
    kw = dict(max_new_tokens=ctxfree.max_seq_len - len(prompt), stop_token_ids=[], temperature=0.9, seed=5)
    plain = sess.generate(prompt, block_size=1, **kw)
    auto = sess.generate(prompt, record_steps=True, **kw)
    assert auto.output_ids == plain.output_ids
    assert sum(s["accepted"] for s in auto.steps if s["lookup"]) > 0


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_lookups_with_host_sampling_and_a_reused_prefix(ctxfree, monkeypatch):
    """top_k sampling (the host samples each verified row) with lookups equals the seeded plain
    sample, and a second turn that extends the first (its cached rows reused) equals plain too."""
    _fixed_costs(monkeypatch)
    sess = runtime.load(ctxfree.artifact)
    monkeypatch.setattr(sess.policy(ctxfree.block_size), "drafted_rate", lambda limit: 0.0)
    prompt = [5, 7, ctxfree.mask_id]
    kw = dict(max_new_tokens=12, stop_token_ids=[], temperature=0.9, top_k=5, seed=2)
    plain = sess.generate(prompt, block_size=1, **kw)
    auto = sess.generate(prompt, record_steps=True, **kw)
    assert auto.output_ids == plain.output_ids
    assert sum(s["accepted"] for s in auto.steps if s["lookup"]) > 0
    second = prompt + auto.output_ids + [9]
    turn = sess.generate(second, max_new_tokens=10, stop_token_ids=[])  # reuses the first turn's rows
    assert turn.reused_tokens > 0
    assert turn.output_ids == sess.generate(second, max_new_tokens=10, stop_token_ids=[], block_size=1,
                                            reuse_prefix=False).output_ids
