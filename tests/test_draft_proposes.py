"""A draft graph that ends in the proposal head, and the verify shape chosen from its confidence.

Where the draft has a proposal vocabulary, `build` moves the proposal head (the LM head's rows of that
vocabulary) from the target graph into the draft graph: the draft returns its top candidates and
their probabilities, and the target takes the proposal ids. The policy arithmetic
(`runtime.speculation.confidence`, `auto_policy(draft_probabilities=True)`) runs on fixed costs and hand-made
probabilities; the graphs on the tiny pairs.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from runtime.graphs import costs as call_costs
from runtime.speculation.confidence import ConfidenceTrim
from runtime.errors import DFlashError
from runtime.manifest import draft_proposes, load_manifest, proposal_ranks
from runtime.speculation.proposals import Proposal, StepRecord
from runtime.speculation.policy import UNTRAINED_DRAFT_PRIOR, AcceptanceEstimate, AdaptiveLength, auto_policy
from runtime.graphs.tree import VerifyTree

PROMPTS = ([5, 6, 7], [1, 40, 33, 12, 90, 7, 61, 18], [3])
COSTS = rf.proposing_costs()  # plain 30 ms; draft + verify n: 40 + 2n ms (verify 32 + 2n)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.proposing_artifact("qwen3", tmp_path_factory)


@pytest.fixture(scope="module")
def ctxfree(tmp_path_factory) -> rf.Pair:
    return rf.proposing_artifact("ctxfree", tmp_path_factory)


# ---- the graphs ----------------------------------------------------------------------------------
def _graph_names(path):
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return ([i.name for i in model.graph.input], [o.name for o in model.graph.output],
            {t.name for t in model.graph.initializer})


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_the_proposal_head_moves_into_the_draft(qwen, tmp_path):
    """The draft graph holds the proposal rows and returns [R, 4] ids and probabilities; the target
    takes proposal ids (no ranks, no hidden rows) and holds no proposal rows. `--draft-vocab full`
    keeps the earlier form (the full head is the target's own: moving it would store it twice)."""
    from dflash_export.build import BuildOptions, build

    manifest = load_manifest(qwen.artifact)
    assert draft_proposes(manifest) and proposal_ranks(manifest) == 4
    t_in, t_out, t_init = _graph_names(qwen.artifact / "target.onnx")
    d_in, d_out, d_init = _graph_names(qwen.artifact / "draft.onnx")
    assert t_in[:6] == ["input_ids", "proposal_ids", "temperature", "uniform", "tree_depth", "tree_bias"]
    assert "proposal_ids" not in t_out and "draft_head" not in t_init
    assert d_out[:2] == ["draft_top_ids", "draft_top_probs"] and "draft_head" in d_init
    full = build(BuildOptions(str(qwen.target_dir), str(qwen.draft_dir), tmp_path / "full", max_seq_len=qwen.max_seq_len,
                 quiet=True, draft_vocab="full"))
    assert not draft_proposes(full)
    assert _graph_names(tmp_path / "full" / "target.onnx")[0][1] == "draft_hidden"


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_check_compares_the_draft_candidates(qwen):
    """`check` compares the draft's candidate ids (where their ranks are clear) and probabilities with
    the PyTorch draft scored by the target's proposal rows."""
    from dflash_export.check.parity import run_check

    report = run_check(qwen.artifact)
    rows = {(r.case, r.output): r for r in report.results}
    assert report.passed
    assert rows[("draft_prefill", "draft_top_ids")].passed and rows[("draft_step", "draft_top_probs")].passed
    assert rows[("draft_prefill", "draft_top_ids")].shape == (qwen.block_size - 1, 4)


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_read_draft_proposals(qwen):
    """Candidates come from the proposal vocabulary in rank order, with descending probabilities that
    sum to at most 1; the top-1 column is what the target verifies."""
    sess = runtime.load(qwen.artifact)
    res = sess.generate([5, 6, 7], max_new_tokens=6, stop_token_ids=[], verify_len=3, record_steps=True)
    ids, probs = sess.read_draft_proposals(3)
    vocab = set(range(0, 128, 2)) | {qwen.mask_id}
    assert ids.shape == probs.shape == (3, 4) and ids.dtype == np.int64 and probs.dtype == np.float32
    assert set(ids.ravel().tolist()) <= vocab
    assert (np.diff(probs, axis=1) <= 1e-7).all() and (probs > 0).all() and (probs.sum(axis=1) <= 1 + 1e-5).all()
    assert all(set(s["proposed"]) <= vocab for s in res.steps)
    assert list(res.steps[-1]["proposed"]) == ids[: len(res.steps[-1]["proposed"]), 0].tolist()


def test_read_draft_proposals_needs_a_proposing_draft(tmp_path_factory):
    sess = runtime.load(rf.artifact("qwen3", tmp_path_factory).artifact)
    assert not sess.draft_proposes
    with pytest.raises(DFlashError, match="returns hidden rows, not proposals .* rebuild it"):
        sess.read_draft_proposals(1)


@pytest.mark.slow  # a proposing-artifact build: `make test`
@pytest.mark.parametrize("verify_len", [1, 3, "2+1", "all", None])
def test_greedy_output_equals_plain(qwen, verify_len):
    sess = runtime.load(qwen.artifact)
    for prompt in PROMPTS:
        plain = sess.generate(list(prompt), max_new_tokens=24, stop_token_ids=[], block_size=1)
        spec = sess.generate(list(prompt), max_new_tokens=24, stop_token_ids=[], verify_len=verify_len)
        assert spec.output_ids == plain.output_ids


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_sampling_is_unchanged_by_the_layout(qwen):
    """A seed gives the same sampled reply with and without speculation (one uniform per position)."""
    sess = runtime.load(qwen.artifact)
    plain = sess.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[], block_size=1, temperature=0.9, seed=3)
    spec = sess.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[], verify_len=3, temperature=0.9, seed=3)
    assert spec.output_ids == plain.output_ids


