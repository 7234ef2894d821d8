"""DFlash draft: the PyTorch module against a plain reading of the math, and the ONNX graph against the module.

Reference (written here, straightforward torch, float64 after the RoPE angles):
    C = hidden_norm(fc(target_hidden))
    per layer: x = input_layernorm(h); Q = q_norm(q_proj(x)); K = k_norm([k_proj(C); k_proj(x)]);
               V = [v_proj(C); v_proj(x)]; RoPE (the DRAFT's rope_theta) on K at all positions
               (context first, then block), on Q at the block positions; NON-causal softmax attention
               with repeat_kv for GQA; h += o_proj(attn); h += mlp(post_attention_layernorm(h))
    output: norm(h)[1:]
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tolerances import assert_fp32_close

# Module, graph and reference differ by fp32 rounding (tests/tolerances.py): the longest reduction is fc's
# (3 taps x hidden 64), then 2 layers and the final norm.
ROUNDING = dict(reduction=192, depth=4)


def reference_draft(state, cfg, context_hidden, block_emb, rope_theta=None, rope_tables=None):
    """Plain DFlash draft forward over the WHOLE context (no cache).

    `rope_tables(cfg, positions)`, when given, supplies the cos/sin tables `[S, D]` (e.g. transformers'
    own, for scaled RoPE); layers the config lists as `sliding_attention` mask keys with |i - j| >=
    `sliding_window` (tests/test_sliding_drafts.py), and are causal inside the block unless the config's
    `is_causal` says otherwise (which then decides for every layer).

    Returns (draft_hidden [B-1, d], [K_ctx_0, V_ctx_0, K_ctx_1, ...] each [C, Hkv, D]) in float64.
    """
    f64 = torch.float64
    w = {k: v.to(f64) for k, v in state.items()}
    eps = float(cfg["rms_norm_eps"])
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = float(cfg["rope_theta"] if rope_theta is None else rope_theta)

    def rms(x, weight):
        return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    def lin(x, name):
        return x @ w[name].T

    ctx = rms(lin(context_hidden.to(f64), "fc.weight"), w["hidden_norm.weight"])
    h = block_emb.to(f64)
    c, b = ctx.shape[0], h.shape[0]
    pos = torch.arange(c + b)
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    if rope_tables is None:  # the draft's own theta; angles in fp32 as Hugging Face computes them
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        ang = (pos.float()[:, None] * inv[None, :]).to(f64)
        cos_t, sin_t = (torch.cat([t, t], dim=-1)[:, None, :] for t in (ang.cos(), ang.sin()))
    else:
        cos_t, sin_t = (t.to(f64)[:, None, :] for t in rope_tables(cfg, pos))

    def rope(x, rows):  # x [S, heads, D]; HF rotate_half layout
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos_t[rows] + torch.cat([-x2, x1], dim=-1) * sin_t[rows]

    kv_ctx = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rms(lin(x, p + "self_attn.q_proj.weight").view(b, H, D), w[p + "self_attn.q_norm.weight"])
        kin = torch.cat([ctx, x], dim=0)
        k = rms(lin(kin, p + "self_attn.k_proj.weight").view(c + b, Hkv, D), w[p + "self_attn.k_norm.weight"])
        v = lin(kin, p + "self_attn.v_proj.weight").view(c + b, Hkv, D)
        q = rope(q, pos[c:])
        k = rope(k, pos)
        kv_ctx += [k[:c], v[:c]]
        k_rep = k.repeat_interleave(H // Hkv, dim=1)  # repeat_kv: head j uses kv head j // (H / Hkv)
        v_rep = v.repeat_interleave(H // Hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k_rep) / math.sqrt(D)
        # the reference's rule (model.py, 2026-08): is_causal decides when set, else sliding layers are causal
        causal = types[i] == "sliding_attention" if cfg.get("is_causal") is None else cfg["is_causal"]
        diff = pos[c:, None] - pos[None, :]  # query position - key position
        visible = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
        if types[i] == "sliding_attention":  # within the window: i - j < W (and j - i < W unless causal)
            visible = visible & (diff < cfg["sliding_window"]) & (causal | (-diff < cfg["sliding_window"]))
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v_rep).reshape(b, H * D)
        h = h + lin(attn, p + "self_attn.o_proj.weight")
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        mlp = lin(
            torch.nn.functional.silu(lin(y, p + "mlp.gate_proj.weight")) * lin(y, p + "mlp.up_proj.weight"),
            p + "mlp.down_proj.weight",
        )
        h = h + mlp
    return rms(h, w["norm.weight"])[1:], kv_ctx


def _close(got, want, what):
    assert_fp32_close(np.asarray(got, np.float64), np.asarray(want, np.float64), what=what, **ROUNDING)


@pytest.fixture(scope="module")
def draft(tiny):
    return tiny.draft()


def _inputs(draft, c: int, b: int, seed: int):
    """Tap features `[c, k*d]` and block embeddings `[anchor, MASK x (b-1)]` from the target's table."""
    g = torch.Generator().manual_seed(seed)
    d = draft.spec.arch.hidden_size
    ctx = torch.randn(c, len(draft.spec.target_layer_ids) * d, generator=g) * 2.0
    emb = draft.target.state["model.embed_tokens.weight"].float()
    anchor = int(torch.randint(0, emb.shape[0], (1,), generator=g))
    block = torch.cat([emb[anchor : anchor + 1], emb[draft.spec.mask_token_id].expand(b - 1, d)], dim=0)
    return ctx, block.clone()


