"""INT4 weight-only targets (issue 12): the graph form, parity with the dequantized PyTorch modules,
onnxruntime's MatMulNBits fusion, lossless speculative decoding, and bad input."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import runtime
import runtime_fixtures as rf
import tiny_models
from dflash_export.build import BuildOptions, build
from shared_cache import shared_dir
from dflash_export.check.parity import run_check
from dflash_export.export.checks import check_graph
from dflash_export.quant.int4 import pack_int4, unpack_int4
from dflash_export.quant.rtn import dequantize, quantize_rtn
from int4_fusion import assert_int4_fused
from runtime.errors import DFlashError
from runtime.manifest import draft_proposes

LINEARS = 7  # q, k, v, o, gate, up, down per decoder layer
GEMMS = 4  # per layer in the graph: q+k+v and gate+up are packed (graph_passes.py)


PAIR_KINDS = (("qwen3", "qwen3", False), ("qwen3_tied", "qwen3", True), ("llama", "llama", False))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Tiny targets (head_dim 24 != 64 / 4 heads, GQA 4:2): Qwen3 untied, Qwen3 tied, Llama untied
    (made once per test run, shared by the xdist workers: read-only)."""

    def make(root):
        for kind, family, tie in PAIR_KINDS:
            t = tiny_models.make_target(root / kind / "target", family=family, tie=tie, layers=3)
            tiny_models.make_draft(root / kind / "draft", t, taps=[0, 2])

    root = shared_dir(tmp_path_factory, "int4_pairs", make)
    return {kind: (root / kind / "target", root / kind / "draft") for kind, _, _ in PAIR_KINDS}


@pytest.fixture(scope="module")
def int4_art(pairs, tmp_path_factory):
    """`int4_art(kind, dtype="fp32", lm_head=False)`: the INT4 (block 16) build of `pairs[kind]` at max_seq_len 64,
    built once per test run for every test that needs that same build (read-only: copy it to change it).
    `int4_art(kind, quant=None)`: the full-precision build of the same pair."""

    def get(kind, dtype="fp32", lm_head=False, quant="int4"):
        target, draft = pairs[kind]
        opts = dict(quant="int4", quant_block=16, quant_lm_head=lm_head) if quant == "int4" else {}
        name = f"int4_art_{kind}_{dtype}_{quant}_{'head' if lm_head else 'nohead'}"
        return shared_dir(tmp_path_factory, name, lambda d: build(BuildOptions(
            str(target), str(draft), d / "art", max_seq_len=64, dtype=dtype, quiet=True, **opts))) / "art"

    return get


# `make test` checks the untied fp32 form and a tied table with an INT4 head; the other four (a build
# each, or a check of a build a fast test reuses) run in `make test-nightly`
@pytest.mark.slow  # two INT4 builds; fast: test_runtime_defaults_to_int8_activations_only_where_rows_are_exact
@pytest.mark.parametrize("kind, dtype, lm_head", [("qwen3", "fp32", False),
                                                  pytest.param("qwen3_tied", "fp32", False, marks=pytest.mark.nightly),
                                                  pytest.param("llama", "fp32", False, marks=pytest.mark.nightly),
                                                  pytest.param("qwen3", "fp16", False, marks=pytest.mark.nightly),
                                                  pytest.param("qwen3", "fp32", True, marks=pytest.mark.nightly),
                                                  ("qwen3_tied", "fp32", True)])
