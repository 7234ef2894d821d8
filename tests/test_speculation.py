"""The default speculation policy (auto verify length), its cached step costs, and Session lifetime.

Policy arithmetic runs on fixed costs and hand-made acceptance; the loop tests use the tiny pairs: the
random qwen3 draft (accepts almost nothing: auto must fall back to plain steps and still probe) and the
context-free pair (accepts whole blocks: auto must speculate).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from runtime.graphs import costs as call_costs
from runtime.graphs.costs import CallCosts, measurement_points
from runtime.errors import DFlashError
from runtime.speculation.proposals import StepRecord
from runtime.speculation.policy import UNTRAINED_DRAFT_PRIOR, AcceptanceEstimate, AdaptiveLength, FixedLength


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


@pytest.fixture(scope="session")
def ctxfree(tmp_path_factory) -> rf.Pair:
    return rf.artifact("ctxfree", tmp_path_factory)


# CPU-like costs: a plain step 30 ms, the draft + a verify of n proposals 40 + 2n ms.
CPU_COSTS = CallCosts({0: 30.0, 1: 42.0, 3: 46.0, 7: 54.0, 15: 70.0}, past_len=128)


def _policy(rate: float, costs=CPU_COSTS, **kw) -> AdaptiveLength:
    return AdaptiveLength(costs, AcceptanceEstimate(rate, 15, prior_weight=1e9, carry=1.0), **kw)  # prior pinned


# ---- policy arithmetic ---------------------------------------------------------------------------
def test_expected_tokens_follow_leviathan():
    """With constant acceptance a, verifying n commits (1 - a^(n+1)) / (1 - a) tokens on average."""
    est = AcceptanceEstimate(0.6, 15, prior_weight=1e9, carry=1.0)
    a = 0.6
    np.testing.assert_allclose(est.expected_tokens(), [(1 - a ** (n + 1)) / (1 - a) for n in range(16)])


def test_auto_picks_the_fastest_length_and_plain_when_nothing_wins():
    # a = 0.9: E(n) / step(n) peaks inside the block (E(15) = 8.15 / 70 ms beats E(7) = 5.7 / 54 ms)
    exp = [(1 - 0.9 ** (n + 1)) / 0.1 for n in range(16)]
    step = CPU_COSTS.step_s(np.arange(16))
    assert _policy(0.9).proposals(15) == int(np.argmax([e / t for e, t in zip(exp, step)]))
    assert _policy(0.9).proposals(3) == 3  # the token budget caps the length
    # a = 0.2: the best speculative step commits 1.25 tokens in 42 ms < 1 token in 30 ms: plain
    assert _policy(0.2).proposals(15) == 0
    assert _policy(0.9).proposals(0) == 0  # no budget for proposals
    # a GPU-like device where verifying is nearly free: speculate even at a = 0.2
    gpu = CallCosts({0: 10.0, 1: 10.5, 15: 11.0}, past_len=128)
    assert _policy(0.2, gpu).proposals(15) > 0


def test_a_cost_point_slowed_by_other_load_counts_as_the_least_later_one():
    """A table measured beside another job (14:07 on the 2-core AVX-512 machine: 7 proposals at 5.35 ms,
    15 at 1.36) kept lookups of 11-13 accepted tokens from ever running: a call verifying more proposals
    never costs less, so the disturbed point counts as the least later value."""
    loaded = CallCosts({0: 0.64, 1: 0.98, 3: 1.31, 7: 5.35, 15: 1.36}, 31, {1: 0.62, 3: 0.90, 7: 4.92, 15: 0.85})
    clean = CallCosts({0: 0.64, 1: 0.98, 3: 1.31, 7: 1.36, 15: 1.36}, 31, {1: 0.62, 3: 0.85, 7: 0.85, 15: 0.85})
    n = np.arange(16)
    np.testing.assert_allclose(loaded.step_s(n), clean.step_s(n), rtol=1e-12)
    np.testing.assert_allclose(loaded.verify_s(n), clean.verify_s(n), rtol=1e-12)
    assert loaded.step_s(np.array([7]))[0] <= 1.36e-3


def test_plain_steps_probe_with_a_doubling_gap():
    """A useless draft: plain steps, a probe after 4 of them, the gap doubling per failed probe up to 128,
    and never shorter than what keeps the probes' net extra cost within 1% of the time."""
    pol = _policy(0.2)
    probes = []
    for step in range(400):
        n = pol.proposals(15)
        if n:
            probes.append(step)
        pol.observe(StepRecord(n, 0, float(CPU_COSTS.step_s(np.array([n]))[0])))
    gaps = np.diff(probes).tolist()
    # a probe costs 42 - 30 = 12 ms more than a plain step: at least 0.012 / (0.01 * 0.030) = 40 steps apart
    assert pol.probe_extra_s == pytest.approx(0.012)
    assert probes[0] == 3 and gaps[:5] == [40, 40, 40, 64, 128] and set(gaps[4:]) == {128}
    pol.start()  # a new prompt: half the gap reached, not the first gap
    assert pol.probe_gap == 64
    # a catch-up probe's full time counts as its cost, but not as a verify step's cost
    pol = _policy(0.2)
    pol.probing = True
    pol.observe(StepRecord(1, 0, 0.100, catch_up=True))
    assert pol.probe_extra_s == pytest.approx(0.070) and pol.spec_scale == 1.0
    # an accepted probe committed 2 tokens in 42 ms where plain steps take 60: it cost nothing net,
    # and probes that pay for themselves are not spaced out for their cost
    pol.probing = True
    pol.observe(StepRecord(1, 1, 0.042))
    assert pol.probe_extra_s == pytest.approx(0.5 * (0.070 + 0.042 - 0.060))
    pol.probing = True
    pol.observe(StepRecord(1, 1, 0.042))
    pol.probing = True
    pol.observe(StepRecord(1, 1, 0.042))
    assert pol.probe_extra_s < 0 and pol._min_probe_gap() == 0
    # probes that accept but do not make speculation pay keep doubling the gap; once speculation
    # wins, the gap starts again at 4
    pol = _policy(0.2)
    pol.probe_gap, pol.probing = 8, True
    pol.observe(StepRecord(7, 2, 0.054))
    assert pol.probe_gap == 16 and pol.proposals(15) == 0
    pol.acceptance.prior = 0.9
    assert pol.proposals(15) > 0 and pol.probe_gap == 4


