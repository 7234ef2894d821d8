"""The TensorRT backend's and engine builder's OWN code, run against a TEST DOUBLE of TensorRT and CUDA
(`tests/trt_doubles.py`).

THIS IS NOT TENSORRT VERIFICATION. The doubles implement only the few TensorRT Python calls that
dflash_export/trt/engine.py and runtime/backends/trt.py make (both are written against TensorRT's
documented Python API, 10.3 through 11.x, and have run only through this double here). What this does
check: profile derivation and selection (the double refuses input shapes outside the active profile, as
TensorRT does, and a profile that lacks a dynamic input or contradicts a static dim of the ONNX graph),
256-byte address alignment (the double refuses misaligned addresses, as TensorRT does) and the
scratch-and-copy path, that only device pointers are bound and copies go in the declared direction, the
manifest's "trt" section and its atomic update, the precision plan, and the version/GPU refusal. Real
engines are checked by scripts/gpu_check.sh on a machine with a GPU and TensorRT. Hybrid (Qwen3.5)
artifacts through the same double: tests/test_trt_hybrid_double.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from test_profiles import tiny_artifact
from trt_doubles import GPU, FakeTensorRT, doubles  # noqa: F401 - `doubles` is a fixture


# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A copy of the tiny fp32 artifact with fake "engines" built by dflash_export.trt.engine.build_engines."""
    from dflash_export.trt.engine import build_engines

    src = tiny_artifact(tmp_path_factory)
    out = tmp_path_factory.mktemp("trt_double") / "artifact"
    shutil.copytree(src, out)
    fake = FakeTensorRT("10.3.0.30")
    manifest = build_engines(out, precision="fp32", trt=fake, gpu=GPU, quiet=True)
    return out, manifest, fake


# ---- tests --------------------------------------------------------------------------------------------
def test_build_engines_records_profiles_and_device(engines):
    from runtime.backends.profiles import profiles_to_json, shape_ranges
    from runtime.manifest import load_manifest

    out, manifest, fake = engines
    assert load_manifest(out) == manifest  # written, atomically, and still a valid manifest
    t = manifest["trt"]
    assert t["tensorrt_version"] == "10.3.0.30" and t["gpu"] == GPU and t["precision"] == "fp32"
    assert t["profiles"] == profiles_to_json(shape_ranges(manifest))
    assert [p["name"] for p in t["profiles"]["target"]] == ["prefill", "verify", "extend"]
    assert (out / "target.plan").is_file() and (out / "draft.plan").is_file() and (out / "timing.cache").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left
    rec = {Path(r["onnx"]).name: r for r in fake.built}
    assert rec["target.onnx"]["profiles"][0]["past_key_0"] == [[0, 2, 24]] * 3  # prefill: empty past
    assert "TF32" not in rec["target.onnx"]["flags"] and not rec["target.onnx"]["strongly_typed"]


def test_generate_matches_onnxruntime_through_the_double(engines, doubles):
    import runtime

    out, _, _ = engines
    ort_sess = runtime.load(out)
    trt_sess = runtime.load(out, backend="trt")
    assert type(trt_sess.backend).__name__ == "TrtBackend"
    prompt = [5, 17, 33, 8, 61]
    for kw in (dict(max_new_tokens=30), dict(max_new_tokens=10, block_size=1), dict(max_new_tokens=25, temperature=0.9, seed=4),
               dict(max_new_tokens=40, block_size=16)):
        verify = None if kw.get("block_size") == 1 else "all"  # auto's choices depend on each backend's timings
        a = ort_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len=verify, **kw)
        b = trt_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len=verify, **kw)
        assert b.output_ids == a.output_ids and b.acceptance_lengths == a.acceptance_lengths and b.steps == a.steps, kw
    for kw in (dict(max_new_tokens=30), dict(max_new_tokens=25, temperature=0.9, seed=4)):  # verify trees
        a = ort_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len="2+3", **kw)
        b = trt_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len="2+3", **kw)
        assert b.output_ids == a.output_ids and b.steps == a.steps, kw
        assert max(len(s["proposed"]) for s in b.steps) == 5  # tree steps ran (2 + 3 nodes)
    # KV reuse: the new rows of a prompt extending the cached one go through the "extend" profile
    longer = prompt + a.output_ids[:5] + [9, 10, 11]
    a2 = ort_sess.generate(longer, stop_token_ids=[], max_new_tokens=12, verify_len="all", reuse_prefix=False)
    b2 = trt_sess.generate(longer, stop_token_ids=[], max_new_tokens=12, verify_len="all")
    assert b2.reused_tokens == len(prompt) + 5 and b2.output_ids == a2.output_ids
    # the default policy measures the double's step costs and still gives the target's output
    auto = trt_sess.generate(prompt, stop_token_ids=[], max_new_tokens=30)
    assert auto.policy == "auto" and auto.output_ids == ort_sess.generate(prompt, stop_token_ids=[], max_new_tokens=30, block_size=1).output_ids
    stats = trt_sess.backend.stats
    assert stats["direct"] > 0 and stats["scratch"] > 0  # both binding paths ran (192-byte K/V rows)
    cuda = doubles["cuda"]
    assert cuda.copies[3] > 0 and cuda.copies[2] > 0  # device->device (scratch, anchor) and device->host (ids)
    ctx = {c._graph(): c for c in doubles["trt"].contexts}
    assert ctx["target"].switches >= 2 and ctx["draft"].switches >= 2  # prefill <-> verify, first draft <-> step
    trt_sess.backend.close()
    assert not cuda.blocks  # every device buffer freed


