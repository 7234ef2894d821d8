"""Streamed export (issue 11): weights are read only while they are written, the graphs are the ones an
in-memory export gives, fp16 graphs keep fp32 RoPE frequencies, and `check_graph` reads external data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

import tiny_models
from dflash_export.export import graphs as export_mod
from dflash_export.checkpoint import weights as weights_mod
from dflash_export.build import BuildOptions, build
from dflash_export.export.checks import check_graph
from runtime.errors import DFlashError
from runtime.graphs.tree import chain_inputs


def _graph_values(path):
    model = onnx.load(str(path), load_external_data=True)
    return [n.op_type for n in model.graph.node], {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("streamed")
    target = tiny_models.make_target(root / "target", tie=True, hidden=64, layers=3)
    draft = tiny_models.make_draft(root / "draft", target, taps=[0, 2])
    (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": list(range(0, tiny_models.VOCAB, 2))}))
    return target, draft


# two builds per dtype: `make test-nightly` runs both; in `make test`, test_qwen3_5_runtime.py's
# test_build_streams_the_hybrid_weights checks that streamed weights are read once, while written, and
# test_export_memory.py that a real build stays within its memory bound
@pytest.mark.nightly
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_streamed_weights_give_the_same_graph_and_are_read_only_while_written(pair, tmp_path, monkeypatch, dtype):
    target, draft = pair
    build(BuildOptions(str(target), str(draft), tmp_path / "eager", max_seq_len=64, dtype=dtype, quiet=True))


    # stream every weight matrix of the tiny pair (not only those above 16k elements) and write external data
    monkeypatch.setattr(weights_mod, "STREAM_MIN_ELEMENTS", 1000)
    monkeypatch.setattr(export_mod, "EXTERNAL_DATA_THRESHOLD", 0)
    reads = tiny_models.record_weight_reads(monkeypatch)
    build(BuildOptions(str(target), str(draft), tmp_path / "streamed", max_seq_len=64, dtype=dtype, quiet=True))

    streamed = {name for name, inside in reads if inside}
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "fc.weight",
            "layers.1.self_attn.q_proj.weight"} <= streamed
    early = [name for name, inside in reads if not inside]  # only small tensors (norms) are read before writing
    assert early and all(name.endswith("norm.weight") for name in early), early
    heads = {}
    for graph in ("target", "draft"):
        assert (tmp_path / "streamed" / f"{graph}.onnx.data").is_file()
        ops_a, init_a = _graph_values(tmp_path / "eager" / f"{graph}.onnx")
        ops_b, init_b = _graph_values(tmp_path / "streamed" / f"{graph}.onnx")
        assert ops_a == ops_b
        assert init_a.keys() == init_b.keys()
        for name in init_a:
            assert init_a[name].dtype == init_b[name].dtype and np.array_equal(init_a[name], init_b[name]), name
        heads[graph] = init_b.get("draft_head")
    # the draft vocabulary's head rows, streamed too, at the end of the draft graph (which proposes)
    assert heads["target"] is None and heads["draft"].shape == (tiny_models.VOCAB // 2, 64)
    # the tied table is read for itself and once more for the draft rows, both while writing
    assert reads.count(("model.embed_tokens.weight", True)) == 2


def test_fp16_graph_keeps_fp32_rope_frequencies_at_long_positions(tiny, tmp_path):
    """RoPE inverse frequencies rounded to fp16 turn keys at position 2000 by up to ~0.5 rad; they stay fp32."""
    import onnxruntime as ort

    from dflash_export.export.graphs import export_target
    from dflash_export.nn.layers import TargetForExport, cast_for_export, load_weights, rope_inv_freq

    t = tiny.target("qwen3")
    module = TargetForExport(t.spec, t.taps, torch.float16).eval()
    load_weights(module, t.state, "tiny")
    cast_for_export(module, torch.float16)
    assert module.inv_freq.dtype == torch.float32
    assert torch.equal(module.inv_freq, rope_inv_freq(t.spec.arch, t.spec.family)[0])
    export_target(module, tmp_path / "target.onnx")
    a = t.spec.arch
    sess = ort.InferenceSession(str(tmp_path / "target.onnx"), providers=["CPUExecutionProvider"])
    past = 2000
    feed = {"input_ids": np.array([5], np.int64), "draft_hidden": np.zeros((0, a.hidden_size), np.float16),
            "temperature": np.zeros(1, np.float32), "uniform": np.zeros(1, np.float32), **chain_inputs(0)}
    for i in range(a.num_layers):
        for kind in ("key", "value"):
            feed[f"past_{kind}_{i}"] = np.zeros((past, a.num_kv_heads, a.head_dim), np.float16)
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    args = [torch.from_numpy(v.astype(np.float32) if v.dtype == np.float16 else v) for v in feed.values()]
    with torch.no_grad():
        want = t.module(*args)
    key0 = want[5].numpy()  # outputs: next_ids, proposal_ids, next_embeddings, logits, taps, key_0, ...
    err = np.abs(got["key_0"].astype(np.float32) - key0).max()
    assert err < 0.02 * np.abs(key0).max(), f"key_0 at position {past} is off by {err} (max |k| {np.abs(key0).max()})"


def _graph_with(tmp_path, arrays, external: bool):
    nodes = [helper.make_node("Identity", [name], [f"{name}_out"]) for name in arrays]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(f"{n}_out", onnx.TensorProto.FLOAT, None)
                                              for n in arrays],
                              initializer=[numpy_helper.from_array(a, n) for n, a in arrays.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    path = tmp_path / "g.onnx"
    onnx.save(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
              location="g.onnx.data", size_threshold=0)
    return path


@pytest.mark.parametrize("external", [True, False])
def test_check_graph_finds_duplicates_in_external_data(tmp_path, external):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    other = rng.standard_normal((64, 96)).astype(np.float32)
    ok = _graph_with(tmp_path, {"w": w, "other": other, "zeros_a": np.zeros((64, 96), np.float32),
                                "zeros_b": np.zeros((64, 96), np.float32)}, external)
    assert (tmp_path / "g.onnx.data").is_file() == external
    assert check_graph(ok)["initializer_bytes"] == 4 * w.nbytes
    for copy in (w.copy(), np.ascontiguousarray(w.T)):
        dup = _graph_with(tmp_path, {"w": w, "copy": copy}, external)
        with pytest.raises(DFlashError, match="weight copy duplicates w"):
            check_graph(dup)


def test_check_graph_names_missing_external_data(tmp_path):
    path = _graph_with(tmp_path, {"w": np.ones((64, 96), np.float32) * np.arange(96)}, True)
    (tmp_path / "g.onnx.data").unlink()
    with pytest.raises(DFlashError, match="external data is missing or truncated"):
        check_graph(path)
