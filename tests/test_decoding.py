"""Decoding semantics of the runtime against the DFlash reference `spec_generate` (greedy, oracle drafts;
real drafts, sampling and arguments: `test_decoding_drafts.py`).

Greedy speculative output must equal plain greedy decoding (block_size 1) on the same artifact and
Hugging Face `generate`; accepted blocks are forced with an oracle draft (at the `Session._draft`
seam) or with a real draft ONNX that a context-free target accepts; sampling is checked for
determinism and for the target's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime
import runtime_fixtures as rf
from runtime import DFlashError

@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> rf.Pair:
    return rf.artifact("llama", tmp_path_factory)


@pytest.fixture(scope="session")
def ctxfree(tmp_path_factory) -> rf.Pair:
    return rf.artifact("ctxfree", tmp_path_factory)


@pytest.fixture(scope="session")
def qwen_rows(qwen) -> np.ndarray:
    return rf.token_rows(qwen.target_dir)


@pytest.fixture(scope="session")
def qwen_ref(qwen):
    return rf.greedy_reference(qwen)


PROMPTS = rf.DECODING_PROMPTS


def check_steps(res):
    """Internal consistency of a recorded run: the steps commit exactly output[1:], each step commits
    its accepted proposals (then the posterior token), and acceptance_lengths = accepted + 1."""
    committed = [t for s in res.steps for t in s["committed"]]
    assert [res.output_ids[0], *committed] == res.output_ids
    spec_steps = [s for s in res.steps if s["proposed"]]
    assert res.acceptance_lengths == [s["accepted"] + 1 for s in spec_steps]
    for i, s in enumerate(res.steps):
        assert 0 <= s["accepted"] <= len(s["proposed"])
        k = min(s["accepted"], len(s["committed"]))
        assert s["committed"][:k] == s["proposed"][:k]
        if i < len(res.steps) - 1:  # only the last step may be cut by a stop token
            assert len(s["committed"]) == s["accepted"] + 1


# ---- 1. lossless greedy ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen", pytest.param("llama", marks=pytest.mark.slow)])
def test_greedy_equals_plain_and_hugging_face(kind, request):
    pair = request.getfixturevalue(kind)
    sess = runtime.load(pair.artifact)
    n, compared = 24, 0
    for prompt in PROMPTS:
        spec = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
        plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1)
        assert spec.output_ids == plain.output_ids
        assert len(spec.output_ids) == n and spec.finish_reason == "length"
        assert plain.acceptance_lengths == [] and plain.tau == 1.0
        check_steps(spec)
        hf_ids, margin = rf.hf_greedy(pair.target_dir, prompt, n)
        small = np.flatnonzero(margin < 1e-3)
        cut = int(small[0]) if small.size else n
        assert spec.output_ids[:cut] == hf_ids[:cut], f"prompt {prompt}: diverges from HF before position {cut}"
        compared += cut
        # teacher-forced: every token is HF's argmax (within 1e-3) given the runtime's own prefix
        assert rf.hf_greedy_violations(pair.target_dir, prompt, spec.output_ids) == []
    assert compared >= 2 * n, "too many near-ties: the comparison with Hugging Face is vacuous"


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_greedy_any_block_size_equals_plain(qwen, qwen_ref, block_size):
    sess = runtime.load(qwen.artifact)
    for prompt in PROMPTS:
        res = sess.generate(prompt, max_new_tokens=21, stop_token_ids=[], block_size=block_size, record_steps=True, verify_len="all")
        assert res.output_ids == qwen_ref(prompt)[:21]
        assert all(len(s["proposed"]) <= block_size - 1 for s in res.steps)
        check_steps(res)


def test_default_stop_token_is_the_manifest_eos(qwen, qwen_ref):
    sess = runtime.load(qwen.artifact)
    assert sess.stop_token_ids == (rf.EOS,)
    ref = qwen_ref(PROMPTS[0])
    assert rf.EOS not in ref[:10]
    res = sess.generate(PROMPTS[0], max_new_tokens=10, verify_len="all")
    assert res.output_ids == ref[:10] and res.finish_reason == "length"


# ---- 2a. oracle draft: accepted blocks, rollback, stops, capacity, reuse ---------------------------
@pytest.mark.parametrize("n", [1, 2, 8, 9, 13, 20, 33])
def test_oracle_fully_correct_blocks(qwen, qwen_rows, qwen_ref, n):
    prompt = PROMPTS[1]
    ref = qwen_ref(prompt)
    sess = runtime.load(qwen.artifact)
    oracle = rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref))
    res = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
    assert res.output_ids == ref[:n]
    assert res.finish_reason == "length"
    assert res.acceptance_lengths == rf.expected_acceptance(n, qwen.block_size)
    assert all(a == qwen.block_size for a in res.acceptance_lengths[:-1])
    assert len(oracle.calls) == len(res.acceptance_lengths)
    assert all(s["accepted"] == len(s["proposed"]) for s in res.steps)
    check_steps(res)
    if n == 1:
        assert oracle.calls == [] and res.steps == []


@pytest.mark.parametrize("correct", [0, 1, 3, 6])
def test_oracle_partly_correct_blocks_roll_back(qwen, qwen_rows, qwen_ref, correct):
    prompt, n = PROMPTS[0], 30
    ref = qwen_ref(prompt)
    sess = runtime.load(qwen.artifact)
    rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref, correct=correct))
    res = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
    assert res.output_ids == ref[:n]
    assert res.acceptance_lengths == rf.expected_acceptance(n, qwen.block_size, correct)
    for s in res.steps:
        assert s["accepted"] == min(correct, len(s["proposed"]))
    check_steps(res)


def test_oracle_mixed_acceptance_per_step(qwen, qwen_rows, qwen_ref):
    """A different number of right proposals each step (rollback by different lengths)."""
    prompt, n = PROMPTS[2], 40
    ref = qwen_ref(prompt)
    pattern = [7, 0, 3, 7, 1, 5, 2, 6, 0, 4, 7, 7, 2]
    calls = []

    def propose(k, m):
        c = pattern[len(calls) % len(pattern)]
        calls.append(c)
        return rf.follow(ref, correct=c)(k, m)

    sess = runtime.load(qwen.artifact)
    rf.Oracle(sess, qwen_rows, len(prompt), propose)
    res = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
    assert res.output_ids == ref[:n]
    assert [s["accepted"] for s in res.steps] == [min(c, len(s["proposed"])) for c, s in zip(calls, res.steps)]
    check_steps(res)


@pytest.mark.parametrize("verify_len", [1, 3, 7])
def test_oracle_verify_len_limits_verified_proposals(qwen, qwen_rows, qwen_ref, verify_len):
    """verify_len k: the draft still fills its whole block, only the first k proposals are verified."""
    prompt, n = PROMPTS[1], 23
    ref = qwen_ref(prompt)
    sess = runtime.load(qwen.artifact)
    oracle = rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref))
    res = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len=verify_len)
    k = verify_len
    assert res.output_ids == ref[:n]
    assert res.acceptance_lengths == rf.expected_acceptance(n, k + 1)
    assert all(len(s["proposed"]) <= k for s in res.steps)
    assert all(len(toks) == qwen.block_size - 1 for _, toks in oracle.calls)
    check_steps(res)
    plain = runtime.load(qwen.artifact).generate(prompt, max_new_tokens=n, stop_token_ids=[], verify_len=verify_len)
    assert plain.output_ids == ref[:n]  # the real draft too
    for bad in (0, qwen.block_size):  # beyond block_size - 1 is refused, not silently capped
        with pytest.raises(DFlashError, match=rf"verify_len must be between 1 and block_size - 1 = {qwen.block_size - 1} \(got {bad}\)"):
            sess.generate(prompt, max_new_tokens=4, verify_len=bad)
    with pytest.raises(DFlashError, match=r"block_size 1 \(plain decoding\) verifies no proposals; omit verify_len \(got 3\)"):
        sess.generate(prompt, max_new_tokens=4, block_size=1, verify_len=3)


def _stop_candidates(ref, block, n, where):
    """Output positions j (< n) whose token is new at j; `where`: "mid" of a block, block "end" (bonus)."""
    out = []
    for j in range(1, n):
        pos = (j - 1) % block  # index within the step's committed run (steps commit `block` tokens)
        if ref[j] in ref[:j]:
            continue
        if (where == "mid" and 1 <= pos <= block - 2) or (where == "end" and pos == block - 1):
            out.append(j)
    return out


@pytest.mark.parametrize("where", ["mid", "end"])
def test_oracle_stop_inside_accepted_block(qwen, qwen_rows, qwen_ref, where):
    b = qwen.block_size
    found = None
    for prompt in (*PROMPTS, [7, 7, 7, 7], [9, 30, 2, 11], [60, 61, 62]):
        ref = qwen_ref(prompt)
        cands = [j for j in _stop_candidates(ref, b, 40, where) if j < 40 - b]  # blocks of b tokens
        if cands:
            found = prompt, ref, cands[0]
            break
    assert found, "no usable stop token in the reference continuations"
    prompt, ref, j = found
    stop = ref[j]
    sess = runtime.load(qwen.artifact)
    rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref))
    res = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[stop], record_steps=True, verify_len="all")
    assert res.output_ids == ref[: j + 1]
    assert res.output_ids[-1] == stop and res.finish_reason == "stop"
    last = res.steps[-1]
    assert last["accepted"] == b - 1  # the whole block was accepted, then cut after the stop token
    start = 1 + (len(res.steps) - 1) * b
    assert last["committed"] == ref[start : j + 1]
    check_steps(res)
    # a stop token committed as the very last allowed token still finishes with "stop"
    rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref))
    exact = sess.generate(prompt, max_new_tokens=j + 1, stop_token_ids=[stop], verify_len="all")
    assert exact.output_ids == ref[: j + 1] and exact.finish_reason == "stop"
    short = sess.generate(prompt, max_new_tokens=j, stop_token_ids=[stop], verify_len="all")
    assert short.output_ids == ref[:j] and short.finish_reason == "length"
    # the same stop on plain decoding ends at the same place
    plain = runtime.load(qwen.artifact).generate(prompt, max_new_tokens=40, stop_token_ids=[stop], block_size=1)
    assert plain.output_ids == res.output_ids and plain.finish_reason == "stop"


def test_oracle_stop_as_first_token(qwen, qwen_rows, qwen_ref):
    prompt = PROMPTS[0]
    ref = qwen_ref(prompt)
    sess = runtime.load(qwen.artifact)
    oracle = rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(ref))
    res = sess.generate(prompt, max_new_tokens=20, stop_token_ids=[ref[0], 93], record_steps=True, verify_len="all")
    assert res.output_ids == [ref[0]] and res.finish_reason == "stop"
    assert res.steps == [] and oracle.calls == [] and res.acceptance_lengths == []


def test_oracle_rejected_stop_proposal_is_not_committed(qwen, qwen_rows, qwen_ref):
    """A stop id proposed after the first wrong proposal is never committed, so decoding goes on."""
    prompt, n = PROMPTS[1], 30
    ref = qwen_ref(prompt)
    stop = next(t for t in range(3, rf.VOCAB) if t not in ref)

    def propose(k, m):
        return [ref[k + j] if j < 2 else stop for j in range(m)]

    sess = runtime.load(qwen.artifact)
    rf.Oracle(sess, qwen_rows, len(prompt), propose)
    res = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[stop], record_steps=True, verify_len="all")
    assert res.output_ids == ref[:n] and res.finish_reason == "length"
    assert any(stop in s["proposed"] for s in res.steps)
    assert res.acceptance_lengths == rf.expected_acceptance(n, qwen.block_size, 2)


def test_exact_capacity(qwen, qwen_rows):
    prompt = [1, 40, 33, 12, 90, 7]
    n = qwen.max_seq_len - len(prompt)
    sess = runtime.load(qwen.artifact)
    plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], block_size=1)
    assert len(plain.output_ids) == n
    spec = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
    assert spec.output_ids == plain.output_ids
    hf_ids, margin = rf.hf_greedy(qwen.target_dir, prompt, n)
    small = np.flatnonzero(margin < 1e-3)
    cut = int(small[0]) if small.size else n
    assert plain.output_ids[:cut] == hf_ids[:cut]
    # every position up to the last row of the buffers is HF's argmax given the same prefix
    assert rf.hf_greedy_violations(qwen.target_dir, prompt, plain.output_ids) == []
    # fully accepted blocks right up to the last row of the KV buffers
    rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(plain.output_ids))
    full = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], record_steps=True, verify_len="all")
    assert full.output_ids == plain.output_ids
    assert full.acceptance_lengths == rf.expected_acceptance(n, qwen.block_size)
    with pytest.raises(DFlashError, match=rf"max_seq_len {qwen.max_seq_len}.*--max-seq-len {qwen.max_seq_len + 1}"):
        sess.generate(prompt, max_new_tokens=n + 1, stop_token_ids=[], verify_len="all")


def test_stop_token_ids_outside_the_vocabulary_are_refused(qwen):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError, match=r"stop_token_ids holds 96, which is not a token id of this model: ids are 0 "
                                          r"to 95 \(vocabulary size 96\)"):
        sess.generate([5, 6], max_new_tokens=4, stop_token_ids=[3, 96])


def test_an_absurd_max_new_tokens_suggests_no_absurd_rebuild(qwen):
    """max_new_tokens far beyond any buffer: the error says how many new tokens fit, and suggests no
    --max-seq-len no export could take."""
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError) as err:
        sess.generate([5, 6], max_new_tokens=10**12)
    msg = str(err.value)
    assert f"ask for at most {qwen.max_seq_len - 2} new tokens" in msg and "--max-seq-len" not in msg


def test_prompt_beyond_capacity_is_refused_before_running(qwen):
    sess = runtime.load(qwen.artifact)
    runs = []
    real_run = sess.backend.run
    sess.backend.run = lambda graph, i, o: (runs.append(graph), real_run(graph, i, o))
    with pytest.raises(DFlashError) as err:
        sess.generate(list(range(3, 3 + qwen.max_seq_len)), max_new_tokens=1, verify_len="all")
    msg = str(err.value)
    assert f"max_seq_len {qwen.max_seq_len}" in msg and "--max-seq-len" in msg
    assert runs == []
    with pytest.raises(DFlashError, match="--max-seq-len"):
        sess.generate([5, 6], max_new_tokens=qwen.max_seq_len - 1, verify_len="all")
    assert runs == []
    # the session is still usable afterwards
    assert len(sess.generate([5, 6], max_new_tokens=qwen.max_seq_len - 2, stop_token_ids=[], verify_len="all").output_ids) == qwen.max_seq_len - 2


def test_session_reuse_equals_fresh_sessions(qwen, qwen_rows, qwen_ref):
    long_prompt = [(7 * i + 3) % 90 + 3 for i in range(30)]
    calls = [
        (long_prompt, dict(max_new_tokens=20)),
        ([1, 40, 33, 12, 90], dict(max_new_tokens=17)),
        ([3], dict(max_new_tokens=12)),
        ([5, 6, 7], dict(max_new_tokens=9, temperature=0.8, seed=3)),
        ([1, 40, 33, 12, 90], dict(max_new_tokens=17)),
    ]
    reused = runtime.load(qwen.artifact)
    for prompt, kw in calls:  # the real (random) draft: proposals depend on the draft's cache too
        a = reused.generate(prompt, stop_token_ids=[], record_steps=True, **kw, verify_len="all")
        b = runtime.load(qwen.artifact).generate(prompt, stop_token_ids=[], record_steps=True, **kw, verify_len="all")
        assert (a.output_ids, a.acceptance_lengths, a.steps) == (b.output_ids, b.acceptance_lengths, b.steps)
        if "temperature" not in kw:
            assert a.output_ids == qwen_ref(prompt)[: kw["max_new_tokens"]]
    # and with accepted blocks (the oracle), so stale verified rows sit past the committed length
    for prompt, kw in calls:
        if "temperature" in kw:
            continue
        ref = qwen_ref(prompt)
        rf.Oracle(reused, qwen_rows, len(prompt), rf.follow(ref, correct=4))
        a = reused.generate(prompt, stop_token_ids=[], record_steps=True, **kw, verify_len="all")
        assert a.output_ids == ref[: kw["max_new_tokens"]]
        assert a.acceptance_lengths == rf.expected_acceptance(kw["max_new_tokens"], qwen.block_size, 4)
