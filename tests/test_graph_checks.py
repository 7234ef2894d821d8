"""Graph checks: exported graphs pass `check_graph` (opset <= 20, TensorRT 10 operators only, every weight
stored once), and `check_graph` rejects hand-made graphs that break each rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from dflash_export.export.checks import OPSET, check_graph, trt10_supported_ops
from runtime.errors import DFlashError


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(attr.g)
            for g in attr.graphs:
                yield from _all_nodes(g)


def _large_arrays(model) -> list[tuple[str, np.ndarray]]:
    """Every stored weight-sized tensor: initializers and Constant node values."""
    arrays = [(i.name, numpy_helper.to_array(i)) for i in model.graph.initializer]
    for node in _all_nodes(model.graph):
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    arrays.append((node.name, numpy_helper.to_array(attr.t)))
    return [(n, a) for n, a in arrays if a.size >= 1024]


def _count_copies(arrays, table: np.ndarray) -> int:
    n = 0
    for _, arr in arrays:
        if arr.shape == table.shape and np.array_equal(arr, table):
            n += 1
        elif arr.ndim == 2 and arr.shape == table.T.shape and np.array_equal(arr, table.T):
            n += 1
    return n


@pytest.mark.parametrize("kind", ["qwen3_tied", "qwen3"])
def test_exported_target_passes_checks(tiny, kind):
    t = tiny.target(kind)
    info = check_graph(t.onnx_path)
    model = onnx.load(str(t.onnx_path), load_external_data=True)
    opset = max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    assert opset <= OPSET == 20 and info["opset"] == opset
    ops = {n.op_type for n in _all_nodes(model.graph)}
    assert all(n.domain in ("", "ai.onnx") for n in _all_nodes(model.graph))
    assert ops <= trt10_supported_ops(), f"not in the TensorRT 10 list: {sorted(ops - trt10_supported_ops())}"
    assert set(info["ops"]) == ops

    arrays = _large_arrays(model)
    embed = t.state["model.embed_tokens.weight"].float().numpy()
    assert _count_copies(arrays, embed) == 1, "the embedding table must be stored exactly once"
    if kind == "qwen3":
        head = t.state["lm_head.weight"].float().numpy()
        assert not np.array_equal(head, embed)
        assert _count_copies(arrays, head) == 1, "the LM head must be stored exactly once"
    # No weight-sized tensor is stored twice (directly or transposed).
    for i, (n1, a1) in enumerate(arrays):
        for n2, a2 in arrays[i + 1 :]:
            assert not (a1.shape == a2.shape and np.array_equal(a1, a2)), f"{n1} and {n2} are the same weight"
            assert not (a1.ndim == 2 and a1.T.shape == a2.shape and np.array_equal(a1.T, a2)), f"{n1} = {n2}^T"
    assert info["initializer_bytes"] == sum(numpy_helper.to_array(i).nbytes for i in model.graph.initializer)


def test_exported_draft_passes_checks(tiny):
    info = check_graph(tiny.draft().onnx_path)
    assert info["opset"] <= 20
    assert set(info["ops"]) <= trt10_supported_ops()


# ---- hand-made graphs that must be refused -------------------------------------------------------


def _save(tmp_path: Path, nodes, inits=(), opset=20, name="m.onnx", inputs=None, outputs=None, extra_opsets=()):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _w(seed, shape=(64, 64)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_valid_hand_made_graph_passes(tmp_path):
    a, b = _w(0), _w(1)
    path = _save(
        tmp_path,
        [helper.make_node("MatMul", ["x", "a"], ["h"]), helper.make_node("MatMul", ["h", "b"], ["y"])],
        [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")],
    )
    info = check_graph(path)
    assert info["ops"] == ["MatMul"] and info["opset"] == 20
    assert info["initializer_bytes"] == a.nbytes + b.nbytes


def test_small_repeated_constants_are_allowed(tmp_path):
    c = np.arange(16, dtype=np.float32)
    path = _save(
        tmp_path,
        [helper.make_node("Add", ["x", "c1"], ["h"]), helper.make_node("Add", ["h", "c2"], ["y"])],
        [numpy_helper.from_array(c, "c1"), numpy_helper.from_array(c.copy(), "c2")],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [16])],
    )
    check_graph(path)


def test_unsupported_operator_is_refused(tmp_path):
    op = "Unique"
    assert op not in trt10_supported_ops()
    path = _save(
        tmp_path,
        [helper.make_node(op, ["x"], ["y"])],
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
    )
    onnx.checker.check_model(onnx.load(str(path)))  # a valid ONNX graph, just not TensorRT-parsable
    with pytest.raises(DFlashError, match="Unique"):
        check_graph(path)


def test_unsupported_operator_inside_a_subgraph_is_refused(tmp_path):
    branch_out = [helper.make_tensor_value_info("u", TensorProto.FLOAT, None)]
    then_g = helper.make_graph([helper.make_node("Unique", ["x"], ["u"])], "then", [], branch_out)
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["u"])], "else", [], branch_out)
    path = _save(
        tmp_path,
        [helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)],
        inputs=[
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [8]),
        ],
    )
    with pytest.raises(DFlashError, match="Unique"):
        check_graph(path)


def test_non_default_domain_is_refused(tmp_path):
    path = _save(
        tmp_path,
        [helper.make_node("FastGelu", ["x"], ["y"], domain="com.microsoft")],
        extra_opsets=[helper.make_opsetid("com.microsoft", 1)],
    )
    with pytest.raises(DFlashError, match="com.microsoft"):
        check_graph(path)


def test_opset_above_20_is_refused(tmp_path):
    path = _save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], opset=21)
    with pytest.raises(DFlashError, match="opset 21"):
        check_graph(path)


def test_duplicated_initializer_is_refused(tmp_path):
    w = _w(2)  # 4096 elements: weight-sized
    path = _save(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(w.copy(), "w2")],
    )
    with pytest.raises(DFlashError, match="w2.*w1|stored twice"):
        check_graph(path)


def test_transposed_duplicate_initializer_is_refused(tmp_path):
    w = _w(3, (64, 96))  # a tied table stored once as [V, d] and once transposed as [d, V]
    path = _save(
        tmp_path,
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        [numpy_helper.from_array(w, "w1"), numpy_helper.from_array(np.ascontiguousarray(w.T), "w2")],
    )
    with pytest.raises(DFlashError, match="stored twice"):
        check_graph(path)
