"""The batched target graph (`build --batched`) and `runtime.batching.BatchEngine`: every stream's output
equals its batch-1 output (greedy and seeded, whatever joins or leaves, plain or verifying its draft's
proposals), long prompts join in chunks, slots are reused and freed, bad input gets one clear error."""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest
import runtime_fixtures as rf
from shared_cache import shared_dir
from trt_doubles import doubles  # noqa: F401 (a fixture)

import runtime
from dflash_export.build import BuildOptions, build

# (imported here, not inside a test: imported while the `doubles` fixture patches runtime.backends.trt, it
# would keep the fake TensorRT look-ups for the rest of the session)
from dflash_export.trt.engine import build_engines
from runtime.batching import BatchEngine
from runtime.batching.calls import SequenceRows
from runtime.errors import DFlashError

# the batched build (40 s on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow

PROMPT_LENGTHS = (3, 5, 9, 17, 40, 2, 7)


def _build(tmp_path_factory, name: str, external: bool = False, **options):
    """The tiny qwen3 pair built with `--batched`; its draft gets a proposal vocabulary of every id, so its
    graph proposes ids (`runtime.manifest.draft_proposes`) and batched steps can speculate. `external`:
    every weight in `.onnx.data` files, as a real target's are (test_weights_are_shared_with_the_target_graph)."""
    from unittest import mock

    from dflash_export.export import graphs

    root = rf.checkpoints("qwen3", tmp_path_factory)

    def make(d):
        draft = d / "draft"
        shutil.copytree(root / "draft", draft)
        (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(rf.VOCAB))}))
        with mock.patch.object(graphs, "EXTERNAL_DATA_THRESHOLD", 0 if external else graphs.EXTERNAL_DATA_THRESHOLD):
            build(BuildOptions(str(root / "target"), str(draft), d / "artifact", max_seq_len=96, batched=True,
                               quiet=True, **options))

    return shared_dir(tmp_path_factory, name, make) / "artifact"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return _build(tmp_path_factory, "batched_fp32", external=True)


@pytest.fixture(scope="module")
def art_int4(tmp_path_factory):
    return _build(tmp_path_factory, "batched_int4", quant="int4", quant_block=32, quant_lm_head=True)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 90, size=n)] for n in PROMPT_LENGTHS]


def _batch1(artifact, prompts, **options) -> list[list[int]]:
    """Each prompt's reply from a one-sequence Session (plain decoding, no reuse)."""
    with runtime.load(artifact) as s:
        return [s.generate(p, block_size=1, reuse_prefix=False, **options).output_ids for p in prompts]


_drain = rf.drain


def test_greedy_streams_equal_their_batch1_output_whatever_joins_or_leaves(art):
    """7 prompts of 2-40 tokens on 3 slots with 8-row prefill chunks: streams join as others finish (their
    lengths differ), long prompts prefill over several calls beside running streams."""
    prompts = _prompts()
    lengths = [12, 30, 5, 20, 9, 25, 16]
    with runtime.load(art) as s:
        expected = [s.generate(p, max_new_tokens=n, block_size=1, stop_token_ids=[], reuse_prefix=False).output_ids
                    for p, n in zip(prompts, lengths)]
        speculative = [s.generate(p, max_new_tokens=n, stop_token_ids=[], reuse_prefix=False).output_ids
                       for p, n in zip(prompts, lengths)]
    assert speculative == expected  # (lossless: the batch-1 reference is the same with speculation)
    with BatchEngine(art, max_batch=3, prefill_chunk=8) as engine:
        got = _drain([engine.stream(p, max_new_tokens=n, stop_token_ids=[]) for p, n in zip(prompts, lengths)])
        assert {k: engine.status()[k] for k in ("waiting", "running", "slots")} == {"waiting": 0, "running": 0, "slots": 3}
    assert got == expected


