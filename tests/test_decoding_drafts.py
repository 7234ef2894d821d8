"""Decoding with real drafts and sampling (the rest of `test_decoding.py`'s semantics): a real draft ONNX
that a context-free target accepts, mask ids in the output, the draft's proposal vocabulary, the
draft computing only the rows a step verifies; sampling determinism per seed and the target's
distribution; argument errors and text prompts.
"""

from __future__ import annotations

import numpy as np
import pytest
import runtime_fixtures as rf
from tolerances import assert_fp32_close
from test_decoding import ctxfree, qwen, qwen_ref, qwen_rows  # noqa: F401 - fixtures

import runtime
from runtime import DFlashError

PROMPTS = rf.DECODING_PROMPTS


# ---- 2b. a real draft ONNX that is accepted, and mask ids in the output -------------------------
def test_real_draft_accepted_and_mask_ids_kept(ctxfree):
    m, b = ctxfree.mask_id, ctxfree.block_size
    sess = runtime.load(ctxfree.artifact)
    for prompt in ([5, 7, m], [m]):
        res = sess.generate(prompt, max_new_tokens=14, stop_token_ids=[], record_steps=True, verify_len="all")
        assert res.output_ids == [m] * 14  # the target emits the mask id: it is kept, never filtered
        assert res.acceptance_lengths == rf.expected_acceptance(14, b) == [b] * 3
        assert all(s["proposed"] == [m] * len(s["proposed"]) for s in res.steps)
        plain = sess.generate(prompt, max_new_tokens=14, stop_token_ids=[], block_size=1)
        assert plain.output_ids == res.output_ids
        hf_ids, margin = rf.hf_greedy(ctxfree.target_dir, prompt, 14)
        assert hf_ids == res.output_ids and margin.min() > 1e-2
    # a prompt ending in another token: the target repeats it, the draft's mask proposals are rejected
    res = sess.generate([5, 7, 9], max_new_tokens=10, stop_token_ids=[], record_steps=True, verify_len="all")
    assert res.output_ids == [9] * 10
    assert res.acceptance_lengths == rf.expected_acceptance(10, b, 0) == [1] * 8  # the last step has no proposal
    # the mask id as a stop token stops at once; as a non-stop it fills the whole budget
    res = sess.generate([5, m], max_new_tokens=10, stop_token_ids=[m], verify_len="all")
    assert res.output_ids == [m] and res.finish_reason == "stop"
    res = sess.generate([5, m], max_new_tokens=10, stop_token_ids=[2], verify_len="all")
    assert res.output_ids == [m] * 10 and res.finish_reason == "length"


def test_real_draft_exact_capacity_and_reuse(ctxfree):
    m = ctxfree.mask_id
    sess = runtime.load(ctxfree.artifact)
    first = sess.generate([4, 8, 15, 16, 23, 42, m], max_new_tokens=ctxfree.max_seq_len - 7, stop_token_ids=[], verify_len="all")
    assert first.output_ids == [m] * (ctxfree.max_seq_len - 7)
    assert first.acceptance_lengths == rf.expected_acceptance(ctxfree.max_seq_len - 7, ctxfree.block_size)
    again = sess.generate([m], max_new_tokens=9, stop_token_ids=[], record_steps=True, verify_len="all")
    fresh = runtime.load(ctxfree.artifact).generate([m], max_new_tokens=9, stop_token_ids=[], record_steps=True, verify_len="all")
    assert (again.output_ids, again.steps) == (fresh.output_ids, fresh.steps)


