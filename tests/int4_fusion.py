"""What onnxruntime makes of an artifact's INT4 weights when the runtime loads it: every
`DequantizeLinear -> MatMul` must become one MatMulNBits (an unfused one re-expands its whole weight
to floats on every call)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx


def optimized_ops(art: Path, graph: str, tmp: Path) -> Counter:
    """Operator counts of `graph` ("target" or "draft") of the artifact `art` after onnxruntime's
    optimizers run with the options the runtime loads it with (level, disabled optimizers, INT4
    accuracy level), read back from `SessionOptions.optimized_model_filepath`."""
    import onnxruntime as ort

    from runtime.backends.ort import _optimization_level, default_int4_accuracy_level, disabled_optimizers

    manifest = json.loads((Path(art) / "manifest.json").read_text())
    opts = ort.SessionOptions()
    opts.graph_optimization_level = _optimization_level(ort)
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(default_int4_accuracy_level(manifest)))
    out = Path(tmp) / f"{graph}.optimized.onnx"
    opts.optimized_model_filepath = str(out)
    ort.InferenceSession(str(Path(art) / f"{graph}.onnx"), opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=disabled_optimizers(manifest, ort))
    ops = Counter(n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node)
    for extra in out.parent.glob(out.name + "*"):
        extra.unlink()
    return ops


def assert_int4_fused(art: Path, tmp: Path) -> dict[str, int]:
    """Assert that no DequantizeLinear is left in either graph of `art` once optimized; returns
    {graph: MatMulNBits count}."""
    fused = {}
    for graph in ("target", "draft"):
        ops = optimized_ops(art, graph, tmp)
        assert ops["DequantizeLinear"] == 0, f"{graph}: {ops['DequantizeLinear']} DequantizeLinear left unfused"
        fused[graph] = ops["MatMulNBits"]
    return fused
