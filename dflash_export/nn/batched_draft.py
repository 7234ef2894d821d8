"""The batched draft: one call drafts a block for each of several sequences, each reading its own context
K/V from a static per-slot cache. What lets `runtime.batching` speculate for every sequence of a batched
step in one draft call instead of one call per sequence.

Each sequence's block sees what the one-sequence draft (`nn.draft.DFlashDraft`) shows it: its cached
context rows, its new context rows and its whole block (or, in a causal layer, the block rows up to
itself; in a sliding layer, the keys within the window), at the positions the one-sequence draft gives
them. Keys are laid out per sequence as [cached rows | new context rows | block rows], padded to the
longest of the call, and padding is masked. Unlike the batched target, the draft need not be bit-exact
against its one-sequence graph (its proposals are verified; only the target decides the output), so it
uses a plain softmax.

Inputs (B sequences; the new context rows of all of them packed, Ctot rows, sequence after sequence):
    context_hidden: `[N, k * d]`: a buffer holding every sequence's new tap features (the runtime's
        per-slot pending rows of all slots, bound whole).
    context_rows: int64 `[Ctot]`: the rows of `context_hidden` that are new context, sequence-major.
    context_positions: int64 `[Ctot]`: each new context row's draft position (its sequence's cached
        rows, plus its place among that sequence's new rows).
    context_index: int64 `[B, C]`: sequence b's new row c < context_lengths[b] is packed row
        context_index[b, c] (of the Ctot); later entries are padding (masked; any index < Ctot).
    context_lengths: int64 `[B]`: new context rows per sequence.
    past_lengths: int64 `[B]`: cached context rows per sequence (its first new row's position).
    key_index: int64 `[B, L]`: sequence b's cached row l < past_lengths[b] is cache row key_index[b, l];
        later entries are padding (masked; clipped into the cache).
    block_embeddings: `[B, Bk, d]`: each sequence's `[anchor, MASK x (Bk - 1)]` embeddings.
    proposal_rows: int64 `[R]`, values in [0, Bk - 1): the block rows whose proposals are returned
        (row r is block position r + 1), the same for every sequence; the last layer is cut to them.
    past_key_i / past_value_i: `[M, Hkv, D]`: layer i's whole cache (every slot's rows).

Outputs:
    draft_top_ids: int64 `[B * R, K]`, draft_top_probs: fp32 `[B * R, K]`: each sequence's proposal
        table (`nn.layers.proposal_table`), sequence-major.
    key_i / value_i: `[Ctot, Hkv, D]`: the K/V of the packed new context rows, which the runtime writes
        to each sequence's cache after its cached rows.
"""

from __future__ import annotations

import copy

import torch

from dflash_export.nn.draft import ProposingDraft
from dflash_export.nn.layers import proposal_table
from dflash_export.nn.tables import rope_cos_sin
from runtime.manifest import BATCHED_DRAFT_INPUTS

BATCHED_DRAFT_OUTPUTS = ("draft_top_ids", "draft_top_probs")


def batched_draft_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the batched draft graph, in positional order."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return [*BATCHED_DRAFT_INPUTS, *kv_in], [*BATCHED_DRAFT_OUTPUTS, *kv_out]