def test_short_replies_keep_the_probe_budget():
    """Plain steps since the last probe count across generate calls: 30 replies of 44 steps on a useless
    draft whose probes cost 2.5 plain steps more probe every 128 steps (the longest gap; the 1% budget asks
    255), not once per reply."""
    costs = CallCosts({0: 30.0, 1: 105.0, 3: 110.0, 7: 115.0, 15: 125.0}, past_len=128)
    pol = _policy(0.01, costs)
    probes = 0
    for reply in range(30):
        pol.start()
        for _ in range(44):
            n = pol.proposals(15)
            probes += n > 0
            pol.observe(StepRecord(n, 0, float(costs.step_s(np.array([n]))[0])))
    assert pol.probe_extra_s == pytest.approx(0.075, rel=0.05)
    # the first probes find the cost; from then on one per 128 plain steps
    assert 10 <= probes <= 14, probes


def test_the_shape_search_runs_again_only_when_its_inputs_change(monkeypatch):
    """Plain steps change neither the acceptance estimate nor the speculative costs: the search over
    shapes is not repeated for them (it cost 1.5% of an INT4 step), but a speculative step, a new
    prompt or another limit repeats it."""
    pol = AdaptiveLength(CPU_COSTS, AcceptanceEstimate(0.2, 15))
    searched = []
    search = pol._search
    monkeypatch.setattr(pol, "_search", lambda limit: searched.append(limit) or search(limit))
    for _ in range(3):
        assert pol.proposals(15) == 0
        pol.observe(StepRecord(0, 0, 0.031))
    assert searched == [15]
    pol.proposals(7)
    pol.observe(StepRecord(0, 0, 0.031))
    pol.observe(StepRecord(1, 1, 0.042))  # (a step the policy did not choose: still evidence)
    pol.proposals(7)
    pol.start()
    pol.proposals(7)
    assert searched == [15, 7, 7, 7]


