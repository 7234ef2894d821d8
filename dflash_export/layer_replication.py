"""Export a deep target by tracing a shallow one: tracing cost that does not grow with the layer count.

Tracing, decomposing and optimizing a target costs a few seconds per decoder layer (4-5 s at Qwen3-8B
sizes on 2 cores: most of a 36-layer build), and every decoder layer of a dense Llama / Qwen3 target
exports to the same subgraph on its own weights and cache. So `export.export_target` traces a template
instead, the same module with `TEMPLATE_LAYERS` layers (`template_target`), optimized as usual, and
`replicate_layers` turns it into the full graph:

1. The template's nodes are partitioned by the name scope the exporter records for each node
   (`model.layers.j`, from the `DecoderLayer.forward` call), and each template layer is checked to be
   the last layer's subgraph exactly (same operators, attributes and wiring, on its own weights and past
   K/V, the values shared by all layers, and the previous layer's hidden state or the embedding as its
   only other input). Anything else raises `ReplicationError` (the caller then traces every layer).
2. The last template layer is copied once per real layer, with fresh value names, layer i's past_key_i /
   past_value_i inputs and key_i / value_i outputs, and its weights renamed to layer i's, each bound to
   its lazy reader (streamed weights are still read only while the file is written).
3. The final norm reads the last copy; the `taps` Concat reads the copies at the draft's tap layers.
4. Initializer deduplication and CSE run once more on the whole graph, as the optimizer ran them on a
   full trace (a random checkpoint's norms, all ones, are then stored once, as before).

The template's own layer weights are stand-ins: small ones get distinct random values (equal ones
would be merged by the optimizer's deduplication, hiding which layer's weight a node reads) and large
ones placeholders that are never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

# Two layers are enough to check that a layer's subgraph does not depend on its neighbours: the first
# follows the embedding and feeds a layer, the last follows a layer and feeds the final norm, and both must
# be the same subgraph. Each more would add its tracing time (3-4 s) and check nothing new.
TEMPLATE_LAYERS = 2
_PROTO = TEMPLATE_LAYERS - 1  # the layer copied: it reads a layer's hidden state, as all but the first do
_TAP = TEMPLATE_LAYERS - 2  # stands in for every tap below the last layer
# Stand-ins above this many elements are placeholders: above onnxscript's constant folding (8192) and
# initializer deduplication (1024) limits, so the optimizer never needs their values.
_STAND_IN_PLACEHOLDER = 1 << 14
_SCOPES = "pkg.torch.onnx.name_scopes"
_LAYER_SCOPE = re.compile(r"model\.layers\.(\d+)(?=[.'\"]|$)")
_LAYER_WEIGHT = re.compile(r"^model\.layers\.(\d+)\.")
_PAST = re.compile(r"^past_(key|value)_(\d+)$")


class ReplicationError(RuntimeError):
    """The traced template does not have the structure layer replication relies on."""


def replicable(module) -> bool:
    """Whether `module` (a TargetForExport) has more layers than the template, so replication saves time."""
    return module.spec.arch.num_layers > TEMPLATE_LAYERS


def template_target(module, readers: dict) -> tuple:
    """A `TEMPLATE_LAYERS`-layer copy of `module` (a TargetForExport) to trace in its place.

    It shares the embedding, final norm, LM head, proposal rows and RoPE buffers of `module`; its layers
    hold stand-in weights. A tap at the last layer stays at the template's last layer (post-norm); other
    taps all read its first layer (replication rewires them).

    Returns:
        (template module, readers of its streamed weights: `readers` for the shared ones, and for each
        large stand-in one that raises if called).

    Raises:
        ReplicationError: the layers of `module` differ in their parameters' names, shapes or dtypes.
    """
    from .modules import TargetForExport
    from .weights import empty_module, placeholder, set_parameter

    spec = module.spec
    params = _layer_parameters(module)
    last = spec.arch.num_layers - 1
    taps = tuple(TEMPLATE_LAYERS - 1 if t == last else _TAP for t in module.tap_layers)
    tspec = replace(spec, arch=replace(spec.arch, num_layers=TEMPLATE_LAYERS))
    template = empty_module(lambda: TargetForExport(tspec, taps, module.compute_dtype)).eval()
    template.model.embed_tokens, template.model.norm = module.model.embed_tokens, module.model.norm
    template.lm_head = module.lm_head
    for name in ("draft_vocab", "draft_head", "inv_freq"):
        setattr(template, name, getattr(module, name))
    template.rope_scale = module.rope_scale
    shared = {k: v for k, v in readers.items() if not _LAYER_WEIGHT.match(k)}
    gen = torch.Generator().manual_seed(0)
    for j, layer in enumerate(template.model.layers):
        for suffix, (shape, dtype) in params.items():
            if _numel(shape) > _STAND_IN_PLACEHOLDER:
                set_parameter(layer, suffix, placeholder(shape, dtype))
                shared[f"model.layers.{j}.{suffix}"] = _never_read(f"model.layers.{j}.{suffix}")
            else:
                set_parameter(layer, suffix, torch.randn(shape, generator=gen).to(dtype))
    return template, shared


def _layer_parameters(module) -> dict:
    """{parameter name in a layer: (shape, dtype)}, the same for every layer of `module`."""
    layers = module.model.layers
    first = {k: (tuple(p.shape), p.dtype) for k, p in layers[0].named_parameters()}
    for i, layer in enumerate(layers):
        own = {k: (tuple(p.shape), p.dtype) for k, p in layer.named_parameters()}
        if own != first or type(layer) is not type(layers[0]) or list(layer.buffers()):
            raise ReplicationError(f"decoder layer {i} differs from layer 0")
    return first


def _never_read(name: str):
    def read():
        raise AssertionError(f"{name} is a stand-in weight of the template; it must never be read")
    return read


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


@dataclass
class _Layer:
    """One template layer: its nodes in graph order and the values it exchanges with the rest."""

    index: int
    nodes: list
    local: dict  # id(output value) -> (node position in the layer, output index)
    res_in: object = None  # the hidden state it reads (the previous layer's res_out, or the embedding)
    res_out: object = None  # the hidden state it writes
    kv: tuple = ()  # its key_j, value_j graph outputs


def replicate_layers(model, module, readers: dict) -> None:
    """Expand an optimized template graph (`template_target` traced) to the layers of `module`, in place.

    Args:
        model: the onnx_ir model of the template (optimized, before GEMM packing).
        module: the full TargetForExport: its layer parameters give the real weights.
        readers: initializer name -> reader of the streamed weights of `module`.

    Raises:
        ReplicationError: the template's structure is not what replication relies on (see module doc);
            `model` may be left half-edited then (the caller traces every layer instead).
    """
    from onnx_ir.passes.common import CommonSubexpressionEliminationPass, DeduplicateInitializersPass

    from .export import target_io_names

    graph = model.graph
    n = module.spec.arch.num_layers
    layers, after = _partition(graph)
    proto = layers[_PROTO]
    signature = _signature(proto, layers)
    for layer in layers:
        _match(layer, proto, signature, layers)
    owner = {id(node): layer.index for layer in layers for node in layer.nodes}
    taps = _taps_node(graph, module.tap_layers, n, layers)
    _check_outside_uses(graph, layers, owner, taps)
    weights = _real_weights(graph, module, readers, signature)
    pasts = _past_inputs(graph, n)
    copies, res = [], layers[0].res_in
    for i in range(n):
        copies.append(_copy_layer(proto, signature, i, res, weights[i], pasts[2 * i: 2 * i + 2]))
        res = copies[-1][1]
    _rewire(layers, owner, taps, [c[1] for c in copies], module.tap_layers)
    graph.outputs[:] = [*graph.outputs[:5], *[v for c in copies for v in c[2]]]
    graph.inputs[:] = [*graph.inputs[:4], *pasts]
    graph.remove([node for layer in layers for node in layer.nodes], safe=True)
    graph.insert_before(after, [node for c in copies for node in c[0]])
    _read_past_length_from_first_cache(graph, pasts[0])
    _order_initializers(graph, weights)
    # the optimizer's last passes on a full trace, now on the real weights: equal small weights (a random
    # checkpoint's norms) are stored once, and nodes that became identical are merged, as before
    DeduplicateInitializersPass()(model)
    CommonSubexpressionEliminationPass()(model)
    ins, outs = target_io_names(n)
    if [v.name for v in graph.inputs] != ins or [v.name for v in graph.outputs] != outs:
        raise AssertionError("the replicated graph's inputs or outputs are not target_io_names")


def _partition(graph) -> tuple[list[_Layer], object]:
    """The template layers (contiguous runs of nodes by name scope) and the first node after them."""
    nodes = list(graph)
    labels = [_scope_layer(node) for node in nodes]
    runs = [lab for k, lab in enumerate(labels) if k == 0 or lab != labels[k - 1]]
    inner = runs[1:] if runs and runs[0] is None else runs
    if inner[-1:] != [None] or inner[:-1] != list(range(TEMPLATE_LAYERS)):
        raise ReplicationError(f"the template's nodes are not one contiguous run per layer (runs {runs[:12]})")
    layers = []
    for j in range(TEMPLATE_LAYERS):
        own = [node for node, lab in zip(nodes, labels) if lab == j]
        local = {id(v): (pos, k) for pos, node in enumerate(own) for k, v in enumerate(node.outputs)}
        layers.append(_Layer(j, own, local))
    last = max(k for k, lab in enumerate(labels) if lab is not None)
    for layer in layers:
        _find_outputs(layer)
    for prev, layer in zip(layers, layers[1:]):
        layer.res_in = prev.res_out
    return layers, nodes[last + 1]


def _scope_layer(node) -> int | None:
    """The decoder layer whose module call produced `node` (from its name scopes), or None."""
    scopes = node.metadata_props.get(_SCOPES)
    if scopes is None:
        raise ReplicationError(f"node {node.name} ({node.op_type}) has no {_SCOPES} metadata")
    found = {int(m) for m in _LAYER_SCOPE.findall(scopes)}
    if len(found) > 1:
        raise ReplicationError(f"node {node.name} is in the scopes of layers {sorted(found)}")
    return found.pop() if found else None


def _find_outputs(layer: _Layer) -> None:
    """Set `layer.kv` (its key_j / value_j graph outputs) and `layer.res_out` (the one other value
    that something outside the layer reads)."""
    inside = {id(node) for node in layer.nodes}
    kv, escaping = {}, []
    for node in layer.nodes:
        for v in node.outputs:
            if v.is_graph_output():
                kv[v.name] = v
            elif any(id(use.node) not in inside for use in v.uses()):
                escaping.append(v)
    j = layer.index
    if sorted(kv) != [f"key_{j}", f"value_{j}"] or len(escaping) != 1:
        raise ReplicationError(f"layer {j} writes graph outputs {sorted(kv)} and {len(escaping)} other values read "
                               "outside it; expected key_j, value_j and the hidden state")
    layer.kv, layer.res_out = (kv[f"key_{j}"], kv[f"value_{j}"]), escaping[0]


def _signature(proto: _Layer, layers: list[_Layer]) -> list[list[tuple]]:
    """For each node of the copied layer, what each input is: ("local", position, output index),
    ("residual",), ("past", "key"|"value"), ("weight", name in the layer), ("shared", value), ("none",)."""
    j = proto.index
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
            elif v.is_graph_input() and v.name in (f"past_key_{j}", f"past_value_{j}"):
                classes.append(("past", v.name.split("_")[1]))
            elif v.is_initializer() and v.name.startswith(f"model.layers.{j}."):
                classes.append(("weight", v.name[len(f"model.layers.{j}."):]))
            elif _layer_specific(v, layers):
                raise ReplicationError(f"layer {j} reads {v.name}, a value of another layer")
            else:
                classes.append(("shared", v))
        out.append(classes)
    return out


def _layer_specific(v, layers: list[_Layer]) -> bool:
    """Whether `v` belongs to one layer: a node output, a past input or a weight of a layer."""
    if any(id(v) in layer.local for layer in layers):
        return True
    if v.is_graph_input() and _PAST.match(v.name or ""):
        return True
    return v.is_initializer() and bool(_LAYER_WEIGHT.match(v.name or ""))


def _match(layer: _Layer, proto: _Layer, signature: list, layers: list[_Layer]) -> None:
    """Check that `layer` is the copied layer's subgraph on its own weights, cache and hidden state
    (setting `res_in` of layer 0, the embedding, from where layer 1 reads its hidden state)."""
    j = layer.index
    if len(layer.nodes) != len(proto.nodes):
        raise ReplicationError(f"layer {j} has {len(layer.nodes)} nodes, layer {_PROTO} {len(proto.nodes)}")
    for pos, (node, pnode, classes) in enumerate(zip(layer.nodes, proto.nodes, signature)):
        where = f"layer {j} node {pos} ({node.op_type})"
        if _node_key(node) != _node_key(pnode) or len(node.inputs) != len(classes):
            raise ReplicationError(f"{where} differs from layer {_PROTO}'s ({pnode.op_type})")
        for k, (v, c) in enumerate(zip(node.inputs, classes)):
            if c[0] == "residual" and layer.res_in is None and v is not None and not _layer_specific(v, layers):
                layer.res_in = v
            if not _fits(v, c, layer):
                raise ReplicationError(f"{where} input {k} is {getattr(v, 'name', None)}, not the {c[0]} input "
                                       f"layer {_PROTO} has there")
        for v, pv in zip(node.outputs, pnode.outputs):
            if (v.dtype, str(v.shape)) != (pv.dtype, str(pv.shape)):
                raise ReplicationError(f"{where} output {v.name} is {v.dtype} {v.shape}, not {pv.dtype} {pv.shape}")
    for v, pv in zip((layer.res_out, *layer.kv), (proto.res_out, *proto.kv)):
        if layer.local[id(v)] != proto.local[id(pv)]:
            raise ReplicationError(f"layer {j} writes {v.name} from another node than layer {_PROTO} does")


def _fits(v, c: tuple, layer: _Layer) -> bool:
    kind, j = c[0], layer.index
    if kind == "none":
        return v is None
    if v is None:
        return False
    if kind == "local":
        return layer.local.get(id(v)) == (c[1], c[2])
    if kind == "residual":
        return v is layer.res_in
    if kind == "past":
        return v.is_graph_input() and v.name == f"past_{c[1]}_{j}"
    if kind == "weight":
        return v.is_initializer() and v.name == f"model.layers.{j}.{c[1]}"
    return v is c[1]


def _node_key(node) -> tuple:
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


def _check_outside_uses(graph, layers: list[_Layer], owner: dict, taps) -> None:
    """Outside its layer, a hidden state is read only by the next layer (the last one's by the final
    norm, the tap stand-in's by the taps too); a layer's weights only by its own nodes; its past K/V
    only by its own nodes and by Shape nodes (the past length)."""
    for layer in layers:
        for use in layer.res_out.uses():
            at, j = owner.get(id(use.node)), layer.index
            if at == j + 1 or (at is None and (j == TEMPLATE_LAYERS - 1 or (j == _TAP and use.node is taps))):
                continue
            raise ReplicationError(f"layer {layer.index}'s hidden state is read by {use.node.op_type} {use.node.name}")
    for name, v in graph.initializers.items():
        m = _LAYER_WEIGHT.match(name)
        if m and any(owner.get(id(use.node)) != int(m.group(1)) for use in v.uses()):
            raise ReplicationError(f"{name} is read outside its layer")
    for v in graph.inputs:
        m = _PAST.match(v.name or "")
        for use in v.uses() if m else ():
            at = owner.get(id(use.node))
            if at != int(m.group(2)) and not (at is None and use.node.op_type == "Shape"):
                raise ReplicationError(f"{v.name} is read by {use.node.op_type} {use.node.name} outside its layer")


def _taps_node(graph, tap_layers: tuple, n: int, layers: list[_Layer]):
    """The Concat writing `taps`, checked: its input k reads the tap stand-in's hidden state for a tap
    below the last layer (`template_target` put every such tap there), the final norm's output for a
    tap at the last layer."""
    node = graph.outputs[4].producer() if graph.outputs[4].name == "taps" else None
    if node is None or node.op_type != "Concat" or len(node.inputs) != len(tap_layers):
        raise ReplicationError(f"taps is not a Concat of the {len(tap_layers)} tap layers")
    for k, (v, t) in enumerate(zip(node.inputs, tap_layers)):
        ok = v is layers[_TAP].res_out if t != n - 1 else v is not None and not _layer_specific(v, layers)
        if not ok:
            raise ReplicationError(f"taps input {k} ({getattr(v, 'name', None)}) is not the template's tap of layer {t}")
    return node


def _real_weights(graph, module, readers: dict, signature: list) -> list[dict]:
    """Per layer of `module`: {name in the layer: initializer value}, in parameter order (a full trace's
    order), streamed ones as lazy tensors calling their reader, the others holding the parameter."""
    import onnx_ir as ir

    from .export import lazy_weight

    used = {c[1] for classes in signature for c in classes if c[0] == "weight"}
    out = []
    for i, layer in enumerate(module.model.layers):
        params = dict(layer.named_parameters())
        if set(params) != used:
            raise ReplicationError(f"the template's layer reads weights {sorted(used ^ set(params))[:3]} "
                                   "differently from the module's parameters")
        values = {}
        for suffix, p in params.items():
            like = graph.initializers[f"model.layers.{_PROTO}.{suffix}"]
            name = f"model.layers.{i}.{suffix}"
            if name in readers:
                tensor = lazy_weight(readers[name], like.dtype, like.shape, name)
            else:
                try:
                    tensor = ir.tensor(p.detach().cpu().numpy(), name=name)
                except TypeError as exc:  # a dtype numpy lacks (bfloat16): not one the export casts to
                    raise ReplicationError(f"{name}: {exc}") from None
            if tensor.dtype != like.dtype or tuple(tensor.shape) != tuple(like.shape):
                raise ReplicationError(f"{name} is {tensor.dtype} {tensor.shape}, the template's {like.dtype} {like.shape}")
            values[suffix] = ir.Value(name=name, shape=ir.Shape(like.shape), type=like.type, const_value=tensor)
        out.append(values)
    return out


def _past_inputs(graph, n: int) -> list:
    """past_key_i, past_value_i for every layer: the template's own inputs where it has them (a shape
    computation of the graph may read one), new ones of the same type after."""
    import onnx_ir as ir

    existing = {v.name: v for v in graph.inputs}
    like = existing["past_key_0"]
    out = []
    for i in range(n):
        for kind in ("key", "value"):
            name = f"past_{kind}_{i}"
            out.append(existing.get(name) or ir.Value(name=name, shape=ir.Shape(like.shape), type=like.type))
    return out


def _copy_layer(proto: _Layer, signature: list, i: int, res_in, weights: dict, past: list) -> tuple:
    """The copied layer's nodes for layer i, reading `res_in`, `weights` and `past` (key, value).

    Returns:
        (nodes, hidden state written, [key_i, value_i])."""
    import onnx_ir as ir

    made = {}  # (position, output index) in the copied layer -> the copy's value
    nodes = []
    for pos, (pnode, classes) in enumerate(zip(proto.nodes, signature)):
        inputs = [_resolve(c, made, res_in, weights, past) for c in classes]
        outputs = [ir.Value(name=_copy_name(pv.name, i), shape=None if pv.shape is None else ir.Shape(pv.shape),
                            type=pv.type) for pv in pnode.outputs]
        attrs = [ir.Attr(a.name, a.type, a.value, doc_string=a.doc_string) for a in pnode.attributes.values()]
        meta = {k: _LAYER_SCOPE.sub(f"model.layers.{i}", v) for k, v in pnode.metadata_props.items()}
        nodes.append(ir.Node(pnode.domain, pnode.op_type, inputs, attrs, overload=pnode.overload, outputs=outputs,
                             version=pnode.version, name=_copy_name(pnode.name, i), metadata_props=meta))
        made.update({(pos, k): v for k, v in enumerate(outputs)})
    res_out = made[proto.local[id(proto.res_out)]]
    return nodes, res_out, [made[proto.local[id(v)]] for v in proto.kv]


def _resolve(c: tuple, made: dict, res_in, weights: dict, past: list):
    """The value a copy reads where the copied layer reads an input of class `c` (see `_signature`)."""
    kind = c[0]
    if kind == "local":
        return made[(c[1], c[2])]
    if kind == "residual":
        return res_in
    if kind == "past":
        return past[0 if c[1] == "key" else 1]
    if kind == "weight":
        return weights[c[1]]
    return None if kind == "none" else c[1]


def _copy_name(name: str | None, i: int) -> str | None:
    """Layer i's name for a value or node of the copied layer: key_i / value_i for its outputs, the
    layer's prefix on the others (unique: the copied layer's names are)."""
    if name in (f"key_{_PROTO}", f"value_{_PROTO}"):
        return f"{name.split('_')[0]}_{i}"
    return None if name is None else f"model.layers.{i}/{name}"


def _rewire(layers: list[_Layer], owner: dict, taps, hidden: list, tap_layers: tuple) -> None:
    """Point the nodes after the layers at the copies: the final norm at the last copy's hidden state,
    each tap below the last layer at its layer's."""
    for use in list(layers[-1].res_out.uses()):
        if owner.get(id(use.node)) is None:
            use.node.replace_input_with(use.idx, hidden[-1])
    for k, t in enumerate(tap_layers):
        if t != len(hidden) - 1:
            taps.replace_input_with(k, hidden[t])


def _read_past_length_from_first_cache(graph, past_key_0) -> None:
    """Make the nodes outside the layers that read a past input's shape read past_key_0's.

    Every past input has the shape `[past_len, Hkv, D]`, so which one gives the past length P is
    immaterial, and the exporter picks any (past_key_31 of 72 at 36 layers, past_key_18 at 28, past_key_0
    in the template): this fixes it to the one the module reads (`past[0].shape[0]`), whatever the
    template's choice."""
    for node in graph:
        for k, v in enumerate(node.inputs):
            if node.op_type == "Shape" and v is not None and v.is_graph_input() and _PAST.match(v.name or "") \
                    and _scope_layer(node) is None:
                node.replace_input_with(k, past_key_0)


def _order_initializers(graph, weights: list[dict]) -> None:
    """Replace the template's layer weights by the real ones, where a full trace lists them (after the
    embedding, before the final norm: the order initializer deduplication keeps the first of)."""
    order, placed = [], False
    for name, v in graph.initializers.items():
        if not _LAYER_WEIGHT.match(name):
            order.append(v)
        elif not placed:
            order += [w for layer in weights for w in layer.values()]
            placed = True
    for name in list(graph.initializers):
        del graph.initializers[name]
    for v in order:
        graph.register_initializer(v)
