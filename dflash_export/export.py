"""ONNX export of the target and draft modules, with the checks every graph must pass.

Graphs are exported with `torch.onnx.export(dynamo=True)` at opset 20 (primitive operators only:
the one graph every deployed TensorRT 10.x and onnxruntime can load), with dynamic sequence and
past lengths. After export each graph is checked: every operator must be in the TensorRT 10 ONNX
parser's list (`trt10_onnx_ops.tsv`, shipped with the package) and no weight may be stored twice.
"""

from __future__ import annotations

import mmap
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from runtime.errors import DFlashError
from runtime.manifest import DRAFT_PROPOSAL_OUTPUTS
from runtime.tree import TREE_INPUTS, TREE_SHAPE_INPUTS, tree_bias_of

from .graph_passes import pack_shared_input_gemms
from .quantize import QUANT_OPSET, check_int4_form

OPSET = 20
# Above this many bytes of initializers the graph stores its weights as external data, written one tensor at
# a time (protobuf caps a file at 2 GiB, and serializing weights into one message holds them twice more).
EXTERNAL_DATA_THRESHOLD = 64 << 20


def target_io_names(num_layers: int, draft_proposes: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names of the target graph, in positional order (`draft_proposes`: the target
    takes the proposal ids, `modules.TargetForExport`)."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    if draft_proposes:
        return (["input_ids", "proposal_ids", "temperature", "uniform", *TREE_SHAPE_INPUTS, *kv_in],
                ["next_ids", "next_embeddings", "logits", "taps", *kv_out])
    return (
        ["input_ids", "draft_hidden", "temperature", "uniform", *TREE_INPUTS, *kv_in],
        ["next_ids", "proposal_ids", "next_embeddings", "logits", "taps", *kv_out],
    )


def draft_io_names(num_layers: int, proposes: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names of the draft graph, in positional order (`proposes`: it ends in the
    proposal head, `draft_model.ProposingDraft`)."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    heads = list(DRAFT_PROPOSAL_OUTPUTS) if proposes else ["draft_hidden"]
    return ["context_hidden", "block_embeddings", "proposal_rows", *kv_in], [*heads, *kv_out]


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
            only with INT4 weights), a DequantizeLinear outside the INT4 form of `quantize.py`, or the
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
    the kernel not to read ahead: each sampled element then costs one page, not a 128 KB read-around
    (an 8B-shaped graph's check, its 16 GB no longer in the page cache: 14 s -> 1.8 s)."""
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


def lazy_weight(read, dtype, shape, name: str):
    """An onnx_ir tensor of `dtype` and `shape` whose values `read()` (a torch tensor) gives when it is
    written, and not before."""
    import onnx_ir as ir

    return ir.LazyTensor(lambda: ir.tensor(read().numpy()), dtype=dtype, shape=shape, name=name)


def _attach_readers(model, readers: dict) -> None:
    """Replace each streamed initializer's placeholder with a lazy tensor that calls its reader."""
    inits = model.graph.initializers
    absent = [name for name in readers if name not in inits]
    if absent:
        raise AssertionError(f"streamed weights {absent[:3]} are not initializers of the traced graph")
    for name, read in readers.items():
        value = inits[name].const_value
        inits[name].const_value = lazy_weight(read, value.dtype, value.shape, name)


def _check_streamed(model, readers: dict) -> None:
    """After optimization every streamed weight must still be its own, unread initializer: a pass that
    folded or merged one would have needed its values (and changed the graph's numerics)."""
    import onnx_ir as ir

    inits = model.graph.initializers
    lost = [n for n in readers if n not in inits or not isinstance(inits[n].const_value, ir.LazyTensor)]
    if lost:
        raise AssertionError(f"the graph optimizer rewrote streamed weights {lost[:3]}")


def save_graph(model, path: Path, progress: bool = False) -> None:
    """Write an onnx_ir model; above `EXTERNAL_DATA_THRESHOLD` bytes of initializers the weights go to
    `<name>.data`, streamed one tensor at a time (a lazy tensor is read, written and freed), with a
    progress bar over bytes written when `progress`."""
    import onnx_ir as ir
    from tqdm import tqdm

    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total <= EXTERNAL_DATA_THRESHOLD:
        ir.save(model, str(path))
        return
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {path.name} weights",
              disable=not progress, file=sys.stderr, mininterval=1.0) as bar:
        ir.save(model, str(path), external_data=f"{path.name}.data",
                callback=lambda tensor, info: bar.update(tensor.nbytes))


def _trace(module, args, names, dynamic_shapes, readers: dict):
    """Trace `module` and optimize it; `readers` (from `weights.bind_weights`) supply the values of
    placeholder parameters, which stay unread (lazy tensors) through optimization.

    Returns:
        the optimized onnx_ir model.

    Raises:
        AssertionError: the optimizer folded or merged a streamed weight.
    """
    import logging

    # the exporter logs one warning per missing optional torchvision operator: noise for LLMs
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    in_names, out_names = names
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
            optimize=False,  # below, once the streamed weights are lazy tensors
            verbose=False,
            report=False,
        )
        _attach_readers(program.model, readers)
        program.optimize()
    _check_streamed(program.model, readers)
    return program.model


