"""The graph surgery of layer replication (`export.replication`): cut a traced template into its
layers, check that each layer is its kind's copied layer on its own inputs, and copy that layer once
per layer of the real target.

Terms: the template has every layer kind of the target twice (`Plan.template_kinds`); the second
layer of each kind is the one copied (its kind's prototype, `Plan.protos`), the first is checked to be
the same subgraph. A layer's inputs are classified once, on the prototype (`signature`): a value of the
layer itself, the hidden state it reads, one of its cache inputs, one of its weights, a constant the
optimizer folded from one of its weights (`Plan.folded`), or a value shared by all layers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

SCOPES = "pkg.torch.onnx.name_scopes"
LAYER_SCOPE = re.compile(r"model\.layers\.(\d+)(?=[.'\"]|$)")
LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.")
_FOLDED_MAX_ELEMENTS = 1 << 20  # constants larger than this are never compared as folded candidates


class ReplicationError(RuntimeError):
    """The traced template does not have the structure layer replication relies on."""


@dataclass
class Plan:
    """What the surgery needs to know besides the graph.

    Attributes:
        kinds: the real target's layer kinds, one per layer.
        template_kinds: the template's (every kind of `kinds`, in order of first use, twice).
        cache_names: (kind, layer) -> (cache input names, cache output names) of that layer.
        folded: per template layer, [(parameter name in the layer, value)]: the constants the graph
            optimizer may fold from that layer's weights (the family's `Layout.folded`).
    """

    kinds: tuple[str, ...]
    template_kinds: tuple[str, ...]
    cache_names: Callable[[str, int], tuple[list[str], list[str]]]
    folded: list[list[tuple[str, np.ndarray]]] = field(default_factory=list)

    @property
    def protos(self) -> dict[str, int]:
        """Layer kind -> the template layer copied for it (its second one)."""
        out, seen = {}, set()
        for j, kind in enumerate(self.template_kinds):
            if kind in seen:
                out.setdefault(kind, j)
            seen.add(kind)
        return out

    def cache_inputs(self, j: int) -> list[str]:
        return self.cache_names(self.template_kinds[j], j)[0]

    def cache_outputs(self, j: int) -> list[str]:
        return self.cache_names(self.template_kinds[j], j)[1]


@dataclass
class Layer:
    """One template layer: its nodes in graph order and the values it exchanges with the rest."""

    index: int
    nodes: list
    local: dict  # id(output value) -> (node position in the layer, output index)
    res_in: object = None  # the hidden state it reads (the previous layer's res_out, or the embedding)
    res_out: object = None  # the hidden state it writes
    cache_out: list = field(default_factory=list)  # its cache graph outputs, in `cache_names` order


def partition(graph, plan: Plan) -> tuple[list[Layer], object]:
    """The template layers (contiguous runs of nodes by name scope) and the first node after them.

    Nodes in a layer's scope that read nothing of any layer (`_shared_nodes`: masks and constants made
    from the row counts, which the optimizer's CSE merged into the first layer that made them) are left
    out of the layers: they stay where they are and the copies read them, as a full trace's layers do."""
    nodes = list(graph)
    labels = [scope_layer(node) for node in nodes]
    runs = [lab for k, lab in enumerate(labels) if k == 0 or lab != labels[k - 1]]
    inner = runs[1:] if runs and runs[0] is None else runs
    if inner[-1:] != [None] or inner[:-1] != list(range(len(plan.template_kinds))):
        raise ReplicationError(f"the template's nodes are not one contiguous run per layer (runs {runs[:12]})")
    shared = _shared_nodes(graph, nodes, labels, plan)
    layers = []
    for j in range(len(plan.template_kinds)):
        own = [node for node, lab in zip(nodes, labels) if lab == j and id(node) not in shared]
        local = {id(v): (pos, k) for pos, node in enumerate(own) for k, v in enumerate(node.outputs)}
        layers.append(Layer(j, own, local))
    last = max(k for k, lab in enumerate(labels) if lab is not None)
    for layer in layers:
        _find_outputs(layer, plan)
    for prev, layer in zip(layers, layers[1:]):
        layer.res_in = prev.res_out
    return layers, nodes[last + 1]