@pytest.mark.slow  # a proposing-artifact build: `make test`
def test_auto_verifies_confident_blocks(ctxfree, monkeypatch):
    """The context-free pair accepts whole blocks and its draft is sure of them: from a pessimistic
    prior, auto probes, measures that drafted steps pay and then verifies whole blocks; output
    equals plain. Costs are fixed so the test does not depend on this machine's timings."""
    monkeypatch.setattr(call_costs, "load_or_measure", lambda sess: (COSTS, "fixed"))
    sess = runtime.load(ctxfree.artifact)
    sess.acceptance_prior = UNTRAINED_DRAFT_PRIOR
    policy = sess.policy(ctxfree.block_size)
    assert policy.confidence.trimmer is not None
    policy.smoothing = policy.probe_smoothing = 0.0  # keep the fixed costs: the tiny graphs take microseconds
    policy.lookups = None  # the draft's own path (its repeated output would be verified by lookups)
    m = ctxfree.mask_id
    prompt = [5, 7, m]
    n = ctxfree.max_seq_len - len(prompt)
    plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1)
    auto = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True)
    assert auto.output_ids == plain.output_ids == [m] * n
    _, probs = sess.read_draft_proposals(1)
    assert probs[0, 0] > 0.5  # the draft is confident of the mask id
    lens = [len(s["proposed"]) for s in auto.steps]
    assert lens[:3] == [0, 0, 0] and lens[3] > 0  # plain until the first probe
    assert lens[-2] == ctxfree.block_size - 1 and auto.tau >= 2.5  # then whole blocks (block 4: tau <= 4)


