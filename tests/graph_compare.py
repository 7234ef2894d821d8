"""Compare two exported target graphs (layer replication against a full trace): the same DAG of operators
over the same inputs and initializer bytes, modulo value names, and the same onnxruntime outputs."""

from __future__ import annotations

import collections
import hashlib
import re

import numpy as np
import onnx
from onnx import numpy_helper

from runtime.graphs.tree import VerifyTree, chain_inputs, tree_inputs
from runtime.manifest import TREE_INPUTS

# the exporter's numbered constants (their numbers follow the node count), and replication's copies of the
# constants the optimizer folded from a layer's weights (`model.layers.i/select_11`)
AUTO_NAME = re.compile(r"^(model\.layers\.\d+/)?[A-Za-z_]+_\d+$")
CACHE = re.compile(r"^(past|conv_state|recurrent_state|pending)(_key|_value|_qkv|_a|_b)?_\d+$")


def _digest(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else repr(p).encode())
    return h.hexdigest()


def dag(path):
    """(graph output hashes, multiset of node hashes, {initializer name: bytes} minus numbered constants).

    A value's hash covers how it is computed from the graph inputs and initializers (operators,
    attributes, input order, initializer bytes and names except numbered constants), not its name."""
    model = onnx.load(str(path), load_external_data=True)
    g = model.graph
    h = {i.name: _digest("input", i.name) for i in g.input}
    h.update({CACHE.sub(r"\1", i.name): _digest("input", CACHE.sub(r"\1", i.name)) for i in g.input if CACHE.match(i.name)})
    weights = {}
    for t in g.initializer:
        arr = numpy_helper.to_array(t)
        h[t.name] = _digest("init", "" if AUTO_NAME.match(t.name) else t.name, t.data_type, tuple(t.dims), arr.tobytes())
        if not AUTO_NAME.match(t.name):
            weights[t.name] = (t.data_type, arr.tobytes())
    h[""] = "none"
    nodes = []
    for node in g.node:  # graphs are stored in topological order
        attrs = sorted((a.name, a.SerializeToString()) for a in node.attribute)
        # the caches of one kind share their dynamic sizes: the exporter reads them from any (replication: the first)
        inputs = [CACHE.sub(r"\1", i) if node.op_type == "Shape" else i for i in node.input]
        key = _digest(node.domain, node.op_type, attrs, [h[i] for i in inputs])
        nodes.append(key)
        for k, out in enumerate(node.output):
            h[out] = _digest(key, k)
    return [h[o.name] for o in g.output], collections.Counter(nodes), weights


def assert_same_graph(full, replicated):
    a, b = onnx.load(str(full), load_external_data=False), onnx.load(str(replicated), load_external_data=False)
    assert [i.name for i in a.graph.input] == [i.name for i in b.graph.input]
    assert [o.name for o in a.graph.output] == [o.name for o in b.graph.output]
    assert [str(i.type) for i in a.graph.input] == [str(i.type) for i in b.graph.input]
    assert [str(o.type) for o in a.graph.output] == [str(o.type) for o in b.graph.output]
    assert a.opset_import == b.opset_import
    named = [[i.name for i in m.graph.initializer if not AUTO_NAME.match(i.name)] for m in (a, b)]
    assert named[0] == named[1]  # the same weights, in the same order
    outs_a, nodes_a, weights_a = dag(full)
    outs_b, nodes_b, weights_b = dag(replicated)
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        assert weights_a[name] == weights_b[name], name
    assert nodes_a == nodes_b
    assert outs_a == outs_b
    first = {}  # the first layer with each kind of cache: replication reads a shared size from its caches
    for i in b.graph.input:
        if CACHE.match(i.name):
            first.setdefault(CACHE.sub(r"\1", i.name), int(i.name.rsplit("_", 1)[1]))
    shapes = [n.input[0] for n in b.graph.node if n.op_type == "Shape" and CACHE.match(n.input[0])]
    assert shapes and all(int(s.rsplit("_", 1)[1]) == first[CACHE.sub(r"\1", s)] for s in shapes), shapes


def run_both(full, replicated, vocab: int, steps: int = 3, seed: int = 0) -> None:
    """onnxruntime outputs of both target graphs on the same random feeds (a prefill with empty caches,
    then random caches with proposals, greedy and sampled); they must agree exactly. Each input is made
    from the graph's own declared shape and type, so any family's caches are fed."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    sessions = [ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (full, replicated)]
    names = [o.name for o in sessions[0].get_outputs()]
    types = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
    for step in range(steps):
        n = 0 if step == 0 else int(rng.integers(1, 4))
        sizes = {"new_tokens": int(rng.integers(1, 5)), "proposals": n, "sampled_rows": n + 1,
                 "past_len": 0 if step == 0 else int(rng.integers(1, 9)),
                 "pending_rows": 0 if step == 0 else int(rng.integers(1, 4))}
        feed = {}
        for i in sessions[0].get_inputs():
            shape = [d if isinstance(d, int) else sizes[d] for d in i.shape]
            if i.name == "input_ids":
                feed[i.name] = rng.integers(0, vocab, size=shape).astype(np.int64)
            elif i.name == "temperature":
                feed[i.name] = np.array([0.0 if step % 2 == 0 else 0.8], np.float32)
            elif i.name == "uniform":
                feed[i.name] = rng.random(shape).astype(np.float32)
            elif i.name in TREE_INPUTS:  # a chain of 1 plus n - 1 alternatives: a real tree
                tree = chain_inputs(0) if n == 0 else tree_inputs(VerifyTree(1, n - 1))
                feed[i.name] = tree[i.name]
            else:
                feed[i.name] = (0.5 * rng.standard_normal(shape)).astype(types[i.type])
        got = [s.run(None, feed) for s in sessions]
        for name, x, y in zip(names, *got):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert np.array_equal(x, y), f"step {step}: {name} differs by {np.abs(x.astype(np.float64) - y).max()}"