@pytest.mark.nightly  # two more ctxfree builds; `make test`: test_target_parity::test_draft_vocab_restricts_proposals_only, test_draft_proposes
def test_draft_vocab_limits_proposals_never_the_output(ctxfree, tmp_path, tmp_path_factory):
    """A draft_vocab.json restricts what the draft may propose: with the mask id inside it every block
    is accepted as before; without it the proposals all miss, and the output is still the same."""
    import json
    import shutil

    from dflash_export.build import BuildOptions, build

    m, b, vocab_size = ctxfree.mask_id, ctxfree.block_size, rf.lm_head_matrix(ctxfree.target_dir).shape[0]
    for keep_mask in (True, False):
        ids = [i for i in range(0, vocab_size, 2) if i != m] + ([m] if keep_mask else [])
        if keep_mask:  # that build is the session's proposing ctxfree artifact (every 2nd id plus the mask id)
            proposing = rf.proposing_artifact("ctxfree", tmp_path_factory)
            assert json.loads((proposing.draft_dir / "draft_vocab.json").read_text())["token_ids"] == sorted(ids)
            art = proposing.artifact
            manifest = json.loads((art / "manifest.json").read_text())
        else:
            draft = tmp_path / f"draft_{keep_mask}"
            shutil.copytree(ctxfree.draft_dir, draft)
            (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
            art = tmp_path / f"art_{keep_mask}"
            manifest = build(BuildOptions(str(ctxfree.target_dir), str(draft), art, max_seq_len=ctxfree.max_seq_len, quiet=True))
        assert manifest["draft"]["draft_vocab_size"] == len(ids)
        res = runtime.load(art).generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], record_steps=True, verify_len="all")
        assert res.output_ids == [m] * 14
        assert all(set(s["proposed"]) <= set(ids) for s in res.steps)
        if keep_mask:
            assert res.acceptance_lengths == rf.expected_acceptance(14, b) == [b] * 3
        else:
            assert res.acceptance_lengths == rf.expected_acceptance(14, b, 0)
    # --draft-vocab full ignores the file: the mask id is proposed and accepted again
    full = build(BuildOptions(str(ctxfree.target_dir), str(tmp_path / "draft_False"), tmp_path / "art_full",
                 max_seq_len=ctxfree.max_seq_len, quiet=True, draft_vocab="full"))
    assert full["draft"]["draft_vocab_size"] is None
    res = runtime.load(tmp_path / "art_full").generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len="all")
    assert res.output_ids == [m] * 14 and res.acceptance_lengths == [b] * 3


# ---- 3. sampling --------------------------------------------------------------------------------
def test_sampling_is_deterministic_per_seed(qwen):
    sess = runtime.load(qwen.artifact)
    prompt = PROMPTS[1]
    outs = {}
    for seed in range(4):
        a = sess.generate(prompt, max_new_tokens=16, stop_token_ids=[], temperature=1.0, seed=seed, verify_len="all")
        b = sess.generate(prompt, max_new_tokens=16, stop_token_ids=[], temperature=1.0, seed=seed, verify_len="all")
        c = runtime.load(qwen.artifact).generate(prompt, max_new_tokens=16, stop_token_ids=[], temperature=1.0, seed=seed, verify_len="all")
        assert a.output_ids == b.output_ids == c.output_ids
        outs[seed] = tuple(a.output_ids)
    assert len(set(outs.values())) > 1, "different seeds gave the same sample: temperature is ignored"


def test_sampling_spec_equals_plain_when_proposals_are_right(qwen, qwen_rows):
    """One uniform per output position: with proposals equal to the plain sampled continuation, every
    block is accepted and the output equals plain sampling token for token; with only the first 2 of
    each block right, the output is still the same."""
    prompt, n, t = PROMPTS[0], 20, 0.9
    for seed in range(4):
        sess = runtime.load(qwen.artifact)
        plain = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], temperature=t, seed=seed, block_size=1)
        rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(plain.output_ids))
        spec = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], temperature=t, seed=seed, record_steps=True, verify_len="all")
        assert spec.output_ids == plain.output_ids
        assert spec.acceptance_lengths == rf.expected_acceptance(n, qwen.block_size)
        rf.Oracle(sess, qwen_rows, len(prompt), rf.follow(plain.output_ids, correct=2))
        part = sess.generate(prompt, max_new_tokens=n, stop_token_ids=[], temperature=t, seed=seed, record_steps=True, verify_len="all")
        first_step = part.steps[0]
        assert first_step["accepted"] == 2
        # each output position has its own uniform: rejected proposals do not change the reply
        assert part.output_ids == plain.output_ids