# ---- the policy arithmetic ------------------------------------------------------------------------
def test_trim_verifies_what_the_confidence_pays_for():
    """Verifying L proposals with probabilities q commits 1 + q1 + q1 q2 + ... tokens and costs
    verify(L) / plain steps; the best L wins, 0 when nothing beats a plain call."""
    trim = ConfidenceTrim(COSTS.verify_s(np.arange(16)))
    plain = 0.030
    # verify(1) = 34 ms = 1.133 plain steps (+0.133), each further row +2 ms (+0.067)
    assert trim.choose(np.array([[0.9, 0.05, 0, 0], [0.9, 0, 0, 0], [0.05, 0, 0, 0]]), plain) == (2, 0)
    assert trim.choose(np.array([[0.1, 0.05, 0, 0], [0.99, 0, 0, 0]]), plain) == (0, 0)  # 0.1 < 0.133
    assert trim.choose(np.array([[0.2, 0.05, 0, 0], [0.1, 0, 0, 0]]), plain) == (1, 0)
    # the same probabilities where a verify row costs half a plain step: only sure proposals pay
    dear = ConfidenceTrim(np.array([0.030, 0.045, 0.060, 0.075]))
    assert dear.choose(np.array([[0.45, 0, 0, 0]]), plain) == (0, 0)
    assert dear.choose(np.array([[0.55, 0, 0, 0], [0.6, 0, 0, 0]]), plain) == (1, 0)


def test_trim_adds_alternatives_when_the_top_candidate_is_unsure():
    trim = ConfidenceTrim(COSTS.verify_s(np.arange(19)), alternatives=3)
    probs = np.array([[0.35, 0.3, 0.2, 0.01], [0.1, 0, 0, 0]])
    assert trim.choose(probs, 0.030) == (1, 2)  # ranks 1 and 2 pay their 2 ms rows; rank 3 does not
    assert ConfidenceTrim(COSTS.verify_s(np.arange(19))).choose(probs, 0.030) == (1, 0)  # chains only


def test_calibration_follows_the_acceptance_of_first_proposals():
    """An over-confident draft (0.9 given, a third accepted) is corrected: its calibration falls
    toward 1/3 and the same probabilities then buy shorter verifies."""
    trim = ConfidenceTrim(np.array([0.030, 0.045, 0.060, 0.075]))
    probs = np.array([[0.9, 0, 0, 0], [0.9, 0, 0, 0], [0.9, 0, 0, 0]])
    assert trim.choose(probs, 0.030) == (3, 0)
    for i in range(60):
        assert trim.choose(probs, 0.030, least=1)[0] >= 1  # as probes do: always some evidence
        trim.observe(first_accepted=i % 3 == 0)
    assert 0.3 < trim.calibration < 0.55
    assert trim.choose(probs, 0.030) == (0, 0)
    before = trim.calibration
    trim.observe(True)  # nothing was verified: no evidence
    assert trim.calibration == before


def _confident_policy(prior: float) -> AdaptiveLength:
    return auto_policy(COSTS, AcceptanceEstimate(prior, 15, prior_weight=1e9, carry=1.0), draft_probabilities=True)


def test_auto_drafts_where_drafted_steps_pay_and_trims_after():
    policy = _confident_policy(0.9)
    assert policy.proposals(15) == 2  # the prior pays: draft 2 rows (draft_rows starts at 2)
    assert policy.refine(2, Proposal("draft", probs=np.array([[0.95, 0, 0, 0], [0.95, 0, 0, 0]]))) == 2
    assert policy.confidence.rows == 3  # all rows were used: compute one more next time
    assert policy.refine(3, Proposal("draft", probs=np.array([[0.02, 0, 0, 0], [0.9, 0, 0, 0], [0.9, 0, 0, 0]]))) == 0
    assert policy.confidence.rows == 2  # two fewer than drafted were used: one fewer row
    tree = auto_policy(COSTS, AcceptanceEstimate(0.9, 15), alternatives=3, draft_probabilities=True)
    assert tree.refine(2, Proposal("draft", probs=np.array([[0.35, 0.3, 0.2, 0.01], [0.1, 0, 0, 0]]))) == VerifyTree(1, 2)


