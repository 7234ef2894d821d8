"""Per-call tables the target and draft layers share: RoPE (frequencies, cos/sin tables, the one-MatMul
rotation matrix), the causal and sliding-window masks, and the split-invariant attention's key ones.
Each is built once per graph call and read by every layer (`dflash_export.nn.layers`)."""

from __future__ import annotations

import torch

from dflash_export.checkpoint.target import AttentionSpec


def rope_inv_freq(arch: AttentionSpec, family: str) -> tuple[torch.Tensor, float]:
    """Inverse RoPE frequencies `[head_dim // 2]` (fp32) and the cos/sin scaling factor.

    Uses transformers' own RoPE initialisers for scaled types (llama3, linear, yarn, longrope), so
    Llama-3.1 and YaRN checkpoints match Hugging Face exactly.
    """
    import transformers

    if arch.rope["rope_type"] == "default":
        base = float(arch.rope["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, arch.head_dim, 2, dtype=torch.int64).float() / arch.head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    raw = {k: v for k, v in arch.raw.items() if k not in ("auto_map", "architectures")}
    cfg = cls(**raw)
    inv, scale = ROPE_INIT_FUNCTIONS[arch.rope["rope_type"]](cfg, torch.device("cpu"))
    return inv.float(), float(scale)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin `[S, 1, head_dim]` in fp32 for int64 `positions [S]` (half-rotation layout of
    HF). The sin table carries rotate_half's sign (`[-sin, sin]`), so `apply_rope` needs no Neg per
    layer: x * cos + [x2, x1] * [-sin, sin] is HF's x * cos + [-x2, x1] * [sin, sin], bit for bit."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    sin = freqs.sin() * scale
    return torch.cat([freqs, freqs], dim=-1)[:, None, :].cos() * scale, torch.cat([-sin, sin], dim=-1)[:, None, :]


def rope_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """fp32 `[S, D, D]` rotations from the `rope_cos_sin` tables `[S, 1, D]`: `x @ R[s]` is `apply_rope`'s
    x * cos + [x2, x1] * sin for position s (R = diag(cos) + the half-swap permutation times diag(sin)).
    Built once per graph, it turns each layer's RoPE of q and of k into one MatMul instead of five
    nodes (Split, Concat, Mul, Mul, Add): onnxruntime's per-node cost dominates small decoding steps.
    Each output is x_i cos + x_j sin plus exact zeros, a row's own batch: still row-exact."""
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=torch.float32)
    swap = torch.roll(eye, d // 2, dims=0)  # swap[i, j] = 1 where i = (j + D/2) mod D
    return eye * cos + swap * sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor | None) -> torch.Tensor:
    """Rotate `x [S, H, D]` by the `rope_cos_sin` tables `[S, 1, D]`, or (`sin` None) by a `rope_matrix`
    `cos [S, D, D]`; math in fp32, result in x's dtype."""
    xf = x.to(torch.float32)
    if sin is None:
        return torch.matmul(xf, cos).to(x.dtype)
    half = xf.shape[-1] // 2
    swapped = torch.cat([xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + swapped * sin).to(x.dtype)


def causal_bias(rows: int, group: int) -> torch.Tensor:
    """fp32 `[group * rows, rows]` additive mask of causal attention among `rows` new tokens (0 where
    visible, the fp32 minimum where not), repeated for the `group` query heads that share a kv head.
    Built once per graph, so each layer masks with one Add."""
    idx = torch.arange(rows, dtype=torch.int64)
    visible = idx[None, :] <= idx[:, None]
    bias = torch.where(visible, torch.zeros((), dtype=torch.float32), torch.full((), torch.finfo(torch.float32).min))
    return bias.repeat(group, 1)


def tree_bias(rows: int, proposal_bias: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 `[group * (rows + N), rows + N]` additive mask of a verify tree: the first `rows` new tokens
    (committed ones) attend causally among themselves and to no proposal; the N proposals see every
    committed row and, among themselves, what `proposal_bias` (fp32 `[N, N]`: 0 where proposal i sees
    proposal j, the fp32 minimum where not; a chain's is `causal_bias(N, 1)`) allows. Repeated for the
    `group` query heads that share a kv head, as `causal_bias`."""
    n = proposal_bias.shape[0]
    lowest = torch.finfo(torch.float32).min
    top = torch.cat([causal_bias(rows, 1), torch.full((rows, n), lowest, dtype=torch.float32)], dim=1)
    bottom = torch.cat([torch.zeros((n, rows), dtype=torch.float32), proposal_bias.to(torch.float32)], dim=1)
    return torch.cat([top, bottom], dim=0).repeat(group, 1)


def window_bias(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, group: int,
                causal: bool = False) -> torch.Tensor:
    """fp32 `[group * T, K]` additive mask of a draft layer: 0 where the key is visible, the fp32 minimum
    elsewhere; `query_pos [T]`, `key_pos [K]` int64 absolute positions, rows repeated for the `group`
    query heads sharing a kv head (as `causal_bias`). Visible: |query_pos - key_pos| < window
    (flash-attention's `window_size=(window - 1, window - 1)`; no window: every key), and with
    `causal` only keys at or before the query (then the window bounds the distance back only)."""
    diff = query_pos[:, None] - key_pos[None, :]
    if causal:
        visible = diff >= 0 if window is None else (diff >= 0) & (diff < window)
    else:
        visible = diff.abs() < window
    bias = torch.where(visible, torch.zeros((), dtype=torch.float32), torch.full((), torch.finfo(torch.float32).min))
    return bias.repeat(group, 1)


def key_ones_for(past: int, rows: int) -> torch.Tensor:
    """fp32 `[past + rows, 16]` ones: the split-invariant attention's normaliser is `exp-scores @ ones`,
    a 16-column MatMul (a one-column one takes onnxruntime's matrix-vector path, whose rounding depends
    on the key count). Built once per graph and shared by the layers, as `causal_bias` is; as two parts
    (a symbolic `past + rows` traces to a sum whose operand order differs between a full trace and a
    layer-replication template)."""
    return torch.cat([torch.ones(past, 16, dtype=torch.float32), torch.ones(rows, 16, dtype=torch.float32)])
