"""Batched calls' bookkeeping on the CPU provider: the engine's decode and prefill counters, a prefill
call that wants no posterior, and calls padded to bucketed shapes (keys and rows) without changing a
token."""

from __future__ import annotations

import pytest
import runtime_fixtures as rf
from test_batching import _batch1, _prompts, art  # noqa: F401 (art: a fixture)

from runtime.batching import BatchEngine

# the batched build (40 s on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow

_drain = rf.drain


def test_status_counts_decoded_tokens_and_prefilled_rows_apart(art):
    """The decode counters count what decoding steps gave (every token but each reply's first, which its
    prompt's last prefill call gives) and the prefill ones every prompt row, in chunks or not."""
    prompts, lengths = _prompts(5)[:4], [6, 11, 3, 9]
    with BatchEngine(art, max_batch=2, prefill_chunk=8) as engine:
        got = _drain([engine.stream(p, max_new_tokens=n, stop_token_ids=[], reuse_prefix=False)
                      for p, n in zip(prompts, lengths)])
    status = engine.status()  # (after close: the scheduler counts a step's tokens after emitting them)
    assert [len(g) for g in got] == lengths
    assert status["decoded_tokens"] == sum(lengths) - len(prompts)
    assert status["prefill_rows"] == sum(len(p) for p in prompts)
    assert status["decode_seconds"] > 0 and status["prefill_seconds"] > 0


def test_a_prefill_chunk_that_wants_no_row_still_asks_for_one(art):
    """A call whose sequences are all mid-prompt wants no posterior; it still asks for one row (onnxruntime
    1.23's TopK fails on an empty input; TensorRT's profiles start at one row), also where the backend binds
    uniforms for every row, and nobody reads it."""
    prompt = _prompts(7)[4]  # 40 tokens: 8-row chunks, the first four want nothing
    expected = _batch1(art, [prompt], max_new_tokens=6, stop_token_ids=[], temperature=0.7, seed=2)
    with BatchEngine(art, max_batch=2, prefill_chunk=8, lone_graph=False) as engine:  # (the batched graph's calls)
        engine.calls.skip_sampling = False  # (as where empty uniforms are not supported)
        seen, run = [], engine.backend.run
        engine.backend.run = lambda graph, inputs, outputs: (
            seen.append(inputs["logit_rows"].shape[0]) if graph == "target_batched" else None, run(graph, inputs, outputs))
        got = _drain([engine.stream(prompt, max_new_tokens=6, stop_token_ids=[], temperature=0.7, seed=2)])
    assert got == expected
    assert seen[:5] == [1] * 5 and min(seen) == 1


def test_key_and_row_buckets_pad_calls_without_changing_a_token(art):
    """Rounding each call's keys up to a multiple of 16 (masked padding keys, `BatchedCalls.key_bucket`) and
    its rows per sequence up to a power of two or a multiple of 8 (`row_bucket`: padding rows nobody reads)
    gives the same greedy, seeded and verifying streams as exact shapes."""
    prompts = _prompts(3)[:5]
    lengths = [12, 30, 5, 20, 9]
    runs, shapes = [], []
    for bucket in (1, 16):
        with BatchEngine(art, max_batch=3, prefill_chunk=24, lone_graph=False) as engine:
            engine.calls.key_bucket, engine.calls.row_bucket = bucket, bucket // 2
            seen, run = [], engine.backend.run
            engine.backend.run = lambda graph, inputs, outputs: (
                seen.append(inputs["key_index"].shape[1:] + inputs["input_ids"].shape[1:])
                if graph == "target_batched" else None, run(graph, inputs, outputs))
            runs.append(_drain([engine.stream(p, max_new_tokens=n, stop_token_ids=[], temperature=0.8 * (i % 2), seed=i,
                                              verify_len=3 if i % 3 == 2 else "auto")
                                for i, (p, n) in enumerate(zip(prompts, lengths))]))
            shapes.append(seen)
    assert runs[0] == runs[1]
    assert any(k % 16 for k, _ in shapes[0]) and any(t in (3, 5, 6, 7) for _, t in shapes[0])
    assert shapes[1] and all(k % 16 == 0 for k, _ in shapes[1])
    assert all(t & (t - 1) == 0 or t % 8 == 0 for _, t in shapes[1]) and any(t == 4 for _, t in shapes[1])