def test_auto_measures_drafted_steps_and_stops_drafting_when_they_lose():
    """Drafted steps whose proposals are all unlikely commit one token in a draft call and a plain call
    (45 ms measured): they lose to 30 ms plain steps, and after a few auto stops drafting. A catch-up
    step counts at the usual draft time, not its own long one."""
    policy = _confident_policy(0.6)
    assert policy.proposals(15) > 0
    for _ in range(12):
        assert policy.refine(2, Proposal("draft", probs=np.array([[0.05, 0, 0, 0], [0.05, 0, 0, 0]]))) == 0
        policy.observe(StepRecord(0, 0, 0.045, drafted=True))  # trimmed to a plain call after the draft
    assert policy.confidence.tokens == pytest.approx(sum(0.95 ** k for k in range(12)))
    assert policy.confidence.seconds == pytest.approx(0.045 * sum(0.95 ** k for k in range(12)))
    assert policy.confidence.draft_mean_s == pytest.approx(0.008)  # no draft times reported: the measured cost's
    before = policy.confidence.seconds
    policy.observe(StepRecord(1, 1, 0.300, catch_up=True, drafted=True, draft_seconds=0.270))  # read 200 context rows
    assert policy.confidence.seconds == pytest.approx(0.95 * before + 0.030 + 0.008)
    assert policy.drafted_rate(15) * 0.030 < 1.0
    # no curve models the catch-up draft call, but the verify call after it (30 ms, 34 predicted) counts, with
    # the draft part the curve predicts (8 ms): 38 against 42 ms
    assert policy.plain_scale == 1.0 and policy.spec_scale == pytest.approx(1.0 + 0.2 * (0.038 / 0.042 - 1.0))
    assert policy.proposals(15) == 0


def test_catch_up_probes_correct_a_table_that_overprices_speculation():
    """A cost table measured under load priced every speculative step 3x (the true costs: `COSTS`). Probes
    follow runs of plain steps, so each one's draft call catches up on context; the verify call after it
    still teaches the speculative scale and the lookups' time scale, and speculation (drafted and looked
    up) resumes after a few probes."""
    loaded = call_costs.CallCosts({n: ms * (3.0 if n else 1.0) for n, ms in COSTS.step_ms.items()}, COSTS.past_len,
                       {n: 3.0 * ms for n, ms in COSTS.verify_ms.items()})
    policy = auto_policy(loaded, AcceptanceEstimate(0.8, 15, prior_weight=1e9, carry=1.0), draft_probabilities=True,
                         lookups=True)
    offer = Proposal("lookup", ids=np.array([5, 6, 7, 8]))
    assert policy.proposals(15) == 0 and policy.take_offer(15, offer, 0) == 0

    def until(resumed) -> int:
        """Probes before `resumed()` holds (plain steps of 30 ms between them)."""
        probes = 0
        for _ in range(2000):
            if resumed():
                return probes
            if policy.proposals(15):
                probes += 1  # a probe: 200 context rows first (60 ms), then a 2-proposal verify at its true 36 ms
                policy.observe(StepRecord(2, 2, 0.096, "draft", drafted=True, draft_seconds=0.060, catch_up=True))
            else:
                policy.observe(StepRecord(0, 0, 0.030))
        return -1

    assert 1 <= until(lambda: policy.take_offer(15, offer, 0) > 0) <= 6  # verify parts of 36 ms where 108 were predicted
    assert 0 <= until(lambda: policy.drafted_rate(15) * policy._plain_s() > policy.margin) <= 8
    assert policy.spec_scale < 0.6 and policy.proposals(15) > 0 and not policy.probing


def test_probes_run_the_trimmed_draft_and_end_after_one_drafted_step():
    policy = _confident_policy(0.02)
    steps = [policy.proposals(15) for _ in range(4)]
    assert steps == [0, 0, 0, 2] and policy.probing  # the probe drafts draft_rows rows
    # a probe verifies at least one proposal, so the calibration learns even from a draft it wrote off
    assert policy.refine(2, Proposal("draft", probs=np.array([[0.05, 0, 0, 0], [0.9, 0, 0, 0]]))) == 1
    policy.observe(StepRecord(1, 0, 0.045, drafted=True))
    assert not policy.probing and policy.probe_gap == 8
    assert policy.confidence.trimmer.calibration < 1.0  # the forced proposal (0.05) was rejected
