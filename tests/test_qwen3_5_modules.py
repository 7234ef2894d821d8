"""Qwen3.5 hybrid export modules (`dflash_export.nn.qwen3_5`) against transformers' Qwen3_5ForCausalLM.

A tiny random config (hidden 64, layers [GDN, GDN, GDN, full attention], GQA on both kinds, partial
RoPE 0.25 of head_dim 32) built in memory: the chunk routine against HF's token-by-token delta rule,
whole prompts and chunked prompts (lagged GDN state, pending rows) against HF logits, exact rollback
of rejected verify rows, and the ONNX export in onnxruntime.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tolerances import assert_fp32_close

from dflash_export.nn import gated_delta as gd
from dflash_export.nn import qwen3_5 as q35
from dflash_export.export.graphs import export_hybrid_target
from dflash_export.nn.layers import load_weights

TAPS = (0, 2, 3)
VOCAB = 256


def _hf_config(**overrides):
    import transformers

    cfg = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    cfg.update(overrides)
    return transformers.Qwen3_5TextConfig(**cfg)


def _hf_model(seed: int = 0, **overrides):
    """A random Qwen3_5ForCausalLM (eager attention) with weights large enough to make every part count:
    non-zero norm weights (zero-centred and gated), a conv that mixes rows, varied decays."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(_hf_config(**overrides)).eval()
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.normal_(0.0, 0.2)
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4.0).log())
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.4)
            else:
                p.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def pair():
    """(HF model, export module) on the same weights."""
    hf = _hf_model()
    spec = q35.HybridSpec.from_config(hf.config.to_dict())
    module = q35.Qwen35TargetForExport(spec, TAPS).eval()
    load_weights(module, q35.text_state_dict(hf.state_dict()), "tiny qwen3.5")
    return hf, module


def _hf_reference(hf, ids):
    with torch.no_grad():
        out = hf(torch.tensor([list(ids)]), output_hidden_states=True)
    hs = out.hidden_states
    return out.logits[0], torch.cat([hs[L + 1][0] for L in TAPS], dim=-1), hs[-1][0]


def _call(module, ids, caches, logit_rows=None):
    ids = torch.tensor(list(ids), dtype=torch.int64)
    rows = torch.arange(ids.shape[0]) if logit_rows is None else torch.tensor(logit_rows, dtype=torch.int64)
    with torch.no_grad():
        return module(ids, rows, *caches)


def _max_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


# ---- the chunk routine ----------------------------------------------------------------------------

REGIMES = ("hf-init-decay", "slow-decay-beta-near-1", "hard-forget-then-slow")


