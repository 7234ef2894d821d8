"""The batched hybrid target (`nn.batched_hybrid.BatchedHybridTarget`): one call runs several Qwen3.5
sequences, each at its own past length with its own Gated DeltaNet state slot and pending rows, and
gives each what the one-sequence module (`nn.qwen3_5.Qwen35TargetForExport`) gives it alone (within
float tolerance: the batched attention is the split-invariant form), and gives a sequence bit for bit
the same rows whatever else is in the call (padding of new and pending rows adds exact zeros)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_fixtures import VOCAB
from tolerances import assert_fp32_close

# a hybrid build (over a minute on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow

TAPS = (0, 1, 2)
SLOTS, MAX_SEQ = 4, 48


@pytest.fixture(scope="module")
def modules():
    """The one-sequence and the batched module of a 3-layer hybrid ([GDN, GDN, attention]: every cache
    kind, two recurrent states per slot; tracing cost grows with the GDN layers)."""
    from hybrid_fixtures import THREE_LAYER_TYPES, six_layer_model

    from dflash_export.nn import qwen3_5 as q35
    from dflash_export.nn.batched_hybrid import BatchedHybridTarget
    from dflash_export.nn.layers import load_weights

    model = six_layer_model(THREE_LAYER_TYPES)
    spec = q35.HybridSpec.from_config(model.config.to_dict())
    state = q35.text_state_dict(model.state_dict())
    one = q35.Qwen35TargetForExport(spec, TAPS).eval()
    load_weights(one, state, "tiny qwen3.5")
    batched = BatchedHybridTarget(spec, TAPS).eval()
    load_weights(batched, state, "tiny qwen3.5")
    return one, batched


def _history(one, seed: int, prefill: int, verify: int, accepted: int):
    """A sequence's caches after a prefill call of `prefill` rows (all committed) and a verify call of
    `verify` rows of which `accepted` were committed (one-sequence module, `next_caches`)."""
    from dflash_export.nn.qwen3_5 import next_caches

    g = torch.Generator().manual_seed(seed)
    caches = one.empty_caches()
    with torch.no_grad():
        for rows, keep in ((prefill, prefill), (verify, accepted)):
            ids = torch.randint(0, VOCAB, (rows,), generator=g)
            out = one(ids, torch.arange(rows), *caches)
            caches = next_caches(one, caches, out, keep)
    return caches


def _batched_inputs(one, seqs):
    """The batched call's inputs for `seqs`: (slot, caches before the call, new ids `[T_b]`)."""
    spec = one.spec
    b, t = len(seqs), max(len(ids) for _, _, ids in seqs)
    attn = one.first_attention
    pasts = [c[one.cache_offsets[attn]].shape[0] for _, c, _ in seqs]
    pendings = [c[one.cache_offsets[0] + 2].shape[0] for _, c, _ in seqs]
    ids = torch.zeros(b, t, dtype=torch.int64)
    for i, (_, _, new) in enumerate(seqs):
        ids[i, : len(new)] = new
    n_keys = max(pasts) + t
    key_index = torch.zeros(b, n_keys, dtype=torch.int64)
    p = max(max(pendings), 1)
    pending_index = torch.zeros(b, p, dtype=torch.int64)
    for i, (slot, _, _) in enumerate(seqs):
        key_index[i, : pasts[i]] = torch.arange(pasts[i]) * SLOTS + slot
        pending_index[i] = slot * 64 + torch.arange(p)
    caches = []
    for li, kind in enumerate(spec.layer_types):
        o = one.cache_offsets[li]
        if kind == "full_attention":
            for j in range(2):
                buf = torch.randn(spec.num_kv_heads, MAX_SEQ * SLOTS, spec.head_dim)  # other slots: noise
                for (slot, c, _), past in zip(seqs, pasts):
                    buf[:, torch.arange(past) * SLOTS + slot] = c[o + j].transpose(0, 1)
                caches.append(buf)
        else:
            conv = torch.randn(SLOTS, spec.conv_kernel - 1, spec.conv_dim)
            rec = torch.randn(SLOTS, spec.num_v_heads, spec.key_head_dim, spec.value_head_dim)
            rows = [torch.randn(SLOTS * 64, w) for w in (spec.conv_dim, spec.num_v_heads, spec.num_v_heads)]
            for slot, c, _ in seqs:
                conv[slot], rec[slot] = c[o], c[o + 1]
                for buf, recorded in zip(rows, c[o + 2: o + 5]):
                    buf[slot * 64: slot * 64 + recorded.shape[0]] = recorded
            caches += [conv, rec, *rows]
    logit_rows = torch.tensor([i * t + j for i, (_, _, new) in enumerate(seqs) for j in range(len(new))])
    return (ids, torch.tensor(pasts), key_index, logit_rows, torch.zeros(len(logit_rows)), torch.zeros(0),
            torch.tensor([s for s, _, _ in seqs]), pending_index, torch.tensor(pendings), *caches)


# (slot, seed, prefill rows, verify rows, accepted, new rows): pasts 5 + 3, 11 + 1, 2 + 4; pending 3, 1, 4
SEQUENCES = [(2, 1, 5, 4, 3, 1), (0, 2, 11, 2, 1, 4), (3, 3, 2, 5, 4, 2)]


def _sequences(one):
    g = torch.Generator().manual_seed(9)
    return [(slot, _history(one, seed, pre, ver, acc), torch.randint(0, VOCAB, (new,), generator=g))
            for slot, seed, pre, ver, acc, new in SEQUENCES]