def _shared_nodes(graph, nodes: list, labels: list, plan: Plan) -> set:
    """ids of the layer-scoped nodes that depend on no layer's own values: its hidden state (the
    embedding, for the first: the one value from outside the layers that only one layer reads), cache
    values, weights or folded constants. A cache's shape is not its own: the caches of one kind share
    their dynamic sizes (the past length, the pending rows), which the exporter reads from any of them."""
    readers = {}
    for node, lab in zip(nodes, labels):
        for v in node.inputs:
            if v is not None:
                readers.setdefault(id(v), set()).add(lab)
    caches = {name for j in range(len(plan.template_kinds)) for name in plan.cache_inputs(j)}
    own = set()  # ids of values that belong to one layer
    for v in graph.inputs:
        if v.name in caches:
            own.add(id(v))
    for v in graph.initializers.values():
        m = LAYER_WEIGHT.match(v.name or "")
        if m or any(_folded_index(v, plan.folded[j]) is not None for j in range(len(plan.folded))):
            own.add(id(v))
    data = {id(v) for v in graph.inputs}  # values computed from the inputs' values, not only their shapes
    for node, lab in zip(nodes, labels):
        if node.op_type != "Shape" and any(v is not None and id(v) in data for v in node.inputs):
            data |= {id(v) for v in node.outputs}
        if lab is None:  # the embedding
            own |= {id(v) for v in node.outputs if id(v) in data and readers.get(id(v), set()) - {None} == {0}}
    shared = set()
    for node, lab in zip(nodes, labels):
        if lab is None:
            continue
        reads_own = any(v is not None and id(v) in own for v in node.inputs)
        if reads_own and not (node.op_type == "Shape" and node.inputs[0].name in caches):
            own |= {id(v) for v in node.outputs}
        else:
            shared.add(id(node))
    return shared


def scope_layer(node) -> int | None:
    """The decoder layer whose module call produced `node` (from its name scopes), or None."""
    scopes = node.metadata_props.get(SCOPES)
    if scopes is None:
        raise ReplicationError(f"node {node.name} ({node.op_type}) has no {SCOPES} metadata")
    found = {int(m) for m in LAYER_SCOPE.findall(scopes)}
    if len(found) > 1:
        raise ReplicationError(f"node {node.name} is in the scopes of layers {sorted(found)}")
    return found.pop() if found else None


def _find_outputs(layer: Layer, plan: Plan) -> None:
    """Set `layer.cache_out` (its cache graph outputs) and `layer.res_out` (the one other value that
    something outside the layer reads)."""
    inside = {id(node) for node in layer.nodes}
    outs, escaping = {}, []
    for node in layer.nodes:
        for v in node.outputs:
            if v.is_graph_output():
                outs[v.name] = v
            elif any(id(use.node) not in inside for use in v.uses()):
                escaping.append(v)
    expected = plan.cache_outputs(layer.index)
    if sorted(outs) != sorted(expected) or len(escaping) != 1:
        raise ReplicationError(f"layer {layer.index} writes graph outputs {sorted(outs)} and {len(escaping)} other "
                               f"values read outside it; expected {expected} and the hidden state")
    layer.cache_out, layer.res_out = [outs[name] for name in expected], escaping[0]


def signature(proto: Layer, layers: list[Layer], plan: Plan) -> list[list[tuple]]:
    """For each node of the copied layer, what each input is: ("local", position, output index),
    ("residual",), ("cache", k), ("weight", name in the layer), ("folded", k) (entry k of
    `plan.folded[proto.index]`), ("shared", value), ("none",)."""
    j = proto.index
    caches = plan.cache_inputs(j)
    out = []
    for node in proto.nodes:
        classes = []
        for v in node.inputs:
            if v is None:
                classes.append(("none",))
            elif id(v) in proto.local:
                classes.append(("local", *proto.local[id(v)]))
            elif v is proto.res_in:
                classes.append(("residual",))
            elif v.is_graph_input() and v.name in caches:
                classes.append(("cache", caches.index(v.name)))
            elif v.is_initializer() and v.name.startswith(f"model.layers.{j}."):
                classes.append(("weight", v.name[len(f"model.layers.{j}."):]))
            elif (k := _folded_index(v, plan.folded[j])) is not None:
                classes.append(("folded", k))
            elif layer_specific(v, layers, plan):
                raise ReplicationError(f"layer {j} reads {v.name}, a value of another layer")
            else:
                classes.append(("shared", v))
        out.append(classes)
    return out


