#!/usr/bin/env python3
"""What one INT4 matrix costs per row on this CPU: a DequantizeLinear (INT4, block 32) -> MatMul pair,
which onnxruntime fuses into MatMulNBits, timed at M = 1, 4 and 8 rows for each accuracy level
(4: int8 activations; 1 and 0: fp32). Batched decoding of M sequences runs every matrix at M rows, so
M x t(1) / t(M) bounds what batching M sequences can gain on INT4 weights.

    python scripts/int4_rows_cost.py [--shapes 576x1536,2048x6144] [--threads 2] [--block 32] [--bits 4]
        [--levels 4,1,0]
    python scripts/int4_rows_cost.py --artifact ART [--batch 1,4,8] [--rounds 5] [--backend ort|ort-openvino]
        [--key-bucket N]

--artifact ART (an INT4 artifact built with --batched) times all of its target's INT4 matrices (every
layer's and the LM head, its own weights) as one call at each batch size's rows, and the batched engine's
plain decoding step at the same batch sizes, then prints the most a batch of N can gain over one stream if
nothing but those matrices grew with the rows: N x step(1) / (step(1) + matrices(N) - matrices(1)).
"""

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# the onnxruntime execution providers of each backend (ort-openvino: where onnxruntime-openvino is
# installed; the runtime does not ship it: its attention products round by the call's key count)
PROVIDERS = {"ort": ["CPUExecutionProvider"], "ort-openvino": ["OpenVINOExecutionProvider", "CPUExecutionProvider"]}


def provider_options(backend: str, threads: int) -> list[dict] | None:
    """OpenVINO's CPU device at fp32 inference precision (a lower one changes the numbers), `threads` threads."""
    return None if backend == "ort" else [{"device_type": "CPU", "precision": "FP32", "num_of_threads": str(threads)}, {}]


def engine_backend(artifact: Path, backend: str, threads: int):
    """"ort", or an onnxruntime backend on OpenVINO's provider whose calls round keys per sequence up to a
    multiple of 64 and rows per sequence to a power of two or a multiple of 16 (OpenVINO prepares each new
    input shape)."""
    if backend == "ort":
        return "ort"
    from runtime.backends.ort import OrtBackend
    from runtime.manifest import BATCHED_GRAPH, load_manifest

    be = OrtBackend(artifact, load_manifest(artifact), providers=PROVIDERS[backend], threads=threads,
                    graphs=(BATCHED_GRAPH,), provider_options=provider_options(backend, threads))
    be.key_bucket, be.row_bucket = 64, 16
    return be


