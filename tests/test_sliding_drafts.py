"""DFlash drafts with sliding-window layers (Qwen3.6 drafts) and YaRN RoPE.

Reference (written here, straightforward torch in float64, no cache, the whole context at once):
the plain DFlash reading of `test_draft_parity.reference_draft`, with a masked softmax on sliding
layers: a block query at absolute position i sees a key at position j iff |i - j| < W (the
reference's flash-attention `window_size=(W - 1, W - 1)`; otherwise non-causal), and RoPE tables
from transformers' own `Qwen3RotaryEmbedding` (cos and sin carry YaRN's attention factor).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import tiny_models
from tolerances import assert_fp32_close
from test_draft_parity import reference_draft as plain_reading
from runtime.errors import DFlashError

# Module, graph and float64 reference differ by fp32 rounding (tests/tolerances.py): fc's reduction
# (3 taps x hidden 64), then 2 layers and the final norm.
ROUNDING = dict(reduction=192, depth=4)
WINDOW = 5
SLIDING_TYPES = ["sliding_attention", "full_attention"]  # as Qwen3.6 drafts: sliding layers, then full
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 16, "beta_slow": 2}


def hf_cos_sin(cfg: dict, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Qwen3 rotary tables `[S, D]` (fp32, times its attention scaling)."""
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})
    emb = Qwen3RotaryEmbedding(hf)
    cos, sin = emb(torch.zeros(1, len(positions), 1), positions[None])
    return cos[0], sin[0]


def reference_draft(state, cfg, context_hidden, block_emb):
    """`test_draft_parity.reference_draft` (the plain reading, with its sliding-window mask) on
    transformers' RoPE tables."""
    return plain_reading(state, cfg, context_hidden, block_emb, rope_tables=hf_cos_sin)


def _err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    return float(np.max(np.abs(got - want))) if got.size else 0.0


def _close(got, want, what, atol=None):
    """Within fp32 rounding (`ROUNDING`), or exactly `atol` (0.0: tables copied from transformers' own)."""
    if atol is None:
        assert_fp32_close(np.asarray(got, np.float64), np.asarray(want, np.float64), what=what, **ROUNDING)
    else:
        err = _err(got, want)
        assert err <= atol, f"{what}: max abs error {err:.3g} > {atol}"


class Draft:
    def __init__(self, tiny, tmp_path_factory, name, **overrides):
        import json

        from dflash_export.checkpoint.draft import load_draft_spec
        from dflash_export.nn.draft import DFlashDraft
        from dflash_export.nn.layers import load_weights

        self.target = tiny.target("qwen3")
        self.root = tmp_path_factory.mktemp(name)
        ddir = tiny_models.make_draft(self.root / "hf", self.target.hf_dir, scale=0.15, **overrides)
        self.spec, self.state = load_draft_spec(ddir, self.target.spec)
        self.config = json.loads((ddir / "config.json").read_text())
        self.module = DFlashDraft(self.spec, torch.float32).eval()
        load_weights(self.module, self.state, f"draft {ddir}")
        self._onnx = None

    @property
    def onnx_path(self):
        if self._onnx is None:
            from dflash_export.export.graphs import export_draft

            self._onnx = self.root / "draft.onnx"
            export_draft(self.module, self._onnx)
        return self._onnx

    def inputs(self, c, b, seed):
        g = torch.Generator().manual_seed(seed)
        d = self.spec.arch.hidden_size
        ctx = torch.randn(c, len(self.spec.target_layer_ids) * d, generator=g) * 2.0
        emb = self.target.state["model.embed_tokens.weight"].float()
        anchor = int(torch.randint(0, emb.shape[0], (1,), generator=g))
        block = torch.cat([emb[anchor : anchor + 1], emb[self.spec.mask_token_id].expand(b - 1, d)], dim=0)
        return ctx, block.clone()

    def empty_past(self):
        a = self.spec.arch
        return [torch.zeros(0, a.num_kv_heads, a.head_dim) for _ in range(2 * a.num_layers)]

    def run(self, ctx, block, past):
        with torch.no_grad():
            out = self.module(ctx, block, *past)
        return out[0], list(out[1:])

    def split_run(self, ctx, block, cuts):
        """Feed `ctx` in pieces ending at `cuts` (each call's context K/V become the next call's past)."""
        past, start = self.empty_past(), 0
        for end in [*cuts, ctx.shape[0]]:
            hid, kv = self.run(ctx[start:end], block, past)
            past = [torch.cat([a, n]) for a, n in zip(past, kv)]
            start = end
        return hid, past


