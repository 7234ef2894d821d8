"""TensorRT engines and backend for a HYBRID (Qwen3.5, Gated DeltaNet) artifact, through the TEST DOUBLE.

THIS IS NOT TENSORRT VERIFICATION: dflash_export/engine.py and runtime/trt_backend.py are written
against TensorRT's documented Python API (10.3 through 11.x) and run here only against
`FakeTensorRT` / `FakeCuda` (tests/trt_doubles.py), which execute the "engines" with
onnxruntime on their ONNX graphs. What this checks for hybrids: `build_engines` writes profiles for
the state and pending-row inputs (static state shapes, pending rows 0 at prefill and up to
max_call_rows otherwise, T + N <= max_call_rows at every corner, the attention layer's K/V under its
model layer index) and the double accepts them (every dynamic input present, static dims as in the
ONNX graph); `runtime.load(..., backend="trt")` gives onnxruntime's ids for plain decoding, verify-all
speculative decoding (the untrained draft, and an oracle draft whose blocks are accepted whole and
rejected part-way, so the state rolls back through the backend), seeded sampling, a 150-token prompt
fed in 64-row chunks and a reused prefix; every call's shapes lie in one profile and the double's
context (which refuses shapes outside its active profile) accepted them; the recurrent state is bound
as fp32 and a dtype mismatch is refused. Not checked: TensorRT itself (kernels, zero-length tensors on
a device, fp16 numerics), and fp16 hybrid engines (an fp16 export would double this file's build
time; the strongly typed path is the Qwen3 one, with IO dtypes read from the engine).

The hybrid artifact is built once per session (`hybrid_pair`, tests/hybrid_fixtures.py).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from trt_doubles import GPU, FakeTensorRT, doubles  # noqa: F401 - `doubles` is a fixture

from hybrid_fixtures import VOCAB, oracle_draft
from test_profiles import _record  # records each backend call's input/output shapes

PROMPT = [5, 17, 33, 8, 61, 2, 99, 14]

# the hybrid build (half a minute on AVX2): `make test` runs these, `make test-fast` leaves them out
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hybrid(hybrid_pair, tmp_path_factory):
    """(artifact with fake fp32 engines, its manifest, the FakeTensorRT that built them): a copy of the
    session's tiny random Qwen3.5 artifact (`hybrid_fixtures`, the attention layer is layer 3, so there
    is no past_key_0) with engines built through the double."""
    from dflash_export.trt.engine import build_engines

    out = tmp_path_factory.mktemp("trt_hybrid") / "engines"
    shutil.copytree(hybrid_pair.artifact, out)
    fake = FakeTensorRT("10.3.0.30")
    manifest = build_engines(out, precision="fp32", trt=fake, gpu=GPU, quiet=True)
    return out, manifest, fake


def test_hybrid_engines_build_with_state_and_pending_row_profiles(hybrid):
    from runtime.errors import DFlashError
    from runtime.backends.profiles import call_row_limit, profiles_to_json, shape_ranges

    out, manifest, fake = hybrid
    t = manifest["trt"]
    ranges = shape_ranges(manifest)
    assert t["profiles"] == profiles_to_json(ranges)
    assert [p["name"] for p in t["profiles"]["target"]] == ["prefill", "verify", "extend"]
    rows = manifest["target"]["max_call_rows"]
    assert rows == 64
    built = {r["onnx"].rsplit("/", 1)[-1]: r["profiles"] for r in fake.built}["target.onnx"]
    prefill, verify, extend = built
    for prof in built:
        assert "past_key_0" not in prof and prof["past_key_3"][0][1:] == [2, 32]
        for i in range(3):  # GDN layers 0-2: static states, pending rows as the profile says
            assert prof[f"conv_state_{i}"] == [[3, 128]] * 3 and prof[f"recurrent_state_{i}"] == [[4, 16, 16]] * 3
            assert prof[f"pending_a_{i}"][2] == [prof[f"pending_qkv_{i}"][2][0], 4]
        t_max, n_max = prof["input_ids"][2][0], prof["draft_hidden"][2][0]
        assert t_max + n_max <= rows and prof["pending_qkv_0"][2][0] <= rows and prof["uniform"][2][0] <= rows
    assert prefill["pending_qkv_0"] == [[0, 128]] * 3 and prefill["past_key_3"][2][0] == 0  # P = 0 <=> R = 0
    assert prefill["input_ids"][2] == [64]
    assert verify["pending_qkv_0"][0] == [0, 128] and verify["pending_qkv_0"][2] == [64, 128]
    assert verify["draft_hidden"][2] == [63, 64] and verify["input_ids"] == [[1]] * 3
    assert extend["pending_qkv_0"][2] == [64, 128] and extend["input_ids"][2] == [64]
    assert call_row_limit(ranges["target"], "target") == 64  # found via past_key_3
    # fp32 hybrid graphs make no weakly typed fp16 engines (the delta rule would run in fp16); fp16
    # graphs build strongly typed (the exported fp32 islands and fp32 state IO kept), fp32 as fp32
    from dflash_export.trt.engine import precision_plan

    assert precision_plan("10.3.0.30", "fp16", "fp16", hybrid=True)["strongly_typed"]
    assert precision_plan("10.3.0.30", "fp32", "fp32", hybrid=True)["flag"] is None
    assert manifest["trt"]["builder_flag"] is None and not manifest["trt"]["strongly_typed"]  # TensorRT 10 fp32
    for version, precision in (("10.3.0.30", "fp16"), ("10.13.3", "bf16"), ("11.0.0", "fp16")):
        with pytest.raises(DFlashError, match=r"hybrid .*--dtype fp16"):
            precision_plan(version, "fp32", precision, hybrid=True)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(DFlashError, match=r"hybrid .*--dtype fp16"):
        from dflash_export.trt.engine import build_engines

        build_engines(out, precision="fp16", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True)
    assert (out / "manifest.json").read_bytes() == before


def test_generate_matches_onnxruntime_through_the_double(hybrid, doubles):  # noqa: F811
    import runtime
    from runtime.backends.profiles import output_shapes, select_profile, shape_ranges

    out, manifest, _ = hybrid
    ort_sess, trt_sess = runtime.load(out), runtime.load(out, backend="trt")
    assert type(trt_sess.backend).__name__ == "TrtBackend"
    assert trt_sess.backend.max_call_rows("target") == 64
    calls = _record(trt_sess)
    kw = dict(stop_token_ids=[], reuse_prefix=False)
    cases = [
        dict(prompt=PROMPT, max_new_tokens=20, block_size=1),  # plain decoding: verify with N = 0
        dict(prompt=PROMPT, max_new_tokens=30, verify_len="all"),  # untrained draft, block 16: N = 15
        dict(prompt=PROMPT, max_new_tokens=16, verify_len="all", block_size=64),  # T + N = 64
        dict(prompt=PROMPT, max_new_tokens=20, verify_len="all", temperature=0.8, seed=3),
        # 150 rows: prefill 64, then two "extend" calls of 64 + 22 folding 64 pending rows each
        dict(prompt=np.random.default_rng(1).integers(0, VOCAB, 150).tolist(), max_new_tokens=10, verify_len="all"),
    ]
    plain = None
    for case in cases:
        prompt = case.pop("prompt")
        a = ort_sess.generate(prompt, record_steps=True, **kw, **case)
        b = trt_sess.generate(prompt, record_steps=True, **kw, **case)
        assert b.output_ids == a.output_ids and b.acceptance_lengths == a.acceptance_lengths, case
        plain = plain or a.output_ids
    # accepted and part-rejected blocks: the recurrent state rolls back through the TensorRT path
    reference = PROMPT + ort_sess.generate(PROMPT, max_new_tokens=40, block_size=1, **kw).output_ids
    for sess in (ort_sess, trt_sess):
        oracle_draft(sess, reference, 0.2)
    a = ort_sess.generate(PROMPT, max_new_tokens=40, verify_len="all", record_steps=True, **kw)
    b = trt_sess.generate(PROMPT, max_new_tokens=40, verify_len="all", record_steps=True, **kw)
    assert b.output_ids == a.output_ids and b.output_ids[:20] == plain
    accepted = [(s["accepted"], len(s["proposed"])) for s in b.steps if s["proposed"]]
    assert max(acc for acc, _ in accepted) >= 2 and any(acc < n for acc, n in accepted)
    # a follow-up extending the cached context reuses KV rows and the state with its pending rows
    follow = PROMPT + b.output_ids + [7, 9]
    b2 = trt_sess.generate(follow, max_new_tokens=8, stop_token_ids=[], block_size=1)
    assert b2.reused_tokens > 0
    assert b2.output_ids == ort_sess.generate(follow, max_new_tokens=8, block_size=1, **kw).output_ids

    # every call lies in one profile (the backend selected it; the double's context accepted its shapes)
    ranges = shape_ranges(manifest)
    used = set()
    for graph, ins, outs in calls:
        used.add((graph, ranges[graph][select_profile(ranges[graph], ins, graph)].name))
        want = output_shapes(manifest, graph, ins)
        want.pop("logits", None)
        assert want == outs, (graph, ins)
        if graph == "target":
            assert ins["input_ids"][0] + ins["draft_hidden"][0] <= 64 and ins["pending_qkv_0"][0] <= 64
            if ins["past_key_3"][0] == 0:  # an empty context has no pending rows
                assert ins["pending_qkv_0"][0] == 0
    assert {p for g, p in used if g == "target"} == {"prefill", "verify", "extend"}
    target_calls = [ins for g, ins, _ in calls if g == "target"]
    assert max(c["pending_qkv_0"][0] for c in target_calls) == 64  # the chunked prompt's folds
    assert any(c["input_ids"][0] + c["draft_hidden"][0] == 64 for c in target_calls)  # block 64
    ctx = {c._graph(): c for c in doubles["trt"].contexts}
    names = [p.name for p in trt_sess.backend.profiles["target"]]
    seen = {(names[p], shapes["pending_qkv_2"][0]) for p, shapes in ctx["target"].history}
    assert ("prefill", 0) in seen and ("extend", 64) in seen and ctx["target"].runs == len(target_calls)
    # the states were bound in place as fp32 whole buffers, outputs in the other set
    rec = trt_sess.recurrent
    rec_in = rec.states[rec.current][0][1]
    assert rec_in.dtype == np.float32 and trt_sess.backend.io_dtypes["target"]["recurrent_state_0"] == np.float32
    assert ctx["target"].addresses["recurrent_state_out_0"] != ctx["target"].addresses["recurrent_state_0"]
    trt_sess.backend.close()
    assert not doubles["cuda"].blocks


def test_shapes_outside_the_profiles_are_refused(hybrid, doubles, monkeypatch):  # noqa: F811
    """The backend refuses a call no profile covers (T = 2 with N = 62 proposals: within the 64 rows,
    but verify takes T = 1 and prefill/extend N = 0), and the double refuses, as TensorRT does, shapes
    outside the ACTIVE profile even when the backend's own selection is bypassed."""
    import runtime
    import runtime.backends.trt as tb
    from runtime.errors import DFlashError

    out, _, _ = hybrid
    sess = runtime.load(out, backend="trt")
    sess.backend.write(sess.input_ids.rows(0, 1), np.array([5], np.int64))
    with pytest.raises(DFlashError, match=r"no optimization profile .*pending rows"):
        sess.run_target(2, 62, 0)
    ctx = next(c for c in doubles["trt"].contexts if c._graph() == "target")
    assert not ctx.set_input_shape("pending_qkv_0", (65, 128)) and not ctx.set_input_shape("conv_state_0", (4, 128))
    monkeypatch.setattr(tb, "select_profile", lambda profiles, shapes, graph: 0)  # always "prefill"
    sess.run_target(3, 0, 0)  # a prefill call fits it
    sess.commit_target_rows(3)
    with pytest.raises(DFlashError, match="TensorRT refused shape"):
        sess.run_target(1, 0, 3)  # past 3 and 3 pending rows: outside the prefill profile
    sess.backend.close()


