"""The DFlash 2 draft as an export-friendly PyTorch module (z-lab/dflash `DFlash2DraftModel`, 2026-08):
DFlash's layers, each sublayer wrapped in a grouped dynamic convolution over the block, ending in the
target's LM head and a candidate selector that walks the block from the anchor, all in one graph of
standard operators (the walk unrolled over the block: Gather, MatMul, TopK)."""

from __future__ import annotations

import torch
from torch import nn

from dflash_export.checkpoint.dflash2 import DFlash2Spec
from dflash_export.nn.draft import DFlashDraft
from dflash_export.nn.tables import rope_cos_sin

# candidates per row the graph returns (`draft_top_ids` columns): the selector's choice first, then the
# next best by its score; the policy reads their probabilities as v1's proposal table
PROPOSAL_RANKS = 4


class GroupedDynamicConv(nn.Module):
    """A causal convolution along the block whose kernel is a learned base plus a per-row dynamic part.

    `base_kernel [2, K, d]` holds the pre (index 0) and post (index 1) kernels; `kernel_projection`
    maps the normalised sublayer input `[B, d]` to both stages' dynamic coefficients `[B, 2, K, G]`,
    one per group of `group_size` channels. Tap t reads the row t positions back, zero before the
    block's first row (the convolution never crosses the block start)."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def coefficients(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B, d]` (the normalised sublayer input) -> dynamic coefficients `[B, 2, K, G]`."""
        return self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)

    def forward(self, x: torch.Tensor, dynamic: torch.Tensor, stage: int) -> torch.Tensor:
        """Convolve `x [B, d]` with stage `stage`'s kernel: sum over taps t of
        (base[stage, t] + dynamic[:, stage, t] per group) * x shifted t rows down."""
        b = x.shape[0]
        blocks = x.view(b, self.groups, self.group_size)
        out = torch.zeros_like(blocks)
        for t in range(self.kernel_size):
            shifted = blocks if t == 0 else torch.cat([torch.zeros_like(blocks[:t]), blocks[: b - t]])
            base = self.base_kernel[stage, t].view(self.groups, self.group_size).to(x.dtype)
            out = out + base * shifted
            out = out + dynamic[:, stage, t, :, None].to(x.dtype) * shifted
        return out.view(b, -1)