def _delta_inputs(n, seed, regime="hf-init-decay", hk=2, hv=4, dk=16, dv=8):
    """Random delta-rule inputs: L2-normalised q, k (GQA 2 -> 4 heads), decays from HF's A_log init
    range, or slow decays with beta ~ 1 (the worst-conditioned triangular system), or a hard forget
    (g down to -100) in the first quarter of the rows followed by slow decays (large prefix sums)."""
    gen = torch.Generator().manual_seed(seed)
    q = gd.l2_normalize(torch.randn(n, hk, dk, generator=gen))
    k = gd.l2_normalize(torch.randn(n, hk, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    a = torch.randn(n, hv, generator=gen)
    slow = regime != "hf-init-decay"
    A = torch.full((hv,), 1e-3) if slow else torch.empty(hv).uniform_(0.01, 16, generator=gen)
    g = -A * torch.nn.functional.softplus(a + 1.0)
    if regime == "hard-forget-then-slow":
        g[: n // 4] = -100.0 * torch.rand(n // 4, hv, generator=gen)
    beta = torch.sigmoid(torch.randn(n, hv, generator=gen) + (3.0 if slow else 0.0))
    state = torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("regime", REGIMES)
@pytest.mark.parametrize("n", [1, 3, 17, 64])
def test_gated_delta_chunk_matches_hf_recurrent(n, regime):
    """Outputs and final state equal HF's token-by-token rule from a non-zero state (fp32, 1e-5)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    q, k, v, g, beta, state = _delta_inputs(n, seed=n, regime=regime)
    out, final = gd.gated_delta_chunk(q, k, v, g, beta, state)
    want, want_final = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None], output_final_state=True)
    assert out.shape == (n, 4, 8) and final.shape == (4, 16, 8)
    # the chunk form solves a triangular system where HF steps row by row: each sums n rows of dk terms
    rounding = dict(reduction=max(n, 1) * k.shape[-1], depth=2)
    assert_fp32_close(out, want[0], what="outputs", **rounding)
    assert_fp32_close(final, want_final[0], what="final state", **rounding)


def test_gated_delta_chunk_zero_rows_keeps_state():
    q, k, v, g, beta, state = _delta_inputs(0, seed=0)
    out, final = gd.gated_delta_chunk(q, k, v, g, beta, state)
    assert out.shape == (0, 4, 8)
    assert torch.equal(final, state)


def test_inverse_factor_count():
    assert 2 ** gd.INVERSE_FACTORS >= gd.MAX_ROWS == 64


# ---- the whole module against HF ------------------------------------------------------------------

def test_spec_and_weight_names(pair):
    hf, module = pair
    spec = module.spec
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert spec.rotary_dim == 8 and spec.conv_dim == 2 * 2 * 16 + 4 * 8
    # ConditionalGeneration layout: text weights under model.language_model, a vision tower, MTP head
    state = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in hf.state_dict().items()}
    state.update({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(1), "mtp.fc.weight": torch.zeros(1)})
    assert set(q35.text_state_dict(state)) == set(hf.state_dict())
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True,
              "text_config": hf.config.to_dict()}
    assert q35.HybridSpec.from_config(nested).tie_word_embeddings


def test_full_prompt_matches_hf(pair):
    """One call on a 14-token prompt: logits of every row, the taps and the final hidden vs HF."""
    hf, module = pair
    ids = torch.randint(0, VOCAB, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    logits, taps, last = _hf_reference(hf, ids)
    out = _call(module, ids, module.empty_caches())
    assert _max_err(out[0], logits) <= 1e-4
    assert _max_err(out[2], taps) <= 1e-4
    assert _max_err(out[1], last) <= 1e-4


def test_tied_embeddings_and_mrope_config_match_hf():
    """tie_word_embeddings: no lm_head of its own (HF's tied copy in the state dict is dropped); a
    released-style mRoPE section (interleaved T/H/W frequencies) is plain 1-D RoPE for text positions."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    hf = _hf_model(seed=6, tie_word_embeddings=True, rope_parameters=rope)
    module = q35.Qwen35TargetForExport(q35.HybridSpec.from_config(hf.config.to_dict()), TAPS).eval()
    load_weights(module, q35.text_state_dict(hf.state_dict()), "tiny tied qwen3.5")
    assert module.lm_head is None
    ids = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    want, _, _ = _hf_reference(hf, ids)
    out = _call(module, ids, module.empty_caches(), logit_rows=[8, 0])
    assert _max_err(out[0], want[[8, 0]]) <= 1e-4


@pytest.mark.parametrize("sizes", [(5, 7, 1, 1), (64, 64, 12)], ids=["5+7+1+1", "64+64+12"])
def test_chunked_prompt_matches_hf(pair, sizes):
    """A prompt in calls of `sizes` rows, each call's rows all accepted (the next call's pending rows,
    up to MAX_ROWS of them): logits at every position equal HF's on the whole sequence."""
    hf, module = pair
    ids = torch.randint(0, VOCAB, (sum(sizes),), generator=torch.Generator().manual_seed(2)).tolist()
    want, _, _ = _hf_reference(hf, ids)
    caches, start = module.empty_caches(), 0
    for size in sizes:
        out = _call(module, ids[start : start + size], caches)
        assert _max_err(out[0], want[start : start + size]) <= 1e-4, f"rows {start}..{start + size - 1}"
        caches = q35.next_caches(module, caches, out, accepted=size)
        start += size


def test_rejected_rows_leave_no_trace(pair):
    """A 1 + 4 row verify of which acc + 1 = 2 rows are accepted, then a next call: equal, within fp32
    rounding (tests/tolerances.py), to a run that only ever saw those 2 rows, in logits and in every cache,
    and both runs' logits within rounding of HF in float64 on the committed sequence."""
    hf, module = pair
    gen = torch.Generator().manual_seed(3)
    prompt, verify, nxt = (torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 5, 3))
    base = q35.next_caches(module, module.empty_caches(), out := _call(module, prompt, module.empty_caches()), 6)

    spec_out = _call(module, verify, base)
    spec_caches = q35.next_caches(module, base, spec_out, accepted=2)
    spec_next = _call(module, nxt, spec_caches)

    plain_out = _call(module, verify[:2], base)
    plain_caches = q35.next_caches(module, base, plain_out, accepted=2)
    plain_next = _call(module, nxt, plain_caches)

    assert out[0].shape == (6, VOCAB)
    # the states a call returns do not depend on its own rows at all: bit for bit
    for i, kind in enumerate(module.spec.layer_types):
        o = 3 + module.cache_offsets[i]
        if kind == "linear_attention":
            assert torch.equal(spec_out[o], plain_out[o]) and torch.equal(spec_out[o + 1], plain_out[o + 1])
    # the rest differs by the rounding of 5-row vs 2-row products only (kernels chosen by shape and CPU)
    rounding = dict(reduction=module.spec.intermediate_size, depth=len(module.spec.layer_types) + 1)
    want, _, _ = _hf_reference(copy.deepcopy(hf).double(), prompt + verify[:2] + nxt)
    for name, logits in (("verify", spec_out[0][:2]), ("plain", plain_out[0])):
        assert_fp32_close(logits, want[6:8], evaluations=1, what=f"{name} logits vs float64", **rounding)
    for name, logits in (("after verify", spec_next[0]), ("after plain", plain_next[0])):
        assert_fp32_close(logits, want[8:], evaluations=1, what=f"{name}: next logits vs float64", **rounding)
    assert_fp32_close(spec_out[0][:2], plain_out[0], what="verify rows", **rounding)
    for j, (got, want) in enumerate(zip(spec_caches, plain_caches)):
        assert got.shape == want.shape
        assert_fp32_close(got, want, what=f"cache {j}", **rounding)
    for j, (got, want) in enumerate(zip(spec_next, plain_next)):
        assert got.shape == want.shape
        assert_fp32_close(got, want, what=f"next call output {j}", **rounding)


def _hf_states(hf, ids) -> list:
    """HF's cache after `ids`, per layer: (conv state `[K-1, C]` (HF keeps K inputs, the module K-1),
    recurrent state `[Hv, dk, dv]`) for a GDN layer, (keys, values) `[S, Hkv, D]` for an attention layer."""
    with torch.no_grad():
        cache = hf(torch.tensor([list(ids)]), use_cache=True).past_key_values
    out = []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):
            out.append((layer.conv_states[0][0, :, 1:].T, layer.recurrent_states[0][0]))
        else:
            out.append((layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)))
    return out


def _state_errors(module, out, hf_before, hf_after, pos: int, rows: int) -> float:
    """Worst difference between a call's cache outputs and HF's: a GDN layer's returned states are those
    after the committed tokens before the call (`hf_before`), an attention layer's K/V rows are the new
    rows' (`hf_after`, rows pos .. pos + rows - 1)."""
    worst = 0.0
    for i, kind in enumerate(module.spec.layer_types):
        o = 3 + module.cache_offsets[i]
        if kind == "linear_attention":
            if hf_before is not None:
                worst = max(worst, _max_err(out[o], hf_before[i][0]), _max_err(out[o + 1], hf_before[i][1]))
        else:
            k, v = hf_after[i]
            worst = max(worst, _max_err(out[o], k[pos : pos + rows]), _max_err(out[o + 1], v[pos : pos + rows]))
    return worst


def test_verify_steps_past_200_with_rejections_match_hf(pair):
    """A 212-token prompt in chunks, then 16-, 3- and 1-row verifies accepting part, all or one of their
    rows: logits and taps of every row, the attention layers' new K/V rows and the GDN conv and recurrent
    states equal HF's (1e-4) on the committed sequence, where each rejected row's token is replaced by
    another one before the next call (so a state that kept a trace of it would differ)."""
    hf, module = pair
    seq = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    caches, pos, worst = module.empty_caches(), 0, {}
    steps = [(64, 64), (64, 64), (64, 64), (20, 20), (16, 3), (3, 1), (1, 1), (16, 16), (3, 3), (16, 1), (1, 1)]
    for rows, accepted in steps:
        out = _call(module, seq[pos : pos + rows], caches)
        logits, taps, _ = _hf_reference(hf, seq[: pos + rows])
        tag = "prefill" if accepted == rows == 64 or rows == 20 else f"verify {rows}"
        worst[tag] = max(worst.get(tag, 0.0), _max_err(out[0], logits[pos:]), _max_err(out[2], taps[pos:]))
        hf_before = _hf_states(hf, seq[:pos]) if pos else None
        worst["states"] = max(worst.get("states", 0.0),
                              _state_errors(module, out, hf_before, _hf_states(hf, seq[: pos + rows]), pos, rows))
        caches = q35.next_caches(module, caches, out, accepted)
        seq[pos + accepted : pos + rows] = [(t + 1) % VOCAB for t in seq[pos + accepted : pos + rows]]
        pos += accepted
    assert pos > 200 and set(worst) == {"prefill", "verify 16", "verify 3", "verify 1", "states"}
    assert max(worst.values()) <= 1e-4, worst


# ---- ONNX export ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def onnx_case(tmp_path_factory):
    """(module, its ONNX path, an onnxruntime session) for a 2-layer body, one GDN layer and one gated
    attention layer: tracing costs ~10 s per GDN layer (two chunk routines of symbolic shapes), and
    every GDN layer is the same code."""
    import onnxruntime as ort

    hf = _hf_model(seed=5, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    module = q35.Qwen35TargetForExport(q35.HybridSpec.from_config(hf.config.to_dict()), (0, 1)).eval()
    load_weights(module, q35.text_state_dict(hf.state_dict()), "tiny qwen3.5")
    path = tmp_path_factory.mktemp("qwen3_5") / "target.onnx"
    export_hybrid_target(module, path)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return module, path, ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def test_onnx_graph_uses_trt10_ops(onnx_case):
    from dflash_export.export.checks import OPSET, check_graph, trt10_supported_ops

    info = check_graph(onnx_case[1])
    assert set(info["ops"]) <= trt10_supported_ops() and info["opset"] == OPSET
    assert not {"Loop", "Scan", "If"} & set(info["ops"])


def test_onnx_matches_pytorch(onnx_case):
    """ORT vs the module (1e-4) on a first call (P = 0) of 1 and of 5 rows, then steps with pending rows
    (P > 0) of 1 and 4 rows, partial acceptance in between, and logits of chosen rows."""
    module, _, sess = onnx_case
    in_names = [i.name for i in sess.get_inputs()]
    gen = torch.Generator().manual_seed(4)

    def both(ids, caches, rows):
        want = _call(module, ids, caches, rows)
        feed = dict(zip(in_names, [np.asarray(ids, np.int64), np.asarray(rows, np.int64),
                                   *(c.numpy() for c in caches)]))
        got = sess.run(None, feed)
        assert len(got) == len(want)
        for j, (g, w) in enumerate(zip(got, want)):
            assert g.shape == tuple(w.shape), f"output {j}"
            assert _max_err(torch.from_numpy(g), w) <= 1e-4, f"output {j}"
        return want

    one = torch.randint(0, VOCAB, (1,), generator=gen).tolist()
    both(one, module.empty_caches(), [0])
    caches = module.empty_caches()
    for ids, rows, accepted in ((5, [4], 5), (1, [0], 1), (4, [0, 1, 2, 3], 2), (1, [0], 1)):
        ids = torch.randint(0, VOCAB, (ids,), generator=gen).tolist()
        caches = q35.next_caches(module, caches, both(ids, caches, rows), accepted)