def test_seeded_sampling_equals_batch1_in_a_mixed_batch(art):
    """Greedy, graph-sampled (temperature) and host-sampled (top_k, top_p) streams share calls; each
    gives its seed's batch-1 reply."""
    prompts = _prompts(1)
    kinds = [dict(temperature=0.8, seed=3), dict(temperature=1.1, top_k=5, seed=4), dict(), dict(temperature=0.7,
             top_p=0.8, seed=5), dict(temperature=0.9, seed=6), dict(temperature=1.0, top_k=3, top_p=0.9, seed=7),
             dict(temperature=0.5, seed=8)]
    expected = []
    with runtime.load(art) as s:
        for p, kw in zip(prompts, kinds):
            expected.append(s.generate(p, max_new_tokens=16, stop_token_ids=[], reuse_prefix=False, **kw).output_ids)
    with BatchEngine(art, max_batch=4) as engine:
        got = _drain([engine.stream(p, max_new_tokens=16, stop_token_ids=[], **kw) for p, kw in zip(prompts, kinds)])
    assert got == expected
    assert len({tuple(g) for g in got}) == len(got)


def _oracle_drafts(engine, expected: dict[tuple, list[int]]) -> None:
    """Make each sequence's proposals its expected reply's next ids, with the one at position k % (rows + 1)
    changed (k: tokens so far), so steps accept all, some or none of their proposals. The real draft call
    still runs first (its cache and timings as in a real step)."""
    real = engine.speculation.drafts.propose

    def propose(requests, rows, block_size=None):
        out = []
        for (slot, _), (_, probs) in zip(requests, real(requests, rows, block_size)):
            seq = next(s for s in engine.active if s.slot == slot)
            k = len(seq.reply.out)
            ids = list(expected[tuple(seq.prompt)][k:k + rows])
            ids += [1] * (rows - len(ids))
            wrong = k % (rows + 1)
            if wrong < rows:
                ids[wrong] = (ids[wrong] + 1) % rf.VOCAB
            out.append((np.array(ids, np.int64), probs))
        return out

    engine.speculation.drafts.propose = propose


@pytest.mark.nightly  # (its own INT4 build; `make test` checks fp32 exactness here, test_int4 the INT4 row exactness)
def test_int4_level4_streams_equal_batch1(art_int4):
    """INT4 at accuracy level 4 (int8 activations): a one-row call is padded to two rows, so every row
    computes the floats it gets in any batch."""
    prompts = _prompts(2)
    expected = _batch1(art_int4, prompts, max_new_tokens=14, stop_token_ids=[])
    seeded = _batch1(art_int4, prompts[:3], max_new_tokens=14, stop_token_ids=[], temperature=0.9, seed=11)
    with BatchEngine(art_int4, max_batch=4) as engine:
        assert engine.backend.int4_accuracy_level == 4
        got = _drain([engine.stream(p, max_new_tokens=14, stop_token_ids=[]) for p in prompts])
        got_seeded = _drain([engine.stream(p, max_new_tokens=14, stop_token_ids=[], temperature=0.9, seed=11)
                             for p in prompts[:3]])
        _oracle_drafts(engine, {tuple(p): e for p, e in zip(prompts, expected)})
        verified = _drain([engine.stream(p, max_new_tokens=14, stop_token_ids=[], verify_len=3) for p in prompts])
    assert got == expected
    assert got_seeded == seeded
    assert verified == expected  # (verify rows: 1-4 rows per sequence, padded rows beside them)