def test_acceptance_estimate_learns_and_forgets():
    est = AcceptanceEstimate(0.5, 7, prior_weight=2.0, decay=0.95, carry=0.85)
    np.testing.assert_allclose(est.rates(), 0.5 * 0.85 ** np.arange(7))  # no evidence: the prior, carried down
    for _ in range(60):
        est.observe(7, 7)  # every proposal accepted
    assert est.rates().min() > 0.9
    for _ in range(60):
        est.observe(3, 0)  # now the first is always rejected
    rates = est.rates()
    assert rates[0] < 0.1
    assert est.expected_tokens()[-1] < 1.2  # a long verify no longer pays
    fresh = AcceptanceEstimate(0.02, 7)
    fresh.observe(3, 3)  # one accepted probe of 3 lifts the whole curve, deeper positions most
    r = fresh.rates()
    assert 0.3 < r[0] < r[1] < r[2] and r[3] == pytest.approx(0.85 * r[2])


def test_scales_track_observed_step_times():
    """Observed steps 2x slower than measured (a longer past) move the scales, not the choice; a first
    measurement that overrated speculation's cost is corrected by what the probes observe."""
    pol = _policy(0.9)
    before = pol.proposals(15)
    for _ in range(40):
        n = pol.proposals(15)
        pol.observe(StepRecord(n, n, 2 * float(CPU_COSTS.step_s(np.array([n]))[0])))
    assert pol.spec_scale == pytest.approx(2.0, rel=0.05) and pol.proposals(15) == before
    # measured: speculative steps 40% dearer than they are; a = 0.45 then looks like a loss
    wrong = CallCosts({n: v * (1.4 if n else 1.0) for n, v in CPU_COSTS.step_ms.items()}, 128)
    pol = _policy(0.45, wrong)
    assert pol.proposals(15) == 0
    chosen = []
    for _ in range(200):
        n = pol.proposals(15)
        chosen.append(n)
        pol.observe(StepRecord(n, 1 if n else 0, float(CPU_COSTS.step_s(np.array([n]))[0])))  # what steps really cost
    assert pol.spec_scale == pytest.approx(1 / 1.4, rel=0.05) and chosen[-1] > 0
    won = next(i for i in range(len(chosen) - 1) if chosen[i] > 0 and chosen[i + 1] > 0)  # chosen, not a probe
    assert won < 40  # a few probes suffice
    assert FixedLength(5).proposals(3) == 3 and FixedLength(0).proposals(15) == 0


def test_measurement_points():
    assert measurement_points(16) == [0, 1, 3, 7, 15]
    assert measurement_points(8) == [0, 1, 3, 7] and measurement_points(2) == [0, 1] and measurement_points(5) == [0, 1, 3, 4]


# ---- the loop under the default policy -------------------------------------------------------------
def test_auto_falls_back_to_plain_with_a_random_draft(qwen, monkeypatch):
    """The random draft accepts (almost) nothing: auto runs mostly plain steps (no draft call), probes
    now and then, and the output is the target's.

    The step costs are fixed (CPU-like): the tiny graphs take microseconds, so measured costs are
    noise and the number of probes would depend on this machine's load (a CI run once saw 8)."""
    monkeypatch.setattr(call_costs, "load_or_measure", lambda sess: (CallCosts({0: 30.0, 1: 42.0, 3: 46.0, 7: 54.0}, 64), "fixed"))
    sess = runtime.load(qwen.artifact)
    policy = sess.policy(qwen.block_size)
    policy.smoothing = policy.probe_smoothing = 0.0  # keep the fixed costs: the tiny graphs take microseconds
    prompt = [5, 17, 33, 8, 61]
    plain = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], block_size=1)
    auto = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], record_steps=True)
    assert auto.policy == "auto" and auto.output_ids == plain.output_ids
    lens = [len(s["proposed"]) for s in auto.steps]
    assert lens.count(0) >= 0.75 * len(lens) and 1 <= len(auto.acceptance_lengths) <= 6
    assert len(auto.acceptance_lengths) == sum(n > 0 for n in lens)