def test_each_sequence_gets_what_it_gets_alone(modules):
    """Logits, next ids, taps, attention K/V rows, the folded GDN states and the recorded rows of each of
    3 sequences (different pasts, pending rows and new rows) equal the one-sequence module's."""
    one, batched = modules
    seqs = _sequences(one)
    with torch.no_grad():
        out = batched(*_batched_inputs(one, seqs))
    t = max(len(ids) for _, _, ids in seqs)
    rounding = dict(reduction=one.spec.intermediate_size, depth=len(one.spec.layer_types) + 1)  # tests/tolerances.py
    base = 0
    for i, (_, caches, ids) in enumerate(seqs):
        n = len(ids)
        with torch.no_grad():
            want = one(ids, torch.arange(n), *caches)
        rows = slice(i * t, i * t + n)
        assert_fp32_close(out[1][base: base + n], want[0], what=f"sequence {i} logits", **rounding)
        assert torch.equal(out[0][base: base + n], want[0].argmax(-1)), f"sequence {i} next ids"
        assert_fp32_close(out[3][rows], want[2], what=f"sequence {i} taps", **rounding)
        k = 4
        for li, kind in enumerate(one.spec.layer_types):
            o = one.cache_offsets[li]
            if kind == "full_attention":
                for j in range(2):
                    assert_fp32_close(out[k + j][rows], want[3 + o + j], what=f"sequence {i} layer {li} kv", **rounding)
                k += 2
            else:
                assert_fp32_close(out[k][i], want[3 + o], what=f"sequence {i} layer {li} conv state", **rounding)
                assert_fp32_close(out[k + 1][i], want[3 + o + 1], what=f"sequence {i} layer {li} state", **rounding)
                for j in range(3):
                    assert_fp32_close(out[k + 2 + j][rows], want[3 + o + 2 + j], what=f"sequence {i} layer {li} pending rows", **rounding)
                k += 5
        base += n


@pytest.fixture(scope="module")
def graph(modules, tmp_path_factory):
    """The batched target graph `build --batched` exported from the same checkpoint (taps (0, 1, 2): its
    draft taps every layer; the artifact is shared with test_batched_hybrid_engine.py), in onnxruntime."""
    import onnxruntime as ort
    from hybrid_fixtures import batched_hybrid_artifact

    path = batched_hybrid_artifact(tmp_path_factory) / "target_batched.onnx"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run(graph, inputs):
    names = [i.name for i in graph.get_inputs()]
    return graph.run(None, {n: x.numpy() for n, x in zip(names, inputs)})


def test_the_graph_gives_the_modules_floats(modules, graph):
    one, batched = modules
    inputs = _batched_inputs(one, _sequences(one))
    with torch.no_grad():
        want = batched(*inputs)
    got = _run(graph, inputs)
    assert np.array_equal(got[0], want[0].numpy())
    for g, w in zip(got[1:], want[1:]):
        assert_fp32_close(g, w, what="graph vs module", reduction=one.spec.intermediate_size,
                          depth=len(one.spec.layer_types) + 1)


def test_in_the_graph_a_sequence_gets_the_same_floats_in_any_batch(modules, graph):
    """In onnxruntime, each sequence alone in a call (its own T and pending rows, no padding) and in the
    padded batch of three: every output row of it is bit-identical."""
    one, _ = modules
    seqs = _sequences(one)
    together = _run(graph, _batched_inputs(one, seqs))
    t = max(len(ids) for _, _, ids in seqs)
    base = 0
    for i, seq in enumerate(seqs):
        n = len(seq[2])
        alone = _run(graph, _batched_inputs(one, [seq]))
        assert np.array_equal(together[1][base: base + n], alone[1]), f"sequence {i} logits"
        assert np.array_equal(together[3][i * t: i * t + n], alone[3]), f"sequence {i} taps"
        for k in range(4, len(alone)):
            if together[k].shape[0] == len(seqs):  # a GDN state output: [B, ...]
                assert np.array_equal(together[k][i], alone[k][0]), f"sequence {i} output {k}"
            else:
                assert np.array_equal(together[k][i * t: i * t + n], alone[k]), f"sequence {i} output {k}"
        base += n
    assert np.isfinite(together[1]).all()


@pytest.mark.nightly  # a 6-layer hybrid traced whole and as a copied template (2 min on AVX2); `make test`: the same
# replication machinery on the one-sequence hybrid (test_hybrid_replication.py), the batched graph against its module here
def test_the_replicated_batched_graph_is_the_full_trace(tmp_path):
    """A 6-layer hybrid ([GDN, GDN, attention] x 2): the batched graph made from a traced 4-layer template
    (`families.qwen3_5.batched_replication_layout`) is the one tracing every layer gives: the same
    operators and wiring, the same weights, the same onnxruntime outputs bit for bit."""
    import warnings

    import onnxruntime as ort
    from graph_compare import assert_same_graph
    from hybrid_fixtures import six_layer_model

    from dflash_export.export.batched import (
        batched_hybrid_inputs,
        export_batched_hybrid,
    )
    from dflash_export.export.graphs import ReplicationWarning
    from dflash_export.families.qwen3_5 import batched_replication_layout
    from dflash_export.nn import qwen3_5 as q35
    from dflash_export.nn.batched_hybrid import BatchedHybridTarget
    from dflash_export.nn.layers import load_weights

    model = six_layer_model()
    module = BatchedHybridTarget(q35.HybridSpec.from_config(model.config.to_dict()), (1, 3, 5)).eval()
    load_weights(module, q35.text_state_dict(model.state_dict()), "6-layer hybrid")
    full, replicated = tmp_path / "full.onnx", tmp_path / "replicated.onnx"
    export_batched_hybrid(module, full, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        export_batched_hybrid(module, replicated, {}, layout=batched_replication_layout(module))
    assert_same_graph(full, replicated)
    args, (names, _), _ = batched_hybrid_inputs(module)
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    outs = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, feeds) for p in (full, replicated)]
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
