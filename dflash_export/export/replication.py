"""Export a deep target by tracing a shallow one: tracing cost that does not grow with the layer count.

Tracing, decomposing and optimizing a target costs seconds per decoder layer, more for a Gated DeltaNet
layer: most of a deep target's build (figures: docs/export.md#layer-replication-tracing-a-template),
and every decoder layer of one kind exports to the same subgraph on its own weights and caches. So
`export.graphs.export_target` traces a template instead: the same module with every layer kind of the target
twice, in order of first use (`Layout.template_kinds`: 2 layers for Llama / Qwen3, [GDN, attention,
GDN, attention] for a Qwen3.5 hybrid), optimized as usual, and `replicate_layers` turns it into the
full graph (the surgery is `replication_graph`):

1. The template's nodes are partitioned by the name scope the exporter records for each node
   (`model.layers.j`, from the decoder layer's call), and the first template layer of each kind is
   checked to be the second one's subgraph exactly (same operators, attributes and wiring, on its own
   weights, caches and folded constants, the values shared by all layers, and the previous layer's
   hidden state or the embedding as its only other input). Anything else raises `ReplicationError`
   (the caller then traces every layer).
2. The second template layer of each kind is copied once per real layer of that kind, with fresh value
   names, layer i's cache inputs and outputs, and its weights renamed to layer i's, each bound to its
   lazy reader (streamed weights are still read only while the file is written).
3. Constants the optimizer folded from a layer's weights (a hybrid's `1 + w` norm scales, conv kernel
   columns, `-exp(A_log)`) are recognised by value among the family's candidates (`Layout.folded`) and
   computed again from each real layer's weights.
4. The final norm reads the last copy; the `taps` Concat reads the copies at the draft's tap layers.
5. Initializer deduplication and CSE run once more on the whole graph, as the optimizer ran them on a
   full trace (a random checkpoint's norms, all ones, are then stored once, as before).

The template's own layer weights are stand-ins: small ones (and those `Layout.whole` names) get
distinct random values (equal ones would be merged by the optimizer's deduplication, hiding which
layer's weight a node reads) and large ones placeholders that are never read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from dflash_export.checkpoint.weights import empty_module, placeholder, set_parameter
from dflash_export.export import replication_graph as rg
from dflash_export.export.io import lazy_weight, target_inputs, target_io_names
from dflash_export.export.replication_graph import ReplicationError
from dflash_export.nn.layers import TargetForExport

__all__ = ["Layout", "ReplicationError", "dense_layout", "replicable", "template_target", "replicate_layers"]

_TAP = 0  # the template layer standing in for every tap below the last layer
# Stand-ins above this many elements are placeholders: above onnxscript's constant folding (8192) and
# initializer deduplication (1024) limits, so the optimizer never needs their values.
_STAND_IN_PLACEHOLDER = 1 << 14


@dataclass(frozen=True)
class Layout:
    """A target family's layer structure, as replication needs it.

    Attributes:
        kinds: the layer kind of each layer (e.g. "decoder"; "linear_attention" / "full_attention").
        cache_names: (kind, layer index) -> (cache input names, cache output names) of that layer, in
            graph order.
        make_template: (layer kinds, tap layers) -> an empty export module (`weights.empty_module`) of
            the same class and sizes with those layers.
        export_inputs: module -> (dummy args, (input names, output names), dynamic shapes) to trace it.
        io_names: module -> (input names, output names) of its graph, in order.
        folded: a layer module -> [(parameter name in the layer, value as numpy)]: every constant the
            graph optimizer may fold from its weights, as that fold computes it.
        whole: parameter name in a layer -> whether the optimizer reads its values (its template
            stand-in must hold values whatever its size).
    """

    kinds: tuple[str, ...]
    cache_names: Callable[[str, int], tuple[list[str], list[str]]]
    make_template: Callable[[tuple[str, ...], tuple[int, ...]], torch.nn.Module]
    export_inputs: Callable[[torch.nn.Module], tuple]
    io_names: Callable[[torch.nn.Module], tuple[list[str], list[str]]]
    folded: Callable[[torch.nn.Module], list[tuple[str, np.ndarray]]] = lambda layer: []
    whole: Callable[[str], bool] = lambda name: False

    @property
    def template_kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.kinds)) * 2


def dense_layout(module) -> Layout:
    """The layout of a Llama / Qwen3 `TargetForExport`: identical decoder layers with past K/V caches."""

    spec = module.spec

    def make_template(kinds, taps):
        tspec = replace(spec, arch=replace(spec.arch, num_layers=len(kinds)))
        return TargetForExport(tspec, taps, module.compute_dtype, draft_proposes=module.draft_proposes)

    return Layout(kinds=("decoder",) * spec.arch.num_layers,
                  cache_names=lambda kind, i: ([f"past_key_{i}", f"past_value_{i}"], [f"key_{i}", f"value_{i}"]),
                  make_template=make_template, export_inputs=target_inputs,
                  io_names=lambda m: target_io_names(m.spec.arch.num_layers, m.draft_proposes))


def replicable(module, layout: Layout) -> bool:
    """Whether `module` has more layers than its template, so replication saves time."""
    return len(layout.kinds) > len(layout.template_kinds)


def template_target(module, readers: dict, layout: Layout) -> tuple:
    """The template of `module` (a target export module) to trace in its place.

    It shares the embedding, final norm, LM head and buffers (proposal rows, RoPE) of `module`; its
    layers hold stand-in weights. A tap at the last layer stays at the template's last layer (post-norm);
    other taps all read its first layer (replication rewires them).

    Returns:
        (template module, readers of its streamed weights: `readers` for the shared ones, and for each
        large stand-in one that raises if called).

    Raises:
        ReplicationError: layers of one kind differ in their parameters' names, shapes or dtypes.
    """

    kinds = layout.template_kinds
    params = _layer_parameters(module, layout.kinds)
    last = len(layout.kinds) - 1
    taps = tuple(len(kinds) - 1 if t == last else _TAP for t in module.tap_layers)
    template = empty_module(lambda: layout.make_template(kinds, taps)).eval()
    template.model.embed_tokens, template.model.norm = module.model.embed_tokens, module.model.norm
    template.lm_head = module.lm_head
    for name, buf in module.named_buffers(recurse=False):
        setattr(template, name, buf)
    if hasattr(module, "rope_scale"):
        template.rope_scale = module.rope_scale
    shared = {k: v for k, v in readers.items() if not rg.LAYER_WEIGHT.match(k)}
    gen = torch.Generator().manual_seed(0)
    for j, (layer, kind) in enumerate(zip(template.model.layers, kinds)):
        for suffix, (shape, dtype) in params[kind].items():
            if _numel(shape) > _STAND_IN_PLACEHOLDER and not layout.whole(suffix):
                set_parameter(layer, suffix, placeholder(shape, dtype))
                shared[f"model.layers.{j}.{suffix}"] = _never_read(f"model.layers.{j}.{suffix}")
            else:
                set_parameter(layer, suffix, torch.randn(shape, generator=gen).to(dtype))
    return template, shared


def _layer_parameters(module, kinds: tuple[str, ...]) -> dict:
    """{kind: {parameter name in a layer: (shape, dtype)}}, the same for every layer of that kind."""
    out = {}
    for i, (layer, kind) in enumerate(zip(module.model.layers, kinds)):
        own = {k: (tuple(p.shape), p.dtype) for k, p in layer.named_parameters()}
        first = out.setdefault(kind, (i, type(layer), own))
        if own != first[2] or type(layer) is not first[1] or list(layer.buffers()):
            raise ReplicationError(f"decoder layer {i} differs from layer {first[0]} of the same kind ({kind})")
    return {kind: v[2] for kind, v in out.items()}


def _never_read(name: str):
    def read():
        raise AssertionError(f"{name} is a stand-in weight of the template; it must never be read")
    return read


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def replicate_layers(model, module, readers: dict, layout: Layout, template) -> None:
    """Expand an optimized template graph (`template_target` traced) to the layers of `module`, in place.

    Args:
        model: the onnx_ir model of the template (optimized, before GEMM packing).
        module: the full export module: its layer parameters give the real weights.
        readers: initializer name -> reader of the streamed weights of `module`.
        layout: `module`'s layout; `template`: the traced template module (its stand-ins).

    Raises:
        ReplicationError: the template's structure is not what replication relies on (see module doc);
            `model` may be left half-edited then (the caller traces every layer instead).
    """
    from onnx_ir.passes.common import (
        CommonSubexpressionEliminationPass,
        DeduplicateInitializersPass,
    )

    graph = model.graph
    plan = rg.Plan(layout.kinds, layout.template_kinds, layout.cache_names,
                   [layout.folded(layer) for layer in template.model.layers])
    layers, after = rg.partition(graph, plan)
    protos = plan.protos
    sigs = {kind: rg.signature(layers[j], layers, plan) for kind, j in protos.items()}
    for layer in layers:
        kind = plan.template_kinds[layer.index]
        rg.match(layer, layers[protos[kind]], sigs[kind], layers, plan)
    owner = {id(node): layer.index for layer in layers for node in layer.nodes}
    taps = _taps_node(graph, module.tap_layers, len(layout.kinds), layers, plan)
    rg.check_outside_uses(graph, layers, owner, taps, plan, _TAP)
    template_folded = _folded_values(sigs, layers, plan)
    weights, folded = _real_weights(graph, module, readers, layout, sigs, layers, protos)
    caches = _cache_inputs(graph, layout, layers, protos)
    copies, res = [], layers[0].res_in
    for i, kind in enumerate(layout.kinds):
        proto = layers[protos[kind]]
        copies.append(rg.copy_layer(proto, sigs[kind], i, res, weights[i], folded[i], caches[i],
                                    layout.cache_names(kind, i)[1]))
        res = copies[-1][1]
    rg.rewire(layers, owner, taps, [c[1] for c in copies], module.tap_layers)
    ins, outs = layout.io_names(module)
    heads_in = len(ins) - sum(map(len, caches))
    # outputs by name, in the module's order: the copies' cache outputs replace the template layers', and
    # the head's outputs keep their places before and after them (an MTP target's `final_hidden` is last)
    new_caches = {v.name: v for c in copies for v in c[2]}
    kept = {v.name: v for v in graph.outputs if v.name not in new_caches}
    graph.outputs[:] = [new_caches[name] if name in new_caches else kept[name] for name in outs]
    graph.inputs[:] = [*graph.inputs[:heads_in], *[v for c in caches for v in c]]
    graph.remove([node for layer in layers for node in layer.nodes], safe=True)
    graph.insert_before(after, [node for c in copies for node in c[0]])
    _read_lengths_from_first_caches(graph, layout, layers, plan, {id(node) for c in copies for node in c[0]})
    rg.order_initializers(graph, [[*w.values(), *f.values()] for w, f in zip(weights, folded)], template_folded)
    # the optimizer's last passes on a full trace, now on the real weights: equal small weights (a random
    # checkpoint's norms) are stored once, and nodes that became identical are merged, as before
    DeduplicateInitializersPass()(model)
    CommonSubexpressionEliminationPass()(model)
    if [v.name for v in graph.inputs] != ins or [v.name for v in graph.outputs] != outs:
        raise AssertionError("the replicated graph's inputs or outputs are not the module's")


def _taps_node(graph, tap_layers: tuple, n: int, layers: list, plan: rg.Plan):
    """The Concat writing `taps`, checked: its input k reads the tap stand-in's hidden state for a tap
    below the last layer (`template_target` put every such tap there), the final norm's output for a
    tap at the last layer."""
    out = next((v for v in graph.outputs if v.name == "taps"), None)
    node = out.producer() if out is not None else None
    if tuple(tap_layers) == (n - 1,) and out is not None and (node is None or node.op_type != "Concat"):
        # one tap, the final norm's output (an artifact without a DFlash draft): no Concat to rewire
        if rg.layer_specific(out, layers, plan):
            raise ReplicationError(f"taps ({out.name}) is not the final norm's output")
        return None
    if node is None or node.op_type != "Concat" or len(node.inputs) != len(tap_layers):
        raise ReplicationError(f"taps is not a Concat of the {len(tap_layers)} tap layers")
    for k, (v, t) in enumerate(zip(node.inputs, tap_layers)):
        ok = v is layers[_TAP].res_out if t != n - 1 else v is not None and not rg.layer_specific(v, layers, plan)
        if not ok:
            raise ReplicationError(f"taps input {k} ({getattr(v, 'name', None)}) is not the template's tap of layer {t}")
    return node


def _folded_values(sigs: dict, layers: list, plan: rg.Plan) -> set:
    """ids of the template's folded-constant initializers (`match` found them at the same places in
    both layers of a kind), to drop from the replicated graph."""
    out = set()
    for layer in layers:
        for node, classes in zip(layer.nodes, sigs[plan.template_kinds[layer.index]]):
            out |= {id(v) for v, c in zip(node.inputs, classes) if c[0] == "folded"}
    return out


def _real_weights(graph, module, readers: dict, layout: Layout, sigs: dict, layers: list, protos: dict) -> tuple:
    """Per layer of `module`: ({name in the layer: initializer value}, in parameter order (a full trace's
    order), streamed ones as lazy tensors calling their reader, the others holding the parameter;
    {k: initializer value} of the constants its ("folded", k) inputs read, computed from its weights)."""
    import onnx_ir as ir


    weights, folded = [], []
    for i, (layer, kind) in enumerate(zip(module.model.layers, layout.kinds)):
        proto, sig = layers[protos[kind]], sigs[kind]
        used = {c[1] for classes in sig for c in classes if c[0] == "weight"}
        wanted = dict.fromkeys(c[1] for classes in sig for c in classes if c[0] == "folded")  # in reading order
        candidates = layout.folded(layer) if wanted else []
        sources = {candidates[k][0] for k in wanted}
        params = dict(layer.named_parameters())
        if set(params) != used | sources:
            raise ReplicationError(f"the template's layer {proto.index} reads weights "
                                   f"{sorted((used | sources) ^ set(params))[:3]} differently from the module's parameters")
        values = {}
        for suffix, p in params.items():
            if suffix not in used:
                continue
            like = graph.initializers[f"model.layers.{proto.index}.{suffix}"]
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
        weights.append(values)
        folded.append({k: _folded_value(proto, sig, k, candidates[k][1], i) for k in wanted})
    return weights, folded


def _folded_value(proto, sig: list, k: int, value: np.ndarray, i: int):
    """Layer i's initializer for the prototype's ("folded", k) constant, holding `value`."""
    import onnx_ir as ir

    like = next(v for node, classes in zip(proto.nodes, sig) for v, c in zip(node.inputs, classes)
                if c == ("folded", k))
    name = f"model.layers.{i}/{like.name}"
    return ir.Value(name=name, shape=ir.Shape(like.shape), type=like.type, const_value=ir.tensor(value, name=name))


def _cache_inputs(graph, layout: Layout, layers: list, protos: dict) -> list[list]:
    """Each layer's cache input values: the template's own inputs where it has one of that name (a
    shape computation of the graph may read one), new ones typed as its kind's prototype's after."""
    import onnx_ir as ir

    existing = {v.name: v for v in graph.inputs}
    out = []
    for i, kind in enumerate(layout.kinds):
        like = layout.cache_names(kind, protos[kind])[0]
        out.append([existing.get(name) or ir.Value(name=name, shape=existing[proto].shape, type=existing[proto].type)
                    for name, proto in zip(layout.cache_names(kind, i)[0], like)])
    return out


def _read_lengths_from_first_caches(graph, layout: Layout, layers: list, plan: rg.Plan, copied: set) -> None:
    """Make the Shape nodes that read a template cache input, other than the copies' own (ids in
    `copied`), read the same cache of the module's first layer of that kind.

    All layers of a kind share their caches' dynamic sizes (the past length, the pending rows), so which
    one a length is read from is immaterial, and the exporter picks any (past_key_31 of 72 at 36 layers,
    past_key_18 at 28); this fixes it to the first (the one a module reads: `past[0].shape[0]`)."""
    inputs = {v.name: v for v in graph.inputs}
    first = {kind: layout.kinds.index(kind) for kind in set(layout.kinds)}
    for node in graph:
        if node.op_type != "Shape" or id(node) in copied:
            continue
        for k, v in enumerate(node.inputs):
            j = next((j for j in range(len(layers)) if v is not None and v.name in plan.cache_inputs(j)), None)
            if j is not None:
                kind = plan.template_kinds[j]
                name = layout.cache_names(kind, first[kind])[0][plan.cache_inputs(j).index(v.name)]
                node.replace_input_with(k, inputs[name])