def test_auto_speculates_when_blocks_are_accepted(ctxfree, monkeypatch):
    """The context-free pair accepts whole blocks. From the untrained draft's pessimistic prior, auto
    starts plain, its first probe is accepted and it then verifies whole blocks; output equals plain.

    The step costs are fixed (CPU-like) so the test does not depend on this machine's timings."""
    monkeypatch.setattr(call_costs, "load_or_measure", lambda sess: (CallCosts({0: 30.0, 1: 42.0, 3: 46.0, 7: 54.0}, 64), "fixed"))
    sess = runtime.load(ctxfree.artifact)
    sess.acceptance_prior = UNTRAINED_DRAFT_PRIOR  # a checkpoint counts as trained; start pessimistic
    policy = sess.policy(ctxfree.block_size)
    policy.smoothing = policy.probe_smoothing = 0.0  # keep the fixed costs: the tiny graphs take microseconds
    m = ctxfree.mask_id
    prompt = [5, 7, m]
    n = ctxfree.max_seq_len - len(prompt)
    plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1)
    auto = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True)
    assert auto.output_ids == plain.output_ids == [m] * n
    lens = [len(s["proposed"]) for s in auto.steps]
    assert lens[:3] == [0, 0, 0] and lens[3] > 0  # plain until the first probe, which is accepted
    assert lens[-2] == ctxfree.block_size - 1 and auto.tau >= 2.5  # then whole blocks (block 4: tau <= 4)


# ---- cached step costs ---------------------------------------------------------------------------
def test_step_costs_are_measured_once_and_cached(qwen, tmp_path, monkeypatch):
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "costs"))
    sess = runtime.load(qwen.artifact)
    costs, how = call_costs.load_or_measure(sess)
    assert how == "measured" and sorted(costs.step_ms) == measurement_points(qwen.block_size)
    assert all(v > 0 for v in costs.step_ms.values())
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["backend"]["name"] == "ort"
    # a new session of the same artifact on the same machine reads them without measuring
    monkeypatch.setattr(call_costs, "measure", lambda s: pytest.fail("measured again"))
    again, how = call_costs.load_or_measure(runtime.load(qwen.artifact))
    assert how == "cached" and again.step_ms == costs.step_ms
    # another thread count is another key
    monkeypatch.undo()
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "costs"))
    _, how = call_costs.load_or_measure(runtime.load(qwen.artifact, threads=1))
    assert how == "measured" and len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_damaged_or_unwritable_cache_means_measuring(qwen, tmp_path, monkeypatch):
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "costs"))
    sess = runtime.load(qwen.artifact)
    call_costs.load_or_measure(sess)
    (path,) = (tmp_path / "costs").glob("*.json")
    for damage in ("{not json", json.dumps({"format": call_costs.CACHE_FORMAT, "key": call_costs.cache_key(sess),
                                            "costs": {"step_ms": {"0": -1.0, "1": 2.0}, "past_len": 1}})):
        path.write_text(damage)
        _, how = call_costs.load_or_measure(sess)
        assert how == "measured" and json.loads(path.read_text())["costs"]["step_ms"]["0"] > 0  # replaced
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "file" / "costs"))  # cannot be a directory
    res = sess.generate([5, 6], max_new_tokens=6, stop_token_ids=[])
    assert len(res.output_ids) == 6