def test_reads_move_only_token_ids_to_the_host(engines, doubles):
    import runtime

    out, _, _ = engines
    sess = runtime.load(out, backend="trt")
    reads = []
    inner = sess.backend.read
    sess.backend.read = lambda view: reads.append(view.buffer.dtype) or inner(view)
    sess.generate([5, 17, 33], max_new_tokens=20, stop_token_ids=[])
    assert reads and set(reads) == {np.dtype(np.int64)}


def test_engines_from_another_tensorrt_or_gpu_are_refused(engines, doubles):
    import runtime
    from runtime.errors import DFlashError

    out, _, _ = engines
    doubles["trt"] = FakeTensorRT("10.13.3.9")
    with pytest.raises(DFlashError, match=r"TensorRT 10\.3\.0\.30 .*this machine has TensorRT 10\.13\.3\.9.*rebuild them on this device"):
        runtime.load(out, backend="trt")
    doubles["trt"] = FakeTensorRT("10.3.0.30")
    doubles["gpu"] = {"name": "NVIDIA Thor", "compute_capability": "11.0"}
    with pytest.raises(DFlashError, match=r"this GPU is NVIDIA Thor .*rebuild them on this device"):
        runtime.load(out, backend="trt")


def test_artifact_without_engines_is_refused(tmp_path_factory, doubles):
    import runtime
    from runtime.errors import DFlashError

    with pytest.raises(DFlashError, match=r"no TensorRT engines.*dflash_export engine"):
        runtime.load(tiny_artifact(tmp_path_factory), backend="trt")


def test_weakly_typed_fp16_pins_fc_and_norms(tmp_path, tmp_path_factory):
    from dflash_export.trt.engine import build_engines

    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact(tmp_path_factory), out)
    fake = FakeTensorRT("10.3.0.30")
    manifest = build_engines(out, precision="fp16", trt=fake, gpu=GPU, quiet=True)
    rec = {Path(r["onnx"]).name: r for r in fake.built}
    assert set(rec["draft.onnx"]["flags"]) == {"FP16", "OBEY_PRECISION_CONSTRAINTS"}
    assert manifest["trt"]["builder_flag"] == "FP16" and not manifest["trt"]["strongly_typed"]
    assert manifest["trt"]["build"]["draft"]["fp32_pinned_layers"] > 0
    assert any(name.startswith("linear") for name in rec["draft.onnx"]["pinned"])  # the draft's fc


def test_tensorrt11_refuses_fp32_graphs_for_fp16_and_failed_builds_change_nothing(tmp_path, tmp_path_factory):
    from dflash_export.trt.engine import build_engines
    from runtime.errors import DFlashError

    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact(tmp_path_factory), out)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(DFlashError, match=r"strongly typed networks only.*--dtype fp16"):
        build_engines(out, precision="fp16", trt=FakeTensorRT("11.0.0"), gpu=GPU, quiet=True)
    with pytest.raises(DFlashError, match="could not build draft.plan"):
        build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0", fail_graph="draft.onnx"), gpu=GPU, quiet=True)
    assert (out / "manifest.json").read_bytes() == before
    assert not (out / "target.plan").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]
    m = build_engines(out, precision="fp32", trt=FakeTensorRT("11.0.0"), gpu=GPU, quiet=True)
    assert m["trt"]["strongly_typed"]


def test_check_runs_engines_through_the_backend(engines, doubles):
    """`check --backend trt` drives the TrtBackend (here: the double) like the loop does: K/V rows at
    row P = 13 (13 * 192 bytes is not 256-aligned, so through scratch)."""
    from dflash_export.check.parity import run_check

    out, _, _ = engines
    rep = run_check(out, backend="trt")
    assert rep.passed and rep.precision == "fp32" and len(rep.results) == 36


@pytest.mark.parametrize("proposing", [False, pytest.param(True, marks=pytest.mark.slow)],  # (slow: a proposing build)
                         ids=["hidden-rows", "proposing-draft"])
def test_accepted_blocks_through_the_double(tmp_path_factory, doubles, proposing):
    """A pair that accepts whole blocks (the context-free pair) through the TensorRT path: the engines'
    verify profile, the scratch bindings and the one-read ids commit every accepted proposal; also
    where the draft ends in the proposal head (its [R, 4] outputs, the target's `proposal_ids`)."""
    import runtime_fixtures as rf

    import runtime
    from dflash_export.trt.engine import build_engines

    pair = rf.proposing_artifact("ctxfree", tmp_path_factory) if proposing else rf.artifact("ctxfree", tmp_path_factory)
    out = tmp_path_factory.mktemp("trt_double_blocks") / "artifact"
    shutil.copytree(pair.artifact, out)
    build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True)
    m = pair.mask_id
    with runtime.load(out, backend="trt") as sess:
        assert sess.draft_proposes == proposing
        res = sess.generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len="all")
    assert res.output_ids == [m] * 14
    assert res.acceptance_lengths == rf.expected_acceptance(14, pair.block_size) and max(res.acceptance_lengths) == pair.block_size
    assert not doubles["cuda"].blocks  # closed: every device buffer freed
    if proposing:  # check through the engines: greedy cases get uniforms (TensorRT needs them), ids by rank margin
        from dflash_export.check.parity import run_check

        rep = run_check(out, backend="trt")
        assert rep.passed and {(r.case, r.output) for r in rep.results} >= {("draft_step", "draft_top_ids"),
                                                                            ("verify", "next_ids")}
