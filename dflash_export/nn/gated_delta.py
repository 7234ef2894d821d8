"""The gated delta rule (Gated DeltaNet's recurrence) in chunk-parallel WY form, with ONNX-portable
operators only: MatMul, CumSum, Exp, Where masks built from shapes; no triangular solve, no Loop/Scan,
no loop over a data-dependent number of rows. Math in fp32. Batched products are `torch.bmm` (MatMul
in ONNX), not `torch.matmul`: with symbolic row counts the exporter traces matmul's broadcasting
views too, which doubled this file's share of the export time.

Reference: transformers' `torch_recurrent_gated_delta_rule` (token by token) in
`models/qwen3_5/modeling_qwen3_5.py`. Used by `qwen3_5.GatedDeltaNet`.
"""

from __future__ import annotations

import math

import torch

# Rows per call (new rows, and pending rows folded in): the triangular inverse below is exact up to it.
MAX_ROWS = 64
# (I - A)^{-1} = (I + A)(I + A^2)(I + A^4)... for nilpotent A: this many factors cover A^0 .. A^(MAX_ROWS - 1)
INVERSE_FACTORS = math.ceil(math.log2(MAX_ROWS))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last axis in fp32 (HF/FLA's l2norm; Div, as ONNX has no Rsqrt)."""
    xf = x.to(torch.float32)
    return xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """`log(1 + exp(x))` without overflow: `relu(x) + log(1 + exp(-|x|))` (Relu, Abs, Exp, Log)."""
    return torch.relu(x) + torch.log(1.0 + torch.exp(-torch.abs(x)))


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[n, Hk, dk]` -> `[n, heads, dk]`: each key head serves heads // Hk consecutive value heads."""
    n, hk, dk = x.shape
    return x[:, :, None, :].expand(n, hk, heads // hk, dk).reshape(n, heads, dk)


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """`(I - a)^{-1}` for strictly lower-triangular `a [H, n, n]`, n <= MAX_ROWS (MatMul and Add only; no
    solve, no loop over rows).

    a is nilpotent, so the inverse is the finite series sum a^m, which the product (I + a)(I + a^2)
    (I + a^4)... gives exactly with INVERSE_FACTORS factors. The powers a^(2^j) can be far larger than
    the inverse (cancelling terms), which costs ~10x the rounding error of a triangular solve when the
    keys are near-parallel and decays slow; one Newton step X + X (I - (I - a) X) wins it back.
    """
    n = a.shape[-1]
    idx = torch.arange(n, dtype=torch.int64)
    eye = (idx[:, None] == idx[None, :]).to(a.dtype)
    inv, power = eye + a, a
    for _ in range(INVERSE_FACTORS - 1):
        power = torch.bmm(power, power)
        inv = inv + torch.bmm(inv, power)  # inv @ (I + a^(2^j))
    return inv + torch.bmm(inv, eye - inv + torch.bmm(a, inv))


def gated_delta_chunk(q, k, v, g, beta, state, outputs: bool = True, final_state: bool = True,
                      padded: bool = False):
    """The gated delta rule over n <= MAX_ROWS rows in one chunk-parallel (WY) step, math in fp32.

    Per value head, token by token (as transformers' `torch_recurrent_gated_delta_rule`):
    `S = exp(g_t) S; S = S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t / sqrt(dk)`.

    Args:
        q, k: `[n, Hk, dk]` (already L2-normalised; q is scaled by 1/sqrt(dk) here). q may be None
            when `outputs` is False.
        v: `[n, Hv, dv]`; Hv a multiple of Hk (key head j serves value heads j*Hv/Hk ...).
        g: fp32 `[n, Hv]`, log decays (<= 0). beta: `[n, Hv]` in (0, 1).
        state: `[Hv, dk, dv]`, the state before the n rows. n = 0 is allowed.
        outputs / final_state: which results to compute.
        padded: n >= 1, and rows of zeros (k = v = 0, g = 0, beta = 0) appended to the chunk must leave
            every result bit-identical: the sums over rows are then the last rows of the running sums
            (CumSum, sequential) instead of ReduceSums, which a SIMD reduction groups by the row count.

    Returns:
        (o fp32 `[n, Hv, dv]` or None, state after the n rows fp32 `[Hv, dk, dv]` or None).
    """
    f32 = torch.float32
    n, hv = v.shape[0], v.shape[1]
    state = state.to(f32)
    k = _expand_heads(k.to(f32), hv).transpose(0, 1)  # [Hv, n, dk]
    v = v.to(f32).transpose(0, 1)  # [Hv, n, dv]
    beta = beta.to(f32).transpose(0, 1)[..., None]  # [Hv, n, 1]
    g = g.to(f32).transpose(0, 1)  # [Hv, n]
    cum = torch.cumsum(g, dim=1)  # log decay from the chunk start to row i (inclusive)
    idx = torch.arange(n, dtype=torch.int64)
    causal = idx[None, :] <= idx[:, None]
    # log decay between rows j < i summed directly, g_(j+1) + ... + g_i, not as cum_i - cum_j: after a
    # hard forget (g ~ -100) that difference of large prefixes loses ~1e-5 (HF's chunked form does)
    later = torch.where(idx[:, None] > idx[None, :], g[:, :, None], torch.zeros((), dtype=f32))  # [Hv, i, j]
    between = torch.cumsum(later, dim=1)
    # masked to exp(min) = 0 before the Exp, so that no exp(> 0) overflows
    decay = torch.exp(torch.where(causal, between, torch.finfo(f32).min))
    # WY form: (I + strict_lower(beta_i k_i.k_j decay_ij)) [u | w] = beta [v | k exp(cum)]
    kk = torch.bmm(k, k.transpose(1, 2))
    system = torch.where(idx[None, :] < idx[:, None], -(beta * kk * decay), torch.zeros((), dtype=f32))
    inv = _unit_lower_inverse(system)
    u = torch.bmm(inv, v * beta)
    w = torch.bmm(inv, k * beta * torch.exp(cum)[..., None])
    v_new = u - torch.bmm(w, state)  # [Hv, n, dv]: what the (decayed) old state does not predict
    out = new_state = None
    if outputs:
        qs = _expand_heads(q.to(f32), hv).transpose(0, 1) * (q.shape[-1] ** -0.5)
        attn = torch.bmm(qs, k.transpose(1, 2)) * decay  # decay is 0 above the diagonal
        out = torch.bmm(qs * torch.exp(cum)[..., None], state) + torch.bmm(attn, v_new)
        out = out.transpose(0, 1)
    if final_state:
        # [Hv] and [Hv, n]: sums, so that n = 0 needs no empty slice (or, padded, the running sums' last rows)
        total = cum[:, -1] if padded else g.sum(dim=1)
        to_end = between[:, -1] if padded else later.sum(dim=1)
        k_decayed = k * torch.exp(to_end)[..., None]  # decay from row j to the end
        new_state = state * torch.exp(total)[:, None, None] + torch.bmm(k_decayed.transpose(1, 2), v_new)
    return out, new_state