def test_measurement_leaves_generation_unchanged(qwen, tmp_path, monkeypatch):
    """Measuring writes only rows past the committed length: the next generate is exact."""
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "costs"))
    sess = runtime.load(qwen.artifact)
    prompt = [3, 1, 4, 1, 5]
    before = sess.generate(prompt, max_new_tokens=12, stop_token_ids=[], verify_len="all", record_steps=True)
    call_costs.measure(sess)
    after = sess.generate(prompt, max_new_tokens=12, stop_token_ids=[], verify_len="all", record_steps=True)
    assert (after.output_ids, after.steps) == (before.output_ids, before.steps)


# ---- Session lifetime and threads ------------------------------------------------------------------
def test_close_and_context_manager(qwen):
    with runtime.load(qwen.artifact) as sess:
        assert len(sess.generate([5, 6], max_new_tokens=3, stop_token_ids=[]).output_ids) == 3
    assert sess.closed and sess.backend.sessions == {}
    with pytest.raises(DFlashError, match="this Session is closed; load the artifact again"):
        sess.generate([5, 6], max_new_tokens=3)
    sess.close()  # twice is fine


def test_a_second_thread_gets_an_error_while_one_generates(qwen, monkeypatch):
    """The documented choice: a busy Session refuses a concurrent generate at once (no waiting, no
    shared buffers); the first call's output is unaffected."""
    sess = runtime.load(qwen.artifact)
    started, release = threading.Event(), threading.Event()
    real = sess.run_target

    def slow_target(*args, **kw):
        started.set()
        release.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(sess, "run_target", slow_target)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("ids", sess.generate([5, 6], max_new_tokens=4, stop_token_ids=[], block_size=1).output_ids))
    worker.start()
    assert started.wait(10)
    with pytest.raises(DFlashError, match="already generating in another thread"):
        sess.generate([7, 8], max_new_tokens=4)
    release.set()
    worker.join(10)
    monkeypatch.undo()
    assert result["ids"] == sess.generate([5, 6], max_new_tokens=4, stop_token_ids=[], block_size=1).output_ids


def test_a_second_generate_in_the_same_thread_names_the_open_stream(qwen):
    """An open stream blocks the next generate of its own thread: the error says so (not "another
    thread"); closing the stream frees the session."""
    sess = runtime.load(qwen.artifact)
    stream = sess.stream([5, 6], max_new_tokens=4, stop_token_ids=[], block_size=1)
    next(iter(stream))
    with pytest.raises(DFlashError, match="a stream of this Session is still open in this thread; read it to the end or close"):
        sess.generate([7, 8], max_new_tokens=4)
    stream.close()
    assert len(sess.generate([7, 8], max_new_tokens=4, stop_token_ids=[], block_size=1).output_ids) == 4


def test_policy_argument_takes_an_object_or_a_name(qwen):
    """generate(policy=...): a Policy object runs as given (what it learns stays with the caller), a
    name is a verify_len value or "plain"; greedy output is plain decoding's either way; policy and
    verify_len together, or something else, are refused."""
    sess = runtime.load(qwen.artifact)
    plain = sess.generate([5, 6, 7], max_new_tokens=12, stop_token_ids=[], block_size=1).output_ids

    class Count(FixedLength):
        def __init__(self):
            super().__init__(3)
            self.records = []

        def observe(self, record):
            self.records.append(record)

    mine = Count()
    result = sess.generate([5, 6, 7], max_new_tokens=12, stop_token_ids=[], policy=mine, record_steps=True)
    assert result.output_ids == plain and result.policy == "fixed"
    assert [r.verified for r in mine.records] == [min(3, len(s["proposed"])) for s in result.steps]
    assert mine.records[0].verified == 3 and mine.records[0].source == "draft"
    assert [r.committed for r in mine.records] == [s["committed"] for s in result.steps]
    for name in ("plain", "all", 2, "auto"):
        assert sess.generate([5, 6, 7], max_new_tokens=12, stop_token_ids=[], policy=name).output_ids == plain
    with pytest.raises(DFlashError, match="either policy or verify_len"):
        sess.generate([5], policy="all", verify_len=2)
    with pytest.raises(DFlashError, match="policy must be a runtime.speculation.policy.Policy or a name"):
        sess.generate([5], policy=3.5)