def test_sampling_distribution_matches_target(qwen, qwen_rows):
    """First token over many seeds ~ softmax(HF logits / T); second token (verified against an oracle
    proposal of its most likely value) ~ the target's conditional: accepted iff the sample equals it."""
    prompt, t, n_seeds = PROMPTS[0], 0.3, 700
    logits1 = rf.hf_next_logits(qwen.target_dir, prompt)
    p1 = rf.softmax(logits1, t)
    a = int(np.argmax(p1))
    logits2 = rf.hf_next_logits(qwen.target_dir, prompt + [a])
    p2 = rf.softmax(logits2, t)
    mode2 = int(np.argmax(p2))
    sess = runtime.load(qwen.artifact)
    rf.Oracle(sess, qwen_rows, len(prompt), lambda k, m: [mode2] * m)
    first, second, accepted = np.zeros(rf.VOCAB, int), np.zeros(rf.VOCAB, int), []
    for seed in range(n_seeds):
        # max_new_tokens 3: one proposal is verified after the first token (n_prop = remaining - 1)
        res = sess.generate(prompt, max_new_tokens=3, stop_token_ids=[], temperature=t, seed=seed, block_size=4, record_steps=True, verify_len="all")
        x1, x2 = res.output_ids[:2]
        first[x1] += 1
        step = res.steps[0]
        assert step["proposed"] == [mode2]
        assert step["accepted"] == int(x2 == mode2)
        if x1 == a:
            second[x2] += 1
            accepted.append(step["accepted"])
    ok, stat, thr = rf.chi_square_ok(first, p1)
    assert ok, f"first token: chi-square {stat:.1f} > {thr:.1f}"
    assert second.sum() >= 150, "too few samples of the conditional"
    ok, stat, thr = rf.chi_square_ok(second, p2)
    assert ok, f"second token given {a}: chi-square {stat:.1f} > {thr:.1f}"
    # the test has power: the same counts are rejected against the target at another temperature
    assert not rf.chi_square_ok(first, rf.softmax(logits1, 2 * t))[0]
    assert not rf.chi_square_ok(second, rf.softmax(logits2, 2 * t))[0]
    rate = float(np.mean(accepted))
    assert abs(rate - p2[mode2]) < 4 * np.sqrt(p2[mode2] * (1 - p2[mode2]) / len(accepted)) + 1e-9
    # block_size 1: the same first tokens for the same seeds (the prefill draws the first uniform)
    for seed in range(0, n_seeds, 70):
        x1 = sess.generate(prompt, max_new_tokens=1, stop_token_ids=[], temperature=t, seed=seed, block_size=1).output_ids
        y1 = sess.generate(prompt, max_new_tokens=1, stop_token_ids=[], temperature=t, seed=seed, block_size=4, verify_len="all").output_ids
        assert x1 == y1


# ---- arguments ----------------------------------------------------------------------------------
def test_argument_errors(qwen):
    sess = runtime.load(qwen.artifact)
    with pytest.raises(DFlashError, match="max_new_tokens must be at least 1"):
        sess.generate([5], max_new_tokens=0)
    with pytest.raises(DFlashError, match="block_size 0 must be between 1 and"):
        sess.generate([5], max_new_tokens=4, block_size=0)
    with pytest.raises(DFlashError, match="temperature must be a finite number >= 0"):
        sess.generate([5], max_new_tokens=4, temperature=-0.5, verify_len="all")
    with pytest.raises(DFlashError, match=r"outside the vocabulary \[0, 96\)"):
        sess.generate([5, 96], max_new_tokens=4, verify_len="all")
    with pytest.raises(DFlashError, match="outside the vocabulary"):
        sess.generate([-1], max_new_tokens=4, verify_len="all")


def test_text_prompt_with_tokenizer(qwen, qwen_ref):
    sess = runtime.load(qwen.artifact)
    assert sess.encode("t5 t6 t7") == [5, 6, 7]
    res = sess.generate("t5 t6 t7", max_new_tokens=10, stop_token_ids=[], verify_len="all")
    assert res.output_ids == qwen_ref([5, 6, 7])[:10]
    assert res.text == " ".join(f"t{i}" for i in res.output_ids if i > 2)  # 0-2: special tokens
    res = runtime.generate(qwen.artifact, "t5 t6 t7", max_new_tokens=4, stop_token_ids=[], verify_len="all")
    assert res.output_ids == qwen_ref([5, 6, 7])[:4]


