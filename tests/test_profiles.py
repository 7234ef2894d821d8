"""TensorRT optimization profiles cover every shape the decoding loop binds (checked on onnxruntime).

`runtime.backends.profiles.shape_ranges` is the ONE source of the engines' profiles; here every `run` call
that a real onnxruntime Session makes during `generate` is recorded (by wrapping the backend's
`run`) and must lie inside one profile of its graph, with output views of exactly the shapes the
graph produces. Also: the graphs use only TensorRT 10 ONNX operators, and the 256-byte alignment
arithmetic of K/V row offsets. Nothing here runs TensorRT.

`tiny_artifact` (below) is the tiny fp32 artifact shared by the TensorRT-related test files
(test_check, test_trt_backend_double): built once per test run and shared by the xdist workers
(read-only: copy it to change it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

_CACHE: dict[str, Path] = {}


def tiny_artifact(tmp_path_factory) -> Path:
    """A tiny Qwen3 target (4 layers, GQA 4:2, head_dim 24) + draft (2 layers, block 8), fp32,
    max_seq_len 64, exported once per session. Target K/V rows are 2*24*4 = 192 bytes, so row
    offsets are 256-byte aligned only every 4 rows: both binding paths are exercised."""
    if "fp32" not in _CACHE:
        from tiny_models import make_draft, make_target

        from dflash_export.build import BuildOptions, build
        from shared_cache import shared_dir

        def make(root: Path) -> None:
            target = make_target(root / "target")
            draft = make_draft(root / "draft", target)
            build(BuildOptions(str(target), str(draft), root / "artifact", max_seq_len=64, quiet=True))

        _CACHE["fp32"] = shared_dir(tmp_path_factory, "trt_tiny", make) / "artifact"
    return _CACHE["fp32"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return tiny_artifact(tmp_path_factory)


def _record(sess) -> list[tuple[str, dict, dict]]:
    calls = []
    inner = sess.backend.run

    def run(graph, inputs, outputs):
        calls.append((graph, {n: v.shape for n, v in inputs.items()}, {n: v.shape for n, v in outputs.items()}))
        return inner(graph, inputs, outputs)

    sess.backend.run = run
    return calls


def test_every_bound_shape_lies_in_a_profile(artifact):
    import runtime
    from runtime.backends.profiles import call_row_limit, output_shapes, select_profile, shape_ranges

    sess = runtime.load(artifact)
    manifest = sess.manifest
    S = manifest["max_seq_len"]
    ranges = shape_ranges(manifest)
    # the loop splits calls as it would on engines with these profiles
    sess.backend.max_call_rows = lambda graph: call_row_limit(ranges[graph], graph)
    calls = _record(sess)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 90, size=5)]
    cases = [
        dict(prompt=prompt, max_new_tokens=40),  # default block (8)
        dict(prompt=prompt, max_new_tokens=12, block_size=1),  # plain decoding: N = 0 verify
        dict(prompt=prompt, max_new_tokens=12, block_size=2),
        dict(prompt=prompt[:1], max_new_tokens=S - 1, block_size=sess.max_block),  # largest block, fills the buffers
        dict(prompt=prompt, max_new_tokens=20, temperature=0.8, seed=3),
        dict(prompt=[int(t) for t in rng.integers(3, 90, size=S - 1)], max_new_tokens=1),  # longest prefill
        dict(prompt=[int(t) for t in rng.integers(3, 90, size=S - 3)], max_new_tokens=3),  # long first draft context
        dict(prompt=prompt, max_new_tokens=10),
        dict(prompt=prompt + [7, 8, 9, 10], max_new_tokens=10),  # extends a reused prefix (KV reuse)
    ]
    for case in cases:  # every proposal verified: the profiles must hold the largest calls
        sess.generate(case.pop("prompt"), stop_token_ids=[], verify_len="all" if case.get("block_size") != 1 else None, **case)
    used = {}
    for graph, ins, outs in calls:
        idx = select_profile(ranges[graph], ins, graph)  # raises if no profile covers the call
        used.setdefault(graph, set()).add(ranges[graph][idx].name)
        want = output_shapes(manifest, graph, ins)
        want.pop("logits", None)  # not bound unless the session keeps logits (TensorRT writes them to scratch)
        assert want == outs, (graph, ins)
    assert used == {"target": {"prefill", "verify", "extend"}, "draft": {"draft_prefill", "draft_step"}}
    # The loop's extremes are what the profiles were derived for.
    t_prefill = [c[1]["input_ids"][0] for c in calls if c[0] == "target" and c[1]["past_key_0"][0] == 0]
    assert max(t_prefill) == S - 1 and min(t_prefill) == 1
    n_verify = [c[1]["draft_hidden"][0] for c in calls if c[0] == "target" and c[1]["past_key_0"][0] > 0]
    assert min(n_verify) == 0 and max(n_verify) == S - 3  # block 64 after a 1-token prompt: 61 proposals fit
    assert max(c[1]["past_key_0"][0] + c[2]["key_0"][0] for c in calls if c[0] == "target") <= S


def test_profiles_are_consistent_boxes(artifact):
    from runtime.backends.profiles import output_shapes, profiles_from_json, profiles_to_json, shape_ranges

    manifest = json.loads((artifact / "manifest.json").read_text())
    ranges = shape_ranges(manifest)
    assert profiles_from_json(json.loads(json.dumps(profiles_to_json(ranges)))) == ranges
    for graph, profiles in ranges.items():
        for prof in profiles:
            names = [t["name"] for t in manifest["io"][graph]["inputs"]]
            assert list(prof.shapes) == names
            for i in range(3):  # min, opt and max are each a consistent set of shapes for the graph
                shapes = {n: s[i] for n, s in prof.shapes.items()}
                output_shapes(manifest, graph, shapes)
                assert all(lo <= x <= hi for n in names for lo, x, hi in zip(*[prof.shapes[n][j] for j in range(3)]))
    target = {p.name: p for p in ranges["target"]}
    assert target["prefill"].shapes["past_key_0"][2][0] == 0 and target["prefill"].shapes["input_ids"][2] == (63,)
    assert target["verify"].shapes["uniform"][2] == (64,)  # "proposals + 1" evaluated from the IO


def test_select_profile_refuses_uncovered_shapes(artifact):
    from runtime.errors import DFlashError
    from runtime.backends.profiles import select_profile, shape_ranges

    manifest = json.loads((artifact / "manifest.json").read_text())
    prof = shape_ranges(manifest)["target"]
    shapes = {"input_ids": (2,), "draft_hidden": (3, 64), "temperature": (1,), "uniform": (4,), "past_key_0": (10, 2, 24)}
    with pytest.raises(DFlashError, match="no optimization profile"):
        select_profile(prof, shapes, "target")


def test_graphs_use_only_tensorrt10_operators(artifact):
    from dflash_export.export.checks import trt10_supported_ops

    manifest = json.loads((artifact / "manifest.json").read_text())
    for graph in ("target", "draft"):
        checks = manifest["graph_checks"][graph]
        assert checks["opset"] <= 20
        assert set(checks["ops"]) <= trt10_supported_ops(), graph


def test_row_offset_alignment_arithmetic():
    from runtime.backends.base import ADDRESS_ALIGNMENT, Buffer, is_aligned

    # Qwen3 (8 KV heads x 128, fp16): 2048-byte rows, every row offset is aligned: always in place.
    qwen = Buffer(np.float16, 4096 * 8 * 128, (8, 128))
    assert all(is_aligned(qwen.rows(p, 1)) for p in range(0, 4096, 7))
    # Tiny target (2 x 24, fp32): 192-byte rows, aligned exactly when P % 4 == 0.
    tiny = Buffer(np.float32, 64 * 2 * 24, (2, 24))
    assert [p for p in range(12) if is_aligned(tiny.rows(p, 1))] == [0, 4, 8]
    assert tiny.rows(5, 3).byte_offset == 5 * 192 and ADDRESS_ALIGNMENT == 256
    # SmolLM2-135M (3 KV heads x 64, fp32): 768-byte rows, aligned when P % 1 == 0 (768 = 3 * 256).
    smol = Buffer(np.float32, 16 * 3 * 64, (3, 64))
    assert all(is_aligned(smol.rows(p, 1)) for p in range(16))
    with pytest.raises(IndexError):
        tiny.rows(63, 2)


def _hybrid_manifest(S: int = 4096, block: int = 16) -> dict:
    """A minimal hybrid (Qwen3.5) manifest: GDN layer 0, attention layer 1 (so past_key_1, no past_key_0)."""
    t_in = [{"name": "input_ids", "shape": ["new_tokens"]}, {"name": "draft_hidden", "shape": ["proposals", 64]},
            {"name": "temperature", "shape": [1]}, {"name": "uniform", "shape": ["sampled_rows"]},
            {"name": "conv_state_0", "shape": [3, 128]}, {"name": "recurrent_state_0", "shape": [4, 16, 16]},
            {"name": "pending_qkv_0", "shape": ["pending_rows", 128]}, {"name": "pending_a_0", "shape": ["pending_rows", 4]},
            {"name": "pending_b_0", "shape": ["pending_rows", 4]},
            {"name": "past_key_1", "shape": ["past_len", 2, 32]}, {"name": "past_value_1", "shape": ["past_len", 2, 32]}]
    t_out = [{"name": "next_ids", "shape": ["proposals + 1"]}, {"name": "qkv_0", "shape": ["proposals + new_tokens", 128]},
             {"name": "recurrent_state_out_0", "shape": [4, 16, 16]}, {"name": "key_1", "shape": ["proposals + new_tokens", 2, 32]}]
    d_in = [{"name": "context_hidden", "shape": ["context_len", 128]}, {"name": "block_embeddings", "shape": ["block_size", 64]},
            {"name": "past_key_0", "shape": ["past_context_len", 2, 32]}]
    return {"max_seq_len": S, "draft": {"block_size": block},
            "target": {"layer_types": ["linear_attention", "full_attention"], "max_call_rows": 64},
            "io": {"target": {"inputs": t_in, "outputs": t_out}, "draft": {"inputs": d_in, "outputs": []}}}


@pytest.mark.parametrize("max_block_size", [None, 128])
def test_hybrid_profiles_bound_rows_per_call(max_block_size):
    """Hybrid targets: static state shapes, pending rows (0 at prefill, up to max_call_rows otherwise),
    T + N <= max_call_rows at every profile corner (also with engines built for a larger block), the
    row limit found through the first attention layer's past_key_1. (The tiny hybrid artifact through
    the engine builder and backend: tests/test_trt_hybrid_double.py.)"""
    from runtime.errors import DFlashError
    from runtime.backends.profiles import call_row_limit, select_profile, shape_ranges

    m = _hybrid_manifest()
    ranges = shape_ranges(m, max_block_size)
    target = {p.name: p for p in ranges["target"]}
    for p in target.values():
        assert p.shapes["conv_state_0"] == ((3, 128),) * 3 and p.shapes["recurrent_state_0"] == ((4, 16, 16),) * 3
        assert p.shapes["input_ids"][2][0] + p.shapes["draft_hidden"][2][0] <= 64 and p.shapes["uniform"][2][0] <= 64
        assert p.shapes["pending_a_0"][2] == (p.shapes["pending_qkv_0"][2][0], 4)
    assert target["prefill"].shapes["pending_qkv_0"] == ((0, 128),) * 3 and target["prefill"].dims["past_len"] == (0, 0, 0)
    assert target["verify"].dims["pending_rows"] == (0, 8, 64) and target["verify"].dims["proposals"] == (0, 15, 63)
    assert target["extend"].dims["pending_rows"] == (0, 64, 64) and target["extend"].dims["new_tokens"] == (1, 64, 64)
    assert target["prefill"].dims["new_tokens"] == (1, 64, 64)
    assert call_row_limit(ranges["target"], "target") == 64 and call_row_limit(ranges["draft"], "draft") == 256
    shapes = lambda t, n, p, r: {"input_ids": (t,), "draft_hidden": (n, 64), "temperature": (1,), "uniform": (n + 1,),  # noqa: E731
                                 "conv_state_0": (3, 128), "recurrent_state_0": (4, 16, 16), "pending_qkv_0": (r, 128),
                                 "pending_a_0": (r, 4), "pending_b_0": (r, 4), "past_key_1": (p, 2, 32), "past_value_1": (p, 2, 32)}
    names = [p.name for p in ranges["target"]]
    assert names[select_profile(ranges["target"], shapes(64, 0, 0, 0), "target")] == "prefill"
    assert names[select_profile(ranges["target"], shapes(1, 63, 100, 0), "target")] == "verify"  # R = 0 after a cut-back
    assert names[select_profile(ranges["target"], shapes(64, 0, 64, 64), "target")] == "extend"
    for bad in (shapes(65, 0, 0, 0), shapes(1, 64, 100, 5), shapes(1, 3, 100, 65), shapes(5, 0, 0, 3)):
        with pytest.raises(DFlashError, match="no optimization profile"):
            select_profile(ranges["target"], bad, "target")
    del m["target"]["max_call_rows"]
    with pytest.raises(DFlashError, match="max_call_rows"):
        shape_ranges(m)
