"""The checks every exported graph passes: TensorRT 10 operators only, opset, every weight stored once, and
INT4 weights in the one DequantizeLinear form TensorRT and onnxruntime both load."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from runtime.errors import DFlashError

OPSET = 20


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

    Weights stored as external data are read one at a time through a memory map, so checking a
    graph larger than memory works.

    Returns:
        {"ops": sorted op types, "opset": int, "initializer_bytes": int, "int4_weights": int}.

    Raises:
        DFlashError: an operator outside the TensorRT 10 list, a non-default domain, opset > 20 (21
            only with INT4 weights), a DequantizeLinear outside the INT4 form of `quant/int4.py`, or the
            same weight stored twice (also transposed).
    """
    import onnx

    model_path = Path(model_path)
    model = onnx.load(str(model_path), load_external_data=False)
    versions = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not versions:
        raise DFlashError(f"{model_path.name} imports no default-domain opset; it is not a graph this tool exported")
    opset = max(versions)
    if opset > QUANT_OPSET:
        raise DFlashError(f"{model_path.name}: opset {opset} > {OPSET} ({QUANT_OPSET} with INT4 weights); "
                          "TensorRT 10 cannot parse it")
    int4 = check_int4_form(model, lambda t: _tensor_array(t, model_path.parent))
    if opset > OPSET and not int4:
        raise DFlashError(f"{model_path.name}: opset {opset} > {OPSET} without INT4 weights; TensorRT 10 cannot parse it")
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
    seen: dict[tuple, list] = {}
    total = 0
    for init in tensors:
        arr = _tensor_array(init, model_path.parent, sampled=True)
        total += arr.nbytes
        if arr.size < 4096:  # small constants (shapes, epsilons) may legitimately repeat
            continue
        key = _fingerprint(arr)
        if key is None:  # constant-filled weights (zeroed, pruned) repeat legitimately
            continue
        for other in seen.get(key, []):  # equal summaries: compare the values themselves
            if _same_or_transposed(np.asarray(_tensor_array(init, model_path.parent)),
                                   np.asarray(_tensor_array(other, model_path.parent))):
                raise DFlashError(f"{model_path.name}: weight {init.name} duplicates {other.name} (stored twice)")
        seen.setdefault(key, []).append(init)  # not the array: a kept memory map would stay resident
        del arr
    return {"ops": sorted(ops), "opset": opset, "initializer_bytes": total, "int4_weights": int4}


