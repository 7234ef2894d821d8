"""The batched target: one call decodes (or prefills) several sequences, each at its own past length,
reading their K/V from static slots. What `runtime.batching` serves several clients with.

Every sequence's rows compute the floats the one-sequence target graph (`nn.layers.TargetForExport`)
gives them: per-row RoPE from each sequence's own positions, and attention in the split-invariant form
over keys laid out per sequence as [its past, its new rows, masked padding] (the padding adds exact
zeros at the end of every sum over keys, as the masked keys of a verify call do). So a stream's output
does not depend on what else runs in the batch.

The caches are whole static buffers, head-major `[Hkv, max_seq_len * S, D]` (row p * S + s: position
p of slot s), bound once; each layer gathers only the rows its sequences read, straight into the
`[Hkv, B, L, D]` layout its MatMuls take (no transpose of the cache), and writes the new rows into
their places (ScatterND).

Inputs (B sequences of T rows each, flattened row r = b * T + t; L keys per sequence):
    input_ids: int64 `[B, T]`.
    past_lengths: int64 `[B]`: sequence b's cached rows; its row t sits at position past_lengths[b] + t.
    key_index: int64 `[B, L]`, L >= max(past_lengths) + T: sequence b's key l < past_lengths[b] is
        cache row key_index[b, l]; keys past_b .. past_b + T - 1 are its new rows (whatever the index
        says), later keys padding (masked whatever they index).
    logit_rows: int64 `[K]`: the flattened rows whose logits and next ids are wanted (every row of a
        decoding step; the last row of a prefill chunk; a row nobody reads where none is wanted), K >= 1.
    temperature: fp32 `[K]`: per logits row; 0 is greedy.
    uniform: fp32 `[U]`, U = K (sample) or 0 (all greedy: the sampling branch is empty).
    past_key_i / past_value_i: `[Hkv, max_seq_len * S, D]`: layer i's whole cache.

Outputs:
    next_ids: int64 `[K]`: the posterior id of each logits row (sampled at its temperature).
    logits: fp32 `[K, V]`.
    next_embeddings: `[K, d]`: embed_tokens(next_ids), a sequence's next draft block anchor.
    taps: `[B * T, k * d]`: the tap layers' outputs of every row, the draft's context features (the
        one-sequence graph's `taps`): what lets a batched step verify each sequence's draft proposals.
    key_i / value_i: `[B * T, Hkv, D]`: the new K/V rows, which the runtime writes to cache row
        (past_lengths[b] + t) * S + slot of sequence b, in every head.
"""

from __future__ import annotations

import torch

from dflash_export.nn.layers import TargetForExport
from dflash_export.nn.tables import rope_cos_sin, rope_matrix
from runtime.manifest import BATCHED_INPUTS

BATCHED_OUTPUTS = ("next_ids", "logits", "next_embeddings", "taps")


def batched_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the batched target graph, in positional order."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return [*BATCHED_INPUTS, *kv_in], [*BATCHED_OUTPUTS, *kv_out]


