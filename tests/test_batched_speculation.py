"""Speculation in batched steps (`runtime.batching.speculating`): streams verifying their draft's proposals in
shared calls give their batch-1 output whatever is accepted (greedy, graph- and host-sampled); one batched
draft call drafts for every speculating sequence of a step and proposes what each sequence's own draft
call would; without the batched draft graph, the per-sequence draft calls keep within an engine's row
limit. The artifact and helpers are test_batching's."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from test_batching import _drain, _oracle_drafts, _prompts, art  # noqa: F401 (art: a fixture)

import runtime
from runtime.batching import BatchEngine
from tolerances import assert_fp32_close

# the batched build (40 s on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def per_sequence_art(art, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """`art` without its batched draft graph (as a DFlash 2 draft's artifact): each sequence's draft call
    runs the one-sequence draft graph."""
    out = tmp_path_factory.mktemp("per_sequence") / "artifact"
    shutil.copytree(art, out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["draft_batched"], manifest["io"]["draft_batched"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "draft_batched.onnx").unlink()
    return out


def test_speculative_streams_equal_batch1_whatever_is_accepted(art):  # noqa: F811 (the imported fixture)
    """Streams verifying their proposals (all of them, a fixed 3, a tree's chain of 2, the policy's choice,
    none) in shared calls,
    with proposals right up to a changing position: every stream equals its batch-1 plain output, steps
    accepted whole and partial proposals, and the draft ran once per speculating sequence and step."""
    prompts = _prompts(3)
    lengths = [20, 26, 9, 30, 14, 22, 17]
    modes = [dict(verify_len="all"), dict(verify_len=3), dict(verify_len="auto"), dict(block_size=1),
             dict(verify_len="2+1"), dict(verify_len="all"), dict(verify_len=5)]
    with runtime.load(art) as s:
        expected = [s.generate(p, max_new_tokens=n, block_size=1, stop_token_ids=[], reuse_prefix=False).output_ids
                    for p, n in zip(prompts, lengths)]
    with BatchEngine(art, max_batch=3, prefill_chunk=8) as engine:
        assert engine.speculates
        _oracle_drafts(engine, {tuple(p): e for p, e in zip(prompts, expected)})
        handles = [engine.stream(p, max_new_tokens=n, stop_token_ids=[], **kw) for p, n, kw in zip(prompts, lengths, modes)]
        got = _drain(handles)
        results = [h.result for h in handles]
        status = engine.status()
    assert got == expected
    assert status["speculative_steps"] > 0
    fixed = [r for r, kw in zip(results, modes) if kw.get("verify_len", "auto") != "auto"]
    assert all(r.acceptance_lengths and r.policy == "batched-fixed" for r in fixed)
    accepted = [a for r in fixed for a in r.acceptance_lengths]
    assert max(accepted) >= 4 and min(accepted) == 1  # whole and partial blocks, and a first proposal rejected
    plain = results[modes.index(dict(block_size=1))]
    assert plain.acceptance_lengths == [] and plain.policy == "batched-plain"


def test_seeded_speculative_streams_equal_batch1(art):  # noqa: F811 (the imported fixture)
    """Graph-sampled and host-sampled (top_k / top_p) streams verifying proposals beside greedy ones: each
    gives its seed's batch-1 reply (a proposal is accepted iff it equals the sample of its row, drawn with
    the uniform of its output position)."""
    prompts = _prompts(4)[:5]
    kinds = [dict(temperature=0.8, seed=3), dict(temperature=1.1, top_k=5, seed=4), dict(),
             dict(temperature=0.7, top_p=0.8, seed=5), dict(temperature=0.9, seed=6)]
    with runtime.load(art) as s:
        expected = [s.generate(p, max_new_tokens=18, stop_token_ids=[], reuse_prefix=False, block_size=1,
                               **kw).output_ids for p, kw in zip(prompts, kinds)]
    with BatchEngine(art, max_batch=4) as engine:
        _oracle_drafts(engine, {tuple(p): e for p, e in zip(prompts, expected)})
        handles = [engine.stream(p, max_new_tokens=18, stop_token_ids=[], verify_len=4, **kw)
                   for p, kw in zip(prompts, kinds)]
        got = _drain(handles)
    assert got == expected
    assert all(max(h.result.acceptance_lengths) >= 3 for h in handles)


def test_one_draft_call_per_step_for_every_speculating_sequence(art, per_sequence_art):  # noqa: F811
    """Three streams verifying 3 proposals each: with the batched draft graph every speculative step runs one
    draft call for all of them (plus calls that read a slot's overflowing taps), without it one per
    sequence; both give the batch-1 output."""
    prompts = _prompts(3)[:3]
    runs = {}
    for name, artifact in (("batched", art), ("per_sequence", per_sequence_art)):
        with BatchEngine(artifact, max_batch=3) as engine:
            assert engine.speculation.drafts.batched == (name == "batched")
            calls, run = [], engine.backend.run

            def spy(graph, inputs, outputs):
                if graph.startswith("draft"):
                    calls.append(inputs["block_embeddings"].shape[0] if graph == "draft_batched" else 1)
                return run(graph, inputs, outputs)

            engine.backend.run = spy
            got = _drain([engine.stream(p, max_new_tokens=24, stop_token_ids=[], verify_len=3) for p in prompts])
            runs[name] = (got, calls)
    with runtime.load(art) as s:
        expected = [s.generate(p, max_new_tokens=24, block_size=1, stop_token_ids=[], reuse_prefix=False).output_ids
                    for p in prompts]
    assert runs["batched"][0] == runs["per_sequence"][0] == expected
    assert max(runs["batched"][1]) == 3 and set(runs["per_sequence"][1]) == {1}
    assert len(runs["batched"][1]) < len(runs["per_sequence"][1]) / 2


# The tiny drafts' fc reduction (3 taps x hidden 64), 2 layers and the norm (tests/tolerances.py).
DRAFT_ROUNDING = dict(reduction=192, depth=4)


def test_a_batched_draft_call_proposes_what_each_sequence_would_alone(art, per_sequence_art):  # noqa: F811
    """The same slots (different cached and new context rows, different anchors) drafted in one batched call
    and in one call each: the same proposals, their probabilities and the new context K/V within fp32 rounding, and
    the same bookkeeping after."""
    from runtime.backends.select import make_backend
    from runtime.batching.drafts import SlotDrafts, draft_graph
    from runtime.manifest import load_manifest

    rng = np.random.default_rng(7)
    forms = []
    for artifact in (art, per_sequence_art):
        m = load_manifest(artifact)
        drafts = SlotDrafts(make_backend("ort", artifact, m, 1, None, graphs=(draft_graph(m),)), m, artifact,
                            3, np.float32, pending_rows=8)
        forms.append(drafts)
    cached, new = [0, 5, 9], [3, 1, 2]
    taps = rng.standard_normal(forms[0].taps.array.shape).astype(np.float32)
    anchors = rng.standard_normal(forms[0].anchors.array.shape).astype(np.float32)
    kv = [rng.standard_normal(k.array.shape).astype(np.float32) * 0.5 for pair in forms[0].kv for k in pair]
    for drafts in forms:
        drafts.taps.array[:], drafts.anchors.array[:] = taps, anchors
        for buf, values in zip([k for pair in drafts.kv for k in pair], kv):
            buf.array[:] = values
        drafts.draft_len[:], drafts.pending[:] = list(cached), list(new)
    (batched, alone) = [d.propose([(0, 3), (1, 4), (2, 5)], 3) for d in forms]
    for (ids_b, probs_b), (ids_a, probs_a) in zip(batched, alone):
        assert np.array_equal(ids_b, ids_a)
        assert_fp32_close(probs_b, probs_a, what="probabilities", **DRAFT_ROUNDING)
    for pair_b, pair_a in zip(forms[0].kv, forms[1].kv):
        for k_b, k_a in zip(pair_b, pair_a):
            assert_fp32_close(k_b.array, k_a.array, what="context K/V", **DRAFT_ROUNDING)
    assert forms[0].draft_len == forms[1].draft_len == [3, 6, 11] and forms[0].pending == forms[1].pending == [0, 0, 0]
    assert forms[0].calls == 1 and forms[1].calls == 3


def test_draft_calls_respect_an_engines_context_row_limit(per_sequence_art):
    """Where an engine's profiles limit a draft call's context rows (TensorRT), a slot's pending taps (60-
    and 50-token prompts prefilled in 8-row chunks: more than the 40 rows a slot keeps) are read in calls of
    at most that many rows once the draft's cache holds rows; the streams still equal batch 1."""
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 90, size=n)] for n in (60, 50)]
    with runtime.load(per_sequence_art) as s:
        expected = [s.generate(p, max_new_tokens=12, block_size=1, stop_token_ids=[], reuse_prefix=False).output_ids
                    for p in prompts]
    with BatchEngine(per_sequence_art, max_batch=2, prefill_chunk=8) as engine:
        calls, run = [], engine.backend.run

        def spy(graph, inputs, outputs):
            if graph == "draft":
                calls.append((inputs["past_key_0"].shape[0], inputs["context_hidden"].shape[0]))
            return run(graph, inputs, outputs)

        engine.backend.run = spy
        engine.backend.max_call_rows = lambda graph: 3 if graph == "draft" else None
        got = _drain([engine.stream(p, max_new_tokens=12, stop_token_ids=[], verify_len=3) for p in prompts])
    assert got == expected
    assert calls and all(rows <= 3 for past, rows in calls if past > 0)
    assert any(past == 0 and rows > 3 for past, rows in calls)  # (an empty cache's first call takes them all)


def test_a_batched_draft_call_without_new_context_reads_nothing(art):  # noqa: F811 (the imported fixture)
    """Slots with no pending tap rows (a fully reused prefix) still draft in one batched call: proposals
    come back and the draft caches stay as they were."""
    with BatchEngine(art, max_batch=2) as engine:
        drafts = engine.speculation.drafts
        drafts.draft_len[:], drafts.pending[:] = [0, 5], [0, 0]
        out = drafts.propose([(0, 3), (1, 4)], 3)
        assert [len(ids) for ids, _ in out] == [3, 3] and all(np.all((p >= 0) & (p <= 1)) for _, p in out)
        assert drafts.draft_len == [0, 5] and drafts.pending == [0, 0]