def test_batched_call_rows_are_the_one_sequence_graphs_floats(art):
    """Logits of a decoding row are bit-identical in a batch of 3 (other sequences at other past lengths,
    padded key rows) and in a one-sequence call; padded rows produce no NaN."""
    prompts = _prompts(3)[:3]
    with BatchEngine(art, max_batch=3) as engine:
        calls = engine.calls
        with engine.cond:  # the scheduler is idle: drive the calls directly
            calls.run([SequenceRows(i, 0, p) for i, p in enumerate(prompts)])
            ids = [p[-1] for p in prompts]
            calls.run([SequenceRows(i, len(p), [t]) for i, (p, t) in enumerate(zip(prompts, ids))], keep_logits=True)
            batched = [calls.read_logits(i) for i in range(3)]
            calls.run([SequenceRows(1, len(prompts[1]), [ids[1]])], keep_logits=True)
            alone = calls.read_logits(0)
    assert all(np.isfinite(b).all() for b in batched)
    assert np.array_equal(batched[1], alone)


def test_a_long_prompt_joins_a_running_stream_one_chunk_at_a_time(art):
    """A 60-token prompt with 8-row chunks takes 8 prefill calls; the running stream gets a token after
    each of them (it waits at most one chunk)."""
    events, cond = [], threading.Condition()

    def recorder(name):
        def on_event(kind, payload):
            with cond:
                events.append((name, kind))
                cond.notify_all()
        return on_event

    short, long_prompt = _prompts(4)[0], [int(t) for t in np.random.default_rng(5).integers(3, 90, size=60)]
    with BatchEngine(art, max_batch=2, prefill_chunk=8) as engine:
        a = engine.stream(short, max_new_tokens=30, stop_token_ids=[], on_event=recorder("a"))
        with cond:
            assert cond.wait_for(lambda: ("a", "chunk") in events, timeout=30)
        b = engine.stream(long_prompt, max_new_tokens=4, stop_token_ids=[], on_event=recorder("b"))
        with cond:
            assert cond.wait_for(lambda: ("a", "done") in events and ("b", "done") in events, timeout=60)
    order = [name for name, kind in events if kind == "chunk"]
    first_b = order.index("b")
    a_before = order[:first_b].count("a")
    assert a_before >= 8  # one token per prefill chunk of b (60 rows / 8), at least
    assert a.result.output_ids == _batch1(art, [short], max_new_tokens=30, stop_token_ids=[])[0]
    assert b.result.output_ids == _batch1(art, [long_prompt], max_new_tokens=4, stop_token_ids=[])[0]


def test_cancel_frees_the_slot_for_the_next_request(art):
    prompts = _prompts(6)
    with BatchEngine(art, max_batch=1) as engine:
        first = engine.stream(prompts[0], max_new_tokens=60, stop_token_ids=[])
        waiting = engine.stream(prompts[1], max_new_tokens=5, stop_token_ids=[])
        next(first), next(first)
        assert engine.status()["waiting"] == 1
        extra = engine.stream(prompts[2], max_new_tokens=5, stop_token_ids=[])
        extra.cancel()  # a client that left while waiting no longer counts against the queue
        assert engine.status()["waiting"] == 1
        first.cancel()
        assert list(first) == [] or first.result is None
        list(waiting)
        assert waiting.result.output_ids == _batch1(art, [prompts[1]], max_new_tokens=5, stop_token_ids=[])[0]
        assert first.result is None
        assert engine.status()["running"] == 0


def test_a_later_turn_reuses_its_slot_rows(art):
    prompt = _prompts(7)[4]
    with BatchEngine(art, max_batch=2) as engine:
        first = engine.generate([prompt], max_new_tokens=8, stop_token_ids=[])[0]
        follow = prompt + first.output_ids + [5, 6, 7]
        again = engine.generate([follow], max_new_tokens=8, stop_token_ids=[])[0]
        fresh = engine.generate([follow], max_new_tokens=8, stop_token_ids=[], reuse_prefix=False)[0]
    assert again.reused_tokens == len(prompt) + len(first.output_ids) - 1  # the last reply id is not cached
    assert fresh.reused_tokens == 0
    assert again.output_ids == fresh.output_ids


