"""Layer replication of a Qwen3.5 hybrid target (issue 15): `build` traces a 4-layer template ([GDN,
attention, GDN, attention]) and copies its layers; the graph is the one tracing every layer gives (the
same operators wired the same way, the same initializer bytes, the same onnxruntime outputs), with the
constants the optimizer folds from each layer's weights (the norms' 1 + w, the conv kernel's columns,
-exp(A_log)) computed for every layer, and streamed weights read only while the file is written."""

from __future__ import annotations

import warnings

import onnx
import pytest
import tiny_models
from graph_compare import assert_same_graph, run_both
from hybrid_fixtures import VOCAB, save_with_random_mtp_head, six_layer_model, untrained_draft_dir
from int4_fusion import assert_int4_fused

from dflash_export.build import BuildOptions, build
from dflash_export.checkpoint import weights as weights_mod
from dflash_export.export import graphs as export_mod
from dflash_export.export import replication as layer_replication
from dflash_export.export.graphs import ReplicationWarning

MATRICES = {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
            "down_proj"}


@pytest.fixture(scope="module")
def six_layer_hybrid(tmp_path_factory):
    """A random 6-layer Qwen3_5ForCausalLM checkpoint with distinct norms, conv kernels and decays per layer,
    carrying a random `mtp.*` head, and the untrained DFlash draft as a directory: (target, draft). With
    both drafters the target graph also returns `final_hidden`, an output after the layers' caches."""
    model = six_layer_model()
    root = tmp_path_factory.mktemp("hybrid_replication")
    save_with_random_mtp_head(model, root / "target")
    untrained_draft_dir(root / "target", root / "draft")
    return root / "target", root / "draft"


@pytest.mark.slow  # two fp16 INT4 builds of a 6-layer hybrid: the only check of hybrid layer replication in `make test`
def test_replicated_hybrid_build_is_the_full_trace(six_layer_hybrid, tmp_path, monkeypatch):
    """fp16 graph, INT4 layers, every matrix streamed: replicated == traced layer by layer; the artifact
    passes `check` and speculative decoding on it equals plain (the fp16 INT4 hybrid's promises, also
    test_qwen3_5_runtime.py's nightly test_fp16_int4_hybrid_passes_check_and_speculates_losslessly)."""
    monkeypatch.setattr(weights_mod, "STREAM_MIN_ELEMENTS", 1000)
    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    target, draft = six_layer_hybrid
    opts = dict(max_seq_len=64, dtype="fp16", quiet=True, quant="int4", quant_block=32)
    with monkeypatch.context() as m:
        m.setattr(layer_replication, "replicable", lambda module, layout: False)
        build(BuildOptions(str(target), str(draft), tmp_path / "full", **opts))

    reads = tiny_models.record_weight_reads(monkeypatch)
    templates = []
    original = layer_replication.template_target

    def recording_template(module, readers, layout):
        templates.append(layout.template_kinds)
        return original(module, readers, layout)

    monkeypatch.setattr(layer_replication, "template_target", recording_template)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicationWarning)
        build(BuildOptions(str(target), str(draft), tmp_path / "replicated", **opts))
    assert templates == [("linear_attention", "full_attention") * 2]
    assert ("model.layers.4.linear_attn.out_proj.weight", True) in reads
    early = {name.split(".")[-2] for name, inside in reads if not inside and name.startswith("model.layers.")}
    assert {"conv1d", "linear_attn"} <= early  # the conv kernels and A_log / dt_bias: the optimizer folds them
    assert not early & MATRICES, early & MATRICES  # matrices: only while the file is written
    full, replicated = tmp_path / "full" / "target.onnx", tmp_path / "replicated" / "target.onnx"
    assert_same_graph(full, replicated)
    graph = onnx.load(str(replicated), load_external_data=False).graph
    folded = [t.name for t in graph.initializer if t.name.startswith("model.layers.5/")]
    assert folded, "the copies compute their own folded constants"
    run_both(full, replicated, VOCAB)
    assert_int4_fused(tmp_path / "replicated", tmp_path)  # fp16 INT4 hybrid: all in MatMulNBits
    from dflash_export.check.parity import run_check

    import runtime

    report = run_check(tmp_path / "replicated")
    assert report.passed and {"final_hidden", "mtp_hidden"} <= {r.output for r in report.results}, report
    with runtime.load(tmp_path / "replicated") as sess:
        for prompt in ([5, 17, 33, 8], [61, 2, 9]):
            plain = sess.generate(prompt, max_new_tokens=16, block_size=1, stop_token_ids=[])
            assert sess.generate(prompt, max_new_tokens=16, verify_len="all", stop_token_ids=[]).output_ids == plain.output_ids
