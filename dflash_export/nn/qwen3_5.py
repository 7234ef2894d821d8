"""Export modules for the Qwen3.5 hybrid target: Gated DeltaNet (GDN) layers and gated full attention.

Numerical reference: transformers' `models/qwen3_5/modeling_qwen3_5.py` (5.24). Sequence axis outermost,
batch 1, every cache explicit, as in `nn/layers.py`: full-attention layers take past K/V `[P, Hkv, D]` and
return only the new rows.

GDN state design (lagged by one call). A speculative verify processes T new rows of which only a
prefix is accepted. Folding all T rows into the returned recurrent state would make rollback
impossible without per-row state outputs, and those are large: Qwen3.5-4B's state is ~2 MB per GDN
layer (32 heads x 128 x 128 fp32), so a 16-row verify would return ~0.8 GB of states (24 GDN layers). Instead a call
returns the state as it was BEFORE its own rows, plus those rows' recorded inputs (pre-conv
`in_proj_qkv`, `in_proj_a`, `in_proj_b` outputs: a few KB a row). The runtime passes the accepted
prefix of them to the next call as its "pending" rows, which the next call folds in first and then
computes its T new rows from the folded state. Rejected rows leave no trace and no extra graph call
is needed.

Within a call the delta rule runs in the chunk-parallel (WY) form with plain ONNX operators (no
Loop/Scan, no triangular solve; `gated_delta.gated_delta_chunk`, applied twice: the fold of the
pending rows returns only the state, the new rows' pass only outputs): the unit-triangular inverse is
a fixed product of `ceil(log2(MAX_ROWS))` factors, exact for at most `MAX_ROWS` = 64 rows, so one call
takes at most MAX_ROWS new rows and MAX_ROWS pending rows (the runtime feeds longer prompts in chunks
of 64).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_export.checkpoint.hybrid import HybridSpec
from dflash_export.nn.gated_delta import (
    MAX_ROWS,
    gated_delta_chunk,
    l2_normalize,
    softplus,
)
from dflash_export.nn.layers import (
    MLP,
    Attention,
    RMSNorm,
    apply_rope,
    causal_bias,
    rope_cos_sin,
)


def text_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's text weights under `Qwen3_5ForCausalLM` names: `model.language_model.*` (the
    `Qwen3_5ForConditionalGeneration` layout) becomes `model.*`; the vision tower (`model.visual.*`) and
    the multi-token-prediction head (`mtp.*`) are dropped."""
    return {text_weight_name(name): value for name, value in state.items() if text_weight_name(name) is not None}