# ---- 2c. the draft computes only the rows a step verifies ---------------------------------------
def test_draft_rows_follow_the_verified_proposals(qwen):
    """The draft call returns as many `draft_hidden` rows as the step verifies (its last layer cut to
    them; a tree: its chain length), and those rows equal the uncut call's."""
    sess = runtime.load(qwen.artifact)
    b = qwen.block_size
    assert sess.proposal_rows is not None  # artifacts built now take proposal_rows
    sess.generate([5, 6, 7], max_new_tokens=4, stop_token_ids=[], block_size=1)  # fills the context cache
    be, past = sess.backend, len(sess.context.ids)
    full = None
    for rows in (None, 1, 3, b - 1):
        be.copy(sess.block.rows(0, 1), sess.next_embeddings.rows(0, 1))
        sess.run_draft(1, past - 1, b, rows=rows)
        got = be.read(sess.draft_hidden.rows(0, rows or b - 1))
        full = got if full is None else full
        assert_fp32_close(got, full[: len(got)], what=f"{rows} rows", reduction=192, depth=4)  # fc (3 taps x 64), 2 layers, norm
    sess.reset()
    bound, run = [], be.run

    def record(graph, inputs, outputs):
        if graph == "draft":
            bound.append((inputs["proposal_rows"].shape[0], outputs["draft_hidden"].shape[0]))
        return run(graph, inputs, outputs)

    be.run = record
    for verify_len, rows in ((2, 2), ("2+2", 2), ("all", b - 1)):
        bound.clear()
        sess.generate([5, 6, 7], max_new_tokens=b + 4, stop_token_ids=[], verify_len=verify_len)
        # the first step verifies the full length; a step near the token budget may verify fewer
        assert bound[0] == (rows, rows) and all(r == o <= rows for r, o in bound), (verify_len, bound)


def test_an_artifact_whose_draft_returns_every_row_still_runs(qwen, qwen_ref, tmp_path):
    """Artifacts built before `proposal_rows` (a draft graph returning all B - 1 rows) load, check and
    decode as before: the runtime binds no rows input and the output equals plain decoding."""
    import json
    import shutil

    import torch

    from dflash_export.build import _io_spec, prepare_pair
    from dflash_export.checkpoint.weights import WeightSource
    from dflash_export.drafts.dflash import draft_export_module
    from dflash_export.export.graphs import _export

    art = tmp_path / "old"
    shutil.copytree(qwen.artifact, art)
    _, dspec, _, dstate, _ = prepare_pair(str(qwen.target_dir), str(qwen.draft_dir))
    module, readers = draft_export_module(dspec, WeightSource("draft", tensors=dstate), torch.float32)
    a = dspec.arch
    args = (torch.randn(3, len(dspec.target_layer_ids) * a.hidden_size), torch.randn(6, a.hidden_size),
            *[torch.randn(5, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)])
    dims = ({0: torch.export.Dim("context_len", min=1, max=1 << 20)}, {0: torch.export.Dim("block_size", min=2, max=1 << 10)},
            tuple({0: torch.export.Dim("past_context_len", min=0, max=1 << 20)} for _ in range(2 * a.num_layers)))
    kv = [f"past_{k}_{i}" for i in range(a.num_layers) for k in ("key", "value")]
    names = (["context_hidden", "block_embeddings", *kv], ["draft_hidden", *[n[5:] for n in kv]])
    _export(module, args, names, dims, art / "draft.onnx", readers)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["io"]["draft"] = _io_spec(art / "draft.onnx")
    (art / "manifest.json").write_text(json.dumps(manifest))
    sess = runtime.load(art)
    assert sess.proposal_rows is None
    for prompt in PROMPTS:
        want = qwen_ref(prompt, 20)
        for verify_len in (1, "2+2", None):
            got = sess.generate(list(prompt), max_new_tokens=20, stop_token_ids=[], verify_len=verify_len)
            assert got.output_ids == want, (prompt, verify_len)