def _tensor_array(tensor, base_dir: Path, sampled: bool = False) -> np.ndarray:
    """A TensorProto's values: a read-only memory map for external data, else decoded in memory.

    `sampled`: the caller reads a few scattered elements (the duplicate fingerprint), so the map asks
    the kernel not to read ahead: each sampled element then costs one page, not a 128 KB read-around,
    which matters once a large artifact no longer fits the page cache (figures:
    docs/export.md#layer-replication-tracing-a-template)."""
    from onnx import TensorProto, external_data_helper, helper, numpy_helper

    shape = tuple(int(d) for d in tensor.dims)
    packed = tensor.data_type in (TensorProto.INT4, TensorProto.UINT4)  # two values a byte: read the bytes
    if not external_data_helper.uses_external_data(tensor):
        return np.frombuffer(tensor.raw_data, np.uint8) if packed else numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = np.dtype(np.uint8) if packed else np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    if packed:
        shape = ((int(np.prod(shape, dtype=np.int64)) + 1) // 2,)
    path = base_dir / info["location"]
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    try:
        arr = np.memmap(path, dtype=dtype, mode="r", offset=int(info.get("offset", 0)), shape=shape)
        raw_map = getattr(arr, "_mmap", None)  # numpy's mmap.mmap behind the array (absent: no advice)
        if sampled and hasattr(raw_map, "madvise") and hasattr(mmap, "MADV_RANDOM"):
            raw_map.madvise(mmap.MADV_RANDOM)
        return arr
    except (OSError, ValueError) as exc:
        raise DFlashError(f"cannot read weight {tensor.name} from {path}: {exc}; the graph's external data is "
                          "missing or truncated: rebuild the artifact") from None


def _fingerprint(arr: np.ndarray) -> tuple | None:
    """A summary that a copy and a transposed copy of `arr` share exactly, read from a few hundred
    elements (a memory-mapped 1 GB weight costs a few page reads): dtype, sorted shape and the sorted
    values of a sample grid whose indices depend only on each axis' size (a 2-D tensor's grid and its
    transpose's grid hold the same values). None for a constant-filled tensor (checked in full when
    the sample is constant)."""
    def axis_sample(n: int) -> np.ndarray:
        return np.unique(np.linspace(0, n - 1, num=min(n, 16)).astype(np.int64))

    if arr.ndim == 2:
        sample = np.asarray(arr[np.ix_(axis_sample(arr.shape[0]), axis_sample(arr.shape[1]))]).reshape(-1)
    else:
        flat = arr.reshape(-1)
        sample = np.asarray(flat[axis_sample(flat.size)])
    if (sample == sample[0]).all() and _constant_filled(arr):
        return None
    return (arr.dtype.str, tuple(sorted(arr.shape)), np.sort(sample).tobytes())


def _constant_filled(arr: np.ndarray, chunk: int = 1 << 24) -> bool:
    flat = arr.reshape(-1)
    first = flat[0]
    return all(bool((np.asarray(flat[i:i + chunk]) == first).all()) for i in range(0, flat.size, chunk))


def _same_or_transposed(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape == b.shape and np.array_equal(a, b):
        return True
    return a.ndim == 2 and a.shape == b.shape[::-1] and np.array_equal(a.T, b)


QUANT_OPSET = 21


def check_int4_form(model, read_array) -> int:
    """Check that every DequantizeLinear of an ONNX ModelProto is in the one INT4 form (module doc).

    Args:
        model: onnx.ModelProto (external data not loaded).
        read_array: TensorProto -> numpy values (for the scales).

    Returns:
        the number of INT4 weights.

    Raises:
        DFlashError: a DequantizeLinear in another form (UINT4 or INT8 values, a zero point, scales that
            are not strictly positive or of another shape, a block size that is not a power of two >= 16,
            a 3-D weight, an output that does not feed exactly one MatMul as its B input), naming it.
    """
    from onnx import TensorProto

    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[tuple[str, int]]] = {}
    for node in graph.node:
        for idx, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node.op_type, idx))
    count = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear":
            continue
        where = f"DequantizeLinear {node.name or node.output[0]}"
        attrs = {a.name: a for a in node.attribute}
        values = inits.get(node.input[0])
        if values is None or values.data_type != TensorProto.INT4:
            raise DFlashError(f"{where}: weights must be a signed INT4 initializer (TensorRT blocks only INT4)")
        if len(values.dims) != 2:
            raise DFlashError(f"{where}: weights must be 2-D [K, N] (TensorRT 10 blocks only 2-D inputs)")
        if len(node.input) > 2 and node.input[2]:
            raise DFlashError(f"{where}: has a zero point; the form is symmetric (no zero point)")
        axis = attrs["axis"].i if "axis" in attrs else 1
        block = attrs["block_size"].i if "block_size" in attrs else 0
        if axis != 0 or block < 16 or block & (block - 1):
            raise DFlashError(f"{where}: axis {axis}, block_size {block}; the form is axis 0 with a power-of-two "
                              "block >= 16")
        k, n = values.dims
        scale = inits.get(node.input[1])
        if scale is None or scale.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            raise DFlashError(f"{where}: scales must be an fp32 or fp16 initializer")
        if list(scale.dims) != [k // block, n] or k % block:
            raise DFlashError(f"{where}: scales {list(scale.dims)} for weights [{k}, {n}] and block {block}; "
                              f"expected [{k // block}, {n}] with the block dividing K")
        if not bool((read_array(scale) > 0).all()):
            raise DFlashError(f"{where}: scales must be strictly positive (TensorRT refuses zero or negative scales)")
        if consumers.get(node.output[0]) != [("MatMul", 1)]:
            raise DFlashError(f"{where}: its output must feed exactly one MatMul as input B")
        count += 1
    return count
