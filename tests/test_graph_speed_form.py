"""The graph form onnxruntime runs fast (issue 12): packed projections, fused RMSNorm, the LM head as a
GEMM on its stored table, the optimizers the runtime disables per onnxruntime version; the host binders."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import runtime_fixtures as rf
from runtime.backends.ort import _optimization_level, disabled_optimizers, host_binders


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return rf.artifact("qwen3", tmp_path_factory).artifact


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def test_projections_sharing_an_input_are_one_gemm(artifact):
    model = onnx.load(str(artifact / "target.onnx"), load_external_data=False)
    layers = sum(1 for i in model.graph.input if i.name.startswith("past_key_"))
    gemm_weights = [n.input[1] for n in model.graph.node if n.op_type == "Gemm"]
    # per layer: q+k+v, o, gate+up, down; then the LM head for the logits and for the proposals
    assert len(gemm_weights) == 4 * layers + 2
    assert sum("q_proj.weight+" in w and w.endswith("v_proj.weight") for w in gemm_weights) == layers
    assert sum("gate_proj.weight+" in w and w.endswith("up_proj.weight") for w in gemm_weights) == layers
    head = "lm_head.weight" if "lm_head.weight" in {i.name for i in model.graph.initializer} else "model.embed_tokens.weight"
    assert gemm_weights.count(head) == 2


def test_onnxruntime_fuses_norms_and_no_layer_masks_or_negates(artifact, tmp_path):
    manifest = json.loads((artifact / "manifest.json").read_text())
    opts = ort.SessionOptions()
    opts.graph_optimization_level = _optimization_level(ort)
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(artifact / "target.onnx"), opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled_optimizers(manifest, ort))
    ops = _ops(tmp_path / "optimized.onnx")
    exported = _ops(artifact / "target.onnx")
    layers = manifest["target"]["num_layers"]
    # every RMSNorm (2 per layer, q/k norms, the final one) became one fused node
    assert ops["SimplifiedLayerNormalization"] == exported["Sqrt"] == 4 * layers + 1 and "Sqrt" not in ops
    # RoPE's sign lives in the sin table and the causal mask is one bias: no Neg or Where per layer (the
    # four Wheres left are global: the causal bias and the sampling branch's three selects)
    assert layers >= 4 and exported["Neg"] <= 1 and exported["Where"] == 4


def test_attention_is_split_invariant_and_rope_is_one_matmul(artifact):
    """Per layer: RoPE of q and of k as one MatMul each (`modules.rope_matrix`), the scores against the
    past and the new rows, and the split-invariant value sum and normaliser (`Attention.attend`): six
    MatMuls, one score max and one Exp, no Softmax (the one left is the sampling branch's)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    exported = _ops(artifact / "target.onnx")
    layers = manifest["target"]["num_layers"]
    assert manifest["target"]["row_exact"] is True
    assert (exported["MatMul"], exported["ReduceMax"], exported["Exp"]) == (6 * layers, layers, layers)
    assert exported["Softmax"] == 1


class _Version:
    def __init__(self, version):
        self.__version__ = version


def test_matmul_transpose_fusion_is_disabled_only_where_it_crashes():
    # 1.23.2 dies (SIGFPE) in the FusedMatMul this optimizer makes, on an empty past (tests/test_py310_jetpack.py)
    assert disabled_optimizers({}, _Version("1.23.2")) == ["MatmulTransposeFusion"]
    assert disabled_optimizers({}, _Version("1.32.0")) == []
    assert disabled_optimizers({"quantization": {"block": 32}}, _Version("1.32.0")) == ["MatMulAddFusion"]


def test_host_binders_bind_the_same_buffers_as_the_public_calls():
    """`host_binders` calls onnxruntime's C++ binding directly; the fallback (a version without the private
    `_iobinding`) calls the public one. Both must read and write the buffers they are given."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "ab"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                                   providers=["CPUExecutionProvider"])

    class NoPrivateBinding:  # the public methods only
        def __init__(self, binding):
            self.bind_input, self.bind_output = binding.bind_input, binding.bind_output

    for wrap in (lambda b: b, NoPrivateBinding):
        a, b, y = np.arange(5, dtype=np.float32), np.full(5, 10, np.float32), np.zeros(7, np.float32)
        binding = session.io_binding()
        bind_in, bind_out = host_binders(ort, wrap(binding))
        bind_in("a", a.dtype, [3], a.ctypes.data + 8)  # a view: a[2:5]
        bind_in("b", b.dtype, [3], b.ctypes.data)
        bind_out("y", y.dtype, [3], y.ctypes.data + 4)  # written in place at y[1:4]
        session.run_with_iobinding(binding)
        assert y.tolist() == [0, 12, 13, 14, 0, 0, 0]
