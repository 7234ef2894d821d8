"""Qwen3.5 / Qwen3.6's multi-token-prediction (MTP) head as an export module.

The checkpoint ships it next to the target (`mtp.*`): one gated full-attention Qwen3.5 decoder layer
with its MLP, an `fc [d, 2d]` and three (1 + w) RMSNorms; the embedding and the LM head are the
target's. vLLM's `qwen3_5_mtp.py` and SGLang's agree on the computation:

    entry i = (the token at i + 1, the target's final post-norm hidden state at i), at RoPE position i
    x = fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
    h = layer(x)          causal over the MTP's own entries, which have their own K/V cache
    out = norm(h)         -> the target's LM head: the prediction for the token at i + 2

Chaining: the next entry is (the drafted token, the head's own post-norm output `out`) at the next
position (vLLM's form; llama.cpp chains the pre-norm state). After the target verifies, the accepted
positions are entered again with the target's hidden states (`runtime` rolls the head's cache back by
length: the head is attention only).

Graph IO (batch 1, sequence axis outermost, as the target's attention layers):
    inputs: input_ids int64 `[T]` (1 <= T <= MAX_ROWS), hidden `[T, d]`, past_key / past_value
        `[P, Hkv, D]` (P: entries already in the cache; positions P .. P + T - 1).
    outputs: next_ids int64 `[1]` (the greedy token after the last row), mtp_hidden `[1, d]` (its
        post-norm output, the next chained entry's hidden), key / value `[T, Hkv, D]` (the new rows).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_export.checkpoint.hybrid import HybridSpec
from dflash_export.nn.gated_delta import MAX_ROWS
from dflash_export.nn.layers import causal_bias, rope_cos_sin
from dflash_export.nn.qwen3_5 import HybridDecoderLayer, ZeroCentredRMSNorm

MTP_IO = (["input_ids", "hidden", "past_key", "past_value"], ["next_ids", "mtp_hidden", "key", "value"])


class _Embedding(nn.Module):  # (named `model.embed_tokens` as in the target graph: the weights link to its file)
    def __init__(self, spec: HybridSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)


class MTPHead(nn.Module):
    """The MTP head with its K/V as explicit IO (see the module docstring).

    Args:
        spec: the target's HybridSpec (the head's layer has the target's full-attention sizes).
        dtype: the compute dtype of the matmuls (norms and the logits stay fp32).
    """

    def __init__(self, spec: HybridSpec, dtype: torch.dtype = torch.float32):
        super().__init__()
        d, eps = spec.hidden_size, spec.rms_norm_eps
        self.spec, self.compute_dtype = spec, dtype
        self.model = _Embedding(spec)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(d, spec.vocab_size, bias=False)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(d, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(d, eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(spec, "full_attention")])
        self.norm = ZeroCentredRMSNorm(d, eps)
        r = spec.rotary_dim
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
        self.register_buffer("inv_freq", inv, persistent=False)

    def head_weight(self) -> torch.Tensor:
        """The `[V, d]` LM head matrix (the embedding's when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor):
        s, p = input_ids.shape[0], past_key.shape[0]
        torch._check(s <= MAX_ROWS)
        spec = self.spec
        rope = rope_cos_sin(torch.arange(s, dtype=torch.int64) + p, self.inv_freq, 1.0)
        causal = causal_bias(s, spec.num_heads // spec.num_kv_heads)
        e = self.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden.to(e.dtype))], dim=-1).to(self.fc.weight.dtype)).to(e.dtype)
        h, (key, value) = self.layers[0](x, (past_key, past_value), rope, causal)
        out = self.norm(h[-1:])
        logits = nn.functional.linear(out, self.head_weight()).to(torch.float32)
        return torch.argmax(logits, dim=-1), out, key, value


def mtp_weight_name(name: str) -> str | None:
    """A checkpoint tensor's name in :class:`MTPHead` (None: not the head's): `mtp.*` without the prefix,
    and the target's embedding and LM head (a ConditionalGeneration's under `model.language_model.`)."""
    if name.startswith("mtp."):
        return name[len("mtp."):]
    if name in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if name == "lm_head.weight":
        return name
    return None


def mtp_export_inputs(module: MTPHead) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace with: T=3, P=5."""
    s, dt = module.spec, module.compute_dtype
    t, p = 3, 5
    args = (torch.randint(0, s.vocab_size, (t,)), torch.randn(t, s.hidden_size, dtype=dt),
            torch.randn(p, s.num_kv_heads, s.head_dim, dtype=dt), torch.randn(p, s.num_kv_heads, s.head_dim, dtype=dt))
    T = torch.export.Dim("new_entries", min=1, max=MAX_ROWS)
    P = torch.export.Dim("past_entries", min=0, max=1 << 20)
    return args, MTP_IO, ({0: T}, {0: T}, {0: P}, {0: P})