@pytest.fixture(scope="module")
def sliding(tiny, tmp_path_factory):
    return Draft(tiny, tmp_path_factory, "sliding_draft", layers=2, layer_types=SLIDING_TYPES, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def yarn(tiny, tmp_path_factory):
    return Draft(tiny, tmp_path_factory, "yarn_draft", layers=2, rope_parameters=dict(YARN), rope_theta=YARN["rope_theta"],
                 max_position_embeddings=256, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)


# ---- spec ---------------------------------------------------------------------------------------


def test_spec_reads_layer_types_and_the_raw_window(sliding):
    assert sliding.spec.layer_types == tuple(SLIDING_TYPES)
    assert sliding.spec.sliding_window == WINDOW
    assert "use_sliding_window" not in sliding.config  # transformers' Qwen3Config would drop the window
    fields = sliding.spec.manifest_fields()
    assert {k: fields[k] for k in ("layer_types", "sliding_window")} == {"layer_types": SLIDING_TYPES,
                                                                        "sliding_window": WINDOW}
    # no is_causal in the config: the reference's rule makes the sliding layer causal inside the block
    assert fields["block_attention"] == ["causal", "bidirectional"] and "is_causal" in fields["block_attention_rule"]


def test_full_draft_spec_defaults(tiny):
    spec = tiny.draft().spec
    assert spec.layer_types == ("full_attention",) * spec.arch.num_layers
    assert spec.sliding_window is None and spec.causal_layers == (False,) * spec.arch.num_layers
    assert set(spec.manifest_fields()) == {"block_attention", "block_attention_rule"}


@pytest.mark.parametrize("is_causal, types, want", [
    (None, ["sliding_attention", "full_attention"], (True, False)),   # the rule: sliding layers are causal
    (False, ["sliding_attention", "full_attention"], (False, False)),  # DFlash 2 releases: bidirectional
    (True, ["full_attention", "full_attention"], (True, True)),        # set: it decides for every layer
])
def test_block_causality_follows_the_reference_rule(tiny, is_causal, types, want):
    extra = {} if is_causal is None else {"is_causal": is_causal}
    assert _parse(tiny, layer_types=types, sliding_window=WINDOW, **extra).causal_layers == want


def test_a_non_boolean_is_causal_is_refused(tiny):
    with pytest.raises(DFlashError, match=r"is_causal 'yes' must be true, false or absent"):
        _parse(tiny, is_causal="yes")


def _parse(tiny, **changes):
    from dflash_export.checkpoint.draft import parse_draft_config

    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "rope_theta": 1e6, "block_size": 8, "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 3]}}
    cfg.update(changes)
    return parse_draft_config({k: v for k, v in cfg.items() if v is not None}, tiny.target("qwen3").spec, "d", None)


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["sliding_attention", "full_attention"]), r"layers \[0\] are sliding_attention but config.json's sliding_window is None"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=0), r"sliding_window is 0"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=True), r"sliding_window is True"),
    (dict(layer_types=["full_attention", "chunked_attention"], sliding_window=8),
     r"draft d uses layer types \['chunked_attention'\]; a DFlash draft's layers must be one of \['full_attention', 'sliding_attention'\]"),
    (dict(layer_types=["full_attention"]), r"layer_types lists 1 layers but num_hidden_layers is 2"),
    (dict(layer_types="sliding_attention"), r"layer_types 'sliding_attention' must be a list"),
    (dict(use_sliding_window=True, max_window_layers=1), r"layers \[1\] are sliding_attention but config.json's sliding_window is None"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), r"YaRN RoPE .* declares no factor"),
])
def test_parse_errors(tiny, changes, match):
    with pytest.raises(DFlashError, match=match):
        _parse(tiny, **changes)