def test_int4_graph_form_and_parity_with_dequantized_modules(int4_art, tmp_path, kind, dtype, lm_head):
    art = int4_art(kind, dtype, lm_head)  # the build `build(... quant="int4", quant_block=16, quant_lm_head=lm_head)`
    manifest = json.loads((art / "manifest.json").read_text())
    q = manifest["quantization"]
    head = "model.embed_tokens.weight" if kind == "qwen3_tied" else "lm_head.weight"
    assert (q["method"], q["block"], q["quantized_tensors"], q["lm_head"]) == ("rtn", 16, 3 * LINEARS + lm_head, lm_head)
    assert q["head"] == (head if lm_head else None)
    model = onnx.load(str(art / "target.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    gemms = [n for n in model.graph.node if n.op_type == "Gemm"]
    # an INT4 head is used once per graph (onnxruntime fuses only a DequantizeLinear whose INT4 values have
    # one consumer): the target's logits; the draft ends in its own proposal head (the target takes ids)
    assert len(dqs) == 3 * GEMMS + lm_head
    assert manifest["graph_checks"]["target"] == {**manifest["graph_checks"]["target"], "opset": 21,
                                                  "int4_weights": 3 * GEMMS + lm_head}
    assert draft_proposes(manifest) == lm_head
    assert [g.input[1] for g in gemms] == ([] if lm_head else [head, head])
    assert (head in inits) == (not lm_head or kind == "qwen3_tied")  # a tied table stays for the token lookups
    users = {i: n for n in model.graph.node for i in n.input}
    for dq in dqs:
        values, scale = inits[dq.input[0]], inits[dq.input[1]]
        assert values.data_type == TensorProto.INT4 and len(dq.input) == 2  # signed, no zero point
        k, n = values.dims
        assert list(scale.dims) == [k // 16, n] and (numpy_helper.to_array(scale) > 0).all()
        assert scale.data_type == (TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT)
        assert {a.name: a.i for a in dq.attribute} == {"axis": 0, "block_size": 16}
        assert users[dq.output[0]].op_type == "MatMul" and list(users[dq.output[0]].input).index(dq.output[0]) == 1
    # the embedding (and the untied LM head) stay in the graph dtype; of the draft, only the last layer's
    # weights that run on the verified rows (q, o, MLP; gate+up packed) are INT4
    assert inits["model.embed_tokens.weight"].data_type == (TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.FLOAT)
    last = f"layers.{manifest['draft']['num_layers'] - 1}."
    want = [last + n for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                               "mlp.up_proj.weight", "mlp.down_proj.weight")]
    assert q["draft"] == {"method": "rtn", "block": 16, "tensors": want}
    ddqs = [n for n in onnx.load(str(art / "draft.onnx")).graph.node if n.op_type == "DequantizeLinear"]
    packed = f"{last}mlp.gate_proj.weight+{last}mlp.up_proj.weight"
    assert sorted(d.input[0] for d in ddqs) == sorted([f"{n}.int4" for n in [want[0], want[1], want[4], packed]]
                                                      + ["draft_head.int4"] * lm_head)
    assert manifest["graph_checks"]["draft"]["int4_weights"] == 4 + lm_head
    assert_int4_fused(art, tmp_path)
    rep = run_check(art)  # the tight tolerance of the graph dtype: the graph computes its dequantized model
    assert rep.passed, [r for r in rep.results if not r.passed]
    if dtype == "fp32":
        assert max(r.max_abs for r in rep.results if r.max_abs is not None) < 1e-4


@pytest.mark.slow  # INT4 builds (15 s on AVX2); fast: test_runtime_defaults_to_int8_activations_only_where_rows_are_exact
def test_onnxruntime_fuses_int4_weights_into_matmulnbits(int4_art, tmp_path):
    import onnxruntime as ort

    from runtime.backends.ort import _optimization_level, disabled_optimizers

    art = int4_art("qwen3")
    manifest = json.loads((art / "manifest.json").read_text())
    opts = ort.SessionOptions()
    opts.graph_optimization_level = _optimization_level(ort)  # the level and optimizers the runtime runs with
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(art / "target.onnx"), opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled_optimizers(manifest))
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    if int(_optimization_level(ort)) < int(ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED):
        pytest.skip(f"onnxruntime {ort.__version__} runs these graphs at the basic level: no MatMulNBits fusion")
    assert ops.count("MatMulNBits") == 3 * GEMMS and "DequantizeLinear" not in ops
    # the attention is split-invariant: a row computes the same floats as row 1 of a verify and as the
    # row of a (padded) plain step, at both accuracy levels; one-row calls differ by fp32 rounding at
    # most (`dflash_export.check.row_split`)
    assert manifest["target"]["row_exact"] is True
    from dflash_export.check.row_split import check

    for level in (1, 4):
        d = check(art, level=level, past_len=12, proposals=3)
        assert d["split_padded_logits"] == d["split_padded_keys"] == 0.0, (level, d)
        assert max(d.values()) < 1e-3, (level, d)


def test_runtime_defaults_to_int8_activations_only_where_rows_are_exact(int4_art, tmp_path):
    """INT4 artifacts with a row-exact target run MatMulNBits at level 4 (int8 activations) by default,
    others at level 1; the one-row probe decides padding, and speculative output equals plain output."""
    import shutil

    from runtime.graphs.row_exact import single_row_calls_match

    art = tmp_path / "art"  # a copy: its manifest is edited below
    shutil.copytree(int4_art("qwen3"), art)
    sess = runtime.load(art)
    assert (sess.backend.int4_accuracy_level, sess.backend.int8_activations) == (4, True)
    assert runtime.load(art, int4_accuracy_level=1).backend.int4_accuracy_level == 1
    with pytest.raises(DFlashError, match="int4_accuracy_level must be 1"):
        runtime.load(art, int4_accuracy_level=2)
    plain = sess.generate([3, 9, 27], max_new_tokens=20, stop_token_ids=[], block_size=1).output_ids
    assert sess.pad_single_rows == (not single_row_calls_match(sess))  # decided by the probe on first use
    assert sess.generate([3, 9, 27], max_new_tokens=20, stop_token_ids=[], verify_len="all").output_ids == plain
    sess.pad_single_rows = True  # padded plain steps give the same ids (the padding row is never read)
    assert sess.generate([3, 9, 27], max_new_tokens=20, stop_token_ids=[], block_size=1).output_ids == plain
    manifest_path = art / "manifest.json"  # an artifact without row_exact (older builds) keeps fp32 compute
    m = json.loads(manifest_path.read_text())
    # blocks above 32: MatMulNBits rounds a call's odd last row as a one-row call (measured at 64): fp32 compute
    manifest_path.write_text(json.dumps({**m, "quantization": {**m["quantization"], "block": 64}}))
    assert runtime.load(art).backend.int4_accuracy_level == 1
    del m["target"]["row_exact"]
    manifest_path.write_text(json.dumps(m))
    old = runtime.load(art)
    assert (old.backend.int4_accuracy_level, old.backend.int8_activations) == (1, False)
    old.generate([3, 9, 27], max_new_tokens=4, stop_token_ids=[])
    assert old.pad_single_rows is False  # no probe without int8 activations
    # fp16 graphs: onnxruntime's CPU fp16 operators round rows by call shape, so fp32 compute
    assert runtime.load(int4_art("qwen3", "fp16")).backend.int4_accuracy_level == 1


@pytest.mark.slow  # an INT4 build of the 4-layer pair; fast: speculative == plain in test_runtime_defaults_to_int8_...
def test_int4_speculative_equals_plain_with_accepted_blocks(tmp_path_factory, tmp_path):
    root = rf.checkpoints("qwen3", tmp_path_factory)
    art = tmp_path / "art"
    build(BuildOptions(str(root / "target"), str(root / "draft"), art, max_seq_len=64, quiet=True, quant="int4", quant_block=16))
    sess = runtime.load(art)
    prompt = [1, 17, 33, 5, 60]
    plain = sess.generate(prompt, max_new_tokens=40, stop_token_ids=[], block_size=1).output_ids
    rows = rf.token_rows(root / "target")
    for correct in (None, 3):
        spec = runtime.load(art)
        rf.Oracle(spec, rows, len(prompt), rf.follow(plain, correct=correct))
        res = spec.generate(prompt, max_new_tokens=40, stop_token_ids=[], verify_len="all")
        assert res.output_ids == plain
        assert res.acceptance_lengths == rf.expected_acceptance(40, 8, correct)
        assert max(res.acceptance_lengths) == (8 if correct is None else 4)


@pytest.mark.nightly  # a build; `make test`: the INT4 heads above
def test_int4_proposal_head_ranks_proposals_only(tmp_path_factory, tmp_path):
    """--proposal-head int4 on an fp32 artifact with a proposal vocabulary: only the proposal head rows
    (at the end of the draft graph, which proposes) become INT4 (one DequantizeLinear; block: the
    largest power of two <= 128 dividing the hidden size), the target graph has none, `check` passes
    against a reference ranking with the same dequantized rows, and output equals plain decoding with
    accepted blocks (the full-precision head verifies)."""
    import json
    import shutil

    root = rf.checkpoints("ctxfree", tmp_path_factory)
    m = rf.ctxfree_mask_id(root / "target")
    vocab_size = rf.lm_head_matrix(root / "target").shape[0]
    draft = tmp_path / "draft"
    shutil.copytree(root / "draft", draft)
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": [i for i in range(0, vocab_size, 3) if i != m] + [m]}))
    art = tmp_path / "art"
    manifest = build(BuildOptions(str(root / "target"), str(draft), art, max_seq_len=32, quiet=True, proposal_head="int4"))
    hidden = manifest["target"]["hidden_size"]
    block = max(b for b in (16, 32, 64, 128) if hidden % b == 0)
    assert manifest["proposal_head"] == {"format": "int4", "method": "rtn", "block": block} and "quantization" not in manifest
    dqs = {g: [n.input[0] for n in onnx.load(str(art / f"{g}.onnx")).graph.node if n.op_type == "DequantizeLinear"]
           for g in ("target", "draft")}
    assert dqs == {"target": [], "draft": ["draft_head.int4"]}
    rep = run_check(art)
    assert rep.passed, [r for r in rep.results if not r.passed]
    sess = runtime.load(art)
    plain = sess.generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], block_size=1)
    spec = sess.generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len="all")
    assert spec.output_ids == plain.output_ids == [m] * 14 and max(spec.acceptance_lengths) == manifest["draft"]["block_size"]