def text_weight_name(name: str) -> str | None:
    """A checkpoint tensor's `Qwen3_5ForCausalLM` name (see `text_state_dict`), None for the tensors
    that are not exported (vision tower, MTP head)."""
    if name.startswith(("model.visual.", "mtp.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3.5's RMSNorm: `x / sqrt(mean(x^2) + eps) * (1 + weight)` in fp32, cast back to x's dtype
    (HF scales before the cast, unlike Llama). The weight is stored zero-centred (zeros = identity)."""

    def __init__(self, width: int, eps: float):
        super().__init__(width, eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """The GDN output norm: `weight * norm(x) * silu(z)` over the last axis (weight stored as is, not
    zero-centred). All in fp32, cast to x's dtype: identical to HF in fp32 (HF rounds norm(x) to the
    input dtype before the weight multiply)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * xf * nn.functional.silu(z.to(torch.float32))).to(x.dtype)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `r = cos.shape[-1]` dims of `x [S, H, D]` (HF's half-rotation layout within
    those r dims); the other D - r dims pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class GatedAttention(Attention):
    """Qwen3.5 full attention: queries carry a per-head output gate, zero-centred q/k norms, RoPE on the
    first `rotary_dim` dims, `o_proj(attention * sigmoid(gate))`. The past/new split attention is
    `Attention.attend`'s."""

    def __init__(self, spec: HybridSpec):
        super().__init__(spec.attention_spec(), qk_norm=False)
        h, hd = spec.num_heads, spec.head_dim
        # q_proj emits [query | gate] per head: [.., H, 2 * D]
        self.q_proj = nn.Linear(spec.hidden_size, 2 * h * hd, bias=spec.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(hd, spec.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(hd, spec.rms_norm_eps)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [S, d]` -> (rotated queries times 1/sqrt(D) `[S, H, D]`, gate `[S, H * D]`). The scale is a
        Mul here, not folded into the tables: with partial RoPE the pass-through dims need it too."""
        s, hd = x.shape[0], self.head_dim
        qg = self.q_proj(x).view(s, self.num_heads, 2 * hd)
        q = partial_rope(self.q_norm(qg[..., :hd]), cos, sin) * self.scale
        return q, qg[..., hd:].reshape(s, self.num_heads * hd)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [S, d]` -> (rotated keys, values), each `[S, Hkv, D]` (the rows a cache stores)."""
        k = self.k_norm(self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        return partial_rope(k, cos, sin), v

    def forward(self, x, cos, sin, past_k, past_v, causal):
        """`x [S, d]` (normed) -> (output `[S, d]`, new keys, new values `[S, Hkv, D]`)."""
        q, gate = self.query(x, cos, sin)
        k, v = self.key_value(x, cos, sin)
        attn = self.attend(q, past_k, past_v, k, v, causal)
        return self.o_proj(attn * torch.sigmoid(gate)), k, v


class GatedDeltaNet(nn.Module):
    """A Qwen3.5 linear-attention layer with the lagged state of the module docstring.

    `forward` inputs: normed hidden `x [T, d]` (1 <= T <= MAX_ROWS); `conv_state [K-1, C]` (conv inputs
    before the pending rows); fp32 `recurrent_state [Hv, dk, dv]` (state before the pending rows);
    `pending_qkv [P, C]`, `pending_a [P, Hv]`, `pending_b [P, Hv]` (0 <= P <= MAX_ROWS, the accepted rows'
    recorded inputs). Outputs: `out [T, d]`; `conv_state_out [K-1, C]` (last K-1 rows of
    [conv_state; pending_qkv]); fp32 `recurrent_state_out` (after the pending rows); the new rows'
    `qkv [T, C]`, `a [T, Hv]`, `b [T, Hv]`. C = conv_dim.
    """

    # cast_for_export keeps these fp32: exp(A_log) reaches 9e6 (A_log up to 16), beyond fp16's range,
    # and the decay's error would compound over every token of the state
    keep_fp32 = ("A_log", "dt_bias")

    def __init__(self, spec: HybridSpec):
        super().__init__()
        d, c, hv = spec.hidden_size, spec.conv_dim, spec.num_v_heads
        self.num_k_heads, self.num_v_heads = spec.num_k_heads, hv
        self.key_head_dim, self.value_head_dim = spec.key_head_dim, spec.value_head_dim
        self.kernel = spec.conv_kernel
        self.in_proj_qkv = nn.Linear(d, c, bias=False)
        self.in_proj_z = nn.Linear(d, hv * spec.value_head_dim, bias=False)
        self.in_proj_b = nn.Linear(d, hv, bias=False)
        self.in_proj_a = nn.Linear(d, hv, bias=False)
        self.conv1d = nn.Conv1d(c, c, spec.conv_kernel, groups=c, bias=False)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(spec.value_head_dim, spec.rms_norm_eps)
        self.out_proj = nn.Linear(hv * spec.value_head_dim, d, bias=False)

    def conv(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """SiLU of the depthwise causal conv at the last n of `rows [K - 1 + n, C]` (the first K - 1 are
        left context), as K shifted Mul-Adds in the weight's dtype (no Conv, no transposes)."""
        w = self.conv1d.weight[:, 0, :]
        x = rows.to(w.dtype)
        out = x[: x.shape[0] - (self.kernel - 1)] * w[:, 0]
        for j in range(1, self.kernel):
            out = out + x[j : x.shape[0] - (self.kernel - 1 - j)] * w[:, j]
        return nn.functional.silu(out)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output `[n, C]` -> L2-normalised fp32 q, k `[n, Hk, dk]` and v `[n, Hv, dv]`."""
        n, kd = y.shape[0], self.num_k_heads * self.key_head_dim
        q = l2_normalize(y[:, :kd].reshape(n, self.num_k_heads, self.key_head_dim))
        k = l2_normalize(y[:, kd : 2 * kd].reshape(n, self.num_k_heads, self.key_head_dim))
        return q, k, y[:, 2 * kd :].reshape(n, self.num_v_heads, self.value_head_dim)

    def gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recorded `a, b [n, Hv]` -> fp32 (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))."""
        f32 = torch.float32
        g = -torch.exp(self.A_log.to(f32)) * softplus(a.to(f32) + self.dt_bias.to(f32))
        return g, torch.sigmoid(b.to(f32))

    def forward(self, x, conv_state, recurrent_state, pending_qkv, pending_a, pending_b):
        # fold the pending rows (accepted at the previous call) into the state: k and v only
        context = torch.cat([conv_state, pending_qkv.to(conv_state.dtype)], dim=0)
        _, k_p, v_p = self.split(self.conv(context, pending_qkv.shape[0]))
        g_p, beta_p = self.gates(pending_a, pending_b)
        _, state = gated_delta_chunk(None, k_p, v_p, g_p, beta_p, recurrent_state.to(torch.float32), outputs=False)
        conv_state_out = context[context.shape[0] - (self.kernel - 1) :]
        # the new rows, from the folded state; their own inputs are only recorded
        t = x.shape[0]
        qkv, a, b = self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x)
        q, k, v = self.split(self.conv(torch.cat([conv_state_out, qkv.to(conv_state_out.dtype)], dim=0), t))
        g, beta = self.gates(a, b)
        o, _ = gated_delta_chunk(q, k, v, g, beta, state, final_state=False)
        z = self.in_proj_z(x).view(t, self.num_v_heads, self.value_head_dim)
        o = self.norm(o, z).reshape(t, self.num_v_heads * self.value_head_dim)
        return self.out_proj(o.to(self.out_proj.weight.dtype)), conv_state_out, state, qkv, a, b


class HybridDecoderLayer(nn.Module):
    """Pre-norm Qwen3.5 layer: a GDN (`linear_attn`) or gated attention (`self_attn`) mixer, then the MLP."""

    def __init__(self, spec: HybridSpec, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(spec)
        else:
            self.self_attn = GatedAttention(spec)
        self.post_attention_layernorm = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size, bias=False)

    def forward(self, h, cache, rope, causal):
        """`h [T, d]`, this layer's cache inputs (see `cache_names`) -> (`h [T, d]`, its cache outputs).
        `rope` is the (cos, sin) pair of the new rows' positions, `causal` their `causal_bias`."""
        x = self.input_layernorm(h)
        if self.layer_type == "linear_attention":
            mixed, *new = self.linear_attn(x, *cache)
        else:
            mixed, *new = self.self_attn(x, *rope, *cache, causal)
        h = h + mixed
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, new


def cache_names(layer_type: str, i: int) -> tuple[list[str], list[str]]:
    """Input and output names of layer i's caches, in positional order."""
    if layer_type == "full_attention":
        return [f"past_key_{i}", f"past_value_{i}"], [f"key_{i}", f"value_{i}"]
    kinds = ("conv_state", "recurrent_state")
    return ([f"{k}_{i}" for k in kinds] + [f"pending_{k}_{i}" for k in ("qkv", "a", "b")],
            [f"{k}_out_{i}" for k in kinds] + [f"{k}_{i}" for k in ("qkv", "a", "b")])


def hybrid_io_names(spec: HybridSpec) -> tuple[list[str], list[str]]:
    """Input and output names of `Qwen35TargetForExport`, in positional order."""
    ins, outs = ["input_ids", "logit_rows"], ["logits", "hidden", "taps"]
    for i, kind in enumerate(spec.layer_types):
        cin, cout = cache_names(kind, i)
        ins, outs = ins + cin, outs + cout
    return ins, outs


class _HybridBody(nn.Module):
    def __init__(self, spec: HybridSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList([HybridDecoderLayer(spec, kind) for kind in spec.layer_types])
        self.norm = ZeroCentredRMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen35TargetForExport(nn.Module):
    """The Qwen3.5 text stack with explicit per-layer caches, taps and logits of chosen rows.

    Inputs (batch 1, sequence axis outermost):
        input_ids: int64 `[T]`, 1 <= T <= MAX_ROWS: the new rows (positions P .. P + T - 1).
        logit_rows: int64 `[R]`: indices into the T rows whose logits to return.
        then per layer i (`cache_names`): full attention: past_key_i / past_value_i `[P, Hkv, D]`
            (P, the committed length, is read from the first one's shape); GDN: conv_state_i
            `[K-1, C]`, recurrent_state_i fp32 `[Hv, dk, dv]`, pending_qkv_i `[Pp, C]`, pending_a_i /
            pending_b_i `[Pp, Hv]` (Pp: rows accepted at the previous call, the same for every layer;
            all zero-row and zero states at the first call).

    Outputs:
        logits: fp32 `[R, V]`. hidden: `[T, d]` after the final norm.
        taps: `[T, k * d]`: outputs of the tap layers (HF `hidden_states[L + 1]`; the last layer's
            after the final norm, as in Hugging Face).
        then per layer: key_i / value_i `[T, Hkv, D]`; or conv_state_out_i, recurrent_state_out_i
            (the state after the pending rows) and qkv_i `[T, C]`, a_i / b_i `[T, Hv]` (the new rows'
            recorded inputs: their accepted prefix is the next call's pending rows).
    """

    def __init__(self, spec: HybridSpec, tap_layers: tuple[int, ...]):
        super().__init__()
        if not tap_layers:
            raise ValueError("tap_layers must name at least one layer")
        self.spec = spec
        self.tap_layers = tuple(tap_layers)
        self.model = _HybridBody(spec)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        r = spec.rotary_dim
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.first_attention = spec.layer_types.index("full_attention")
        # per layer, where its caches start in the flat input list
        sizes = [2 if kind == "full_attention" else 5 for kind in spec.layer_types]
        self.cache_offsets = [sum(sizes[:i]) for i in range(len(sizes))] + [sum(sizes)]

    def head_weight(self) -> torch.Tensor:
        """The `[V, d]` LM head matrix (embed_tokens' when tied: stored once)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, logit_rows, *caches):
        h, tap_features, new = self.body(input_ids, caches)
        logits = nn.functional.linear(torch.index_select(h, 0, logit_rows), self.head_weight()).to(torch.float32)
        return (logits, h, tap_features, *new)

    def body(self, ids: torch.Tensor, caches: tuple) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The decoder stack on `ids [S]` (S <= MAX_ROWS) after `caches` (the per-layer inputs above):
        (final-norm hidden `[S, d]`, tap features `[S, k * d]`, the cache outputs in output order), the
        contract of `nn.layers.TargetForExport.body`."""
        spec = self.spec
        s = ids.shape[0]
        torch._check(s <= MAX_ROWS)
        p = caches[self.cache_offsets[self.first_attention]].shape[0]
        rope = rope_cos_sin(torch.arange(s, dtype=torch.int64) + p, self.inv_freq, 1.0)
        causal = causal_bias(s, spec.num_heads // spec.num_kv_heads)
        h = self.model.embed_tokens(ids)
        taps, new = {}, []
        for i, layer in enumerate(self.model.layers):
            h, outs = layer(h, caches[self.cache_offsets[i] : self.cache_offsets[i + 1]], rope, causal)
            new += outs
            if i in self.tap_layers and i != spec.num_layers - 1:
                taps[i] = h
        h = self.model.norm(h)
        if spec.num_layers - 1 in self.tap_layers:
            taps[spec.num_layers - 1] = h  # HF's last hidden_states entry is post-final-norm
        return h, torch.cat([taps[i] for i in self.tap_layers], dim=-1), new

    def empty_caches(self, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """The caches of a first call: no past rows, zero conv and recurrent states, no pending rows."""
        s = self.spec
        out = []
        for kind in s.layer_types:
            if kind == "full_attention":
                out += [torch.zeros(0, s.num_kv_heads, s.head_dim, dtype=dtype)] * 2
            else:
                out += [torch.zeros(s.conv_kernel - 1, s.conv_dim, dtype=dtype),
                        torch.zeros(s.num_v_heads, s.key_head_dim, s.value_head_dim, dtype=torch.float32),
                        torch.zeros(0, s.conv_dim, dtype=dtype), torch.zeros(0, s.num_v_heads, dtype=dtype),
                        torch.zeros(0, s.num_v_heads, dtype=dtype)]
        return out


def next_caches(module: Qwen35TargetForExport, caches: list, outputs: tuple, accepted: int) -> list[torch.Tensor]:
    """The next call's cache inputs after a call whose first `accepted` new rows were committed: K/V
    rows appended, GDN states as returned, pending rows = the accepted prefix of the recorded inputs.
    (A reference of what the runtime does with its static buffers.)"""
    new = list(outputs[3:])
    out = []
    for i, kind in enumerate(module.spec.layer_types):
        o = module.cache_offsets[i]
        if kind == "full_attention":
            out += [torch.cat([caches[o + j], new[o + j][:accepted]]) for j in range(2)]
        else:
            out += [new[o], new[o + 1], *(x[:accepted] for x in new[o + 2 : o + 5])]
    return out