def key_layout(past_lengths: torch.Tensor, key_index: torch.Tensor, cache_rows: int, heads: int, rows: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-call tables of the key layout (see the module docstring), shared by every layer.

    Returns:
        (cache index int64 `[B * L]` (clipped into the cache), new-row places int64 `[Hkv * B * T, 2]`:
        (head, b * L + past_b + t) of head h's new row t of sequence b, in `[Hkv, B * T]` order;
        visible bool `[B, T, L]`: row t of sequence b sees keys l <= past_b + t.)
    """
    b, n_keys = key_index.shape
    cached = torch.clamp(key_index.reshape(-1), max=cache_rows - 1)
    t = torch.arange(rows, dtype=torch.int64)[None, :]
    place = (torch.arange(b, dtype=torch.int64)[:, None] * n_keys + past_lengths[:, None] + t).reshape(1, -1)
    head = torch.arange(heads, dtype=torch.int64)[:, None].expand(heads, b * rows)
    places = torch.stack([head, place.expand(heads, b * rows)], dim=-1).reshape(-1, 2)
    keys = torch.arange(n_keys, dtype=torch.int64)[None, None, :]
    visible = keys <= past_lengths[:, None, None] + t[:, :, None]
    return cached, places, visible


def attention_tables(past_lengths: torch.Tensor, key_index: torch.Tensor, cache_rows: int, attn, rows: int) -> tuple:
    """What every attention layer of a batched call shares (`_attend`'s `tables`): `key_layout`'s cache
    index and new-row places, the additive bias fp32 `[B, group * T, L]` (0 where visible, the fp32
    minimum elsewhere; rows ordered (head in group, t), as the queries) and key ones fp32 `[L, 16]`."""
    cached, places, visible = key_layout(past_lengths, key_index, cache_rows, attn.num_kv_heads, rows)
    bias = torch.where(visible, torch.zeros((), dtype=torch.float32), torch.full((), torch.finfo(torch.float32).min))
    bias = bias.repeat(1, attn.num_heads // attn.num_kv_heads, 1)
    return cached, places, bias, torch.ones(key_index.shape[1], 16, dtype=torch.float32)


class BatchedTarget(TargetForExport):
    """`TargetForExport`'s decoder and LM head over B sequences (see the module docstring). Dense
    families only (Qwen3 / Llama). It holds no proposal head: a sequence's proposals are ids (its draft
    proposes them), verified as the rows after its last committed token."""

    def forward(self, input_ids, past_lengths, key_index, logit_rows, temperature, uniform, *past):
        b, t = input_ids.shape
        attn0 = self.model.layers[0].self_attn
        positions = (past_lengths[:, None] + torch.arange(t, dtype=torch.int64)[None, :]).reshape(-1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        rot = rope_matrix(cos, sin)
        rot_q = rot * attn0.scale
        tables = attention_tables(past_lengths, key_index, past[0].shape[1], attn0, t)
        h = self.model.embed_tokens(input_ids.reshape(-1))
        new_kv, taps = [], {}
        for li, layer in enumerate(self.model.layers):
            x = layer.input_layernorm(h)
            q = layer.self_attn.query(x, rot_q, None)
            k, v = layer.self_attn.key_value(x, rot, None)
            i = len(new_kv)
            out = _attend(layer.self_attn, q, past[i], past[i + 1], k, v, tables, b, t)
            h = h + layer.self_attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new_kv += [k, v]
            if li in self.tap_layers and li != self.num_layers - 1:
                taps[li] = h
        final = self.model.norm(h) if self.num_layers - 1 in self.tap_layers else None
        h = self.model.norm(torch.index_select(h, 0, logit_rows)) if final is None else torch.index_select(final, 0, logit_rows)
        logits = self.logits_of(h)
        next_ids = _posterior(logits, temperature, uniform, self.spec.vocab_size)
        return (next_ids, logits, self.model.embed_tokens(next_ids), self.tap_features(taps, final), *new_kv)


def _attend(attn, q, past_k, past_v, k, v, tables, b: int, t: int) -> torch.Tensor:
    """Split-invariant attention (`nn.layers._split_invariant_values`) of `q [B * T, H, D]` over each
    sequence's keys: its cache rows and its new rows, in the order `tables` (`attention_tables`) gives.
    Returns `[B * T, H * D]`."""
    hkv, d = attn.num_kv_heads, attn.head_dim
    g = attn.num_heads // hkv
    cached, places, bias, key_ones = tables
    n_keys = key_ones.shape[0]

    def arranged(cache, rows):  # -> [Hkv, B, L, D]: the cache rows, the new rows written in their places
        keys = torch.index_select(cache, 1, cached)
        keys = torch.index_put(keys, (places[:, 0], places[:, 1]), rows.permute(1, 0, 2).reshape(-1, d))
        return keys.view(hkv, b, n_keys, d)

    keys, values = arranged(past_k, k), arranged(past_v, v)
    qg = q.view(b, t, hkv, g, d).permute(2, 0, 3, 1, 4).reshape(hkv, b, g * t, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).to(torch.float32) + bias
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    numerator = torch.matmul(e.to(q.dtype), values).to(torch.float32)
    denominator = torch.matmul(e, key_ones)[..., :1]
    out = (numerator / denominator).to(q.dtype)  # [Hkv, B, g * T, D]
    return out.view(hkv, b, g, t, d).permute(1, 3, 0, 2, 4).reshape(b * t, hkv * g * d)


def _posterior(logits, temperature, uniform, vocab_size: int) -> torch.Tensor:
    """int64 `[K]`: each logits row's argmax, or, for the first U rows at a temperature > 0, the
    inverse-CDF sample of softmax(row / T) at its uniform (`TargetForExport.head`'s rule, per row).

    The argmax is a TopK of 1 (ONNX TopK: ties go to the lower index, as ArgMax's first index): the same
    ids and cost on onnxruntime's CPU provider, while OpenVINO runs an ArgMax over several rows slowly (30 ms
    for 8 rows of 49152; `docs/performance.md`). The runtime always asks for K >= 1 rows
    (`runtime.batching.calls`): onnxruntime 1.23's TopK fails on an empty input."""
    greedy = torch.topk(logits, 1, dim=-1).indices[:, 0]
    u = uniform.shape[0]
    rows = logits.shape[0]
    torch._check(u <= rows)
    temp = temperature[:u]
    t_safe = torch.where(temp > 0, temp, torch.ones_like(temp))
    cdf = torch.cumsum(torch.softmax(logits[:u] / t_safe[:, None], dim=-1), dim=-1)
    threshold = uniform[:, None] * cdf[:, -1:]
    sampled = torch.clamp((cdf <= threshold).to(torch.int64).sum(dim=-1), max=vocab_size - 1)
    picked = torch.nn.functional.pad(torch.where(temp > 0, sampled, greedy[:u]), (0, rows - u))
    return torch.where(torch.arange(rows, dtype=torch.int64) < u, picked, greedy)