def test_weights_are_shared_with_the_target_graph(art):
    """Where target.onnx keeps its weights in target.onnx.data (`art` is built so), target_batched.onnx
    refers to that file instead of storing them again, and runs."""
    import onnx

    out = art
    assert (out / "target.onnx.data").is_file() and not (out / "target_batched.onnx.data").exists()
    model = onnx.load(str(out / "target_batched.onnx"), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    # per layer: the packed q/k/v, o, the packed gate/up and down projections; the embedding and LM head
    assert len(external) >= 4 * 4 + 2
    assert all(dict((e.key, e.value) for e in t.external_data)["location"] == "target.onnx.data" for t in external)
    inline = sum(len(t.raw_data) for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
    assert inline < 16_384  # norms and index constants only
    prompts = _prompts(8)[:3]
    with BatchEngine(out, max_batch=3) as engine:
        got = [r.output_ids for r in engine.generate(prompts, max_new_tokens=6, stop_token_ids=[])]
    assert got == _batch1(out, prompts, max_new_tokens=6, stop_token_ids=[])


def test_errors_are_one_clear_message(art, tmp_path_factory):
    plain = rf.artifact("qwen3", tmp_path_factory).artifact
    with pytest.raises(DFlashError, match="--batched"):
        BatchEngine(plain)
    with pytest.raises(DFlashError, match="max_batch must be a positive integer"):
        BatchEngine(art, max_batch=0)
    with BatchEngine(art, max_batch=1) as engine:
        with pytest.raises(DFlashError, match="max_seq_len 96"):
            engine.stream([5] * 90, max_new_tokens=10)
        with pytest.raises(DFlashError, match="unknown generation option penalty"):
            engine.stream([5, 6], penalty=1.0)
        with pytest.raises(DFlashError, match="temperature"):
            engine.stream([5, 6], temperature=-1)
        with pytest.raises(DFlashError, match="outside the vocabulary"):
            engine.stream([5, 10_000])
    with pytest.raises(DFlashError, match="closed"):
        engine.stream([5, 6])


def test_stop_strings_need_a_tokenizer(art, tmp_path):
    """Stop strings match text: without the artifact's tokenizer the request is refused before it runs."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(art, bare)
    shutil.rmtree(bare / "tokenizer")
    with BatchEngine(bare, max_batch=1) as engine:
        with pytest.raises(DFlashError, match=r"has no tokenizer: drop them \(--stop\)"):
            engine.stream([5, 6], max_new_tokens=2, stop=["t7"])
        assert engine.status()["steps"] == 0
        assert len(engine.generate([[5, 6]], max_new_tokens=2, stop_token_ids=[])[0].output_ids) == 2


def test_manifest_records_the_batched_graph_and_its_checks(art):
    m = json.loads((art / "manifest.json").read_text())
    assert m["target_batched"]["graph"] == "target_batched.onnx"
    assert m["draft_batched"]["graph"] == "draft_batched.onnx"
    for graph in ("target_batched", "draft_batched"):
        assert graph in m["graph_checks"] and "Loop" not in m["graph_checks"][graph]["ops"]
        # `art` keeps every weight in data files (as a real model's are): the batched graphs refer to them
        one = graph.split("_")[0]
        assert (art / f"{one}.onnx.data").exists() and not (art / f"{graph}.onnx.data").exists()
        assert m[graph]["weights"] == f"{one}.onnx's data file"


@pytest.mark.parametrize("graph", ["target_batched", "draft_batched"])
def test_a_missing_batched_graph_is_one_clear_error(art, tmp_path, graph):
    import shutil

    out = tmp_path / "artifact"
    shutil.copytree(art, out)
    (out / f"{graph}.onnx").unlink()
    with pytest.raises(DFlashError, match=rf"the batched {graph.split('_')[0]} graph '{graph}.onnx' is missing; "
                                          "the artifact is incomplete, rebuild it"):
        BatchEngine(out)


def test_serve_max_batch_needs_a_batched_artifact(tmp_path_factory):
    import argparse

    from runtime.__main__ import _max_batch

    plain = rf.artifact("qwen3", tmp_path_factory).artifact
    m = json.loads((plain / "manifest.json").read_text())
    args = argparse.Namespace(max_batch=None, backend="ort", dir=plain)
    assert _max_batch(args, m) == 1
    args.max_batch = 4
    with pytest.raises(DFlashError, match="--batched"):
        _max_batch(args, m)


def test_batched_engine_through_the_tensorrt_double(art, tmp_path_factory, doubles):  # noqa: F811
    """The TensorRT backend's own code on the batched graph, through the test double (NOT TensorRT: the
    double runs the ONNX graph with onnxruntime, refusing shapes outside the engine's profiles and
    misaligned or host addresses): `engine --max-batch 3` builds a third engine whose profiles take every
    call the engine makes (verify steps of a whole block included), and the streams equal onnxruntime's."""
    import shutil

    from trt_doubles import GPU, FakeTensorRT


    out = tmp_path_factory.mktemp("trt_batched") / "artifact"
    shutil.copytree(art, out)
    manifest = build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True, max_batch=3)
    assert manifest["trt"]["plans"]["target_batched"] == "target_batched.plan" and manifest["trt"]["max_batch"] == 3
    assert [p["name"] for p in manifest["trt"]["profiles"]["target_batched"]] == ["batched_decode", "batched_prefill"]
    prompts = _prompts(9)
    with BatchEngine(out, max_batch=3, backend="ort") as engine:
        expected = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[], temperature=0.8, seed=i)
                           for i, p in enumerate(prompts)])
        greedy = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[], block_size=1) for p in prompts])
    with pytest.raises(DFlashError, match="--max-batch 4"):
        BatchEngine(out, max_batch=4, backend="trt")
    with BatchEngine(out, max_batch=3, backend="trt") as engine:
        got = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[], temperature=0.8, seed=i)
                      for i, p in enumerate(prompts)])
        # every proposal of the block verified: calls of 3 sequences x 8 rows, the decode profile's largest
        verified = _drain([engine.stream(p, max_new_tokens=10, stop_token_ids=[], verify_len="all") for p in prompts])
        assert engine.status()["speculative_steps"] > 0 and engine.speculation.drafts.calls > 0
    assert got == expected
    assert verified == greedy
    # each new K/V row reaches its slot in one strided copy per layer and kind (all heads at once)
    layers = int(manifest["target"]["num_layers"])
    assert doubles["cuda"].copies_2d > 0 and doubles["cuda"].copies_2d % (2 * layers) == 0


