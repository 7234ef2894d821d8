#!/usr/bin/env python3
"""Which INT4 block sizes give a row the same floats in a one-row call as in a multi-row call on this CPU?

Speculative output stays equal to plain output only if a target row computes the same floats whether it
is the one row of a plain step or a row of a verify call (`runtime/graphs/row_exact.py`). onnxruntime's
MatMulNBits (which our INT4 form, DequantizeLinear + MatMul at opset 21, fuses into) takes a separate
one-row path on some CPUs, so the runtime pads one-row calls to two rows there, at a price. This script
builds our form for each block size, runs it at accuracy level 4 (int8 activations), and reports, per
block size:

- `one-row`: a one-row call equals the same row inside a two-row call (no padding needed);
- `rows`: every row of 3- to 9-row calls equals the same row inside a two-row call (padding suffices);

then the verdict: `exact` (unpadded), `exact padded` or `not exact` (the runtime keeps such blocks at
level 1). Run it on the CPU that will serve, then build with a block it calls `exact`:

    python scripts/int4_row_exact.py [--blocks 16,32,64,128] [--shapes 576:1536,2048:6144] [--threads 1]

Measured results (an AVX-512 VNNI EPYC, an AVX2 CPU emulated by qemu): docs/quantization.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROWS = (3, 4, 5, 7, 8, 9)


def int4_matmul(k: int, n: int, block: int, seed: int = 0) -> bytes:
    """Our INT4 form of one `[k, n]` matrix: MatMul(A, DequantizeLinear(int4 W, fp32 scales, axis 0))."""
    rng = np.random.default_rng(seed)
    weights = helper.make_tensor("W", TensorProto.INT4, [k, n], rng.integers(-8, 8, size=k * n).tolist())
    scales = numpy_helper.from_array((rng.random((k // block, n)) * 0.04 + 0.005).astype(np.float32), "S")
    nodes = [helper.make_node("DequantizeLinear", ["W", "S"], ["Wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["A", "Wd"], ["Y"])]
    graph = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], [weights, scales])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model.SerializeToString()


def row_exactness(k: int, n: int, block: int, threads: int) -> tuple[bool, bool]:
    """(one-row calls match two-row calls, every row of 3..9-row calls matches a two-row call) at level 4."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
    sess = ort.InferenceSession(int4_matmul(k, n, block), opts, providers=["CPUExecutionProvider"])
    a = np.random.default_rng(7).standard_normal((max(ROWS), k)).astype(np.float32)
    pad = np.zeros((1, k), np.float32)
    padded = np.concatenate([sess.run(None, {"A": np.concatenate([a[i:i + 1], pad])})[0][:1] for i in range(len(a))])
    one = np.concatenate([sess.run(None, {"A": a[i:i + 1]})[0] for i in range(len(a))])
    rows = all(np.array_equal(sess.run(None, {"A": a[:m]})[0], padded[:m]) for m in ROWS)
    return bool(np.array_equal(one, padded)), rows


def _blocks(text: str) -> list[int]:
    """`--blocks`: comma-separated powers of two >= 16 (the block sizes `build --quant-block` takes)."""
    try:
        blocks = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 16,32") from None
    bad = [b for b in blocks if b < 16 or b & (b - 1)]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad}: a block size is a power of two >= 16 (as build --quant-block)")
    return blocks


def _shapes(text: str) -> list[tuple[int, int]]:
    """`--shapes`: comma-separated K:N pairs of positive integers."""
    try:
        shapes = [tuple(int(x) for x in s.split(":")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated K:N pairs, e.g. 576:1536")
    return shapes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=_blocks, default="16,32,64,128", help="INT4 block sizes (default 16,32,64,128)")
    p.add_argument("--shapes", type=_shapes, default="576:1536,2048:6144",
                   help="K:N matrix shapes (default SmolLM2's and Qwen3-1.7B's MLP)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    shapes = args.shapes
    print(f"onnxruntime {ort.__version__}, accuracy level 4, {args.threads} thread(s)")
    print(f"{'block':>5}  {'one-row':>7}  {'rows':>5}  verdict")
    for block in args.blocks:
        results = [row_exactness(k, n, block, args.threads) for k, n in shapes if k % block == 0]
        if not results:
            print(f"{block:>5}  (divides no --shapes K)")
            continue
        one, rows = all(r[0] for r in results), all(r[1] for r in results)
        verdict = "exact" if one and rows else "exact padded" if rows else "not exact"
        print(f"{block:>5}  {'yes' if one else 'no':>7}  {'yes' if rows else 'no':>5}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