def test_rtn_round_trip_and_packing():
    rng = np.random.default_rng(0)
    import torch

    w = torch.from_numpy(rng.standard_normal((6, 64)).astype(np.float32))
    w[0, :32] = 0.0  # an all-zero block keeps a positive scale
    q, scale = quantize_rtn(w, 32, torch.float16)
    assert q.shape == (64, 6) and scale.shape == (2, 6) and scale.dtype == np.float16 and (scale > 0).all()
    assert q.min() >= -8 and q.max() <= 7
    np.testing.assert_array_equal(unpack_int4(pack_int4(q), q.shape), q)
    assert pack_int4(np.array([[1, -1], [-8, 7]], np.int8)).tolist() == [0xF1, 0x78]  # low nibble first
    deq = dequantize(q, scale, 32)
    assert deq.shape == (6, 64) and deq.dtype == torch.float16
    assert float((deq.float() - w).abs().max()) <= float(scale.astype(np.float32).max()) / 2 + 1e-3


@pytest.mark.parametrize("options, match", [
    (dict(quant_block=64), r"has 96 input features, which --quant-block 64 does not divide; use --quant-block 16 or 32 "
                           r"\(32 is the README's choice"),
    (dict(quant_block=24), r"--quant-block 24 must be a power of two >= 16"),
    (dict(quant_block=8), r"--quant-block 8 must be a power of two >= 16"),
    (dict(quant_method="gptq"), r"--quant-method 'gptq' is not supported \(supported: rtn, awq\)"),
    (dict(quant="int8"), r"--quant must be none or int4"),
])
def test_bad_quant_options_are_refused_before_any_output(pairs, tmp_path, options, match):
    target, draft = pairs["qwen3"]
    with pytest.raises(DFlashError, match=match):
        build(BuildOptions(str(target), str(draft), tmp_path / "art", max_seq_len=64, quiet=True, **{"quant": "int4", **options}))
    rf.no_partial_output(tmp_path / "art")