def test_costs_extrapolate_and_measurement_fits_small_buffers(qwen, tmp_path, monkeypatch):
    """Beyond the last measured point the cost grows with the last slope (a block_size override
    verifies more than was measured); an artifact whose buffers hold fewer rows than a block is
    measured at points that fit."""
    costs = CallCosts({0: 30.0, 7: 44.0, 15: 60.0}, 128)
    np.testing.assert_allclose(costs.step_s(np.array([0, 7, 15, 31])), [0.030, 0.044, 0.060, 0.092])
    # one disturbed point (n = 1 measured 8 ms low) is smoothed by the line through the others
    noisy = CallCosts({0: 35.0, 1: 38.0, 3: 49.8, 7: 57.5, 15: 71.6}, 128)
    s1, s3 = noisy.step_s(np.array([1, 3]))
    assert s3 - s1 < 0.006 and s1 > 0.040
    monkeypatch.setenv(call_costs.COSTS_ENV, str(tmp_path / "costs"))
    sess = runtime.load(qwen.artifact)
    sess.max_seq_len = 6  # as if built with --max-seq-len 6 (block 8)
    small = call_costs.measure(sess)
    assert small.past_len == 0 and max(small.step_ms) == 5


def test_bad_verify_len_and_step_api_after_close(qwen):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError, match=r'verify_len must be "auto", "all", an integer or a verify tree "L\+A" \(got \'AUTO\'\)'):
        sess.generate([5, 6], max_new_tokens=3, verify_len="AUTO")
    sess.close()
    with pytest.raises(DFlashError, match="this Session is closed"):
        sess.run_target(1, 0, 0)


def test_keep_logits_binds_the_logits(qwen):
    """Logits are written only when asked for; then the posterior is their argmax."""
    assert runtime.load(qwen.artifact).logits is None
    sess = runtime.load(qwen.artifact, keep_logits=True)
    sess.backend.write(sess.input_ids.rows(0, 3), np.array([5, 6, 7], np.int64))
    sess.run_target(3, 0, 0)
    posterior, _ = sess.read_ids(0)
    logits = sess.backend.read(sess.logits.rows(0, 1))
    assert np.isfinite(logits).all() and int(np.argmax(logits[0])) == int(posterior[0])


def test_a_failed_cost_measurement_forgets_the_cached_context(qwen, monkeypatch):
    """The first auto request measures step costs on the session's buffers; if that fails half-way, the
    rows it overwrote must not be reused by the next request (found by an adversarial review)."""
    sess = runtime.load(qwen.artifact)
    prompt = [5, 17, 33, 8, 61]
    first = sess.generate(prompt, max_new_tokens=10, stop_token_ids=[], block_size=1)
    assert len(sess.context.ids) > 0

    def broken(session):
        session.run_target(1, 3, 5)  # writes over cached rows, then fails
        raise DFlashError("transient backend failure")
    monkeypatch.setattr(call_costs, "load_or_measure", broken)
    with pytest.raises(DFlashError, match="transient"):
        sess.generate(prompt + first.output_ids, max_new_tokens=5, stop_token_ids=[])
    assert sess.context.ids == []
    follow = sess.generate(prompt + first.output_ids, max_new_tokens=6, stop_token_ids=[], block_size=1)
    fresh = runtime.load(qwen.artifact).generate(prompt + first.output_ids, max_new_tokens=6, stop_token_ids=[], block_size=1)
    assert follow.reused_tokens == 0 and follow.output_ids == fresh.output_ids


def test_reset_while_a_stream_is_open_is_refused(qwen):
    sess = runtime.load(qwen.artifact)
    with sess.stream([5, 17, 33], max_new_tokens=8, stop_token_ids=[], block_size=1) as stream:
        next(iter(stream))
        with pytest.raises(DFlashError, match="close the stream before reset"):
            sess.reset()
    sess.reset()  # closed: allowed
    assert sess.context.ids == []