def _finish(model, path: Path, readers: dict, progress: bool, rewrite) -> None:
    """Pack linear layers sharing an input into one GEMM (`graph_passes`), apply `rewrite(model, packed)`
    (INT4 weights, `quantize.rewrite_int4`; `packed` maps each packed weight to its parts) and write
    `model` to `path`: streamed weights are read only now, one at a time."""
    _check_streamed(model, readers)
    packed = pack_shared_input_gemms(model)
    if rewrite is not None:
        rewrite(model, packed)
    save_graph(model, Path(path), progress)


def _export(module, args, names, dynamic_shapes, path: Path, readers: dict | None = None,
            progress: bool = False, rewrite=None) -> None:
    """Trace `module` (all of it) and write it to `path` (see `_trace` and `_finish`)."""
    readers = readers or {}
    _finish(_trace(module, args, names, dynamic_shapes, readers), path, readers, progress, rewrite)


def _target_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a TargetForExport with.

    The dummy sizes (T=3, N=4, P=6, U=5) are distinct and >= 2 so the exporter does not specialise
    any dimension to 0, 1 or to another dimension.
    """
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    t, n, p = 3, 4, 6  # uniform gets n + 1 = 5 rows: still distinct from every other size
    proposes = module.draft_proposes
    proposals = (torch.randint(0, spec.vocab_size, (n,), dtype=torch.int64) if proposes
                 else torch.randn(n, a.hidden_size, dtype=dt))
    ranks = () if proposes else (torch.tensor([0, 0, 1, 2], dtype=torch.int64),)
    args = (
        torch.randint(0, spec.vocab_size, (t,), dtype=torch.int64),
        proposals,
        torch.zeros(1, dtype=torch.float32),
        torch.rand(n + 1, dtype=torch.float32),
        torch.tensor([0, 1, 0, 0], dtype=torch.int64),  # a tree: a chain of 2 and two alternatives
        *ranks,
        torch.tensor(tree_bias_of([-1, 0, -1, -1])),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    T = torch.export.Dim("new_tokens", min=1, max=1 << 20)
    N = torch.export.Dim("proposals", min=0, max=1 << 10)
    P = torch.export.Dim("past_len", min=0, max=1 << 20)
    U = torch.export.Dim("sampled_rows", min=0, max=1 << 10)  # 1 + N when sampling, 0 when greedy
    # forward(input_ids, proposals, temperature, uniform, *rest): the tree inputs and caches are `rest`
    rest = ({0: N}, *([{0: N}] * len(ranks)), {0: N, 1: N}, *({0: P} for _ in range(2 * a.num_layers)))
    dyn = ({0: T}, {0: N}, None, {0: U}, rest)
    return args, target_io_names(a.num_layers, proposes), dyn


class ReplicationWarning(UserWarning):
    """Layer replication did not apply to a target: every layer was traced (slower, same graph)."""


def export_target(module, path: Path, readers: dict | None = None, progress: bool = False, rewrite=None,
                  replicate: str = "auto", layout=None) -> None:
    """Export a target export module to `path`: a :class:`TargetForExport` with dynamic T (>= 1), N
    (>= 0), P (>= 0) and U (sampled rows: 1 + N or 0), or another family's module with its `layout`.

    Args:
        readers: initializer name -> reader of the streamed weights (`weights.bind_weights`).
        progress: print a bar while weights are written and one line of phase times (stderr).
        rewrite: `rewrite(model, packed)` edits the optimized graph before it is saved (`_finish`).
        replicate: "auto" traces a template with every layer kind twice (`layer_replication`) and
            copies its layers to every layer (the same graph; tracing time independent of the depth),
            or, when the template's structure is not the expected one, warns (`ReplicationWarning`) and
            traces every layer; "always" raises `layer_replication.ReplicationError` instead of falling
            back; "never" traces every layer.
        layout: the module's `layer_replication.Layout` (default: `dense_layout(module)`, Llama / Qwen3).

    Raises:
        ValueError: an unknown `replicate`.
    """
    from . import layer_replication as lr

    if replicate not in ("auto", "always", "never"):
        raise ValueError(f"replicate must be auto, always or never (got {replicate!r})")
    readers = readers or {}
    layout = layout or lr.dense_layout(module)
    model = None
    if replicate != "never" and lr.replicable(module, layout):
        try:
            model, how = _replicated_target(module, readers, layout)
        except lr.ReplicationError as exc:
            if replicate == "always":
                raise
            warnings.warn(f"layer replication does not apply to this target ({exc}); tracing every layer",
                          ReplicationWarning, stacklevel=2)
    if model is None:
        t0 = time.perf_counter()
        model = _trace(module, *layout.export_inputs(module), readers)
        how = f"traced and optimized {len(layout.kinds)} layers in {time.perf_counter() - t0:.1f}s"
    t0 = time.perf_counter()
    _finish(model, path, readers, progress, rewrite)
    if progress:
        print(f"{Path(path).name}: {how}; packed and wrote it in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)


def _replicated_target(module, readers: dict, layout) -> tuple:
    """The optimized target graph made from a traced template (`layer_replication`), and a line saying
    how long tracing and replicating took."""
    from . import layer_replication as lr

    t0 = time.perf_counter()
    template, template_readers = lr.template_target(module, readers, layout)
    model = _trace(template, *layout.export_inputs(template), template_readers)
    t1 = time.perf_counter()
    lr.replicate_layers(model, module, readers, layout, template)
    return model, (f"traced and optimized a {len(layout.template_kinds)}-layer template in {t1 - t0:.1f}s, copied "
                   f"its layers to {len(layout.kinds)} layers in {time.perf_counter() - t1:.1f}s")


def export_draft(module, path: Path, readers: dict | None = None, progress: bool = False, rewrite=None) -> None:
    """Export a :class:`DFlashDraft` to `path` with dynamic C (>= 1), B (>= 2), R (>= 1: the
    `proposal_rows` returned) and Pc (>= 0), its inputs in :class:`DraftWithRows` order (a
    :class:`ProposingDraft` returns its proposal table instead of `draft_hidden`). `rewrite`:
    as for :func:`export_target` (the INT4 last layer of `build.draft_rewrite`)."""
    from .draft_model import DraftWithRows

    module = DraftWithRows.view_of(module)
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    c, b, r, p = 3, 6, 4, 5  # distinct, so no dimension is specialised to another
    args = (
        torch.randn(c, len(spec.target_layer_ids) * a.hidden_size, dtype=dt),
        torch.randn(b, a.hidden_size, dtype=dt),
        torch.arange(r, dtype=torch.int64),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    C = torch.export.Dim("context_len", min=1, max=1 << 20)
    B = torch.export.Dim("block_size", min=2, max=1 << 10)
    R = torch.export.Dim("draft_rows", min=1, max=1 << 10)
    P = torch.export.Dim("past_context_len", min=0, max=1 << 20)
    dyn = ({0: C}, {0: B}, {0: R}, tuple({0: P} for _ in range(2 * a.num_layers)))
    names = draft_io_names(a.num_layers, getattr(module, "proposes", False))
    _export(module, args, names, dyn, path, readers, progress, rewrite)
