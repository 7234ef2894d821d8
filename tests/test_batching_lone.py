"""A lone sequence's calls on the one-sequence target graph (`runtime.batching.lone`): the same ids and
cache rows as the batched graph's calls, through hand-overs between the two graphs, and the replies of
a stream that runs alone, is joined, and runs alone again."""

from __future__ import annotations

import numpy as np
import pytest
import runtime_fixtures as rf
from test_batching import _batch1, _prompts, art, art_int4  # noqa: F401 (fixtures)
from trt_doubles import doubles  # noqa: F401 (a fixture)

import runtime
from dflash_export.trt.engine import build_engines
from runtime.backends.base import Backend
from runtime.batching import BatchEngine
from runtime.batching.calls import SequenceRows
from runtime.graphs.row_exact import needs_row_padding

# the batched build (40 s on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow


def _calls(engine, script) -> list[list[int]]:
    """Run `script` (a list of calls, each a list of (slot, past, ids, wanted)) on the engine's batched
    calls directly; returns each call's posterior ids."""
    return [engine.calls.run([SequenceRows(*s) for s in call]).tolist() for call in script]


def test_lone_calls_give_the_batched_graphs_ids_and_cache_rows_across_hand_overs(art):
    """One call script on two engines, one with the lone path and one without: lone prefills of slots 0
    and 1 (the copy moves between slots), a batched call of both, lone calls of slot 0 again (its copy
    filled from the cache), a lone verify, slot 1 alone, slot 0 rolled back below its copy, another batched
    call and a lone one after it. Every call's ids and the whole K/V caches are equal."""
    script = _hand_over_script()
    runs, caches, graphs = [], [], []
    for lone, pad in ((True, False), (True, True), (False, False)):
        with BatchEngine(art, max_batch=2, speculation=False, lone_graph=lone) as engine:
            assert (engine.calls.lone is not None) == lone
            if lone:  # (padded one-row calls: a second row nobody reads changes nothing)
                engine.calls.lone.pad_single_rows = pad
            seen, run = [], engine.backend.run
            engine.backend.run = lambda graph, inputs, outputs: (seen.append(graph), run(graph, inputs, outputs))
            runs.append(_calls(engine, script))
            caches.append(_caches(engine))
            graphs.append(seen)
    assert runs[0] == runs[1] == runs[2]
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(*caches))
    assert graphs[0] == graphs[1] == ["target", "target", "target_batched", "target", "target", "target", "target",
                                      "target_batched", "target"]
    assert set(graphs[2]) == {"target_batched"}


def test_the_lone_graph_pads_one_row_calls_where_the_session_does(art_int4):
    """INT4 at accuracy level 4 (int8 activations): the lone graph's own probe decides as the Session's
    does on the same graph (whatever this CPU's kernels do), and leaves no copy behind."""
    with runtime.load(art_int4) as s, BatchEngine(art_int4, max_batch=2, speculation=False) as engine:
        lone = engine.calls.lone
        assert lone is not None and lone.pad_single_rows == needs_row_padding(s)
        assert lone.slot is None and lone.valid == 0 and lone.unsynced is None


def test_lone_calls_through_the_tensorrt_double(art, tmp_path_factory, doubles):  # noqa: F811
    """The TensorRT backend's own copies (`gather_heads`, `scatter_heads` with slices) on the same call
    script, through the test double (NOT TensorRT: onnxruntime behind TensorRT's API, refusing shapes
    outside the engines' profiles): ids and caches equal onnxruntime's batched graph alone."""
    import shutil

    from trt_doubles import GPU, FakeTensorRT

    out = tmp_path_factory.mktemp("trt_lone") / "artifact"
    shutil.copytree(art, out)
    build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True, max_batch=2)
    runs, caches = [], []
    for backend, lone in (("trt", True), ("ort", False)):
        with BatchEngine(out, max_batch=2, speculation=False, backend=backend, lone_graph=lone) as engine:
            assert (engine.calls.lone is not None) == lone
            runs.append(_calls(engine, _hand_over_script()))
            caches.append(_caches(engine))
    assert runs[0] == runs[1]
    assert all(np.array_equal(a, b) for a, b in zip(*caches))