def test_the_drafter_choice_follows_the_measured_rates():
    from runtime.speculation.drafters import DrafterChoice

    choice = DrafterChoice(probe_every=3, decay=0.5, budget=1.0)  # (the cost budget: the next test)
    assert choice.choose() == "mtp"
    choice.observe("mtp", 4, 0.1)  # 40 tokens/s
    assert choice.choose() == "policy"
    choice.observe("policy", 1, 0.05)  # 20 tokens/s
    picks = []
    for _ in range(8):
        side = choice.choose()
        picks.append(side)
        choice.observe(side, 4 if side == "mtp" else 1, 0.1 if side == "mtp" else 0.05)
    # a probe every 3 steps, then every 6 after it lost (the interval doubles while probes lose)
    assert picks == ["mtp", "mtp", "mtp", "policy", "mtp", "mtp", "mtp", "mtp"] and choice.interval == 6
    for _ in range(6):  # the head stops paying (the text changed): the policy's side takes over
        choice.observe("mtp", 1, 0.2)
    assert choice.choose() == "policy"
    choice.since_probe = choice.interval
    assert choice.choose() == "mtp"
    choice.observe("mtp", 40, 0.1)  # a probe that wins: short intervals again
    assert choice.best == "mtp" and choice.interval == 3


def test_tries_of_the_slower_drafter_keep_within_their_budget():
    """Where the head loses (a try: 1 token in 3 plain steps' time), its tries come at least 200 steps of
    the faster side apart (2 steps' time extra each, 1% of the time) once the first try measured that, not
    every 8 to 64."""
    from runtime.speculation.drafters import DrafterChoice

    choice = DrafterChoice()
    picks = []
    for _ in range(1500):
        side = choice.choose()
        picks.append(side)
        choice.observe(side, 1, 0.003 if side == "mtp" else 0.001)
    tries = [i for i, side in enumerate(picks) if side == "mtp"]
    assert choice.try_extra_s == pytest.approx(0.002, rel=1e-6)
    assert tries[:2] == [0, 9] and set(np.diff(tries[1:]).tolist()) == {201}


def test_the_head_chain_follows_what_it_accepts():
    """verify_len unset: two more proposals after a step that accepted all it asked, one fewer after any
    miss, within 1..block_size - 1; a chain the token budget cut grows nothing."""
    from runtime.speculation.drafters import MTPChain

    chain = MTPChain(longest=7, start=3)
    assert chain.length(15) == 3 and chain.length(2) == 2
    chain.observe(3, 3)
    assert chain.n == 5
    chain.observe(5, 5)
    chain.observe(7, 7)
    assert chain.n == 7  # capped at the block
    chain.observe(7, 6)
    assert chain.n == 6
    chain.observe(2, 2)  # cut to 2 by the budget: no evidence about 6
    assert chain.n == 6
    for _ in range(8):
        chain.observe(chain.n, 0)
    assert chain.n == 1 and chain.length(0) == 0


def test_a_fixed_length_policy_fixes_the_heads_chain_as_verify_len_does():
    """`policy=FixedLength(n)` fixes the MTP head's chain at n as `verify_len=n` would (without either, the
    chain follows acceptance), and `policy="plain"` (FixedLength(0)) decodes plainly."""
    from runtime.options import GenerationOptions
    from runtime.session import _fixed_chain

    opts = GenerationOptions(drafter="mtp")
    assert _fixed_chain(opts, FixedLength(2)).verify_len == 2
    assert _fixed_chain(opts, FixedLength(0)).block_size == 1
    assert _fixed_chain(GenerationOptions(drafter="mtp", verify_len=5), FixedLength(2)).verify_len == 5
    from runtime.graphs.tree import verify_tree
    from runtime.speculation.policy import FixedTree

    assert _fixed_chain(opts, None) is opts and _fixed_chain(opts, FixedTree(verify_tree(3, 1))) is opts