def test_recurrent_state_dtype_is_checked(hybrid, doubles, monkeypatch):  # noqa: F811
    """An engine whose recurrent state is not fp32 (the manifest's dtype) is refused at load, and a
    buffer of another dtype bound to it is refused before the engine runs."""
    import runtime
    import trt_doubles as d
    from runtime.errors import DFlashError

    out, _, _ = hybrid
    sess = runtime.load(out, backend="trt")
    rec = sess.recurrent
    half = sess.backend.alloc(np.float16, 4, (16, 16))
    rec.states[rec.current][0] = (rec.states[rec.current][0][0], half)
    sess.backend.write(sess.input_ids.rows(0, 1), np.array([5], np.int64))
    with pytest.raises(DFlashError, match=r"recurrent_state_0: the engine takes float32, the runtime bound float16"):
        sess.run_target(1, 0, 0)
    sess.backend.close()
    real = d.FakeEngine.get_tensor_dtype
    monkeypatch.setattr(d.FakeEngine, "get_tensor_dtype",
                        lambda self, n: np.dtype(np.float16) if n.startswith("recurrent_state") else real(self, n))
    with pytest.raises(DFlashError, match=r"engine IO .*recurrent_state_0.*does not match"):
        runtime.load(out, backend="trt")


def test_check_runs_hybrid_engines_through_the_backend(hybrid, doubles):  # noqa: F811
    """`check --backend trt`: the hybrid cases (the verify case folds the prefill's rows as pending
    rows) through the TrtBackend on the double, against the fp32 PyTorch modules."""
    from dflash_export.check.parity import run_check

    out, _, _ = hybrid
    rep = run_check(out, backend="trt")
    assert rep.passed, [r for r in rep.results if not r.passed]
    assert {"recurrent_state_out_0", "qkv_2", "key_3"} <= {r.output for r in rep.results}