def _empty_past(draft):
    a = draft.spec.arch
    return [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]


def _module(draft, ctx, block, past):
    with torch.no_grad():
        out = draft.module(ctx, block, *past)
    return out[0], list(out[1:])


def test_draft_checkpoint_is_the_interesting_case(draft):
    """The tiny draft uses its own rope_theta (500000, target 10000), GQA and several tap layers."""
    assert draft.config["rope_theta"] != draft.target.spec.arch.rope["rope_theta"]
    assert draft.spec.arch.rope["rope_theta"] == draft.config["rope_theta"]
    assert draft.spec.arch.num_kv_heads < draft.spec.arch.num_heads
    assert len(draft.spec.target_layer_ids) >= 2


@pytest.mark.parametrize("c,b", [(6, 8), (1, 2), (230, 8)])
def test_module_matches_reference_one_call(draft, c, b):
    ctx, block = _inputs(draft, c, b, seed=c + b)
    hid, kv = _module(draft, ctx, block, _empty_past(draft))
    ref_hid, ref_kv = reference_draft(draft.state, draft.config, ctx, block)
    assert hid.shape == (b - 1, draft.spec.arch.hidden_size)
    _close(hid, ref_hid, "draft_hidden")
    for j, (got, want) in enumerate(zip(kv, ref_kv)):
        _close(got, want, f"context kv {j}")


def test_module_uses_the_drafts_own_rope_theta(draft):
    """Sensitivity check: the reference with the TARGET's rope_theta is clearly different."""
    ctx, block = _inputs(draft, 12, 8, seed=3)
    hid, _ = _module(draft, ctx, block, _empty_past(draft))
    wrong, _ = reference_draft(draft.state, draft.config, ctx, block, rope_theta=draft.target.spec.arch.rope["rope_theta"])
    assert float((hid.double() - wrong).abs().max()) > 1e-3


