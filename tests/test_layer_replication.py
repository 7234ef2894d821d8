"""Layer replication (issue 11): a target exported from a traced 2-layer template is the graph a full trace
gives, modulo value names: the same operators wired the same way, the same inputs, outputs and initializer
names and bytes, the same onnxruntime outputs; streamed weights are still read only while written; and a
template of another structure is refused (full tracing then, with a warning)."""

from __future__ import annotations

import json
import types
import warnings

import onnx
import pytest
import torch

import tiny_models
from graph_compare import assert_same_graph, run_both
from dflash_export.export import graphs as export_mod
from dflash_export.export import io as export_io
from dflash_export.export import replication as layer_replication
from dflash_export.export import replication_graph
from dflash_export.checkpoint import weights as weights_mod
from dflash_export.build import BuildOptions, build
from dflash_export.export.graphs import ReplicationWarning, export_target
from int4_fusion import assert_int4_fused

@pytest.fixture(scope="module")
def five_layers(tmp_path_factory):
    """A tiny 5-layer Qwen3 (untied) in fp32 with random norm weights (no two initializers equal)."""
    from dflash_export.checkpoint.target import load_state_dict
    from dflash_export.families.registry import load_target_spec
    from dflash_export.nn.layers import TargetForExport, load_weights

    root = tmp_path_factory.mktemp("replication")
    hf = tiny_models.make_target(root / "hf", layers=5)
    spec = load_target_spec(hf)
    gen = torch.Generator().manual_seed(3)
    state = {k: (1 + 0.1 * torch.randn(v.shape, generator=gen) if "norm" in k else v)
             for k, v in load_state_dict(hf).items()}
    module = TargetForExport(spec, (0, 2, 4), torch.float32).eval()
    load_weights(module, state, "tiny")
    return root, spec, module


@pytest.mark.slow  # two exports; fast: every tiny build replicates its layers, and the refusals below
def test_replicated_target_is_the_full_trace(five_layers):
    root, spec, module = five_layers
    export_target(module, root / "full.onnx", replicate="never")
    export_target(module, root / "replicated.onnx", replicate="always")
    assert_same_graph(root / "full.onnx", root / "replicated.onnx")
    run_both(root / "full.onnx", root / "replicated.onnx", tiny_models.VOCAB)


@pytest.fixture(scope="module")
def template_graph(five_layers):
    """The optimized template graph of `five_layers`, serialized (each test edits its own copy)."""
    import onnx_ir as ir

    _, _, module = five_layers
    template, readers = layer_replication.template_target(module, {}, layer_replication.dense_layout(module))
    return ir.serde.serialize_model(export_mod._trace(template, *export_io.target_inputs(template), readers)), template


@pytest.mark.parametrize("edit, error", [("attribute", "differs from layer 1"), ("operator", "differs from layer 1"),
                                         ("cross-layer input", "2 other values read outside it"),
                                         ("shared weight", "a value of another layer")])
def test_a_template_of_another_structure_is_refused(five_layers, template_graph, edit, error):
    import onnx_ir as ir

    _, _, module = five_layers
    layout = layer_replication.dense_layout(module)
    model = ir.serde.deserialize_model(template_graph[0])
    plan = replication_graph.Plan(layout.kinds, layout.template_kinds, layout.cache_names, [[], []])
    first, last = replication_graph.partition(model.graph, plan)[0]
    if edit == "attribute":  # the first layer computes something else: it is not a copy of the last
        score_max = next(n for n in first.nodes if n.op_type == "ReduceMax")  # the attention's score max
        score_max.attributes["keepdims"] = ir.AttrInt64("keepdims", 0)
    elif edit == "operator":
        sigmoid = next(n for n in last.nodes if n.op_type == "Sigmoid")
        sigmoid.op_type = "Tanh"
    elif edit == "cross-layer input":  # the last layer reads a value of the first besides its hidden state
        node = next(n for n in last.nodes if n.op_type == "Add")
        node.replace_input_with(0, first.nodes[0].outputs[0])
    else:  # both layers read one norm weight (as initializer deduplication would make them)
        mul = next(n for n in last.nodes if any(v is not None and v.name == "model.layers.1.input_layernorm.weight"
                                                for v in n.inputs))
        k = [v.name if v is not None else None for v in mul.inputs].index("model.layers.1.input_layernorm.weight")
        mul.replace_input_with(k, model.graph.initializers["model.layers.0.input_layernorm.weight"])
    with pytest.raises(layer_replication.ReplicationError, match=error):
        layer_replication.replicate_layers(model, module, {}, layout, template_graph[1])