def test_parse_layer_types_as_transformers_derives_them(tiny):
    """No layer_types: transformers' rule (layers >= max_window_layers slide when use_sliding_window)."""
    spec = _parse(tiny, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert spec.layer_types == ("full_attention", "sliding_attention") and spec.sliding_window == 16
    spec = _parse(tiny, use_sliding_window=False, sliding_window=16, max_window_layers=0)
    assert spec.layer_types == ("full_attention",) * 2 and spec.sliding_window is None
    spec = _parse(tiny, sliding_window=16, layer_types=["full_attention"] * 2)  # a window without sliding layers
    assert spec.sliding_window is None


def test_target_sliding_layers_still_refused():
    from dflash_export.checkpoint.target import check_layer_types

    with pytest.raises(DFlashError, match=r"target t uses layer types \['sliding_attention'\]"):
        check_layer_types({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "target t")
    check_layer_types({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8}, "draft d", draft=True)


# ---- module vs the plain reading ----------------------------------------------------------------


@pytest.mark.parametrize("c,b", [(1, 8), (4, 2), (9, 8), (30, 4)])
def test_sliding_module_matches_reference_one_call(sliding, c, b):
    assert c + b > WINDOW  # the window bites
    ctx, block = sliding.inputs(c, b, seed=c + b)
    hid, kv = sliding.run(ctx, block, sliding.empty_past())
    ref_hid, ref_kv = reference_draft(sliding.state, sliding.config, ctx, block)
    _close(hid, ref_hid, "draft_hidden")
    for j, (got, want) in enumerate(zip(kv, ref_kv)):
        _close(got, want, f"context kv {j}")


@pytest.mark.parametrize("is_causal, types", [(False, SLIDING_TYPES), (True, ["full_attention"] * 2)])
def test_is_causal_drafts_match_reference(tiny, tmp_path_factory, is_causal, types):
    """A config's is_causal: false keeps sliding layers bidirectional (DFlash 2 releases), true makes
    full-attention layers causal inside the block; module and cached-context calls follow the reference."""
    d = Draft(tiny, tmp_path_factory, f"causal_{is_causal}", layers=2, layer_types=types, sliding_window=WINDOW,
              is_causal=is_causal)
    assert d.spec.causal_layers == (is_causal, is_causal)
    ctx, block = d.inputs(9, 8, seed=3)
    ref_hid, ref_kv = reference_draft(d.state, d.config, ctx, block)
    for hid, past in (d.run(ctx, block, d.empty_past()), d.split_run(ctx, block, [4])):
        _close(hid, ref_hid, "draft_hidden")
        for j, (got, want) in enumerate(zip(past, ref_kv)):
            _close(got, want, f"context kv {j}")
    flipped, _ = reference_draft(d.state, {**d.config, "is_causal": not is_causal}, ctx, block)
    assert float((ref_hid - flipped).abs().max()) > 1e-3  # sensitivity: the rule changes the rows


@pytest.mark.parametrize("cuts", [(3,), (1, 2, 3, 4, 5, 6), (12,), (20, 21)])
def test_sliding_module_with_cached_context_matches_reference(sliding, cuts):
    """Past lengths below, at and far beyond the window, new contexts shorter and longer than W - 1."""
    ctx, block = sliding.inputs(24, 8, seed=sum(cuts))
    hid, past = sliding.split_run(ctx, block, list(cuts))
    ref_hid, ref_kv = reference_draft(sliding.state, sliding.config, ctx, block)
    _close(hid, ref_hid, "draft_hidden after cached context")
    for j, (got, want) in enumerate(zip(past, ref_kv)):
        _close(got, want, f"cached + new context kv {j}")


def test_the_window_matters(sliding):
    """Sensitivity: the same weights read as all full attention give clearly different proposals."""
    ctx, block = sliding.inputs(12, 8, seed=5)
    hid, _ = sliding.run(ctx, block, sliding.empty_past())
    full_cfg = {**sliding.config, "layer_types": ["full_attention"] * 2}
    wrong, _ = reference_draft(sliding.state, full_cfg, ctx, block)
    assert float((hid.double() - wrong).abs().max()) > 1e-3


def test_sliding_only_draft_ignores_context_beyond_the_window(tiny, tmp_path_factory):
    """Every layer sliding: context rows at distance >= W from every block row cannot matter."""
    d = Draft(tiny, tmp_path_factory, "all_sliding", layers=2, layer_types=["sliding_attention"] * 2,
              sliding_window=WINDOW)
    ctx, block = d.inputs(10, 3, seed=9)
    hid, _ = d.run(ctx, block, d.empty_past())
    ctx2 = ctx.clone()
    ctx2[:8] += 1.0  # positions 0..7; block rows at 10..12 see positions >= 6 only
    hid2, _ = d.run(ctx2, block, d.empty_past())
    assert float((hid - hid2).abs().max()) > 1e-3  # rows 6, 7 are visible
    ctx3 = ctx.clone()
    ctx3[:6] += 1.0
    hid3, _ = d.run(ctx3, block, d.empty_past())
    assert float((hid - hid3).abs().max()) == 0.0
    ref_hid, _ = reference_draft(d.state, d.config, ctx, block)
    _close(hid, ref_hid, "all-sliding draft_hidden")


# ---- ONNX ---------------------------------------------------------------------------------------


def _onnx(sess, spec, ctx, block, past, rows=None):
    rows = np.arange(block.shape[0] - 1) if rows is None else np.asarray(rows, np.int64)
    feed = {"context_hidden": ctx.numpy(), "block_embeddings": block.numpy(), "proposal_rows": rows}
    for i in range(spec.arch.num_layers):
        feed[f"past_key_{i}"] = past[2 * i].numpy()
        feed[f"past_value_{i}"] = past[2 * i + 1].numpy()
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))
    return outs["draft_hidden"], [outs[f"{k}_{i}"] for i in range(spec.arch.num_layers) for k in ("key", "value")]


