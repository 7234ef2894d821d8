"""INT4 weight-only (W4A16) target graphs in the one form TensorRT and onnxruntime both load.

The form (see docs/quantization.md): each decoder linear layer `y = x W^T` becomes
`MatMul(x, DequantizeLinear(Wq, scale, axis=0, block_size=B))` at opset 21, where

- `Wq` is the weight transposed to `[K, N]` (input features first) as signed INT4, two values a byte,
  low nibble first, with no zero point (symmetric);
- `scale` is `[K / B, N]` in the graph dtype, strictly positive (clamped at the dtype's smallest normal,
  so an fp16 scale never underflows to 0, which TensorRT refuses);
- B is a power of two >= 16 that divides K (default 128, as NVIDIA Model Optimizer's INT4 export).

onnxruntime (1.23 to 1.32) fuses exactly this pattern into its MatMulNBits kernel at ORT_ENABLE_EXTENDED
or above (`DQMatMulToMatMulNBits`); TensorRT builds it as block-quantized INT4 weights (10.0+).

Quantization is round-to-nearest per block (RTN): scale = max|w| / 7 over the block, rounded to the
graph dtype first, then q = clamp(round(w / scale), -8, 7). The graph's weights are exactly
`q * scale` computed in the graph dtype: `dequantize` gives that tensor, for references.
It runs one tensor at a time, inside the streamed weight readers (`checkpoint/weights.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from dflash_export.export.checks import QUANT_OPSET
from dflash_export.export.passes import is_linear_gemm
from dflash_export.quant.awq import load_scales, scaled_source
from dflash_export.quant.rtn import dequantize, quantize_rtn
from runtime.errors import DFlashError

# Decoder linear layers that become INT4 (HF names; a Qwen3.5 hybrid's Gated DeltaNet projections too:
# a/b with qkv/z, since the four share their input and are packed into one GEMM); the embedding, norms,
# convs and the draft stay, and the LM head too unless QuantConfig.lm_head.
QUANTIZED_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj"
                             r"|linear_attn\.(in_proj_(qkv|z|a|b)|out_proj))\.weight$")


@dataclass(frozen=True)
class QuantConfig:
    """What `build --quant int4` quantizes and how.

    Attributes:
        method: "rtn" (round to nearest) or "awq" (activation-aware scales folded into the checkpoint
            first, then round to nearest: `quant/awq.py`).
        block: values per scale along K (a power of two >= 16 dividing every quantized layer's K).
        lm_head: quantize the LM head too (its logits GEMM, and the proposal head rows). A tied
            embedding keeps its table in the graph dtype for the token lookups.
    """

    method: str = "rtn"
    block: int = 128
    lm_head: bool = False

    def validate(self) -> None:
        """Raises DFlashError for an unknown method or a block that is not a power of two >= 16."""
        if self.method not in ("rtn", "awq"):
            raise DFlashError(f"--quant-method {self.method!r} is not supported (supported: rtn, awq)")
        if self.block < 16 or self.block & (self.block - 1):
            raise DFlashError(f"--quant-block {self.block} must be a power of two >= 16 (e.g. 32, 64, 128)")


class BlockMismatch(DFlashError):
    """An INT4 block that does not divide a quantized layer's K (build then tries a smaller default)."""


# build's default --quant-block: the first that divides every quantized layer's K. 32 keeps onnxruntime's
# int8-activation kernel row-exact on CPUs (docs/quantization.md), so speculation stays lossless at level 4.
DEFAULT_BLOCKS = (32, 16)


def quantized_names(names, shapes: dict, config: QuantConfig, head_name: str | None = None) -> list[str]:
    """The decoder linear weights among `names` (and `head_name`, the LM head matrix, when
    `config.lm_head`), checked against the block size.

    Raises:
        DFlashError: a layer whose K (input features) the block does not divide, naming --quant-block.
    """
    chosen = [n for n in names if QUANTIZED_LAYER.match(n)]
    if config.lm_head and head_name is not None:
        chosen.append(head_name)
    widths = [int(shapes[name][1]) for name in chosen]
    for name, k in zip(chosen, widths):
        if k % config.block:
            fits = math.gcd(*widths) & -math.gcd(*widths)  # the largest power of two dividing every K
            fitting = [b for b in (16, 32, 64, 128, 256) if b <= fits]
            hint = (f"use --quant-block {' or '.join(map(str, fitting))}" if fitting
                    else "no power-of-two block >= 16 divides every quantized layer's K")
            hint += " (32 is the README's choice for speed and accuracy)" if 32 in fitting else ""
            raise BlockMismatch(f"{name} has {k} input features, which --quant-block {config.block} does not divide; {hint}")
    return chosen


def proposal_head_block(hidden: int, preferred: int | None = None) -> int:
    """INT4 block for the proposal head rows `[V', hidden]`: `preferred` (the target's --quant-block)
    when it divides `hidden`, else the largest power of two <= 128 that does (>= 16).

    Raises:
        DFlashError: no power-of-two block >= 16 divides `hidden` (build with --proposal-head full)."""
    if preferred and hidden % preferred == 0:
        return preferred
    block = 128
    while block >= 16 and hidden % block:
        block //= 2
    if block < 16:
        raise DFlashError(f"no INT4 block (a power of two >= 16) divides the hidden size {hidden}; "
                          "build with --proposal-head full")
    return block


def draft_quant_plan(dspec, source_shapes: dict, config: QuantConfig) -> dict | None:
    """The draft weights an INT4 build quantizes (RTN, whatever the target's method): its LAST layer's
    q_proj, o_proj and MLP, which run on the verified rows only (`proposal_rows`: 1-3 rows a step on a
    CPU, where fp32 weights are read at memory speed). The layers over the whole block (16 rows) stay
    in the graph dtype: onnxruntime's int8-activation INT4 kernel is slower than fp32 SGEMM there on
    CPUs, while the INT4 last layer makes a step faster at unchanged acceptance (figures:
    docs/quantization.md#the-int4-form---quant-int4).

    Returns:
        {"method": "rtn", "block": B, "tensors": [names]}, B the largest power of two <= the target's
        block (>= 16) dividing every such weight's K; None when none does (the draft stays as it is).
    """
    i = dspec.arch.num_layers - 1
    names = [f"layers.{i}.self_attn.q_proj.weight", f"layers.{i}.self_attn.o_proj.weight",
             f"layers.{i}.mlp.gate_proj.weight", f"layers.{i}.mlp.up_proj.weight", f"layers.{i}.mlp.down_proj.weight"]
    widths = [int(source_shapes[n][1]) for n in names]
    block = config.block
    while block >= 16 and any(k % block for k in widths):
        block //= 2
    return {"method": "rtn", "block": block, "tensors": names} if block >= 16 else None


def quantization_record(config: QuantConfig, names: list[str], dtype: str, head_name: str | None = None) -> dict:
    """The manifest's `quantization` section: what was quantized, how, and in which graph form
    (`head`: the LM head's weight name when it is quantized, else None)."""
    return {
        "format": "int4-blockwise-dequantizelinear", "opset": QUANT_OPSET, "method": config.method,
        "block": config.block, "symmetric": True, "scale_dtype": dtype, "lm_head": bool(config.lm_head),
        "head": head_name if config.lm_head else None, "embedding": False,
        "quantized_tensors": len(names), "tensors": list(names),
    }


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int8 values in [-8, 7] into bytes, two per byte, low nibble first (row-major order).

    Raises:
        ValueError: an odd number of values (every quantized layer here has an even N).
    """
    flat = q.reshape(-1).astype(np.uint8) & 0x0F
    if flat.size % 2:
        raise ValueError("INT4 packing needs an even number of values")
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of :func:`pack_int4`: int8 values in [-8, 7] of `shape`."""
    lo = (packed & 0x0F).astype(np.int8)
    hi = (packed >> 4).astype(np.int8)
    flat = np.empty(packed.size * 2, np.int8)
    flat[0::2], flat[1::2] = lo, hi
    flat = np.where(flat > 7, flat - 16, flat).astype(np.int8)
    return flat[: int(np.prod(shape))].reshape(shape)


class _LastQuantized:
    """Quantizes a weight once for its two initializers (INT4 values, scales), written one after the
    other: only the most recent weight is kept."""

    def __init__(self, read, config: QuantConfig, dtype: torch.dtype):
        self.read, self.config, self.dtype = read, config, dtype
        self.name, self.value = None, None

    def get(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        if self.name != name:
            self.name, self.value = None, None  # free the previous one before making the next
            self.value = quantize_rtn(self.read(name), self.config.block, self.dtype)
            self.name = name
        return self.value


def rewrite_int4(model, names: list[str], read, config: QuantConfig, dtype: torch.dtype) -> None:
    """Turn each `Gemm(x, W, transB=1)` on a weight in `names` into `MatMul(x, DequantizeLinear(Wq, scale))`
    in an onnx_ir model (in place), with lazily quantized INT4 values and scales, and set opset 21.

    A weight used by several Gemms (the LM head: logits and proposals) gets one DequantizeLinear per
    MatMul on shared INT4 values and scales (the form: each DQ feeds exactly one MatMul). A weight that
    is also gathered (a tied embedding table) keeps its initializer for those lookups.

    Args:
        read: name -> the weight `[N, K]` (a streamed reader: called while the file is written).

    Raises:
        AssertionError: a weight is used by something other than plain Gemms and Gathers, or by no Gemm
            (the exporter changed its pattern).
    """
    import onnx_ir as ir

    graph = model.graph
    cache = _LastQuantized(read, config, dtype)
    scale_type = {torch.float16: ir.DataType.FLOAT16, torch.float32: ir.DataType.FLOAT}[dtype]
    for name in names:
        weight = graph.initializers[name]
        n, k = weight.shape
        gemms, gathers = _gemm_and_gather_uses(weight, name)

        def int4_values(name=name, k=k, n=n):
            return ir.PackedTensor(pack_int4(cache.get(name)[0]), ir.DataType.INT4, shape=[k, n])

        def scales(name=name):
            return ir.tensor(cache.get(name)[1])

        q = ir.Value(name=f"{name}.int4", shape=ir.Shape([k, n]), type=ir.TensorType(ir.DataType.INT4),
                     const_value=ir.LazyTensor(int4_values, dtype=ir.DataType.INT4, shape=ir.Shape([k, n])))
        s = ir.Value(name=f"{name}.scale", shape=ir.Shape([k // config.block, n]), type=ir.TensorType(scale_type),
                     const_value=ir.LazyTensor(scales, dtype=scale_type, shape=ir.Shape([k // config.block, n])))
        graph.register_initializer(q)
        graph.register_initializer(s)
        for i, gemm in enumerate(gemms):
            _replace_gemm(graph, gemm, q, s, config.block, f"{name}.dequantized" + (f".{i}" if i else ""))
        if not gathers:
            del graph.initializers[name]
    model.opset_imports[""] = QUANT_OPSET
    model.ir_version = max(model.ir_version or 0, 10)  # INT4 tensors need IR 10


def _replace_gemm(graph, gemm, q, s, block: int, dq_name: str) -> None:
    """Replace one `Gemm(x, W, [bias], transB=1)` by `MatMul(x, DequantizeLinear(q, s)) [+ bias]`."""
    import onnx_ir as ir

    dq = ir.node("DequantizeLinear", [q, s], attributes={"axis": 0, "block_size": block})
    mm = ir.node("MatMul", [gemm.inputs[0], dq.outputs[0]])
    new_nodes = [dq, mm]
    out = mm.outputs[0]
    if len(gemm.inputs) > 2 and gemm.inputs[2] is not None:  # a bias
        add = ir.node("Add", [out, gemm.inputs[2]])
        new_nodes.append(add)
        out = add.outputs[0]
    graph.insert_before(gemm, new_nodes)
    old = gemm.outputs[0]
    out.shape, out.type, out_name = old.shape, old.type, old.name
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    graph.remove(gemm, safe=True)
    out.name = out_name
    dq.outputs[0].name = dq_name


def _gemm_and_gather_uses(weight, name: str):
    """(plain Gemm(x, W, transB=1) nodes, Gather nodes) using `weight`; anything else is an error."""

    gemms, gathers = [], []
    for use in weight.uses():
        node, index = use.node, use.idx
        if node.op_type == "Gather" and index == 0:
            gathers.append(node)
        elif index == 1 and is_linear_gemm(node):
            if node not in gemms:
                gemms.append(node)
        else:
            attrs = {a.name: a.value for a in node.attributes.values()}
            raise AssertionError(f"{name} feeds {node.op_type} {attrs} (input {index}); expected Gemm(x, W, transB=1)")
    if not gemms:
        raise AssertionError(f"{name} feeds no Gemm in the traced graph")
    return gemms, gathers


def dequantized_source(source, record: dict, dtype: torch.dtype):
    """A weight source whose quantized decoder layers (the manifest's `quantization` record) read as
    the weights the graph computes with: quantized and dequantized here exactly as `build` did, in
    `dtype`, after AWQ's scaling for `method` "awq" (`record["awq_scales"]`: the scales file's path,
    made absolute by the caller). The LM head is not among them (a tied table is also the embedding,
    which stays): see :func:`head_rows_dequantizer`."""
    if record["method"] == "awq":

        source = scaled_source(source, load_scales(record["awq_scales"]))
    return rtn_round_trip(source, [n for n in record["tensors"] if QUANTIZED_LAYER.match(n)], int(record["block"]), dtype)


def rtn_round_trip(source, names, block: int, dtype: torch.dtype):
    """`source` with the weights `names` read as an INT4 graph computes with them: RTN-quantized at
    `block` and dequantized in `dtype`, exactly as `build` did; other weights as stored."""
    names = set(names)

    def transform(name, t):
        return dequantize(*quantize_rtn(t.to(dtype), block, dtype), block) if name in names else t

    return source.mapped(transform, "dequantized")


def head_rows_dequantizer(record: dict | None, dtype: torch.dtype):
    """rows `[R, d]` of the LM head -> the same rows as the INT4 graph's head computes with, or None
    when the head is not quantized. Row-wise exact: each head row (an output feature) has its own
    scales, so a block of rows quantizes as those rows of the whole head do."""
    if not record or not record.get("lm_head"):
        return None
    block = int(record["block"])
    return lambda rows: dequantize(*quantize_rtn(rows.to(dtype), block, dtype), block)