class CandidateSelector(nn.Module):
    """The selector: for block position j the LM head's top-k candidates b with logits U(b) are scored
    U(b) + <predecessor_codebook[a] * hidden_projection(h_j), successor_codebook[b]>, a being the
    token chosen at j - 1 (the anchor for j = 1); the argmax is chosen and becomes the next a."""

    def __init__(self, hidden: int, rank: int, vocab: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor) -> tuple:
        """The walk over `hidden [N, d]` and its fp32 `logits [N, V]` from `anchor_ids` int64 `[1]`.

        Every pairwise score is computed up front, batched: position j's `[k, k]` table scores each of
        position j - 1's candidates (as predecessor) against each of its own, so the sequential part is
        one row lookup and one ArgMax per position (the graph unrolls it over the block's N = B - 1).

        Returns:
            (candidates int64 `[N, k]`, their logits U fp32 `[N, k]`, scores fp32 `[N, k]` given the chosen
            predecessor, the chosen ids int64 `[N]`), candidates in the LM head's rank order.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1)
        n, k = candidates.shape
        projected = self.hidden_projection(hidden).to(torch.float32)  # [N, r]
        # index_select: one Gather reading each codebook initializer (advanced indexing would export copies)
        successors = torch.index_select(self.successor_codebook, 0, candidates.reshape(-1)).to(torch.float32)
        successors = successors.view(n, k, -1) * projected[:, None, :]  # B[b] * P h_j  [N, k, r]
        first = torch.index_select(self.predecessor_codebook, 0, anchor_ids).to(torch.float32)  # [1, r]
        row = unary[0:1] + torch.matmul(first, successors[0].T)  # [1, k]: the anchor's scores
        index = torch.argmax(row, dim=-1)
        scores = [row]
        if n > 1:
            before = torch.index_select(self.predecessor_codebook, 0, candidates[:-1].reshape(-1)).to(torch.float32)
            tables = unary[1:, None, :] + torch.matmul(before.view(n - 1, k, -1), successors[1:].transpose(1, 2))
            for table in torch.unbind(tables):  # [k, k] per position: row i = predecessor candidate i
                row = torch.index_select(table, 0, index)
                index = torch.argmax(row, dim=-1)
                scores.append(row)
        scores = torch.cat(scores)
        chosen = torch.gather(candidates, 1, torch.argmax(scores, dim=-1, keepdim=True))[:, 0]
        return candidates, unary, scores, chosen


class DFlash2Draft(DFlashDraft):
    """The DFlash 2 draft with its context K/V cache explicit, ending in its proposals.

    Inputs:
        context_hidden `[C, k * d]`, block_embeddings `[B, d]` (B: the draft's block size, fixed in the
        graph: the walk is unrolled over it), past_key_i / past_value_i `[Pc, Hkv, D]`: as
        :class:`DFlashDraft`.
        proposal_rows: int64 `[R]`: the rows of the proposal table to return (row r: block position r + 1).
        anchor_ids: int64 `[1]`: the last committed token (the block's position 0), the walk's first
            predecessor.

    Outputs:
        draft_top_ids: int64 `[R, 4]`: per row the selector's choice, then the next 3 candidates by
            score given the same predecessor.
        draft_top_probs: fp32 `[R, 4]`: their softmax(score) over the k candidates.
        key_i / value_i: `[C, Hkv, D]`, as :class:`DFlashDraft`.

    The LM head is the target's (`draft_head [V, d]`, set by `with_head`), as the reference's
    `compute_logits`: times `output_multiplier`, then soft-capped where the config says.
    """

    proposes = True
    selects = True

    def __init__(self, spec: DFlash2Spec, dtype: torch.dtype = torch.float32):
        super().__init__(spec, dtype)
        d = spec.arch.hidden_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(d, spec.conv_kernel_size, spec.conv_group_size)
            layer.mlp_conv = GroupedDynamicConv(d, spec.conv_kernel_size, spec.conv_group_size)
        self.candidate_selector = CandidateSelector(d, spec.selector_rank, spec.vocab_size, spec.selector_top_k)
        self.register_buffer("draft_head", None, persistent=False)

    def with_head(self, rows: torch.Tensor) -> "DFlash2Draft":
        """Set the target's LM head rows `[V, d]` (a placeholder when streamed: its reader writes them
        as `draft_head`). Returns self."""
        self.draft_head = rows
        return self

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, d]` -> fp32 `[N, V]`: the target's LM head, the output multiplier, the soft cap."""
        spec = self.spec
        logits = self.head_scores(hidden).to(torch.float32)
        if spec.output_multiplier != 1.0:
            logits = logits * spec.output_multiplier
        if spec.final_logit_softcapping:
            logits = torch.tanh(logits / spec.final_logit_softcapping) * spec.final_logit_softcapping
        return logits

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden [N, d]` -> the target LM head's raw logits `[N, V]` (`check`'s reference takes them
        from its reference target)."""
        return nn.functional.linear(hidden.to(self.draft_head.dtype), self.draft_head)

    def hidden_rows(self, context_hidden, block_embeddings, *past) -> tuple:
        """The layers: (norm(h) of block positions 1..B-1 `[B - 1, d]`, new context K/V...)."""
        c, b, p = context_hidden.shape[0], block_embeddings.shape[0], past[0].shape[0]
        positions = torch.arange(c + b, dtype=torch.int64) + p
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        cos_c, sin_c, cos_b, sin_b = cos[:c], sin[:c], cos[c:], sin[c:]
        scale = self.layers[0].self_attn.scale
        masks = self._masks(positions, positions[c:], c, p)
        ctx = self.hidden_norm(self.fc(context_hidden.to(self.fc.weight.dtype))).to(self.compute_dtype)
        h = block_embeddings.to(self.compute_dtype)
        if self.spec.input_embedding_scale != 1.0:
            h = h * self.spec.input_embedding_scale
        new_kv = []
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h).to(self.compute_dtype)
            dynamic = layer.attention_conv.coefficients(x)
            x = layer.attention_conv(x, dynamic, 0)
            k_ctx, v_ctx = layer.self_attn.key_value(ctx, cos_c, sin_c)
            k_blk, v_blk = layer.self_attn.key_value(x, cos_b, sin_b)
            new_kv += [k_ctx, v_ctx]
            q = layer.self_attn.query(x, cos_b * scale, sin_b * scale)
            attn = self._attend(layer, i, q, past, masks, torch.cat([k_ctx, k_blk]), torch.cat([v_ctx, v_blk]))
            h = h + layer.attention_conv(layer.self_attn.o_proj(attn), dynamic, 1)
            y = layer.post_attention_layernorm(h).to(self.compute_dtype)
            dynamic = layer.mlp_conv.coefficients(y)
            h = h + layer.mlp_conv(layer.mlp(layer.mlp_conv(y, dynamic, 0)), dynamic, 1)
        return (self.norm(h)[1:].to(self.compute_dtype), *new_kv)

    def select(self, hidden: torch.Tensor, anchor_ids: torch.Tensor) -> tuple:
        """The selector's walk over `hidden [B - 1, d]` (see `CandidateSelector.walk`)."""
        return self.candidate_selector.walk(hidden, self.logits(hidden), anchor_ids)

    def forward(self, context_hidden, block_embeddings, proposal_rows, anchor_ids, *past):
        hidden, *new_kv = self.hidden_rows(context_hidden, block_embeddings, *past)
        candidates, _, scores, _ = self.select(hidden, anchor_ids)
        k = min(PROPOSAL_RANKS, candidates.shape[1])
        order = torch.topk(scores, k, dim=-1).indices  # column 0: the argmax, the walk's choice
        ids = torch.gather(candidates, 1, order)
        probs = torch.gather(torch.softmax(scores, dim=-1), 1, order)
        return (torch.index_select(ids, 0, proposal_rows), torch.index_select(probs, 0, proposal_rows), *new_kv)