def _session(path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def test_sliding_onnx_matches_module_and_passes_graph_check(sliding):
    from dflash_export.export.checks import check_graph

    report = check_graph(sliding.onnx_path)  # TensorRT 10 operators, no weight stored twice
    assert "And" in report["ops"]  # the causal window: 0 <= i - j < W (a bidirectional one is |i - j| < W: Abs)
    sess = _session(sliding.onnx_path)
    # Pc = 0 with the window biting inside the new rows, then Pc > W (13 cached rows) with C < W - 1 and C > W
    for pc, c, b in [(0, 6, 8), (0, 1, 2), (13, 2, 8), (13, 7, 4), (0, 20, 16)]:
        ctx, block = sliding.inputs(pc + c, b, seed=pc + c + b)
        _, past = sliding.split_run(ctx[:pc], block, []) if pc else (None, sliding.empty_past())
        hid, kv = sliding.run(ctx[pc:], block, past)
        ohid, okv = _onnx(sess, sliding.spec, ctx[pc:], block, past)
        _close(ohid, hid, f"onnx draft_hidden (Pc {pc}, C {c}, B {b})")
        for j, (got, want) in enumerate(zip(okv, kv)):
            _close(got, want, f"onnx context kv {j} (Pc {pc}, C {c}, B {b})")
        ref_hid, _ = reference_draft(sliding.state, sliding.config, ctx, block)
        _close(ohid, ref_hid, f"onnx vs reference draft_hidden (Pc {pc}, C {c}, B {b})")


def test_sliding_draft_cut_to_proposal_rows_keeps_each_rows_window(tiny, tmp_path_factory):
    """A sliding last layer cut to `proposal_rows` masks each returned row by its own position's
    window (block rows 1 and 7 see different rows: W = 5): the graph's rows equal the full block's."""
    d = Draft(tiny, tmp_path_factory, "all_sliding_rows", layers=2, layer_types=["sliding_attention"] * 2,
              sliding_window=WINDOW)
    pc, c, b = 13, 2, 8
    ctx, block = d.inputs(pc + c, b, seed=61)
    _, past = d.run(ctx[:pc], block, d.empty_past())
    full, _ = d.run(ctx[pc:], block, past)
    sess = _session(d.onnx_path)
    for rows in ([0], [0, 1], [1, 6], [6]):
        got, _ = _onnx(sess, d.spec, ctx[pc:], block, past, rows=rows)
        _close(got, full[rows], f"rows {rows}")
        with torch.no_grad():
            cut = d.module(ctx[pc:], block, *past, rows=torch.tensor(rows))[0]
        _close(cut, full[rows], f"module rows {rows}")


def test_sliding_layers_never_read_cached_rows_outside_the_window(sliding):
    """The cached context K/V a sliding layer reads is bounded by the window: its rows before
    Pc - min(Pc, W - 1 - C) are NaN here, and the graph's output is still finite and unchanged (one read
    of a NaN row would spread through the attention MatMuls)."""
    sess = _session(sliding.onnx_path)
    pc, b = 20, 4
    for c in (1, 3, WINDOW + 2):
        ctx, block = sliding.inputs(pc + c, b, seed=40 + c)
        _, past = sliding.split_run(ctx[:pc], block, [])
        want, _ = _onnx(sess, sliding.spec, ctx[pc:], block, past)
        start = pc - min(pc, max(WINDOW - 1 - c, 0))
        poisoned = [p.clone() for p in past]
        for i, kind in enumerate(SLIDING_TYPES):
            if kind == "sliding_attention":
                poisoned[2 * i][:start] = float("nan")
                poisoned[2 * i + 1][:start] = float("nan")
        got, _ = _onnx(sess, sliding.spec, ctx[pc:], block, poisoned)
        assert start > 0 and np.isfinite(got).all() and np.array_equal(got, want), f"C {c}"


def test_full_draft_graph_has_no_window(tiny):
    """A draft without sliding layers exports the graph it always did: no window mask nodes."""
    import onnx

    g = onnx.load(str(tiny.draft().onnx_path), load_external_data=False).graph
    assert not {n.op_type for n in g.node} & {"Abs", "Less"}


# ---- YaRN ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["rope_parameters", "rope_scaling", "attention_factor"])
def test_yarn_tables_match_transformers(yarn, form):
    """cos/sin (with YaRN's attention factor) equal transformers' Qwen3RotaryEmbedding, old and new config forms."""
    from dflash_export.checkpoint.target import AttentionSpec
    from dflash_export.nn.layers import rope_cos_sin, rope_inv_freq

    cfg = copy.deepcopy(yarn.config)
    if form == "rope_scaling":
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params
    elif form == "attention_factor":
        cfg["rope_parameters"]["attention_factor"] = 1.25
    arch = AttentionSpec.from_config(cfg, "yarn draft")
    inv, scale = rope_inv_freq(arch, "qwen3")
    pos = torch.tensor([0, 1, 5, 63, 64, 65, 200, 255, 4000, 100000])
    cos, sin = rope_cos_sin(pos, inv, scale)
    want_cos, want_sin = hf_cos_sin(cfg, pos)
    half = arch.head_dim // 2
    assert scale != 1.0 and (scale == 1.25 if form == "attention_factor" else abs(scale - (0.1 * math.log(4) + 1)) < 1e-12)
    _close(cos[:, 0], want_cos, "cos", atol=0.0)
    _close(torch.cat([-sin[:, 0, :half], sin[:, 0, half:]], dim=-1), want_sin, "sin", atol=0.0)
    if form == "rope_parameters":  # the module's own buffers
        assert torch.equal(yarn.module.inv_freq, inv) and yarn.module.rope_scale == scale


@pytest.mark.parametrize("cuts", [(), (4,), (9,)])
def test_yarn_sliding_module_matches_reference(yarn, cuts):
    ctx, block = yarn.inputs(12, 8, seed=len(cuts))
    hid, past = yarn.split_run(ctx, block, list(cuts))
    ref_hid, ref_kv = reference_draft(yarn.state, yarn.config, ctx, block)
    _close(hid, ref_hid, "yarn draft_hidden")
    for j, (got, want) in enumerate(zip(past, ref_kv)):
        _close(got, want, f"yarn context kv {j}")
    plain = {**yarn.config, "rope_parameters": {"rope_type": "default", "rope_theta": YARN["rope_theta"]}}
    wrong, _ = reference_draft(yarn.state, plain, ctx, block)
    assert float((hid.double() - wrong).abs().max()) > 1e-3  # sensitivity: unscaled RoPE is clearly different


@pytest.mark.nightly  # a build; `make test`: the sliding/YaRN graph and module tests above
def test_build_and_generate_with_a_sliding_yarn_draft(yarn, tmp_path):
    """End to end: the manifest records the window, the runtime loads the sliding draft (its graph
    inputs are still past K/V per layer), speculative output equals plain and `check` passes."""
    import runtime
    from dflash_export.build import BuildOptions, build
    from dflash_export.check.parity import run_check

    art = tmp_path / "art"
    manifest = build(BuildOptions(str(yarn.target.hf_dir), str(yarn.root / "hf"), art, max_seq_len=96, quiet=True))
    assert manifest["draft"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert manifest["draft"]["sliding_window"] == WINDOW
    sess = runtime.load(art)
    prompt = list(range(3, 3 + 2 * WINDOW))  # longer than the window: it bites from the first draft call
    kw = dict(max_new_tokens=30, stop_token_ids=[], reuse_prefix=False)
    assert sess.generate(prompt, verify_len="all", **kw).output_ids == sess.generate(prompt, block_size=1, **kw).output_ids
    assert run_check(art).passed