def int4_matmul(k: int, n: int, block: int = 32, bits: int = 4) -> bytes:
    """A model `y [M, n] = x [M, k] @ DequantizeLinear(W [k, n], blocks of `block` along k)`: W holds INT4
    values (0..15, zero point 8), stored as uint4 (`bits` 4) or in a uint8 container (`bits` 8)."""
    rng = np.random.default_rng(0)
    kind = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
    w = helper.make_tensor("w", kind, [k, n], rng.integers(0, 16, size=k * n).tolist())
    blocks = -(-k // block)
    scales = numpy_helper.from_array((rng.random((blocks, n)) * 0.01).astype(np.float32), "s")
    zero = helper.make_tensor("zp", kind, [blocks, n], [8] * (blocks * n))
    nodes = [helper.make_node("DequantizeLinear", ["w", "s", "zp"], ["wd"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "wd"], ["y"])]
    graph = helper.make_graph(nodes, "int4_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              initializer=[w, scales, zero])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()


def artifact_matrices(artifact: Path, workdir: Path) -> tuple[Path, dict[int, int]]:
    """A model of the artifact target's INT4 matrices side by side: input `x_K [M, K]` per input width K,
    one output per DequantizeLinear -> MatMul pair, the weights read from the artifact's own data file
    (copied into `workdir`). Returns (model path, {K: matrices of that width})."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor

    target = onnx.load(str(artifact / "target.onnx"), load_external_data=False)
    inits = {t.name: t for t in target.graph.initializer}
    widths: dict[int, int] = {}
    nodes, used, outputs = [], [], []
    for i, dq in enumerate(n for n in target.graph.node if n.op_type == "DequantizeLinear"
                           and inits.get(n.input[0]) is not None and len(inits[n.input[0]].dims) == 2):
        k, n = inits[dq.input[0]].dims
        widths[k] = widths.get(k, 0) + 1
        nodes += [helper.make_node("DequantizeLinear", list(dq.input), [f"w{i}"], **{a.name: a.i for a in dq.attribute}),
                  helper.make_node("MatMul", [f"x_{k}", f"w{i}"], [f"y{i}"])]
        used += [inits[name] for name in dq.input if name in inits]
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["m", n]))
    if not nodes:
        raise SystemExit(f"{artifact}: its target.onnx has no INT4 matrices (build it with --quant int4)")
    inputs = [helper.make_tensor_value_info(f"x_{k}", TensorProto.FLOAT, ["m", k]) for k in widths]
    graph = helper.make_graph(nodes, "int4_matrices", inputs, outputs, initializer=list({t.name: t for t in used}.values()))
    for t in graph.initializer:  # a copy of the weights: onnxruntime refuses data files outside the model's folder
        if t.data_location == TensorProto.EXTERNAL:
            load_external_data_for_tensor(t, str(artifact))
    path = workdir / "matrices.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), str(path),
              save_as_external_data=True, location="matrices.onnx.data")
    return path, widths


def timed_calls(sess, feeds: dict, rounds: int) -> float:
    """Median seconds of one `sess.run` over `rounds` rounds of 10 calls (after 3 warm-up calls)."""
    for _ in range(3):
        sess.run(None, feeds)
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(10):
            sess.run(None, feeds)
        per.append((time.perf_counter() - t0) / 10)
    return sorted(per)[len(per) // 2]


def engine_steps(artifact: Path, batches: list[int], rounds: int, threads: int, backend: str,
                 key_bucket: int | None = None) -> dict[int, float]:
    """Median seconds per plain decoding step of the batched engine at each batch size (static batches
    of 100-token random-id prompts, 48 new tokens each, no stop ids), on `backend` ("ort" or
    "ort-openvino"), each call's keys rounded up to a multiple of `key_bucket` (None: the backend's)."""
    from runtime.batching import BatchEngine

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 20000, size=100)] for _ in range(max(batches))]
    steps: dict[int, list[float]] = {b: [] for b in batches}
    with BatchEngine(artifact, max_batch=max(batches), backend=engine_backend(artifact, backend, threads), threads=threads,
                     speculation=False) as engine:
        if key_bucket is not None:
            engine.calls.key_bucket = key_bucket
        engine.generate(prompts[:1], max_new_tokens=4)
        for _ in range(rounds):
            for b in batches:
                handles = [engine.stream(p, max_new_tokens=48, stop_token_ids=[], block_size=1) for p in prompts[:b]]
                for h in handles:
                    next(h)
                before, t0 = engine.status()["steps"], time.perf_counter()
                for h in handles:
                    for _ in h:
                        pass
                steps[b].append((time.perf_counter() - t0) / (engine.status()["steps"] - before))
    return {b: sorted(v)[len(v) // 2] for b, v in steps.items()}


def artifact_bound(artifact: Path, batches: list[int], rounds: int, threads: int, backend: str,
                   key_bucket: int | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, widths = artifact_matrices(artifact, Path(tmp))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
        sess = ort.InferenceSession(str(path), opts, providers=PROVIDERS[backend], provider_options=provider_options(backend, threads))
        rng = np.random.default_rng(1)
        matrices = {b: timed_calls(sess, {f"x_{k}": rng.standard_normal((b, k)).astype(np.float32) for k in widths}, rounds)
                    for b in batches}
        del sess
    print(f"{sum(widths.values())} INT4 matrices (input widths {widths}), one call, ms at "
          + ", ".join(f"{b} rows: {matrices[b] * 1e3:.2f}" for b in batches), flush=True)
    step = engine_steps(artifact, batches, rounds, threads, backend, key_bucket)
    one = step[batches[0]]
    for b in batches:
        bound = b * one / (one + matrices[b] - matrices[batches[0]])
        print(f"batch {b}: plain step {step[b] * 1e3:.2f} ms ({b * one / step[b]:.2f}x one stream's throughput); "
              f"matrices {matrices[b] * 1e3:.2f} ms; at most {bound:.2f}x if nothing else grew with the rows", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="576x1536,2048x6144", help="K x N pairs (SmolLM2's and Qwen3-1.7B's MLP up)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--artifact", type=Path, help="an INT4 --batched artifact: its own matrices and engine step")
    p.add_argument("--batch", default="1,4,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--block", type=int, default=32, help="quantization block along K")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4, help="8: the same INT4 values in uint8 weights")
    p.add_argument("--levels", default="4,1,0", help="accuracy levels to time")
    p.add_argument("--backend", default="ort", choices=sorted(PROVIDERS),
                   help="ort-openvino: onnxruntime's OpenVINO provider (where onnxruntime-openvino is installed)")
    p.add_argument("--key-bucket", type=int, help="round each call's keys up to a multiple of this (default: the backend's)")
    args = p.parse_args()
    providers = PROVIDERS[args.backend]
    if providers[0] not in ort.get_available_providers():
        raise SystemExit(f"--backend {args.backend}: this onnxruntime ({ort.__file__}) has no {providers[0]}; install "
                         "onnxruntime-openvino in an environment of its own (or put it first on PYTHONPATH)")
    if min(1 if args.key_bucket is None else args.key_bucket, args.rounds, args.block) < 1:
        raise SystemExit("--key-bucket, --rounds and --block must be at least 1")
    if args.artifact:
        batches = [int(b) for b in args.batch.split(",") if b.strip().isdigit()]
        if len(batches) != len(args.batch.split(",")) or batches[0] != 1 or min(batches) < 1:
            raise SystemExit(f"--batch must be positive integers starting with 1 (the gains are against one "
                             f"stream), e.g. 1,4,8; got {args.batch!r}")
        if not (args.artifact / "target.onnx").is_file():
            raise SystemExit(f"{args.artifact}: not an artifact (no target.onnx); build one with "
                             "`python -m dflash_export build --quant int4 --batched`")
        artifact_bound(args.artifact, batches, args.rounds, args.threads, args.backend, args.key_bucket)
        return 0
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        model = int4_matmul(k, n, args.block, args.bits)
        for level in (int(v) for v in args.levels.split(",")):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = args.threads
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(level))
            sess = ort.InferenceSession(model, opts, providers=providers, provider_options=provider_options(args.backend, args.threads))
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
            print(f"K={k} N={n} block {args.block} uint{args.bits} accuracy level {level}: {micros[0]:.0f} / {micros[1]:.0f} / {micros[2]:.0f} us at M = 1 / 4 / 8; "
                  f"M rows per M x t(1): {4 * micros[0] / micros[1]:.2f}x at 4, {8 * micros[0] / micros[2]:.2f}x at 8", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