def test_module_is_non_causal(draft):
    """Changing the LAST block row changes the first proposals (a causal draft would not)."""
    ctx, block = _inputs(draft, 5, 8, seed=4)
    hid, _ = _module(draft, ctx, block, _empty_past(draft))
    block2 = block.clone()
    block2[-1] += 0.5
    hid2, _ = _module(draft, ctx, block2, _empty_past(draft))
    assert float((hid[0] - hid2[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("c1,c2", [(4, 3), (200, 20)])
def test_module_split_context_matches_reference(draft, c1, c2):
    """Two calls: the second feeds the first call's context K/V back as the past."""
    ctx, block = _inputs(draft, c1 + c2, 8, seed=c1)
    _, kv1 = _module(draft, ctx[:c1], block, _empty_past(draft))
    hid2, kv2 = _module(draft, ctx[c1:], block, kv1)
    ref_hid, ref_kv = reference_draft(draft.state, draft.config, ctx, block)
    _close(hid2, ref_hid, "draft_hidden after cached context")
    for j, (a, b_, want) in enumerate(zip(kv1, kv2, ref_kv)):
        assert b_.shape[0] == c2
        _close(torch.cat([a, b_]), want, f"cached + new context kv {j}")


# ---- ONNX graph vs the PyTorch module -------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_session(draft):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(draft.onnx_path), opts, providers=["CPUExecutionProvider"])


def _onnx(sess, draft, ctx, block, past, rows=None):
    rows = np.arange(block.shape[0] - 1) if rows is None else np.asarray(rows, np.int64)
    feed = {"context_hidden": ctx.numpy(), "block_embeddings": block.numpy(), "proposal_rows": rows}
    for i in range(draft.spec.arch.num_layers):
        feed[f"past_key_{i}"] = past[2 * i].numpy()
        feed[f"past_value_{i}"] = past[2 * i + 1].numpy()
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(None, feed)))
    kv = [outs[f"{k}_{i}"] for i in range(draft.spec.arch.num_layers) for k in ("key", "value")]
    return outs["draft_hidden"], kv


def test_onnx_io_names(draft_session, draft):
    n = draft.spec.arch.num_layers
    assert [i.name for i in draft_session.get_inputs()] == ["context_hidden", "block_embeddings", "proposal_rows"] + [
        f"past_{k}_{i}" for i in range(n) for k in ("key", "value")
    ]
    assert [o.name for o in draft_session.get_outputs()] == ["draft_hidden"] + [
        f"{k}_{i}" for i in range(n) for k in ("key", "value")
    ]


@pytest.mark.parametrize("c,b", [(6, 8), (1, 2), (9, 16), (230, 8)])
def test_onnx_matches_module_one_call(draft_session, draft, c, b):
    ctx, block = _inputs(draft, c, b, seed=100 + c + b)
    past = _empty_past(draft)
    hid, kv = _module(draft, ctx, block, past)
    ohid, okv = _onnx(draft_session, draft, ctx, block, past)
    _close(ohid, hid, "onnx draft_hidden")
    for j, (got, want) in enumerate(zip(okv, kv)):
        _close(got, want, f"onnx context kv {j}")


@pytest.mark.parametrize("rows", [[0], [0, 1, 2], [2, 5], list(range(15))])
def test_draft_cut_to_proposal_rows_returns_those_rows_of_the_full_block(draft_session, draft, rows):
    """The last layer cut to `proposal_rows` (a step verifying 1-3 proposals) returns exactly the rows
    the uncut draft computes there (module), and the graph matches the module; the context K/V do not
    depend on the rows."""
    c, b = 9, 16
    ctx, block = _inputs(draft, c, b, seed=5)
    _, kv0 = _module(draft, ctx[:4], block, _empty_past(draft))
    full, kv = _module(draft, ctx[4:], block, kv0)
    with torch.no_grad():
        out = draft.module(ctx[4:], block, *kv0, rows=torch.tensor(rows))
    assert out[0].shape == (len(rows), draft.spec.arch.hidden_size)
    _close(out[0], full[rows], "rows of the cut draft vs the full draft")
    ohid, okv = _onnx(draft_session, draft, ctx[4:], block, kv0, rows=rows)
    _close(ohid, full[rows], "onnx cut rows vs the full module")
    for j, (got, want) in enumerate(zip(okv, kv)):
        _close(got, want, f"onnx context kv {j} with rows {rows}")


def test_onnx_split_context_matches_module_and_reference(draft_session, draft):
    """ONNX with a cached context (past from its own first call) vs the module and the reference."""
    c1, c2, b = 7, 5, 8
    ctx, block = _inputs(draft, c1 + c2, b, seed=77)
    _, okv1 = _onnx(draft_session, draft, ctx[:c1], block, _empty_past(draft))
    opast = [torch.from_numpy(x) for x in okv1]
    ohid2, okv2 = _onnx(draft_session, draft, ctx[c1:], block, opast)
    _, kv1 = _module(draft, ctx[:c1], block, _empty_past(draft))
    hid2, kv2 = _module(draft, ctx[c1:], block, kv1)
    _close(ohid2, hid2, "onnx vs module draft_hidden (cached context)")
    for j, (got, want) in enumerate(zip(okv2, kv2)):
        _close(got, want, f"onnx vs module new context kv {j}")
    ref_hid, _ = reference_draft(draft.state, draft.config, ctx, block)
    _close(ohid2, ref_hid, "onnx vs reference draft_hidden (cached context)")
