#!/usr/bin/env python3
"""What one INT4 matrix costs per row on this CPU: a DequantizeLinear (INT4, block 32) -> MatMul pair,
which onnxruntime fuses into MatMulNBits, timed at M = 1, 4 and 8 rows for each accuracy level
(4: int8 activations; 1 and 0: fp32). Batched decoding of M sequences runs every matrix at M rows, so
M x t(1) / t(M) bounds what batching M sequences can gain on INT4 weights.

    python scripts/int4_rows_cost.py [--shapes 576x1536,2048x6144] [--threads 2]
"""

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def int4_matmul(k: int, n: int, block: int = 32) -> bytes:
    """A model `y [M, n] = x [M, k] @ DequantizeLinear(W int4 [k, n], blocks of `block` along k)`."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.UINT4, [k, n], rng.integers(0, 16, size=k * n).tolist())
    scales = numpy_helper.from_array((rng.random((k // block, n)) * 0.01).astype(np.float32), "s")
    zero = helper.make_tensor("zp", TensorProto.UINT4, [k // block, n], [8] * (k // block * n))
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "int4_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              initializer=[w, scales, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="576x1536,2048x6144", help="K x N pairs (SmolLM2's and Qwen3-1.7B's MLP up)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        model = int4_matmul(k, n)
        for level in (4, 1, 0):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
            sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
            micros = []
            for m in (1, 4, 8):
                x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
                for _ in range(5):
                    sess.run(None, {"x": x})
                calls = max(20, int(2e5 // (k * n / 1e3)))
                t0 = time.perf_counter()
                for _ in range(calls):
                    sess.run(None, {"x": x})
                micros.append((time.perf_counter() - t0) / calls * 1e6)
            print(f"K={k} N={n} accuracy level {level}: {micros[0]:.0f} / {micros[1]:.0f} / {micros[2]:.0f} us at M = 1 / 4 / 8; "
                  f"M rows per M x t(1): {4 * micros[0] / micros[1]:.2f}x at 4, {8 * micros[0] / micros[2]:.2f}x at 8", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