def _folded_index(v, candidates: list[tuple[str, np.ndarray]]) -> int | None:
    """Which of `candidates` initializer `v` holds exactly (dtype, shape, bytes), if any."""
    import onnx_ir as ir

    if not v.is_initializer() or v.const_value is None or isinstance(v.const_value, ir.LazyTensor):
        return None
    if v.const_value.size > _FOLDED_MAX_ELEMENTS:
        return None
    value = v.const_value.numpy()
    for k, (_, c) in enumerate(candidates):
        if c.dtype == value.dtype and c.shape == value.shape and np.array_equal(c, value):
            return k
    return None


def layer_specific(v, layers: list[Layer], plan: Plan) -> bool:
    """Whether `v` belongs to one layer: a node output, a cache input or a weight of a layer."""
    if any(id(v) in layer.local for layer in layers):
        return True
    if v.is_graph_input() and any(v.name in plan.cache_inputs(j) for j in range(len(layers))):
        return True
    return v.is_initializer() and bool(LAYER_WEIGHT.match(v.name or ""))


def match(layer: Layer, proto: Layer, sig: list, layers: list[Layer], plan: Plan) -> None:
    """Check that `layer` is the copied layer's subgraph on its own weights, caches and hidden state
    (setting `res_in` of layer 0, the embedding, from where its prototype reads its hidden state)."""
    j = layer.index
    if len(layer.nodes) != len(proto.nodes):
        raise ReplicationError(f"layer {j} has {len(layer.nodes)} nodes, layer {proto.index} {len(proto.nodes)}")
    for pos, (node, pnode, classes) in enumerate(zip(layer.nodes, proto.nodes, sig)):
        where = f"layer {j} node {pos} ({node.op_type})"
        if node_key(node) != node_key(pnode) or len(node.inputs) != len(classes):
            raise ReplicationError(f"{where} differs from layer {proto.index}'s ({pnode.op_type})")
        for k, (v, c) in enumerate(zip(node.inputs, classes)):
            if c[0] == "residual" and layer.res_in is None and v is not None and not layer_specific(v, layers, plan):
                layer.res_in = v
            if not _fits(v, c, layer, plan):
                raise ReplicationError(f"{where} input {k} is {getattr(v, 'name', None)}, not the {c[0]} input "
                                       f"layer {proto.index} has there")
        for v, pv in zip(node.outputs, pnode.outputs):
            if (v.dtype, str(v.shape)) != (pv.dtype, str(pv.shape)):
                raise ReplicationError(f"{where} output {v.name} is {v.dtype} {v.shape}, not {pv.dtype} {pv.shape}")
    for v, pv in zip((layer.res_out, *layer.cache_out), (proto.res_out, *proto.cache_out)):
        if layer.local[id(v)] != proto.local[id(pv)]:
            raise ReplicationError(f"layer {j} writes {v.name} from another node than layer {proto.index} does")


def _fits(v, c: tuple, layer: Layer, plan: Plan) -> bool:
    kind, j = c[0], layer.index
    if kind == "none":
        return v is None
    if v is None:
        return False
    if kind == "local":
        return layer.local.get(id(v)) == (c[1], c[2])
    if kind == "residual":
        return v is layer.res_in
    if kind == "cache":
        return v.is_graph_input() and v.name == plan.cache_inputs(j)[c[1]]
    if kind == "weight":
        return v.is_initializer() and v.name == f"model.layers.{j}.{c[1]}"
    if kind == "folded":
        return _folded_index(v, plan.folded[j][c[1]: c[1] + 1]) == 0
    return v is c[1]


def node_key(node) -> tuple:
    """What two copies of one node share: operator, version, output count and attributes."""
    import onnx_ir as ir

    attrs = []
    for a in node.attributes.values():
        if a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
            raise ReplicationError(f"node {node.name} ({node.op_type}) has a subgraph; layers are copied flat")
        value = a.value
        if isinstance(value, ir.TensorProtocol):
            value = (value.dtype, tuple(value.shape), value.tobytes())
        elif isinstance(value, (list, tuple)):
            value = tuple(value)
        attrs.append((a.name, a.type, value))
    return node.domain, node.op_type, node.overload, node.version, len(node.outputs), tuple(sorted(attrs))


