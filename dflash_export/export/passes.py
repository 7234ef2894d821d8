"""Graph passes on exported onnx_ir models that keep the numerics and the portable operator set.

`pack_shared_input_gemms` merges the linear layers that read the same activation (attention q, k, v;
MLP gate, up) into one GEMM on their stacked weights followed by a Split, as onnxruntime-genai and
llama.cpp pack them. Each output column is the same dot product as before; what changes is the
number of kernel calls per layer (7 -> 4): a narrow call (k_proj's) costs about as much as a wide
one, so three calls cost about what one does (figures:
docs/performance.md#lm-head-form-packed-projections-sampling-branch-2026-11-30-to-2026-12-01).
"""

from __future__ import annotations

import numpy as np


def is_linear_gemm(node, allow_bias: bool = True) -> bool:
    """Whether an onnx_ir node is `Gemm(x, W, [bias], transB=1)` with no scaling: `x @ W^T (+ bias)`,
    the form the exporter gives `nn.Linear` (and that these passes and INT4 rewriting rewrite)."""
    if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
        return False
    attrs = {a.name: a.value for a in node.attributes.values()}
    if attrs.get("transB", 0) != 1 or attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0:
        return False
    has_bias = len(node.inputs) > 2 and node.inputs[2] is not None
    return not has_bias or (allow_bias and attrs.get("beta", 1.0) == 1.0)


# Weights never packed: the LM head rows a draft graph ends in, which INT4 rewriting finds by this name
# (a DFlash 2 selector's hidden projection reads the same input)
UNPACKED = ("draft_head",)


def _plain_gemm_weight(node):
    """The constant weight of a bias-free linear Gemm, used only there (and not in UNPACKED); else None."""
    if not is_linear_gemm(node, allow_bias=False):
        return None
    weight = node.inputs[1]
    if weight is None or weight.const_value is None or len(list(weight.uses())) != 1 or not weight.is_initializer():
        return None
    return None if weight.name in UNPACKED else weight


def packed_name(parts: list[str]) -> str:
    """Initializer name of stacked weights: the parts' names joined by '+' (they stay readable)."""
    return "+".join(parts)


def pack_shared_input_gemms(model) -> dict[str, list[str]]:
    """Merge plain `Gemm(x, W_i, transB=1)` nodes that share their input x into `Split(Gemm(x, [W_1; ...]))`.

    Weights stack along N (output features), in graph order; the stacked initializer is a lazy tensor
    that reads its parts when the file is written (streamed weights stay streamed). Only weights used
    by that one Gemm, with the same K and dtype, are merged.

    Returns:
        {packed initializer name: [part names]} for every merge (INT4 rewriting reads parts by name).
    """
    import onnx_ir as ir

    graph = model.graph
    groups: dict[int, list] = {}
    for node in graph:
        weight = _plain_gemm_weight(node)
        if weight is not None:
            groups.setdefault(id(node.inputs[0]), []).append((node, weight))
    packed = {}
    for members in groups.values():
        if len(members) < 2 or len({(w.shape[1], w.dtype) for _, w in members}) != 1:
            continue
        packed.update(_merge(graph, members, ir))
    return packed


def _merge(graph, members, ir) -> dict[str, list[str]]:
    nodes, weights = [m[0] for m in members], [m[1] for m in members]
    names = [w.name for w in weights]
    sizes = [int(w.shape[0]) for w in weights]
    k, dtype = int(weights[0].shape[1]), weights[0].dtype
    parts = [w.const_value for w in weights]

    def stacked(parts=parts):
        return ir.tensor(np.concatenate([p.numpy() for p in parts], axis=0))

    name = packed_name(names)
    stacked_w = ir.Value(name=name, shape=ir.Shape([sum(sizes), k]), type=ir.TensorType(dtype),
                         const_value=ir.LazyTensor(stacked, dtype=dtype, shape=ir.Shape([sum(sizes), k]), name=name))
    graph.register_initializer(stacked_w)
    split_sizes = ir.Value(name=f"{name}.split", shape=ir.Shape([len(sizes)]), type=ir.TensorType(ir.DataType.INT64),
                           const_value=ir.tensor(np.array(sizes, np.int64), name=f"{name}.split"))
    graph.register_initializer(split_sizes)
    first = nodes[0]
    gemm = ir.node("Gemm", [first.inputs[0], stacked_w], attributes={"transB": 1})
    split = ir.node("Split", [gemm.outputs[0], split_sizes], attributes={"axis": -1}, num_outputs=len(sizes))
    gemm.outputs[0].name = f"{name}.out"
    graph.insert_before(first, [gemm, split])
    rows = first.outputs[0].shape[0] if first.outputs[0].shape is not None else None
    gemm.outputs[0].shape, gemm.outputs[0].type = ir.Shape([rows, sum(sizes)]), first.outputs[0].type
    for node, out in zip(nodes, split.outputs):
        old = node.outputs[0]
        out.shape, out.type, out_name = old.shape, old.type, old.name
        ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        out.name = out_name
    for w in names:
        del graph.initializers[w]
    return {name: names}
