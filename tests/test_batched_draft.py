"""The batched draft (`nn.batched_draft.BatchedDraft`): one call drafts for several sequences, each at its
own cached and new context lengths, and each sequence's proposal table and new context K/V equal what
the one-sequence proposing draft (`nn.draft.ProposingDraft`) returns for it alone, within float
tolerance (full, sliding and causal layers). Its ONNX graph gives what the module gives."""

from __future__ import annotations

import numpy as np
import pytest
import tiny_models
import torch
from tolerances import assert_fp32_close

# Batched and one-sequence drafts differ by fp32 rounding (tests/tolerances.py): fc's reduction
# (3 taps x hidden 64), then 2 layers and the norm.
ROUNDING = dict(reduction=192, depth=4)
WINDOW = 5


def _proposing(tiny, tmp_path_factory, name, **overrides):
    from dflash_export.checkpoint.draft import load_draft_spec
    from dflash_export.nn.draft import DFlashDraft, ProposingDraft
    from dflash_export.nn.layers import load_weights

    target = tiny.target("qwen3")
    ddir = tiny_models.make_draft(tmp_path_factory.mktemp(name) / "hf", target.hf_dir, scale=0.15, **overrides)
    spec, state = load_draft_spec(ddir, target.spec)
    module = DFlashDraft(spec, torch.float32).eval()
    load_weights(module, state, f"draft {ddir}")
    head = torch.randn(target.spec.vocab_size, target.spec.arch.hidden_size, generator=torch.Generator().manual_seed(3))
    return ProposingDraft.with_head(module, None, head * 0.3)


KINDS = {"full": {}, "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW},
         "causal": {"is_causal": True}}


@pytest.fixture(scope="module", params=list(KINDS))
def draft(request, tiny, tmp_path_factory):
    return _proposing(tiny, tmp_path_factory, f"bdraft_{request.param}", **KINDS[request.param])


@pytest.fixture(scope="module")
def sliding_draft(tiny, tmp_path_factory):
    return _proposing(tiny, tmp_path_factory, "bdraft_sliding_onnx", **KINDS["sliding"])


def _sequences(draft, seed: int = 0):
    """Three sequences: (cached context rows `[P, k*d]` already read, new context rows `[C, k*d]`),
    with different P (0 included) and C, and each one's block `[Bk, d]`."""
    g = torch.Generator().manual_seed(seed)
    feat = draft.fc.in_features
    d = draft.spec.arch.hidden_size
    shapes = [(7, 3), (0, 5), (12, 1)]
    return [(torch.randn(p, feat, generator=g), torch.randn(c, feat, generator=g), torch.randn(8, d, generator=g))
            for p, c in shapes]


def _alone(draft, past_rows, new_rows, block, rows):
    """The one-sequence draft: read `past_rows` into its cache (a call), then draft on `new_rows`."""
    a = draft.spec.arch
    empty = [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
    past = empty
    if past_rows.shape[0]:
        out = draft(past_rows, block, torch.arange(1), *empty)
        past = list(out[2:])
    ids, probs, *new_kv = draft(new_rows, block, rows, *past)
    return ids, probs, new_kv, past


def _batched_inputs(draft, seqs, rows, slots_rows: int = 32):
    """The batched call's inputs for `seqs`: each sequence's cached K/V at slot s (rows s * slots_rows..),
    its new rows packed in a pending buffer with a gap, keys padded to the longest."""
    a = draft.spec.arch
    alone = [_alone(draft, p, c, blk, rows) for p, c, blk in seqs]
    b = len(seqs)
    cache = [torch.zeros(b * slots_rows, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]
    for s, (_, _, _, past) in enumerate(alone):
        for i, t in enumerate(past):
            cache[i][s * slots_rows: s * slots_rows + t.shape[0]] = t
    feat = draft.fc.in_features
    pending = torch.randn(b * 10, feat)  # slot s's pending rows at s * 10 ..
    context_rows, positions, lengths = [], [], []
    for s, (p, c, _) in enumerate(seqs):
        pending[s * 10: s * 10 + c.shape[0]] = c
        context_rows += range(s * 10, s * 10 + c.shape[0])
        positions += range(p.shape[0], p.shape[0] + c.shape[0])
        lengths.append(c.shape[0])
    n_ctx, n_past = max(lengths), max(p.shape[0] for p, _, _ in seqs)
    index = torch.zeros(b, n_ctx, dtype=torch.int64)
    keys = torch.full((b, max(n_past, 1)), 10_000, dtype=torch.int64)  # padding beyond the cache: clipped
    start = 0
    for s, (p, c, _) in enumerate(seqs):
        index[s, : c.shape[0]] = torch.arange(start, start + c.shape[0])
        keys[s, : p.shape[0]] = torch.arange(p.shape[0]) + s * slots_rows
        start += c.shape[0]
    args = (pending, torch.tensor(context_rows), torch.tensor(positions), index, torch.tensor(lengths),
            torch.tensor([p.shape[0] for p, _, _ in seqs]), keys, torch.stack([blk for _, _, blk in seqs]), rows, *cache)
    return args, alone


@pytest.mark.parametrize("rows", [torch.arange(7), torch.tensor([0, 1, 2])])
def test_each_sequence_drafts_as_alone(draft, rows):
    from dflash_export.nn.batched_draft import BatchedDraft

    seqs = _sequences(draft)
    args, alone = _batched_inputs(draft, seqs, rows)
    with torch.no_grad():
        ids, probs, *new_kv = BatchedDraft.view_of(draft)(*args)
    r = rows.shape[0]
    start = 0
    for s, (want_ids, want_probs, want_kv, _) in enumerate(alone):
        assert torch.equal(ids[s * r:(s + 1) * r], want_ids), f"sequence {s}: proposals differ"
        assert_fp32_close(probs[s * r:(s + 1) * r], want_probs, what=f"sequence {s} probabilities", **ROUNDING)
        c = want_kv[0].shape[0]
        for got, want in zip(new_kv, want_kv):
            assert_fp32_close(got[start:start + c], want, what=f"sequence {s} context K/V", **ROUNDING)
        start += c


def test_the_onnx_graph_gives_the_modules_floats(sliding_draft, tmp_path):
    """(A draft with sliding, causal and full layers: every mask kind in one graph.)"""
    import onnxruntime as ort

    from dflash_export.export.batched import export_batched_draft
    from dflash_export.nn.batched_draft import BatchedDraft, batched_draft_io_names

    draft = sliding_draft
    module = BatchedDraft.view_of(draft)
    path = tmp_path / "draft_batched.onnx"
    export_batched_draft(module, path, readers=None)
    names, _ = batched_draft_io_names(draft.spec.arch.num_layers)
    rows = torch.tensor([0, 1, 2, 3])
    args, _ = _batched_inputs(draft, _sequences(draft, seed=4), rows)
    with torch.no_grad():
        want = module(*args)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {n: a.detach().numpy() for n, a in zip(names, args)})
    assert np.array_equal(got[0], want[0].numpy())
    for g, w in zip(got[1:], want[1:]):
        assert_fp32_close(g, w, what="graph vs module", **ROUNDING)
