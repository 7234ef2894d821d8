"""`build --quant int4 --quant-method awq`: the scaling keeps the full-precision function, the search
protects outlier channels, and the graph computes exactly the model its stored scales define."""

from __future__ import annotations

import onnx
import pytest
import torch

import tiny_models
from tolerances import assert_fp32_close
from int4_fusion import assert_int4_fused
from dflash_export.quant import awq
from dflash_export.build import BuildOptions, build
from dflash_export.check.parity import run_check
from dflash_export.quant.rtn import dequantize, quantize_rtn
from dflash_export.checkpoint.weights import WeightSource
from runtime.errors import DFlashError


def _random_scales(model, mha: bool) -> dict[str, torch.Tensor]:
    cfg, g = model.config, torch.Generator().manual_seed(1)
    d, inner, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    out = {}
    for i in range(cfg.num_hidden_layers):
        for key, n in (("attn", d), ("mlp", d), ("down", inner)) + ((("o", hd),) if mha else ()):
            out[f"model.layers.{i}.{key}"] = torch.rand(n, generator=g) * 4 + 0.25
    return out


@pytest.mark.parametrize("family, heads, kv_heads, bias", [("qwen3", 4, 2, False), ("llama", 4, 4, True)])
def test_awq_scaling_keeps_the_full_precision_function(tmp_path, family, heads, kv_heads, bias):
    """Folded scales (norms, v rows into o, up rows into down, biases too) leave the logits unchanged."""
    import transformers

    extra = dict(attention_bias=True, mlp_bias=True) if bias else {}
    path = tiny_models.make_target(tmp_path / "t", family=family, layers=2, heads=heads, kv_heads=kv_heads, **extra)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    source = WeightSource("t", files=[path / "model.safetensors"])
    scales = _random_scales(model, heads == kv_heads)
    scaled = awq.scaled_source(source, scales)
    changed = [n for n in source.names() if not torch.equal(scaled.read(n).float(), source.read(n).float())]
    mha = heads == kv_heads
    assert len(changed) == 2 * (6 + mha + 2 + 2 * bias)  # q k v gate up down (o with MHA), 2 norms, v and up biases
    other = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    other.load_state_dict({n: scaled.read(n) for n in source.names()}, strict=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = model(ids).logits, other(ids).logits
    cfg = model.config  # both fp32 evaluations of the same function (tests/tolerances.py)
    assert_fp32_close(got, want, what="scaled logits", reduction=cfg.intermediate_size, depth=cfg.num_hidden_layers + 1)


def test_search_scale_protects_outlier_input_channels():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    x[:, 3] *= 40.0  # one channel carries large activations, as in real LLM layers
    w = torch.randn(32, 64, generator=g) * 0.05
    s, alpha = awq.search_scale(x, [w], 16, torch.float32, torch.arange(512))

    def err(scale):
        wq = dequantize(*quantize_rtn(w * scale, 16, torch.float32), 16) / scale
        return float(((x @ wq.T - x @ w.T) ** 2).mean())

    assert alpha > 0 and int(s.argmax()) == 3
    assert err(s) < 0.7 * err(torch.ones(64))  # alpha = 0 is plain RTN


@pytest.mark.nightly  # an AWQ build + check; `make test`: the AWQ scale search and refusals below and above
def test_awq_build_passes_check_with_its_stored_scales(tmp_path):
    target = tiny_models.make_target(tmp_path / "t", layers=3)
    draft = tiny_models.make_draft(tmp_path / "d", target, taps=[0, 2])
    art = tmp_path / "art"
    manifest = build(BuildOptions(str(target), str(draft), art, max_seq_len=64, quiet=True, quant="int4", quant_block=16,
                     quant_method="awq"))
    q = manifest["quantization"]
    assert (q["method"], q["awq_scales"], q["awq_calibration"]["tokens"]) == ("awq", "awq_scales.safetensors", 2048)
    assert q["awq_calibration"]["prompts"] == "seeded random ids (no tokenizer)"  # the tiny target has none
    scales = awq.load_scales(art / q["awq_scales"])
    assert sorted(scales) == sorted(f"model.layers.{i}.{k}" for i in range(3) for k in ("attn", "mlp", "down"))
    # the same graph form as RTN: 4 INT4 GEMMs a layer, no extra operator for the scales
    model = onnx.load(str(art / "target.onnx"), load_external_data=False)
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) == 3 * 4
    assert assert_int4_fused(art, tmp_path)["target"] == 3 * 4
    rep = run_check(art)  # the reference rebuilds the scaled, dequantized weights from the stored scales
    assert rep.passed and max(r.max_abs for r in rep.results if r.max_abs is not None) < 1e-4
    assert "dequantized INT4 weights (AWQ-scaled, block 16)" in rep.reference and "accuracy level 1" in rep.reference
    # ... and fails with other scales: the check reads them
    awq.save_scales(art / q["awq_scales"], {k: v * (1 + torch.rand(v.shape)) for k, v in scales.items()})
    assert not run_check(art).passed