@pytest.mark.slow  # a build for the default block; runs in the full suite
def test_int4_without_a_block_takes_32_or_16(pairs, tmp_path, capsys):
    """`build --quant int4` alone works on every target: block 32, or 16 where 32 does not divide every
    quantized layer's K (a hidden size of 48 here), said on stderr."""
    target, draft = pairs["qwen3"]
    manifest = build(BuildOptions(str(target), str(draft), tmp_path / "art", max_seq_len=64, quant="int4"))
    assert manifest["quantization"]["block"] == 32
    assert "INT4 block 32 (the default; --quant-block overrides)" in capsys.readouterr().err
    from dflash_export.build import _checked_quant_config
    from dflash_export.quant.int4 import BlockMismatch

    class Family:  # a family whose layers 32 does not divide
        @staticmethod
        def check_options(tspec, taps, source, qconfig, proposal_head):
            if 48 % qconfig.block:
                raise BlockMismatch(f"K 48, block {qconfig.block}")

    assert _checked_quant_config(BuildOptions(quant="int4"), Family, None, types.SimpleNamespace(target_layer_ids=()),
                                 None).block == 16
    assert "INT4 block 16 (32 does not divide every quantized layer's K" in capsys.readouterr().err
    with pytest.raises(BlockMismatch, match="block 32"):
        _checked_quant_config(BuildOptions(quant="int4", quant_block=32), Family, None,
                              types.SimpleNamespace(target_layer_ids=()), None)


