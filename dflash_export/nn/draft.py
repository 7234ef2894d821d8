"""The DFlash draft as an export-friendly PyTorch module: its context K/V cache explicit, built from the
target's layers (`dflash_export.nn.layers`)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from dflash_export.checkpoint.draft import DraftSpec
from dflash_export.nn.layers import DecoderLayer, RMSNorm, proposal_table
from dflash_export.nn.tables import rope_cos_sin, rope_inv_freq, window_bias


class DFlashDraft(nn.Module):
    """The DFlash draft (Chen et al., 2026, arXiv 2602.06036; dflash-facts section 2) with its context
    K/V cache explicit.

    Inputs:
        context_hidden: `[C, k * d]`, C >= 1: target tap features of the newly committed tokens.
        block_embeddings: `[B, d]`: target embeddings of `[anchor, MASK x (B - 1)]`.
        past_key_i / past_value_i: `[Pc, Hkv, D]`: cached context K/V (after k_norm and RoPE).

        rows (keyword; the graph's `proposal_rows` input): int64 `[R]`, values in [0, B - 1): the
            `draft_hidden` rows to compute (row r is block position r + 1), or None for all B - 1.
            Only the last layer is cut to them (its keys and values still come from every block row,
            so the rows it returns equal the uncut forward's): a step verifying 1-3 of 15 proposals
            then skips most of that layer's matrix products, a large share of a shallow draft's call
            (figures: docs/performance.md#the-drafts-rows-cut-draft-call-time-2026-12-03).

    Outputs:
        draft_hidden: `[B - 1, d]` (`[R, d]` with `rows`): norm(h) of block positions 1..B-1 (position
            0 is the known anchor).
        key_i / value_i: `[C, Hkv, D]`: the context K/V rows of the new context, to cache at row Pc.

    Positions: context rows take Pc..Pc+C-1, block rows Pc+C..Pc+C+B-1, from the DRAFT's RoPE.
    Block positions see every context row and the whole block (bidirectional), or, in a layer the
    spec marks causal (`spec.causal_layers`), the block rows up to themselves. Only block rows
    query; context rows only give keys and values.
    Sliding layers (`spec.layer_types`, Qwen3.6 drafts) see a key at position j from a query at
    position i only when |i - j| < `spec.sliding_window` (flash-attention's window in the reference);
    they read just the cached rows a block query can see (the last W - 1 - C, none once C >= W - 1).
    A draft without sliding layers builds no window mask at all (its graph is unchanged).
    `fc`, `hidden_norm` and all norms run in fp32 (released drafts see tap values above 2e4).
    """

    def __init__(self, spec: DraftSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        a = spec.arch
        self.spec = spec
        self.fc = nn.Linear(len(spec.target_layer_ids) * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(a, qk_norm=True) for _ in range(a.num_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        inv, scale = rope_inv_freq(a, "qwen3")
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.compute_dtype = dtype
        self.sliding = tuple(t == "sliding_attention" for t in spec.layer_types)
        self.causal = tuple(spec.causal_layers)

    def _masks(self, positions: torch.Tensor, q_pos: torch.Tensor, c: int, p: int) -> dict:
        """The layers' views for block queries at `q_pos [Q]`, by (sliding, causal) kind: (first visible
        cached row, past bias `[g * Q, Pc - start]` or None, new bias `[g * Q, C + B]`), or None for a
        bidirectional full-attention layer (no mask at all). Shared by the layers of one kind.
        A sliding query at Pc + C + r sees cached row j iff Pc + C + r - j < W, so rows before
        Pc + C - W + 1 are invisible to all of them (the first block row's window is the widest);
        a causal query sees every context row and the block rows up to itself."""
        attn0 = self.layers[0].self_attn
        g = attn0.num_heads // attn0.num_kv_heads
        masks: dict = {}
        for sliding, causal in dict.fromkeys(zip(self.sliding, self.causal)):
            if not sliding:
                masks[(False, causal)] = (0, None, window_bias(q_pos, positions, None, g, True)) if causal else None
                continue
            w = int(self.spec.sliding_window)
            # cached rows kept: min(Pc, max(W - 1 - C, 0)), as symbolic sizes (dynamic C and Pc in the graph)
            keep = torch.sym_min(p, torch.sym_max(w - 1 - c, 0))
            start = p - keep
            past_pos = torch.arange(keep, dtype=torch.int64) + start
            masks[(True, causal)] = (start, window_bias(q_pos, past_pos, w, g, causal),
                                     window_bias(q_pos, positions, w, g, causal))
        return masks

    def forward(self, context_hidden, block_embeddings, *past, rows=None):
        c = context_hidden.shape[0]
        b = block_embeddings.shape[0]
        p = past[0].shape[0]
        positions = torch.arange(c + b, dtype=torch.int64) + p
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        cos_c, sin_c, cos_b, sin_b = cos[:c], sin[:c], cos[c:], sin[c:]
        scale = self.layers[0].self_attn.scale
        cos_q, sin_q = cos_b * scale, sin_b * scale
        masks = self._masks(positions, positions[c:], c, p)
        ctx = self.hidden_norm(self.fc(context_hidden.to(self.fc.weight.dtype))).to(self.compute_dtype)
        h = block_embeddings.to(self.compute_dtype)
        new_kv = []
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h).to(self.compute_dtype)
            k_ctx, v_ctx = layer.self_attn.key_value(ctx, cos_c, sin_c)
            k_blk, v_blk = layer.self_attn.key_value(x, cos_b, sin_b)
            new_kv += [k_ctx, v_ctx]
            if i == last and rows is not None:  # keys/values above used every block row; the rest only `rows`
                picked = rows + 1  # block position of each returned row
                h, x = torch.index_select(h, 0, picked), torch.index_select(x, 0, picked)
                cos_q, sin_q = torch.index_select(cos_q, 0, picked), torch.index_select(sin_q, 0, picked)
                masks = self._masks(positions, torch.index_select(positions[c:], 0, picked), c, p)
            q = layer.self_attn.query(x, cos_q, sin_q)
            h = h + layer.self_attn.o_proj(self._attend(layer, i, q, past, masks, torch.cat([k_ctx, k_blk]),
                                                        torch.cat([v_ctx, v_blk])))
            h = h + layer.mlp(layer.post_attention_layernorm(h).to(self.compute_dtype))
        out = self.norm(h) if rows is not None else self.norm(h)[1:]
        return (out.to(self.compute_dtype), *new_kv)

    def _attend(self, layer, i: int, q, past, masks: dict, k_new, v_new):
        """Layer `i`'s attention of block queries `q` over its cached and new context/block rows, masked
        as its kind says (`_masks`)."""
        mask = masks[(self.sliding[i], self.causal[i])]
        if mask is None:
            return layer.self_attn.attend(q, past[2 * i], past[2 * i + 1], k_new, v_new, None)
        start, past_bias, new_bias = mask
        return layer.self_attn.attend(q, past[2 * i][start:], past[2 * i + 1][start:], k_new, v_new, new_bias, past_bias)


class DraftWithRows(DFlashDraft):
    """A :class:`DFlashDraft` taking its `rows` as the positional input `proposal_rows` (after
    `block_embeddings`, before the past K/V), as the exported graph and `check`'s reference take it.
    Same parameters and names as the draft."""

    def forward(self, context_hidden, block_embeddings, proposal_rows, *past):
        return super().forward(context_hidden, block_embeddings, *past, rows=proposal_rows)

    @classmethod
    def view_of(cls, draft: DFlashDraft) -> "DraftWithRows":
        """`draft` itself when it is one, else a shallow copy sharing its parameters (same names) that
        takes the graph's input order; `draft` is left as it was."""
        if isinstance(draft, cls):
            return draft
        view = copy.copy(draft)
        view.__class__ = cls
        return view


class ProposingDraft(DraftWithRows):
    """A :class:`DraftWithRows` ending in the proposal head: its graph returns, per computed row, the
    draft's top candidates and their probabilities instead of `draft_hidden`, so the runtime sees how
    confident the draft is before it chooses how many proposals the target verifies.

    The head is the target's LM head rows of the proposal vocabulary (`draft_vocab`, FR-Spec), as the
    target graph would apply them: moved here, not copied (the target then takes `proposal_ids`).

    Outputs:
        draft_top_ids: int64 `[R, K]`, K = min(4, V'): each row's candidates in rank order, as target
            token ids (`nn.layers.proposal_table`).
        draft_top_probs: fp32 `[R, K]`: their softmax probabilities over the proposal vocabulary.
        key_i / value_i: as :class:`DFlashDraft`.
    """

    proposes = True

    def forward(self, context_hidden, block_embeddings, proposal_rows, *past):
        hidden, *new_kv = super().forward(context_hidden, block_embeddings, proposal_rows, *past)
        return (*proposal_table(self.proposal_scores(hidden), self.draft_vocab), *new_kv)

    def proposal_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [R, d]` -> the head's scores `[R, V']` over the proposal vocabulary."""
        return nn.functional.linear(hidden.to(self.draft_head.dtype), self.draft_head)

    @classmethod
    def with_head(cls, draft: DFlashDraft, vocab, rows: torch.Tensor) -> "ProposingDraft":
        """A view of `draft` (its parameters shared, `draft` left as it was) with the proposal head:
        `vocab` the proposal vocabulary (target ids, `[V']`; None: all V ids) and `rows` the LM head's
        rows for it `[V', d]` (a placeholder when streamed: then the reader writes them as `draft_head`)."""
        view = copy.copy(draft)
        view.__class__ = cls
        view._buffers = dict(draft._buffers)
        view.register_buffer("draft_vocab", None if vocab is None else torch.tensor(list(vocab), dtype=torch.int64),
                             persistent=False)
        view.register_buffer("draft_head", rows, persistent=False)
        return view
