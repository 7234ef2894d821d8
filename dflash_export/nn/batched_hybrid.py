"""The batched Qwen3.5 hybrid target: `nn.batched`'s interface (B sequences, each at its own past length,
attention K/V in static slots) over the hybrid stack, with one Gated DeltaNet state per slot.

Each GDN layer keeps the one-sequence graph's state lagged by one call (`nn.qwen3_5`): a call takes each
sequence's state as it was before the rows its previous call committed, plus those rows' recorded inputs
(its pending rows), folds them in, and returns the folded state and its own rows' recorded inputs. Per
slot the runtime holds one conv state, one recurrent state and up to MAX_ROWS pending rows, so a slot
rolls back exactly (only committed rows ever become pending).

Padding never reaches a real row: a sequence's padded pending rows get decay 1 and beta 0, which adds
exact zeros to its state (and its conv state is taken after its own pending rows); its padded new rows
come after its real rows, which the causal conv and recurrence never read. Attention is
`nn.batched`'s split-invariant form. So a sequence's rows do not depend on what else is in the call.

Inputs: `nn.batched`'s six (input_ids `[B, T]` with T <= MAX_ROWS, past_lengths, key_index, logit_rows,
temperature, uniform), then
    state_slots: int64 `[B]`: sequence b's GDN state slot.
    pending_index: int64 `[B, P]`, 1 <= P <= MAX_ROWS: rows of the pending buffers holding sequence b's
        pending rows in order (entries past pending_lengths[b] are padding: any row).
    pending_lengths: int64 `[B]`: sequence b's pending rows (0 .. P).
    then per layer i (`nn.qwen3_5.cache_names`): full attention: past_key_i / past_value_i
        `[Hkv, max_seq_len * S, D]` (as `nn.batched`); GDN: conv_state_i `[S, K-1, C]`, recurrent_state_i
        fp32 `[S, Hv, dk, dv]` (slot s's state), pending_qkv_i `[M, C]`, pending_a_i / pending_b_i `[M, Hv]`
        (every slot's pending rows; M rows in all).

Outputs: `nn.batched`'s four (next_ids, logits, next_embeddings, taps), then per layer: key_i / value_i
`[B * T, Hkv, D]`; or conv_state_out_i `[B, K-1, C]`, recurrent_state_out_i fp32 `[B, Hv, dk, dv]`
(sequence b's state after its pending rows, for its slot) and qkv_i `[B * T, C]`, a_i / b_i `[B * T, Hv]`
(its new rows' recorded inputs: the committed prefix becomes its slot's pending rows).
"""

from __future__ import annotations

import torch

from dflash_export.nn.batched import (
    BATCHED_OUTPUTS,
    _attend,
    _posterior,
    attention_tables,
)
from dflash_export.nn.gated_delta import MAX_ROWS, gated_delta_chunk
from dflash_export.nn.layers import TargetForExport, rope_cos_sin
from dflash_export.nn.qwen3_5 import (
    GatedDeltaNet,
    HybridDecoderLayer,
    Qwen35TargetForExport,
    cache_names,
)
from runtime.manifest import BATCHED_HYBRID_INPUTS, BATCHED_INPUTS


def batched_hybrid_io_names(layer_types) -> tuple[list[str], list[str]]:
    """Input and output names of the batched hybrid target graph, in positional order."""
    ins, outs = [*BATCHED_INPUTS, *BATCHED_HYBRID_INPUTS], list(BATCHED_OUTPUTS)
    for i, kind in enumerate(layer_types):
        cin, cout = cache_names(kind, i)
        ins, outs = ins + cin, outs + cout
    return ins, outs