def check_outside_uses(graph, layers: list[Layer], owner: dict, taps, plan: Plan, tap_stand_in: int) -> None:
    """Outside its layer, a hidden state is read only by the next layer (the last one's by the final
    norm, the tap stand-in's by the taps too); a layer's weights only by its own nodes; its cache
    inputs only by its own nodes and by Shape nodes (the past length)."""
    last = len(layers) - 1
    for layer in layers:
        j = layer.index
        for use in layer.res_out.uses():
            at = owner.get(id(use.node))
            if at == j + 1 or (at is None and (j == last or (j == tap_stand_in and use.node is taps))):
                continue
            raise ReplicationError(f"layer {j}'s hidden state is read by {use.node.op_type} {use.node.name}")
    for name, v in graph.initializers.items():
        m = LAYER_WEIGHT.match(name)
        if m and any(owner.get(id(use.node)) != int(m.group(1)) for use in v.uses()):
            raise ReplicationError(f"{name} is read outside its layer")
    for v in graph.inputs:
        j = next((j for j in range(len(layers)) if v.name in plan.cache_inputs(j)), None)
        for use in v.uses() if j is not None else ():
            at = owner.get(id(use.node))
            if at != j and not (at is None and use.node.op_type == "Shape"):
                raise ReplicationError(f"{v.name} is read by {use.node.op_type} {use.node.name} outside its layer")


def copy_layer(proto: Layer, sig: list, i: int, res_in, weights: dict, folded: dict, caches: list,
               cache_outputs: list[str]) -> tuple:
    """The copied layer's nodes for layer i, reading `res_in`, its `weights` ({name in the layer:
    value}), `folded` ({k: value} for ("folded", k) inputs) and `caches` (its cache input values),
    writing its cache outputs under `cache_outputs`' names.

    Returns:
        (nodes, hidden state written, [cache output values])."""
    import onnx_ir as ir

    out_names = {id(v): name for v, name in zip(proto.cache_out, cache_outputs)}
    made = {}  # (position, output index) in the copied layer -> the copy's value
    nodes = []
    for pos, (pnode, classes) in enumerate(zip(proto.nodes, sig)):
        inputs = [_resolve(c, made, res_in, weights, folded, caches) for c in classes]
        outputs = [ir.Value(name=out_names.get(id(pv), _prefixed(pv.name, i)),
                            shape=None if pv.shape is None else ir.Shape(pv.shape), type=pv.type) for pv in pnode.outputs]
        attrs = [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in pnode.attributes.values()]
        meta = {k: LAYER_SCOPE.sub(f"model.layers.{i}", v) for k, v in pnode.metadata_props.items()}
        nodes.append(ir.Node(pnode.domain, pnode.op_type, inputs, attrs, overload=pnode.overload, outputs=outputs,
                             version=pnode.version, name=_prefixed(pnode.name, i), metadata_props=meta))
        made.update({(pos, k): v for k, v in enumerate(outputs)})
    res_out = made[proto.local[id(proto.res_out)]]
    return nodes, res_out, [made[proto.local[id(v)]] for v in proto.cache_out]


def _resolve(c: tuple, made: dict, res_in, weights: dict, folded: dict, caches: list):
    """The value a copy reads where the copied layer reads an input of class `c` (see `signature`)."""
    kind = c[0]
    if kind == "local":
        return made[(c[1], c[2])]
    if kind == "residual":
        return res_in
    if kind == "cache":
        return caches[c[1]]
    if kind == "weight":
        return weights[c[1]]
    if kind == "folded":
        return folded[c[1]]
    return None if kind == "none" else c[1]


def _prefixed(name: str | None, i: int) -> str | None:
    """Layer i's name for a value or node of the copied layer (unique: the copied layer's names are)."""
    return None if name is None else f"model.layers.{i}/{name}"


def rewire(layers: list[Layer], owner: dict, taps, hidden: list, tap_layers: tuple) -> None:
    """Point the nodes after the layers at the copies: the final norm at the last copy's hidden state,
    each tap below the last layer at its layer's."""
    for use in list(layers[-1].res_out.uses()):
        if owner.get(id(use.node)) is None:
            use.node.replace_input_with(use.idx, hidden[-1])
    for k, t in enumerate(tap_layers):
        if t != len(hidden) - 1:
            taps.replace_input_with(k, hidden[t])


def order_initializers(graph, weights: list[list], dropped: set) -> None:
    """Replace the template's layer weights by the real ones (each layer's initializer values, in order),
    where a full trace lists them (after the embedding, before the final norm: the order initializer
    deduplication keeps the first of), and drop the initializers whose ids are in `dropped`."""
    order, placed = [], False
    for name, v in graph.initializers.items():
        if not LAYER_WEIGHT.match(name):
            if id(v) not in dropped:
                order.append(v)
        elif not placed:
            order += [w for layer in weights for w in layer]
            placed = True
    for name in list(graph.initializers):
        del graph.initializers[name]
    for v in order:
        graph.register_initializer(v)