def test_auto_falls_back_to_tracing_every_layer_with_a_warning(five_layers, monkeypatch, tmp_path):
    """"auto" warns and traces the whole module when the template is refused; "always" raises; "never"
    traces the whole module only."""
    _, _, module = five_layers
    traced = []

    def trace(m, *args):
        traced.append(m.spec.arch.num_layers)
        return types.SimpleNamespace(graph=None)

    def refuse(graph, plan):
        raise layer_replication.ReplicationError("test")

    monkeypatch.setattr(export_mod, "_trace", trace)
    monkeypatch.setattr(export_mod, "_finish", lambda *args: None)
    monkeypatch.setattr(replication_graph, "partition", refuse)
    with pytest.raises(layer_replication.ReplicationError):
        export_target(module, tmp_path / "target.onnx", replicate="always")
    with pytest.warns(ReplicationWarning, match="tracing every layer"):
        export_target(module, tmp_path / "target.onnx")
    export_target(module, tmp_path / "target.onnx", replicate="never")
    assert traced == [2, 2, 5, 5]


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """A tiny tied 6-layer Llama (norms all ones: deduplicated to one initializer), a draft tapping layers
    0, 3 and 5 (the last, post-norm) and a proposal vocabulary."""
    root = tmp_path_factory.mktemp("replication_build")
    target = tiny_models.make_target(root / "target", family="llama", tie=True, layers=6)
    draft = tiny_models.make_draft(root / "draft", target, taps=[0, 3, 5])
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(0, tiny_models.VOCAB, 3))}))
    return target, draft


@pytest.mark.nightly  # two fp16 INT4 builds; `make test`: test_replicated_target_is_the_full_trace (fp32) and the
# fp16 INT4 hybrid replication (test_hybrid_replication.py)
def test_build_int4_fp16_streamed_replicated_is_the_full_trace(llama_pair, tmp_path, monkeypatch):
    """`build --dtype fp16 --quant int4 --proposal-head int4` with every matrix streamed: the graph is the
    full trace's, and weights are read only while the file is written."""
    from dflash_export.nn.layers import TargetForExport

    target, draft = llama_pair
    monkeypatch.setattr(weights_mod, "STREAM_MIN_ELEMENTS", 1000)
    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    opts = dict(max_seq_len=64, dtype="fp16", quiet=True, quant="int4", quant_block=32, proposal_head="int4")
    with monkeypatch.context() as m:
        m.setattr(layer_replication, "replicable", lambda module, layout: False)
        build(BuildOptions(str(target), str(draft), tmp_path / "full", **opts))

    reads = tiny_models.record_weight_reads(monkeypatch)

    used = []
    original_replicable = layer_replication.replicable
    monkeypatch.setattr(layer_replication, "replicable",
                        lambda module, layout: used.append(isinstance(module, TargetForExport))
                        or original_replicable(module, layout))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        build(BuildOptions(str(target), str(draft), tmp_path / "replicated", **opts))
    assert used == [True]
    early = [name for name, inside in reads if not inside and name.startswith("model.")]
    assert early and all(name.endswith("norm.weight") for name in early), early  # matrices: only while written
    assert ("model.layers.5.mlp.down_proj.weight", True) in reads
    full, replicated = tmp_path / "full" / "target.onnx", tmp_path / "replicated" / "target.onnx"
    assert_same_graph(full, replicated)
    # per layer: packed q/k/v, packed gate/up, o_proj, down_proj (the proposal head rows are the draft's)
    assert sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(replicated)).graph.node) == 6 * 4
    draft = onnx.load(str(tmp_path / "replicated" / "draft.onnx"), load_external_data=False)
    assert "draft_head.int4" in {i for n in draft.graph.node if n.op_type == "DequantizeLinear" for i in n.input}
    run_both(full, replicated, tiny_models.VOCAB)
    assert_int4_fused(tmp_path / "replicated", tmp_path)  # fp16 INT4 target and draft: all in MatMulNBits