def _caches(engine) -> list[np.ndarray]:
    """Every K/V cache buffer of the engine's batched calls, on the host (a lone sequence's rows written
    there first: a batched call would write them before reading)."""
    if engine.calls.lone is not None:
        engine.calls.lone.sync()
    return [engine.backend.read(buf.rows(0, buf.capacity // buf.row_elems)).copy()
            for pair in engine.calls.kv for buf in pair]


def _hand_over_script() -> list:
    """The call script of the hand-over tests (see the first test's docstring)."""
    p = _prompts(11)
    return [
        [(0, 0, p[4][:20], 1)],
        [(1, 0, p[3][:9], 1)],
        [(0, 20, p[4][20:23], 3), (1, 9, [41], 1)],
        [(0, 23, [17], 1)],
        [(0, 24, [5, 9, 33, 2], 4)],
        [(1, 10, [6], 1)],
        [(0, 22, [8, 8], 2)],
        [(0, 24, [71], 1), (1, 11, [6], 1)],
        [(0, 25, [3], 1)],
    ]


def test_a_stream_alone_then_joined_then_alone_again_equals_its_batch1_reply(art):
    """A greedy stream and a seeded one each start alone (the one-sequence graph), another request joins
    them for a few steps (batched calls) and leaves; both replies equal the one-sequence Session's."""
    prompts = _prompts(12)
    for options in (dict(), dict(temperature=0.8, seed=5)):
        expected = _batch1(art, [prompts[5]], max_new_tokens=40, stop_token_ids=[], **options)
        with BatchEngine(art, max_batch=2) as engine:
            seen, run = [], engine.backend.run
            engine.backend.run = lambda graph, inputs, outputs: (seen.append(graph), run(graph, inputs, outputs))
            first = engine.stream(prompts[5], max_new_tokens=40, stop_token_ids=[], reuse_prefix=False, **options)
            chunks = iter(first)
            for _ in range(8):  # (it decodes alone for a while)
                next(chunks)
            joined = engine.stream(prompts[2], max_new_tokens=4, stop_token_ids=[], reuse_prefix=False)
            got = rf.drain([first, joined])
        assert got[0] == expected[0]
        assert "target_batched" in seen and seen[0] == "target" and seen[-1] == "target"


def test_the_generic_head_copies_equal_the_host_backends(art):
    """`Backend.gather_heads` / `scatter_heads` as a device backend runs them (one copy per row and head)
    equal the onnxruntime backend's indexed assignments, with index arrays and with slices."""
    with BatchEngine(art, max_batch=2, speculation=False) as engine:
        be, calls = engine.backend, engine.calls
        key = calls.kv[0][0]  # head-major: `heads` buffer rows of [cache rows, D]
        rng = np.random.default_rng(0)
        heads, (rows, d) = key.capacity // key.row_elems, key.row_shape
        be.write(key.rows(0, heads), rng.standard_normal((heads, rows, d)).astype(key.dtype))
        for where in (slice(5 * 2 + 1, 9 * 2 + 1, 2), np.array([3, 40, 7])):
            n = len(range(*where.indices(rows))) if isinstance(where, slice) else len(where)
            out = [be.alloc(key.dtype, n, (heads, d)) for _ in range(2)]
            Backend.gather_heads(be, out[0].rows(0, n), key, where)
            be.gather_heads(out[1].rows(0, n), key, where)
            assert np.array_equal(be.read(out[0].rows(0, n)), be.read(out[1].rows(0, n)))
            before = be.read(key.rows(0, heads)).copy()
            new = rng.standard_normal((n, heads, d)).astype(key.dtype)
            be.write(out[0].rows(0, n), new)
            Backend.scatter_heads(be, key, where, out[0].rows(0, n), slice(0, n))
            generic = be.read(key.rows(0, heads)).copy()
            be.write(key.rows(0, heads), before)
            be.scatter_heads(key, where, out[0].rows(0, n), slice(0, n))
            assert np.array_equal(generic, be.read(key.rows(0, heads)))
            assert not np.array_equal(generic, before)


def test_one_copy_writes_every_layers_new_rows_as_a_copy_per_layer_does(art):
    """`scatter_heads_stack` on the engine's stacked caches (one assignment for every layer and kind)
    writes what `scatter_heads` per layer and kind writes, for several sequences' rows (index arrays) and
    one sequence's (slices)."""
    with BatchEngine(art, max_batch=3, speculation=False) as engine:
        be, calls = engine.backend, engine.calls
        caches = [c for pair in calls.kv for c in pair]
        assert caches[0].stack is not None  # (the onnxruntime backend lays them out as one allocation)
        rng = np.random.default_rng(1)
        for batch in ([SequenceRows(0, 7, [1, 2], 2), SequenceRows(2, 3, [4], 1)], [SequenceRows(1, 5, [3, 4, 5], 3)]):
            calls.rows_per_sequence = max(len(s.ids) for s in batch)
            src, dst = calls._new_row_places(batch)
            rows = len(batch) * calls.rows_per_sequence
            new = [n.rows(0, rows) for pair in calls.new_kv for n in pair]
            for v in new:
                be.write(v, rng.standard_normal(v.shape).astype(v.buffer.dtype))
            written = []
            for scatter in (be.scatter_heads_stack, lambda *a: Backend.scatter_heads_stack(be, *a)):
                for c in caches:
                    be.write(c.rows(0, c.capacity // c.row_elems), np.zeros((c.capacity // c.row_elems,) + c.row_shape, c.dtype))
                scatter(caches, dst, new, src)
                written.append([be.read(c.rows(0, c.capacity // c.row_elems)) for c in caches])
            assert all(np.array_equal(a, b) for a, b in zip(*written)) and any(a.any() for a in written[0])