def _by_position(rows: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """`[B * n, ...]` (sequence-major) -> `[n, B, ...]`: the row axis outermost, as the GDN code takes it."""
    return rows.reshape(b, n, *rows.shape[1:]).transpose(0, 1)


def _heads_per_position(x: torch.Tensor) -> torch.Tensor:
    """`[n, B, H, d]` -> `[n, B * H, d]`: every sequence's heads as heads of one chunk (sequence-major)."""
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _qkv_heads(gdn: GatedDeltaNet, y: torch.Tensor):
    """Conv output `[n, B, C]` -> L2-normalised q, k `[n, B * Hk, dk]` and v `[n, B * Hv, dv]`."""
    n, b = y.shape[0], y.shape[1]
    q, k, v = gdn.split(y.reshape(n * b, -1))
    return tuple(_heads_per_position(x.reshape(n, b, *x.shape[1:])) for x in (q, k, v))


def _plus_zero_row(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of `xs` (row axis outermost) with one row of zeros after its rows. A chunk of n + 1 >= 2 rows
    keeps every product of the delta rule at two rows or more: onnxruntime's MatMul rounds a one-row
    product differently from a several-row one, and a sequence alone would then get other floats than
    in a padded batch. A zero row (k = v = 0, decay 1, beta 0) adds exact zeros."""
    return tuple(torch.cat([x, torch.zeros_like(x[:1])], dim=0) for x in xs)


def _rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (int64 `[n]`) of `table [N, ...]` -> `[n, ...]`, as one Gather (an Embedding) with no
    node on the index: indices are shared by every layer, and a per-layer node on them (index_select's
    Reshape) would be merged across layers, which layer replication cannot copy."""
    return torch.nn.functional.embedding(index, table.reshape(table.shape[0], -1)).view(-1, *table.shape[1:])


def batched_gdn(gdn: GatedDeltaNet, x, b: int, t: int, caches, slots, pending_rows, pending_valid, tail_index):
    """One GDN layer for B sequences of T rows (see the module docstring).

    Args:
        x: normed hidden `[B * T, d]`. caches: (conv_state `[S, K-1, C]`, recurrent_state fp32
            `[S, Hv, dk, dv]`, pending_qkv `[M, C]`, pending_a / pending_b `[M, Hv]`).
        slots: int64 `[B]`. pending_rows: int64 `[B * P]` (the flattened `pending_index`).
        pending_valid: bool `[P, B, 1]`: whether pending row p of sequence b is one (not padding).
        tail_index: int64 `[B * (K-1)]`: rows of the flattened `[B * (K-1+P), C]` context that are each
            sequence's conv state after its pending rows.

    Returns:
        (out `[B * T, d]`, conv_state_out `[B, K-1, C]`, recurrent_state_out `[B, Hv, dk, dv]`, qkv, a, b).
    """
    conv_state, rec_state, pend_qkv, pend_a, pend_b = caches
    k1, hv, p = gdn.kernel - 1, gdn.num_v_heads, pending_valid.shape[0]
    conv = _rows(conv_state, slots)
    pending = _rows(pend_qkv, pending_rows).view(b, p, -1).to(conv.dtype)
    context = torch.cat([conv, pending], dim=1)  # [B, K-1+P, C]
    _, k_p, v_p = _qkv_heads(gdn, gdn.conv(context.transpose(0, 1), p))
    g_p, beta_p = gdn.gates(_rows(pend_a, pending_rows), _rows(pend_b, pending_rows))
    zero = torch.zeros((), dtype=torch.float32)
    g_p = torch.where(pending_valid, _by_position(g_p, b, p), zero).reshape(p, b * hv)
    beta_p = torch.where(pending_valid, _by_position(beta_p, b, p), zero).reshape(p, b * hv)
    state = _rows(rec_state, slots).to(torch.float32)
    k_p, v_p, g_p, beta_p = _plus_zero_row(k_p, v_p, g_p, beta_p)
    _, state = gated_delta_chunk(None, k_p, v_p, g_p, beta_p, state.reshape(b * hv, *state.shape[2:]), outputs=False,
                                 padded=True)
    conv_out = _rows(context.reshape(-1, context.shape[-1]), tail_index).view(b, k1, -1)
    # the new rows, from the folded state; their own inputs are only recorded
    qkv, a, b_in = gdn.in_proj_qkv(x), gdn.in_proj_a(x), gdn.in_proj_b(x)
    rows = torch.cat([conv_out, qkv.view(b, t, -1).to(conv_out.dtype)], dim=1)
    q, k, v = _qkv_heads(gdn, gdn.conv(rows.transpose(0, 1), t))
    g, beta = gdn.gates(a, b_in)
    g, beta = _by_position(g, b, t).reshape(t, b * hv), _by_position(beta, b, t).reshape(t, b * hv)
    o, _ = gated_delta_chunk(*_plus_zero_row(q, k, v, g, beta), state, final_state=False, padded=True)  # [T+1, B*Hv, dv]
    o = o[:t].reshape(t, b, hv, -1).transpose(0, 1).reshape(b * t, hv, -1)
    z = gdn.in_proj_z(x).view(b * t, hv, gdn.value_head_dim)
    o = gdn.norm(o, z).reshape(b * t, hv * gdn.value_head_dim)
    new_state = state.view(b, hv, *state.shape[1:])
    return gdn.out_proj(o.to(gdn.out_proj.weight.dtype)), conv_out, new_state, qkv, a, b_in


class BatchedHybridLayer(HybridDecoderLayer):
    """A hybrid decoder layer over B sequences: its own module call, so the exporter scopes its nodes by
    layer (`model.layers.j`) and layer replication can copy a traced template's layers."""

    def forward(self, h, cache, b: int, t: int, rope, tables, state_tables):
        """`h [B * T, d]`, this layer's cache inputs -> (`h`, its outputs). `rope`: (cos, sin) per row;
        `tables`: `nn.batched.attention_tables`; `state_tables`: `batched_gdn`'s slots, pending_rows,
        pending_valid and tail_index."""
        x = self.input_layernorm(h)
        if self.layer_type == "linear_attention":
            mixed, *outs = batched_gdn(self.linear_attn, x, b, t, cache, *state_tables)
        else:
            attn = self.self_attn
            q, gate = attn.query(x, *rope)
            k, v = attn.key_value(x, *rope)
            out = _attend(attn, q, cache[0], cache[1], k, v, tables, b, t)
            mixed, outs = attn.o_proj(out * torch.sigmoid(gate)), [k, v]
        h = h + mixed
        return h + self.mlp(self.post_attention_layernorm(h)), outs


class BatchedHybridTarget(Qwen35TargetForExport):
    """`Qwen35TargetForExport`'s stack and LM head over B sequences (see the module docstring). Like
    `nn.batched.BatchedTarget` it holds no proposal head: a sequence's proposals are ids, verified as
    the rows after its last committed token. Constructed as the families' target modules are."""

    head_weight_name = TargetForExport.head_weight_name
    freeze_draft_head = TargetForExport.freeze_draft_head

    def __init__(self, spec, tap_layers: tuple[int, ...], dtype: torch.dtype = torch.float32, draft_vocab=None,
                 draft_proposes: bool = True):
        super().__init__(getattr(spec, "hybrid", None) or spec, tap_layers)
        self.draft_proposes = True
        self.register_buffer("draft_vocab", None, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)
        self.compute_dtype = dtype
        for layer in self.model.layers:  # the same parameters, the batched forward
            layer.__class__ = BatchedHybridLayer

    def forward(self, input_ids, past_lengths, key_index, logit_rows, temperature, uniform,
                state_slots, pending_index, pending_lengths, *caches):
        spec = self.spec
        b, t = input_ids.shape
        torch._check(t <= MAX_ROWS)
        positions = (past_lengths[:, None] + torch.arange(t, dtype=torch.int64)[None, :]).reshape(-1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, 1.0)
        first = caches[self.cache_offsets[self.first_attention]]
        attn0 = self.model.layers[self.first_attention].self_attn
        tables = attention_tables(past_lengths, key_index, first.shape[1], attn0, t)
        p = pending_index.shape[1]
        steps = torch.arange(p, dtype=torch.int64)
        pending_valid = steps[None, :] < pending_lengths[:, None]
        k1 = spec.conv_kernel - 1
        tail = torch.arange(b, dtype=torch.int64)[:, None] * (k1 + p) + pending_lengths[:, None] \
            + torch.arange(k1, dtype=torch.int64)[None, :]
        # (every table shared by the layers is made here, outside them: replication copies a layer's nodes)
        state_tables = (state_slots, pending_index.reshape(-1), pending_valid.transpose(0, 1)[..., None], tail.reshape(-1))
        h = self.model.embed_tokens(input_ids.reshape(-1))
        taps, new = {}, []
        for i, layer in enumerate(self.model.layers):
            cache = caches[self.cache_offsets[i]: self.cache_offsets[i + 1]]
            h, outs = layer(h, cache, b, t, (cos, sin), tables, state_tables)
            new += outs
            if i in self.tap_layers and i != spec.num_layers - 1:
                taps[i] = h
        h = self.model.norm(h)
        if spec.num_layers - 1 in self.tap_layers:
            taps[spec.num_layers - 1] = h
        logits = torch.nn.functional.linear(torch.index_select(h, 0, logit_rows), self.head_weight()).to(torch.float32)
        next_ids = _posterior(logits, temperature, uniform, spec.vocab_size)
        tap_features = torch.cat([taps[i] for i in self.tap_layers], dim=-1)
        return (next_ids, logits, self.model.embed_tokens(next_ids), tap_features, *new)
