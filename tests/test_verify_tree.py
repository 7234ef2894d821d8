"""Verify trees (`runtime.graphs.tree`): their structure and acceptance walk, the policy's choice between
trees, chains and plain steps, and, on SmolLM2 with its shipped draft, tree steps whose output equals
plain decoding (greedy and sampled) with alternatives accepted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from runtime.graphs.costs import CallCosts
from runtime.errors import DFlashError
from runtime.options import GenerationOptions
from runtime.speculation.policy import AcceptanceEstimate, AdaptiveLength
from runtime.graphs.tree import VerifyTree, chain_inputs, parse_tree, tree_bias_of

LOW = np.finfo(np.float32).min
_ROOT = Path(__file__).resolve().parents[1]


def test_tree_structure_and_bias():
    t = VerifyTree(2, 2)
    assert t.parents == (-1, 0, -1, -1) and t.size == 4
    assert t.depth.tolist() == [0, 1, 0, 0] and t.rank.tolist() == [0, 0, 1, 2]
    visible = t.bias == 0
    assert visible.tolist() == [[True, False, False, False], [True, True, False, False],
                                [False, False, True, False], [False, False, False, True]]
    assert np.all(t.bias[~visible] == LOW)
    chain = chain_inputs(3)  # a chain's bias is causal
    assert (chain["tree_bias"] == 0).tolist() == np.tril(np.ones((3, 3), bool)).tolist()
    assert chain["tree_rank"].tolist() == [0, 0, 0] and chain["tree_depth"].tolist() == [0, 1, 2]
    assert chain_inputs(0)["tree_bias"].shape == (0, 0)
    with pytest.raises(ValueError, match="parent"):
        tree_bias_of([1, -1])
    with pytest.raises(ValueError, match="alternatives"):
        VerifyTree(1, 4)
    assert parse_tree("1+3") == VerifyTree(1, 3)
    for bad in ("1+", "a+1", "1+2+3", "0+1", "1+3 ", "1 + 3", "\u0661+3", "\u00b2+1"):
        with pytest.raises(ValueError):
            parse_tree(bad)


def test_accept_walks_the_tree():
    t = VerifyTree(2, 2)  # nodes: 0 = top-1 at position 1, 1 = top-1 at position 2, 2 and 3 = alternatives
    props = np.array([10, 11, 20, 30])
    # the chain: posterior after the root 10, after node 0 11, after node 1 12 -> path [0, 1], bonus 12
    assert t.accept(props, np.array([10, 11, 12, 0, 0])) == ([0, 1], 12)
    # the second alternative (node 3) is the target's token; the bonus is its row's posterior
    assert t.accept(props, np.array([30, 99, 99, 99, 31])) == ([3], 31)
    # nothing matches: no node accepted, the bonus is the root's posterior
    assert t.accept(props, np.array([40, 11, 12, 13, 14])) == ([], 40)
    # node 0 accepted but node 1 not
    assert t.accept(props, np.array([10, 50, 12, 0, 0])) == ([0], 50)


def test_alternative_estimate_learns_from_tree_steps():
    est = AcceptanceEstimate(0.4, 15, prior_weight=1.0, decay=1.0, alternative_prior=(0.2, 0.1, 0.1))
    np.testing.assert_allclose(est.alternative_tokens(3), [0, 0.2, 0.2 + 0.8 * 0.1, 0.28 + 0.72 * 0.1])
    est.observe(1, 1, alternatives=3, first_rank=2)  # rank 2 accepted: ranks 1 and 2 tried, 2 hit
    assert est.trials[0] == 1 and est.hits[0] == 0  # the top-1 first proposal missed
    assert est.alt_trials.tolist() == [1, 1, 0] and est.alt_hits.tolist() == [0, 1, 0]
    est.observe(1, 1, alternatives=3, first_rank=0)  # the top-1 accepted: the alternatives not counted
    assert est.hits[0] == 1 and est.alt_trials.tolist() == [1, 1, 0]
    est.observe(1, 0, alternatives=3)  # nothing accepted: every alternative missed
    assert est.alt_trials.tolist() == [2, 2, 1] and est.alt_hits.tolist() == [0, 1, 0]


def test_auto_verifies_a_tree_when_alternatives_pay_for_their_rows():
    # CPU-like: rows after the first proposal are cheap, the first one (and the draft call) is not
    costs = CallCosts({0: 23.0, 1: 31.0, 3: 32.0, 7: 37.0, 15: 51.0}, past_len=128)

    def policy(alternatives, alt_prior=(0.21, 0.13, 0.12)):
        est = AcceptanceEstimate(0.41, 15, prior_weight=1e9, carry=0.3, alternative_prior=alt_prior)
        return AdaptiveLength(costs, est, alternatives=alternatives)

    choice = policy(3).proposals(15)
    assert isinstance(choice, VerifyTree) and choice.alternatives >= 1
    # without trees (a hybrid or an older graph) the same estimate gives a chain or plain decoding
    assert isinstance(policy(0).proposals(15), int)
    # alternatives that never match are not verified
    assert not isinstance(policy(3, (0.0, 0.0, 0.0)).proposals(15), VerifyTree)


@pytest.fixture(scope="module")
def real_prompts():
    rows = [json.loads(line) for line in (_ROOT / "models" / "prompts" / "eval.jsonl").read_text().splitlines() if line.strip()]
    seen, prompts = set(), []
    for row in rows:
        if row.get("category") not in seen:
            seen.add(row.get("category"))
            prompts.append(row["prompt"])
    return prompts[:4]


@pytest.mark.slow  # the real pair (SmolLM2 export)
def test_tree_steps_equal_plain_greedy_and_sampled_on_the_real_pair(smollm2_artifact, real_prompts):
    """Fixed trees on SmolLM2 with the shipped draft: the output equals plain decoding, greedy and
    sampled (same seed), and alternatives for the first position are accepted."""
    import runtime

    sess = runtime.load(smollm2_artifact)
    assert sess.verifies_trees
    alternatives_accepted = 0
    for prompt in real_prompts:
        plain = sess.generate(prompt, chat=True, max_new_tokens=40, block_size=1, stop_token_ids=[])
        for tree in ("1+3", "2+2"):
            res = sess.generate(prompt, chat=True, max_new_tokens=40, verify_len=tree, stop_token_ids=[], record_steps=True)
            assert res.output_ids == plain.output_ids, (prompt[:40], tree)
            length = int(tree.split("+")[0])
            for s in res.steps:  # an accepted node past the chain's is an alternative
                if s["accepted"] and s["committed"][0] in s["proposed"][length:] and s["committed"][0] != s["proposed"][0]:
                    alternatives_accepted += 1
        sampled = dict(chat=True, max_new_tokens=24, stop_token_ids=[], temperature=0.8, seed=7)
        assert sess.generate(prompt, verify_len="1+3", **sampled).output_ids == \
            sess.generate(prompt, block_size=1, **sampled).output_ids, prompt[:40]
    assert alternatives_accepted >= 5


@pytest.mark.slow  # the real pair (SmolLM2 export)
def test_tree_requests_are_checked(smollm2_artifact):
    import runtime

    sess = runtime.load(smollm2_artifact)
    with pytest.raises(DFlashError, match="L\\+A"):
        sess.generate([1, 2, 3], max_new_tokens=2, verify_len="1+x")
    with pytest.raises(DFlashError, match="verify_len"):
        sess.generate([1, 2, 3], max_new_tokens=2, verify_len="1+4")
    # a tree's chain must fit the block as an integer verify_len must (its alternatives are ranks at
    # position 1, which every block of 2 or more has); plain decoding takes no tree
    with pytest.raises(DFlashError, match=r'^verify_len must be between 1 and block_size - 1 = 1 \(got "2\+2"\); '
                                          r'block_size 2 proposes 1 token per step'):
        sess.generate([1, 2, 3], max_new_tokens=2, block_size=2, verify_len="2+2")
    with pytest.raises(DFlashError, match=r'block_size 1 \(plain decoding\) verifies no proposals; omit verify_len \(got "1\+3"\)'):
        sess.generate([1, 2, 3], max_new_tokens=2, block_size=1, verify_len="1+3")
    assert sess.check_request([1, 2, 3], GenerationOptions(max_new_tokens=2, block_size=2, verify_len="1+3")) == 2
    assert GenerationOptions(verify_len="3").verify_len == 3  # a number from a command line or a JSON string
    # an artifact that verifies chains only refuses a tree before anything runs (the server checks
    # requests this way before they queue; its 400 names verify_len as the parameter at fault)
    sess.verifies_trees = False
    with pytest.raises(DFlashError, match='^verify_len "1\\+3" needs a target graph that verifies trees'):
        sess.check_request([1, 2, 3], GenerationOptions(max_new_tokens=2, verify_len="1+3"))
    assert sess.check_request([1, 2, 3], GenerationOptions(max_new_tokens=2, verify_len=3)) == sess.block_size


@pytest.mark.slow  # the real pair (SmolLM2 export)
def test_a_tree_near_the_end_of_the_caches_runs_as_its_chain(smollm2_artifact):
    """A request that fills the KV buffers exactly: the alternatives' rows would not fit at the last
    steps, which then verify the chain; the output equals plain decoding and nothing overflows."""
    import runtime

    sess = runtime.load(smollm2_artifact)
    # a long prompt, so the request fills the buffers in about 50 tokens (the steps near the end matter)
    prompt = sess.encode("Count from one to fifty in words. " * 22 + "Go.", chat=True)
    n = sess.max_seq_len - len(prompt)
    assert 20 <= n <= 80, n
    plain = sess.generate(prompt, max_new_tokens=n, block_size=1, stop_token_ids=[])
    tree = sess.generate(prompt, max_new_tokens=n, verify_len="1+3", stop_token_ids=[], record_steps=True)
    assert tree.output_ids == plain.output_ids and len(tree.output_ids) == n
    assert any(len(s["proposed"]) == 4 for s in tree.steps)


@pytest.mark.slow  # the real pair (SmolLM2 export)
def test_a_tree_larger_than_the_scratch_buffers_runs_as_its_chain(smollm2_artifact):
    """block_size 64 with "63+3": 66 nodes do not fit the 64-row scratch buffers (a chain of 63 does);
    it raised IndexError, it now verifies the chain, and the output equals plain decoding."""
    import runtime

    sess = runtime.load(smollm2_artifact)
    prompt = sess.encode("Write a Python function that reverses a linked list.", chat=True)
    plain = sess.generate(prompt, max_new_tokens=66, block_size=1, stop_token_ids=[])
    for tree in ("63+3",):  # the token budget (66) allows the whole chain at the first step
        res = sess.generate(prompt, max_new_tokens=66, block_size=64, verify_len=tree, stop_token_ids=[])
        assert res.output_ids == plain.output_ids, tree
