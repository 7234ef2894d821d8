"""The `ort-openvino` backend (onnxruntime's OpenVINO execution provider, `runtime.backends.ort_openvino`):
the batched engine's streams equal their batch-1 streams on it (greedy, seeded, verifying proposals),
its calls meet bucketed shapes, and what it cannot run is one clear error.

onnxruntime-openvino replaces the onnxruntime package, so these run where it is installed: `make
test-openvino` puts it first on PYTHONPATH for this file. Elsewhere only the missing-provider error runs.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnxruntime
import pytest
import runtime_fixtures as rf
from shared_cache import shared_dir

import runtime
from dflash_export.build import BuildOptions, build
from runtime.backends.select import make_backend
from runtime.batching import BatchEngine
from runtime.batching.calls import SequenceRows
from runtime.errors import DFlashError
from runtime.manifest import BATCHED_GRAPH, load_manifest

HAS_OPENVINO = "OpenVINOExecutionProvider" in onnxruntime.get_available_providers()
if os.environ.get("DFLASH_REQUIRE_OPENVINO") and not HAS_OPENVINO:  # (`make test-openvino`: no silent skip)
    raise RuntimeError(f"onnxruntime {onnxruntime.__version__} from {onnxruntime.__file__} has no OpenVINO provider")
needs_openvino = pytest.mark.skipif(not HAS_OPENVINO, reason="onnxruntime-openvino is not installed (make test-openvino)")
MAX_SEQ_LEN = 96


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """The tiny qwen3 pair, INT4 (block 32 + LM head), built with `--batched`; its draft proposes ids."""
    root = rf.checkpoints("qwen3", tmp_path_factory)

    def make(d):
        draft = d / "draft"
        shutil.copytree(root / "draft", draft)
        (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(rf.VOCAB))}))
        build(BuildOptions(str(root / "target"), str(draft), d / "artifact", max_seq_len=MAX_SEQ_LEN, batched=True,
                           quiet=True, quant="int4", quant_block=32, quant_lm_head=True))

    return shared_dir(tmp_path_factory, f"openvino_int4_{onnxruntime.__version__}", make) / "artifact"


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 90, size=n)] for n in (3, 19, 9, 40, 2)]


_drain = rf.drain


@pytest.mark.skipif(HAS_OPENVINO, reason="checks the error where onnxruntime-openvino is missing")
def test_without_the_openvino_provider_the_backend_is_one_clear_error(tmp_path):
    with pytest.raises(DFlashError, match="no OpenVINO execution provider: install onnxruntime-openvino"):
        make_backend("ort-openvino", tmp_path, {}, None, graphs=(BATCHED_GRAPH,))


@needs_openvino
def test_streams_equal_their_batch1_streams_on_openvino(art):
    """Greedy, seeded and proposal-verifying streams on 3 slots (8-row prefill chunks: streams join and
    leave) equal each prompt run alone on a one-slot engine of the same backend."""
    prompts, lengths = _prompts(), [12, 30, 5, 20, 9]
    kinds = [dict(), dict(temperature=0.8, seed=3), dict(verify_len=3), dict(temperature=0.9, seed=4, verify_len=2), dict()]
    with BatchEngine(art, max_batch=1, backend="ort-openvino") as alone:
        expected = [alone.generate([p], max_new_tokens=n, stop_token_ids=[], block_size=1,
                                   **{k: v for k, v in kw.items() if k != "verify_len"})[0].output_ids
                    for p, n, kw in zip(prompts, lengths, kinds)]
    with BatchEngine(art, max_batch=3, prefill_chunk=8, backend="ort-openvino") as engine:
        assert engine.backend.name == "ort-openvino" and engine.speculates
        got = _drain([engine.stream(p, max_new_tokens=n, stop_token_ids=[], **kw)
                      for p, n, kw in zip(prompts, lengths, kinds)])
        assert engine.speculative_steps > 0
    assert got == expected
    assert len({tuple(g) for g in got}) == len(got)


@needs_openvino
def test_a_rows_logits_are_the_same_floats_in_any_batch(art):
    """A decoding row's logits are bit-identical in a batch of 3 (other past lengths, a verify row beside
    it, padded keys) and alone (a one-row call, padded to two where the probe says so)."""
    prompts = _prompts(3)[:3]
    with BatchEngine(art, max_batch=3, backend="ort-openvino", speculation=False) as engine:
        calls = engine.calls
        with engine.cond:  # the scheduler is idle: drive the calls directly
            calls.run([SequenceRows(i, 0, p) for i, p in enumerate(prompts)])
            rows = [[p[-1]] for p in prompts]
            rows[2] = [prompts[2][-1], 7, 9]
            calls.run([SequenceRows(i, len(p), r) for i, (p, r) in enumerate(zip(prompts, rows))], keep_logits=True)
            batched = calls.read_logits(1)
            calls.run([SequenceRows(1, len(prompts[1]), rows[1])], keep_logits=True)
            alone = calls.read_logits(0)
    assert np.isfinite(batched).all()
    assert np.array_equal(batched, alone)


@needs_openvino
def test_calls_meet_bucketed_shapes(art):
    """Keys per sequence are multiples of 64 (or the cap, max_seq_len + rows) and rows per sequence powers of
    two (verify steps of 3 and 4 rows: 4) or multiples of 16 (or what the call buffers hold), so OpenVINO
    prepares few shapes."""
    seen = []
    with BatchEngine(art, max_batch=3, prefill_chunk=32, backend="ort-openvino") as engine:
        run = engine.backend.run

        def spy(graph, inputs, outputs):
            if graph == BATCHED_GRAPH:
                seen.append((*inputs["input_ids"].shape, inputs["key_index"].shape[1]))
            return run(graph, inputs, outputs)

        engine.backend.run = spy
        _drain([engine.stream(p, max_new_tokens=20, stop_token_ids=[], verify_len=2 + i % 2)
                for i, p in enumerate(_prompts(1))])
        max_rows = engine.calls.max_rows
    assert any(t > 16 for _, t, _ in seen) and any(t == 1 for _, t, _ in seen) and any(t == 4 for _, t, _ in seen)
    for b, t, keys in seen:
        assert keys % 64 == 0 or keys == MAX_SEQ_LEN + t, (b, t, keys)
        assert t & (t - 1) == 0 or t % 16 == 0 or t == max_rows // b, (b, t, keys)


@needs_openvino
def test_what_openvino_cannot_run_is_one_clear_error(art, tmp_path):
    with pytest.raises(DFlashError, match="batched graph only"):
        runtime.load(art, backend="ort-openvino")
    old = tmp_path / "old"
    shutil.copytree(art, old)
    manifest = load_manifest(old)
    del manifest[BATCHED_GRAPH]["greedy"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DFlashError, match="ArgMax.*rebuild"):
        BatchEngine(old, max_batch=2, backend="ort-openvino")