def test_awq_is_refused_for_hybrids_and_without_prompts(tmp_path, monkeypatch):
    from hybrid_fixtures import CONFIG  # noqa: F401 (the hybrid family needs transformers' Qwen3.5)
    from dflash_export.families.qwen3_5 import check_options
    from dflash_export.quant.int4 import QuantConfig

    with pytest.raises(DFlashError, match=r"--quant-method awq supports dense Llama / Qwen3 targets only"):
        check_options(None, (), None, QuantConfig(method="awq", block=16), "full")
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setattr(awq, "PROMPTS_DIR", tmp_path / "missing")
    with pytest.raises(DFlashError, match=r"calibrates on .*train\*\.jsonl, which is missing"):
        awq.calibration_ids(tmp_path, 100)


def test_calibration_keeps_only_ids_the_embedding_has(tmp_path, monkeypatch):
    """A tokenizer with more ids than the embedding's rows (added tokens): those ids are dropped, not
    looked up (an IndexError deep inside torch before)."""
    class Tok:
        chat_template = None

        def encode(self, text):
            return [5, 500, 7]

    monkeypatch.setattr(awq, "_tokenizer", lambda path: Tok())
    ids = awq.calibration_ids(tmp_path, vocab_size=100)
    assert ids.shape == (awq.CALIBRATION_SEQUENCES, awq.CALIBRATION_LENGTH) and set(ids.unique().tolist()) == {5, 7}


def test_a_scales_file_that_does_not_fit_is_one_clear_error(tmp_path):
    path = tiny_models.make_target(tmp_path / "t", layers=2)
    source = WeightSource("t", files=[path / "model.safetensors"])
    d, inner = 64, 128
    good = {f"model.layers.{i}.{k}": torch.ones(n) for i in range(2) for k, n in (("attn", d), ("mlp", d), ("down", inner))}
    awq.scaled_source(source, good)  # fits
    for broken, what in ((dict(good, **{"model.layers.1.down": torch.ones(10)}), r"model.layers.1.down: \(10,\), expected \(128,\)"),
                         ({k: v for k, v in good.items() if k != "model.layers.0.attn"}, "model.layers.0.attn: missing"),
                         (dict(good, **{"model.layers.0.mlp": -torch.ones(d)}), "model.layers.0.mlp has values that are not finite and positive")):
        with pytest.raises(DFlashError, match=f"the AWQ scales do not fit this checkpoint \\({what}"):
            awq.scaled_source(source, broken)


def test_awq_without_prompts_is_refused_before_any_output(tmp_path, monkeypatch):
    import runtime_fixtures as rf

    target = tiny_models.make_target(tmp_path / "t", layers=2)
    rf.add_word_tokenizer(target)
    draft = tiny_models.make_draft(tmp_path / "d", target, taps=[0, 1])
    monkeypatch.setattr(awq, "PROMPTS_DIR", tmp_path / "missing")
    with pytest.raises(DFlashError, match=r"calibrates on .*train\*\.jsonl, which is missing"):
        build(BuildOptions(str(target), str(draft), tmp_path / "art", max_seq_len=64, quiet=True, quant="int4", quant_block=16,
              quant_method="awq"))
    rf.no_partial_output(tmp_path / "art")