def test_callbacks_that_raise_or_close_do_not_stop_the_scheduler(art):
    """A raising on_event callback cancels its own generation only; close() from a callback ends the other
    streams with an error instead of hanging them."""
    prompts = _prompts(10)

    def boom(kind, payload):
        raise ValueError("a client bug")

    with BatchEngine(art, max_batch=2) as engine:
        engine.stream(prompts[0], max_new_tokens=8, stop_token_ids=[], on_event=boom)
        other = engine.stream(prompts[1], max_new_tokens=8, stop_token_ids=[])
        assert len(list(other)) == 8 and other.result is not None
    engine = BatchEngine(art, max_batch=2)
    victim = engine.stream(prompts[2], max_new_tokens=30, stop_token_ids=[])
    engine.stream(prompts[3], max_new_tokens=30, stop_token_ids=[],
                  on_event=lambda kind, payload: engine.close() if kind == "chunk" else None)
    with pytest.raises(DFlashError, match="closed"):
        list(victim)
    engine.close()


def test_a_failing_call_ends_its_generations_and_the_engine_goes_on(art):
    """A graph call that raises (a backend failure) ends the generations in it with that error; later
    requests are served, and requests arriving meanwhile through the server's worker never deadlock with
    the failure's events (the engine emits them outside its lock)."""
    import asyncio

    from runtime.serve.worker import BatchWorker, Job, QueueFull

    prompts = _prompts(11)
    with BatchEngine(art, max_batch=2) as engine:
        real, fail = engine.calls.run, threading.Event()

        def flaky(rows, keep_logits=False):
            if fail.is_set():
                raise RuntimeError("device lost")
            return real(rows, keep_logits)

        engine.calls.run = flaky
        fail.set()
        with pytest.raises(RuntimeError, match="device lost"):
            list(engine.stream(prompts[0], max_new_tokens=8, stop_token_ids=[]))
        worker, loop, done = BatchWorker(engine, queue_size=1000), asyncio.new_event_loop(), []

        def submitter():
            for _ in range(40):
                try:
                    worker.submit(Job(loop, prompts[1], {"max_new_tokens": 4}))
                except QueueFull:
                    pass
            done.append(True)

        threads = [threading.Thread(target=submitter, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(done) == 2, "submitting deadlocked with the failing calls' events"
        fail.clear()
        with engine.cond:
            assert engine.cond.wait_for(lambda: not engine.active and not engine.waiting, timeout=60)
        got = engine.generate([prompts[2]], max_new_tokens=6, stop_token_ids=[])[0].output_ids
        loop.close()
    assert got == _batch1(art, [prompts[2]], max_new_tokens=6, stop_token_ids=[])[0]
    with BatchEngine(art, max_batch=1) as engine:
        with pytest.raises(DFlashError, match="empty"):
            engine.submit([], runtime.options.GenerationOptions(max_new_tokens=4))
        with pytest.raises(DFlashError, match="outside the vocabulary"):
            engine.submit([-5], runtime.options.GenerationOptions(max_new_tokens=4))


def test_generate_takes_a_list_and_a_burst_fills_slots_before_the_queue(art):
    """`generate` refuses a bare string (it would be split into characters) and checks every prompt before
    any runs; the server's worker counts only requests that find no free slot against --queue-size."""
    import asyncio

    from runtime.serve.worker import BatchWorker, Job

    with BatchEngine(art, max_batch=2) as engine:
        with pytest.raises(DFlashError, match="list of prompts"):
            engine.generate("t5 t6")
        with pytest.raises(DFlashError, match="empty"):
            engine.generate([[5, 6], []], max_new_tokens=4)
        assert engine.status() == {"waiting": 0, "running": 0, "slots": 2, "steps": 0, "speculative_steps": 0,
                                   "decoded_tokens": 0, "decode_seconds": 0.0, "prefill_rows": 0,
                                   "prefill_seconds": 0.0}  # the first was never queued
        worker, loop = BatchWorker(engine, queue_size=1), asyncio.new_event_loop()
        jobs = [Job(loop, p, {"max_new_tokens": 30, "stop_token_ids": []}) for p in _prompts(12)[:3]]
        for job in jobs:  # 2 slots + 1 queue place: none refused, even before the scheduler's next step
            worker.submit(job)
        for job in jobs:
            worker.cancel(job)
        loop.close()


@pytest.mark.slow  # (the hybrid fixture's build; the fast set has no other user of it)
def test_requests_are_refused_as_the_session_refuses_them(art):
    """The batched engine checks block_size, verify_len, top_k and stop ids as `Session.check_request` does,
    with the same messages (the server answers a request alike whatever --max-batch)."""
    bad = [dict(verify_len=0), dict(verify_len=99), dict(block_size=0), dict(block_size=1, verify_len=3),
           dict(verify_len="20+1"), dict(top_k=rf.VOCAB + 1, temperature=0.5), dict(stop_token_ids=[rf.VOCAB])]
    with runtime.load(art) as s, BatchEngine(art, max_batch=2) as engine:
        for kw in bad:
            with pytest.raises(DFlashError) as alone:
                s.generate([5, 6], max_new_tokens=4, **kw)
            with pytest.raises(DFlashError) as batched:
                engine.stream([5, 6], max_new_tokens=4, **kw)
            assert str(batched.value) == str(alone.value), kw