class BatchedDraft(ProposingDraft):
    """A :class:`ProposingDraft` over B sequences (see the module docstring). Same parameters and names;
    build one with `BatchedDraft.with_head(draft, vocab, rows)` or `view_of` a proposing draft."""

    @classmethod
    def view_of(cls, draft: ProposingDraft) -> "BatchedDraft":
        """A shallow copy of the proposing `draft` (parameters and proposal head shared) that runs the
        batched forward; `draft` is left as it was."""
        view = copy.copy(draft)
        view._buffers = dict(draft._buffers)  # its proposal vocabulary and head rows
        view.__class__ = cls
        return view

    def forward(self, context_hidden, context_rows, context_positions, context_index, context_lengths,
                past_lengths, key_index, block_embeddings, proposal_rows, *past):
        b, n_blk, d = block_embeddings.shape
        attn0 = self.layers[0].self_attn
        hkv, dh, g = attn0.num_kv_heads, attn0.head_dim, attn0.num_heads // attn0.num_kv_heads
        n_past, n_ctx = key_index.shape[1], context_index.shape[1]
        blk_pos = (past_lengths + context_lengths)[:, None] + torch.arange(n_blk, dtype=torch.int64)[None, :]
        cos_c, sin_c = rope_cos_sin(context_positions, self.inv_freq, self.rope_scale)
        cos_b, sin_b = rope_cos_sin(blk_pos.reshape(-1), self.inv_freq, self.rope_scale)
        picked = (torch.arange(b, dtype=torch.int64)[:, None] * n_blk + proposal_rows[None, :] + 1).reshape(-1)
        past_keys = torch.arange(n_past, dtype=torch.int64)[None, :]
        ctx_keys = torch.arange(n_ctx, dtype=torch.int64)[None, :]
        key_pos = torch.cat([past_keys.expand(b, n_past), past_lengths[:, None] + ctx_keys, blk_pos], dim=1)
        valid = torch.cat([past_keys < past_lengths[:, None], ctx_keys < context_lengths[:, None],
                           torch.ones_like(blk_pos, dtype=torch.bool)], dim=1)
        every = self._biases(blk_pos, key_pos, valid, g)
        last_q = torch.index_select(blk_pos.reshape(-1), 0, picked).reshape(b, -1)
        cut = self._biases(last_q, key_pos, valid, g)
        cached = torch.clamp(key_index.reshape(-1), max=past[0].shape[0] - 1)
        ctx_index = context_index.reshape(-1)
        ctx = torch.index_select(context_hidden, 0, context_rows)
        ctx = self.hidden_norm(self.fc(ctx.to(self.fc.weight.dtype))).to(self.compute_dtype)
        h = block_embeddings.reshape(b * n_blk, d).to(self.compute_dtype)
        cos_q, sin_q = cos_b * attn0.scale, sin_b * attn0.scale
        new_kv, last = [], len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h).to(self.compute_dtype)
            k_ctx, v_ctx = layer.self_attn.key_value(ctx, cos_c, sin_c)
            k_blk, v_blk = layer.self_attn.key_value(x, cos_b, sin_b)
            new_kv += [k_ctx, v_ctx]
            biases = every
            if i == last:  # keys and values above came from every block row; the queries only from `picked`
                h, x = torch.index_select(h, 0, picked), torch.index_select(x, 0, picked)
                cos_q, sin_q = torch.index_select(cos_q, 0, picked), torch.index_select(sin_q, 0, picked)
                biases = cut

            def keys_of(cache, new_ctx, new_blk):  # -> [B, Hkv, L + C + Bk, D]
                parts = [torch.index_select(cache, 0, cached).view(b, n_past, hkv, dh),
                         torch.index_select(new_ctx, 0, ctx_index).view(b, n_ctx, hkv, dh), new_blk.view(b, n_blk, hkv, dh)]
                return torch.cat(parts, dim=1).permute(0, 2, 1, 3)

            q = layer.self_attn.query(x, cos_q, sin_q)
            bias = biases[(self.sliding[i], self.causal[i])]
            out = _attend(q, keys_of(past[2 * i], k_ctx, k_blk), keys_of(past[2 * i + 1], v_ctx, v_blk), bias, b, g)
            h = h + layer.self_attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h).to(self.compute_dtype))
        hidden = self.norm(h).to(self.compute_dtype)
        return (*proposal_table(self.proposal_scores(hidden), self.draft_vocab), *new_kv)

    def _biases(self, q_pos, key_pos, valid, group: int) -> dict:
        """fp32 `[B, group * Q, L + C + Bk]` additive masks by layer kind (sliding, causal) for queries at
        `q_pos [B, Q]` over keys at `key_pos [B, Lk]` (`valid`: not padding): rows ordered (head in
        group, query), as the grouped queries."""
        diff = q_pos[:, :, None] - key_pos[:, None, :]
        lowest = torch.full((), torch.finfo(torch.float32).min)
        out = {}
        for sliding, causal in dict.fromkeys(zip(self.sliding, self.causal)):
            visible = valid[:, None, :].expand(diff.shape)
            if causal:
                visible = visible & (diff >= 0)
            if sliding:
                w = int(self.spec.sliding_window)
                visible = visible & ((diff < w) if causal else (diff.abs() < w))
            bias = torch.where(visible, torch.zeros((), dtype=torch.float32), lowest)
            out[(sliding, causal)] = bias.repeat(1, group, 1)
        return out


def _attend(q, keys, values, bias, b: int, group: int) -> torch.Tensor:
    """Softmax attention of the block queries `q [B * Q, H, D]` over each sequence's keys and values
    `[B, Hkv, Lk, D]` with the additive `bias [B, group * Q, Lk]`. Returns `[B * Q, H * D]`."""
    hkv, d = keys.shape[1], keys.shape[3]
    n_q = q.shape[0] // b
    qg = q.view(b, n_q, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * n_q, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).to(torch.float32) + bias[:, None]
    p = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(p, values)  # [B, Hkv, group * Q, D]
    return out.view(b, hkv, group, n_q, d).permute(0, 3, 1, 2, 4).reshape(b * n_q, hkv * group * d)
