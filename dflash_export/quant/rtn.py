"""Round-to-nearest symmetric INT4 of one weight, and the weight its DequantizeLinear gives back."""

from __future__ import annotations

import numpy as np
import torch


def smallest_scale(dtype: torch.dtype) -> float:
    """The least scale kept: the dtype's smallest normal number (fp16 6.1e-5)."""
    return float(torch.finfo(dtype).tiny)


def quantize_rtn(weight: torch.Tensor, block: int, scale_dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest symmetric INT4 of a linear weight.

    Args:
        weight: `[N, K]` (output features first, as nn.Linear stores it), any float dtype.
        block: values per scale along K.
        scale_dtype: the graph dtype (fp16 or fp32).

    Returns:
        (q, scale): q int8 `[K, N]` with values in [-8, 7]; scale `[K / block, N]` numpy in `scale_dtype`.
    """
    w = weight.to(torch.float32).T.contiguous()  # [K, N]
    k, n = w.shape
    blocks = w.view(k // block, block, n)
    amax = blocks.abs().amax(dim=1)  # [K / B, N]
    scale = (amax / 7.0).clamp(min=smallest_scale(scale_dtype)).to(scale_dtype)
    q = torch.round(blocks / scale.to(torch.float32)[:, None, :]).clamp_(-8, 7).to(torch.int8).view(k, n)
    return q.numpy(), scale.numpy()


def dequantize(q: np.ndarray, scale: np.ndarray, block: int) -> torch.Tensor:
    """The weight a DequantizeLinear of (q, scale) produces, as `[N, K]` in the scale's dtype (the product
    is exact in fp32 and rounded once to the scale dtype, as an fp16 multiply rounds it)."""
    qf = torch.from_numpy(q.astype(np.float32))
    s = torch.from_numpy(scale.astype(np.float32)).repeat_interleave(block, dim=0)
    return (qf * s).to(torch.from_numpy(scale[:1, :1]).dtype).T.contiguous()
