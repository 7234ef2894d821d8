"""The batched target: one call decodes (or prefills) several sequences, each at its own past length,
reading their K/V from static slots. What `runtime.batching` serves several clients with.

Every sequence's rows compute the floats the one-sequence target graph (`nn.layers.TargetForExport`)
gives them: per-row RoPE from each sequence's own positions, and attention in the split-invariant form
over keys laid out per sequence as [its past, its new rows, masked padding] (the padding adds exact
zeros at the end of every sum over keys, as the masked keys of a verify call do). So a stream's output
does not depend on what else runs in the batch.

Inputs (B sequences of T rows each, flattened row r = b * T + t):
    input_ids: int64 `[B, T]`.
    past_lengths: int64 `[B]`: sequence b's cached rows; its row t sits at position past_lengths[b] + t.
    slot_ids: int64 `[B]`: the cache slot of sequence b.
    logit_rows: int64 `[K]`: the flattened rows whose logits and next ids are wanted (every row of a
        decoding step; the last row of a prefill chunk), K >= 1.
    temperature: fp32 `[K]`: per logits row; 0 is greedy.
    uniform: fp32 `[U]`, U = K (sample) or 0 (all greedy: the sampling branch is empty).
    past_key_i / past_value_i: `[P, S, Hkv, D]`: rows [0, P) of every slot of layer i's cache
        (position-major, so this prefix of all S slots is one contiguous view), P >= max(past_lengths).

Outputs:
    next_ids: int64 `[K]`: the posterior id of each logits row (sampled at its temperature).
    logits: fp32 `[K, V]`.
    key_i / value_i: `[B * T, Hkv, D]`: the new K/V rows, which the runtime writes to row
        past_lengths[b] + t of slot slot_ids[b].
"""

from __future__ import annotations

import torch

from dflash_export.nn.layers import TargetForExport
from dflash_export.nn.tables import rope_cos_sin, rope_matrix
from runtime.manifest import BATCHED_INPUTS

BATCHED_OUTPUTS = ("next_ids", "logits")


def batched_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the batched target graph, in positional order."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return [*BATCHED_INPUTS, *kv_in], [*BATCHED_OUTPUTS, *kv_out]


def key_layout(past_lengths: torch.Tensor, slot_ids: torch.Tensor, past: int, slots: int, rows: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sequence's keys come from, and which it sees.

    Returns:
        (index int64 `[B * L]` into `cat([past_view.reshape(P * S, ...), new rows])`, L = P + T: key l
        of sequence b is its cached row l (l < past_b), its new row l - past_b (l < past_b + T), else
        row 0 (padding, masked); visible bool `[B, T, L]`: row t sees keys l <= past_b + t.)
    """
    b = past_lengths.shape[0]
    keys = torch.arange(past + rows, dtype=torch.int64)[None, :]
    pb = past_lengths[:, None]
    cached = keys * slots + slot_ids[:, None]
    new = past * slots + torch.arange(b, dtype=torch.int64)[:, None] * rows + (keys - pb)
    index = torch.where(keys < pb, cached, torch.where(keys < pb + rows, new, torch.zeros_like(new)))
    row = torch.arange(rows, dtype=torch.int64)[None, :, None]
    visible = keys[:, None, :] <= pb[:, :, None] + row
    return index.reshape(-1), visible


class BatchedTarget(TargetForExport):
    """`TargetForExport`'s decoder and LM head over B sequences (see the module docstring). Dense
    families only (Qwen3 / Llama); it holds no proposal head, taps or embeddings outputs: a batched
    step decodes plainly."""

    def forward(self, input_ids, past_lengths, slot_ids, logit_rows, temperature, uniform, *past):
        b, t = input_ids.shape
        p, slots = past[0].shape[0], past[0].shape[1]
        attn0 = self.model.layers[0].self_attn
        group = attn0.num_heads // attn0.num_kv_heads
        positions = (past_lengths[:, None] + torch.arange(t, dtype=torch.int64)[None, :]).reshape(-1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        rot = rope_matrix(cos, sin)
        rot_q = rot * attn0.scale
        index, visible = key_layout(past_lengths, slot_ids, p, slots, t)
        lowest = torch.finfo(torch.float32).min
        bias = torch.where(visible, torch.zeros((), dtype=torch.float32), torch.full((), lowest))
        bias = bias.repeat(1, group, 1)[:, None]  # [B, 1, group * T, L]: rows ordered (head in group, t)
        key_ones = torch.ones(p + t, 16, dtype=torch.float32)
        h = self.model.embed_tokens(input_ids.reshape(-1))
        new_kv = []
        for layer in self.model.layers:
            x = layer.input_layernorm(h)
            q = layer.self_attn.query(x, rot_q, None)
            k, v = layer.self_attn.key_value(x, rot, None)
            i = len(new_kv)
            out = _attend(layer.self_attn, q, past[i], past[i + 1], k, v, index, bias, key_ones, b, t)
            h = h + layer.self_attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            new_kv += [k, v]
        h = self.model.norm(torch.index_select(h, 0, logit_rows))
        logits = self.logits_of(h)
        return (_posterior(logits, temperature, uniform, self.spec.vocab_size), logits, *new_kv)


def _attend(attn, q, past_k, past_v, k, v, index, bias, key_ones, b: int, t: int) -> torch.Tensor:
    """Split-invariant attention (`nn.layers._split_invariant_values`) of `q [B * T, H, D]` over each
    sequence's keys gathered by `index` (`key_layout`). Returns `[B * T, H * D]`."""
    hkv, d = attn.num_kv_heads, attn.head_dim
    g = attn.num_heads // hkv
    n_keys = key_ones.shape[0]
    keys = torch.index_select(torch.cat([past_k.reshape(-1, hkv, d), k], dim=0), 0, index)
    values = torch.index_select(torch.cat([past_v.reshape(-1, hkv, d), v], dim=0), 0, index)
    keys = keys.view(b, n_keys, hkv, d).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    values = values.view(b, n_keys, hkv, d).permute(0, 2, 1, 3)  # [B, Hkv, L, D]
    qg = q.view(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores = torch.matmul(qg, keys).to(torch.float32) + bias
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    numerator = torch.matmul(e.to(q.dtype), values).to(torch.float32)
    denominator = torch.matmul(e, key_ones)[..., :1]
    out = (numerator / denominator).to(q.dtype)  # [B, Hkv, g * T, D]
    return out.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hkv * g * d)


def _posterior(logits, temperature, uniform, vocab_size: int) -> torch.Tensor:
    """int64 `[K]`: each logits row's argmax, or, for the first U rows at a temperature > 0, the
    inverse-CDF sample of softmax(row / T) at its uniform (`TargetForExport.head`'s rule, per row)."""
    greedy = torch.argmax(logits, dim=-1)
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