@pytest.mark.parametrize("options, named", [(dict(quant_block=32), "--quant-block"), (dict(quant_method="rtn"), "--quant-method"),
                                            (dict(quant_lm_head=True), "--quant-lm-head")])
def test_quant_options_without_int4_are_refused(pairs, tmp_path, options, named):
    target, draft = pairs["qwen3"]
    with pytest.raises(DFlashError, match=f"^{named} needs --quant int4$"):
        build(BuildOptions(str(target), str(draft), tmp_path / "art", max_seq_len=64, quiet=True, **options))
    rf.no_partial_output(tmp_path / "art")


def test_already_quantized_checkpoint_is_refused(pairs, tmp_path):
    import json
    import shutil

    target, draft = pairs["qwen3"]
    t = shutil.copytree(target, tmp_path / "t")
    cfg = json.loads((t / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (t / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match=r"is already quantized \(quantization_config: gptq\).*unquantized checkpoint"):
        build(BuildOptions(str(t), str(draft), tmp_path / "art", max_seq_len=64, quiet=True, quant="int4", quant_block=16))


# ---- the operator check accepts only the one form ------------------------------------------------------
def _dq_graph(tmp_path, *, values_type=TensorProto.INT4, zero_point=False, scale=None, axis=0, block=16,
              dims=(32, 8), consumer="MatMul", b_input=True):
    k, n = dims[0], dims[-1]
    count = int(np.prod(dims))
    inits = [helper.make_tensor("wq", values_type, list(dims), pack_int4(np.ones(count, np.int8)).tobytes()
                                if values_type in (TensorProto.INT4, TensorProto.UINT4) else np.ones(count, np.int8).tobytes(),
                                raw=True)]
    s = np.full((max(1, k // block), n), 0.5, np.float32) if scale is None else scale
    inits.append(numpy_helper.from_array(s, "ws"))
    inputs = ["wq", "ws"]
    if zero_point:
        inits.append(helper.make_tensor("wz", TensorProto.INT4, list(s.shape), pack_int4(np.zeros(s.size, np.int8)).tobytes(), raw=True))
        inputs.append("wz")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["wd"], axis=axis, block_size=block),
             helper.make_node(consumer, ["wd", "x"] if not b_input else ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path))
    return path


def test_check_graph_accepts_the_int4_form(tmp_path):
    assert check_graph(_dq_graph(tmp_path))["int4_weights"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(values_type=TensorProto.UINT4), "signed INT4"),
    (dict(values_type=TensorProto.INT8), "signed INT4"),
    (dict(zero_point=True), "zero point"),
    (dict(scale=np.zeros((2, 8), np.float32)), "strictly positive"),
    (dict(scale=-np.ones((2, 8), np.float32)), "strictly positive"),
    (dict(axis=1), "axis 1"),
    (dict(block=24), "block_size 24"),
    (dict(dims=(32, 2, 8)), "2-D"),
    (dict(scale=np.ones((1, 8), np.float32)), r"expected \[2, 8\]"),
    (dict(consumer="Add"), "exactly one MatMul as input B"),
    (dict(b_input=False), "exactly one MatMul as input B"),
])
def test_check_graph_refuses_other_dequantize_forms(tmp_path, kwargs, match):
    with pytest.raises(DFlashError, match=match):
        check_graph(_dq_graph(tmp_path, **kwargs))


def test_opset_21_without_int4_weights_is_refused(tmp_path):
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.save(model, str(tmp_path / "g.onnx"))
    with pytest.raises(DFlashError, match="opset 21 > 20 without INT4 weights"):
        check_graph(tmp_path / "g.onnx")


@pytest.mark.slow  # an INT4-head build (18 s on AVX2); fast: test_runtime_defaults_to_int8_activations_only_where_rows_are_exact
def test_a_head_that_rounds_by_row_count_is_not_amplified(int4_art):
    """An INT4 LM head shared by the logits and the proposals stays DequantizeLinear + MatMul (onnxruntime
    fuses a DequantizeLinear with one consumer only), and that MatMul may round one row differently from
    two (found by review: 4.8e-7 in logits). The head is the last operation, so that stays fp32 rounding:
    the probe compares what feeds int8 kernels (K/V rows, taps), its verdict agrees with a direct one-row
    vs two-row comparison of them at level 4, the logits differ by rounding only, and padded calls are
    exact."""
    from runtime.graphs.row_exact import single_row_calls_match

    from dflash_export.check.row_split import check

    art = int4_art("qwen3", lm_head=True)
    d = check(art, level=4, past_len=12, proposals=3)
    assert d["split_padded_logits"] == d["split_padded_keys"] == 0.0, d
    sess = runtime.load(art)
    assert single_row_calls_match(sess) == (d["padding_keys"] == 0.0), d
    if d["padding_keys"] == 0.0:
        assert d["padding_logits"] < 1e-4 and d["split_logits"] < 1e-4, d
    plain = sess.generate([3, 9, 27], max_new_tokens=20, stop_token_ids=[], block_size=1).output_ids
    assert sess.generate([3, 9, 27], max_new_tokens=20, stop_token_ids=[], verify_len="all").output_ids == plain


@pytest.mark.slow  # builds the fp32 pair too; runs in the full suite
def test_drift_from_the_full_precision_artifact(int4_art, tmp_path, capsys):
    """`dflash_export.check.drift`: an artifact against itself has agreement 1 and KL 0 exactly; the INT4 build
    of the same target drifts (KL > 0); `check --drift-reference` reports it, and a bad reference fails
    before the check runs."""
    from dflash_export import cli
    from dflash_export.check.drift import measure_drift, prompt_ids

    full, quant = int4_art("qwen3", quant=None), int4_art("qwen3")
    ref = runtime.load(full)
    prompts = prompt_ids(ref, Path(__file__).resolve().parents[1] / "models" / "prompts" / "eval.jsonl", 1)
    assert len(prompts) >= 3 and all(len(p) == 12 for p in prompts)  # no tokenizer: seeded id prompts
    same, int4 = measure_drift(ref, {"same": runtime.load(full), "int4": runtime.load(quant)}, prompts, 8)
    assert (same.top1_agreement, same.mean_kl, same.positions) == (1.0, 0.0, 8 * len(prompts))
    assert int4.mean_kl > 0 and 0 <= int4.top1_agreement <= 1 and int4.int4_accuracy_level == 4
    assert cli.main(["check", str(quant), "--drift-reference", str(full), "--drift-tokens", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["drift"]["positions"] == 8 * len(prompts)
    assert report["drift"]["mean_kl"] == pytest.approx(int4.mean_kl)
    for bad, message in ((["--drift-reference", str(tmp_path / "missing")], "--drift-reference: artifact directory"),
                         (["--drift-reference", str(quant)], "is an INT4 artifact"),
                         (["--drift-reference", str(full), "--drift-tokens", "0"], "--drift-tokens must be at least 1"),
                         (["--drift-tokens", "16"], "need --drift-reference")):
        assert cli.main(["check", str(quant), *bad]) == 2
        assert message in capsys.readouterr().err, bad


def test_row_padding_is_announced_once_with_the_build_that_avoids_it(monkeypatch, caplog):
    """Where the probe turns padding on, the user is told once why plain steps are slower and, unless the
    artifact already uses INT4 blocks of 16, which build runs unpadded on AVX2 CPUs."""
    import logging
    from types import SimpleNamespace

    from runtime.graphs import row_exact

    assert "--quant-block 16" in row_exact.row_padding_notice({"quantization": {"block": 32}})
    assert "--quant-block 16" not in row_exact.row_padding_notice({"quantization": {"block": 16}})
    monkeypatch.setattr(row_exact, "_warned", False)
    monkeypatch.setattr(row_exact, "single_row_calls_match", lambda session: False)
    session = SimpleNamespace(backend=SimpleNamespace(int8_activations=True), max_seq_len=64,
                              manifest={"quantization": {"block": 32}})
    with caplog.at_level(logging.WARNING, logger="runtime"):
        assert row_exact.needs_row_padding(session) and row_exact.needs_row_padding(session)
    notices = [r.getMessage() for r in caplog.records if "rounds a one-row call differently" in r.getMessage()]
    assert len(notices) == 1 and "(block 32)" in notices[0]
    monkeypatch.setattr(row_exact, "single_row_calls_match", lambda session: True)
    assert not row_exact.needs_row_padding(session)
