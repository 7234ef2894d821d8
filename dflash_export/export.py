"""ONNX export of the target and draft modules, with the checks every graph must pass.

Graphs are exported with `torch.onnx.export(dynamo=True)` at opset 20 (primitive operators only:
the one graph every deployed TensorRT 10.x and onnxruntime can load), with dynamic sequence and
past lengths. After export each graph is checked: every operator must be in the TensorRT 10 ONNX
parser's list (`trt10_onnx_ops.tsv`, shipped with the package) and no weight may be stored twice.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import torch

from runtime.errors import DFlashError

OPSET = 20
# Above this many bytes of initializers the graph stores weights as external data (protobuf's 2 GiB cap).
EXTERNAL_DATA_THRESHOLD = 512 << 20


def target_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the target graph, in positional order."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return (
        ["input_ids", "draft_hidden", "temperature", "uniform", *kv_in],
        ["next_ids", "proposal_ids", "next_embeddings", "logits", "taps", *kv_out],
    )


def draft_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Input and output names of the draft graph, in positional order."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    return ["context_hidden", "block_embeddings", *kv_in], ["draft_hidden", *kv_out]


def trt10_supported_ops() -> set[str]:
    """Operators the TensorRT 10.0/10.1 ONNX parser supports (opset 9-20), from the shipped TSV."""
    path = Path(__file__).with_name("trt10_onnx_ops.tsv")
    ops = set()
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            ops.add(line.split("\t")[0])
    return ops


def check_graph(model_path: Path) -> dict:
    """Check an exported graph for TensorRT 10 operator support and duplicated weights.

    Returns:
        {"ops": sorted op types, "opset": int, "initializer_bytes": int}.

    Raises:
        DFlashError: an operator outside the TensorRT 10 list, a non-default domain, opset > 20,
            or the same weight stored twice.
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_path), load_external_data=True)
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise DFlashError(f"{model_path.name} imports no default-domain opset; it is not a graph this tool exported")
    opset = max(versions)
    if opset > OPSET:
        raise DFlashError(f"{model_path.name}: opset {opset} > {OPSET}; TensorRT 10 cannot parse it")
    ops = set()
    tensors = list(model.graph.initializer)

    def walk(graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx"):
                raise DFlashError(f"{model_path.name}: node {node.name} uses domain {node.domain!r}")
            ops.add(node.op_type)
            for attr in node.attribute:
                if node.op_type == "Constant" and attr.HasField("t"):
                    tensors.append(attr.t)
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    tensors.extend(sub.initializer)
                    walk(sub)

    walk(model.graph)
    unsupported = sorted(ops - trt10_supported_ops())
    if unsupported:
        raise DFlashError(f"{model_path.name}: operators {unsupported} are not parsed by TensorRT 10")
    seen: dict[str, str] = {}
    total = 0
    for init in tensors:
        arr = numpy_helper.to_array(init)
        total += arr.nbytes
        if arr.size < 4096:  # small constants (shapes, epsilons) may legitimately repeat
            continue
        flat = arr.reshape(-1)
        if flat.size and (flat == flat[0]).all():  # constant-filled weights (zeroed, pruned) repeat legitimately
            continue
        digest = hashlib.sha256(arr.tobytes()).hexdigest()
        for candidate in (digest, hashlib.sha256(arr.T.copy().tobytes()).hexdigest() if arr.ndim == 2 else None):
            if candidate in seen:
                raise DFlashError(
                    f"{model_path.name}: weight {init.name} duplicates {seen[candidate]} (stored twice)"
                )
        seen[digest] = init.name
    return {"ops": sorted(ops), "opset": opset, "initializer_bytes": total}


def _export(module, args, names, dynamic_shapes, path: Path) -> None:
    import logging

    # the exporter logs one warning per missing optional torchvision operator: noise for LLMs
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    in_names, out_names = names
    n_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            args,
            dynamo=True,
            opset_version=OPSET,
            input_names=in_names,
            output_names=out_names,
            dynamic_shapes=dynamic_shapes,
            external_data=n_bytes > EXTERNAL_DATA_THRESHOLD,
            verbose=False,
            report=False,
        )
    program.save(str(path), external_data=n_bytes > EXTERNAL_DATA_THRESHOLD)


def export_target(module, path: Path) -> None:
    """Export a :class:`TargetForExport` to `path` with dynamic T (>= 1), N (>= 0), P (>= 0) and U
    (sampled rows: 1 + N or 0).

    The dummy sizes (T=3, N=4, P=5) are distinct and >= 2 so the exporter does not specialise
    any dimension to 0, 1 or to another dimension.
    """
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    t, n, p = 3, 4, 6  # uniform gets n + 1 = 5 rows: still distinct from every other size
    args = (
        torch.randint(0, spec.vocab_size, (t,), dtype=torch.int64),
        torch.randn(n, a.hidden_size, dtype=dt),
        torch.zeros(1, dtype=torch.float32),
        torch.rand(n + 1, dtype=torch.float32),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    T = torch.export.Dim("new_tokens", min=1, max=1 << 20)
    N = torch.export.Dim("proposals", min=0, max=1 << 10)
    P = torch.export.Dim("past_len", min=0, max=1 << 20)
    U = torch.export.Dim("sampled_rows", min=0, max=1 << 10)  # 1 + N when sampling, 0 when greedy
    dyn = ({0: T}, {0: N}, None, {0: U}, tuple({0: P} for _ in range(2 * a.num_layers)))
    _export(module, args, target_io_names(a.num_layers), dyn, path)


def export_draft(module, path: Path) -> None:
    """Export a :class:`DFlashDraft` to `path` with dynamic C (>= 1), B (>= 2) and Pc (>= 0)."""
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    c, b, p = 3, 6, 5
    args = (
        torch.randn(c, len(spec.target_layer_ids) * a.hidden_size, dtype=dt),
        torch.randn(b, a.hidden_size, dtype=dt),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    C = torch.export.Dim("context_len", min=1, max=1 << 20)
    B = torch.export.Dim("block_size", min=2, max=1 << 10)
    P = torch.export.Dim("past_context_len", min=0, max=1 << 20)
    dyn = ({0: C}, {0: B}, tuple({0: P} for _ in range(2 * a.num_layers)))
    _export(module, args, draft_io_names(a.num_layers), dyn, path)
