"""ONNX export of the target and draft modules, with the checks every graph must pass.

Graphs are exported with `torch.onnx.export(dynamo=True)` at opset 20 (primitive operators only:
the one graph every deployed TensorRT 10.x and onnxruntime can load), with dynamic sequence and
past lengths. After export each graph is checked: every operator must be in the TensorRT 10 ONNX
parser's list (`trt10_onnx_ops.tsv`, shipped with the package) and no weight may be stored twice.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

from dflash_export.export import replication as lr
from dflash_export.export.checks import OPSET
from dflash_export.export.io import draft_io_names, hybrid_target_inputs, lazy_weight
from dflash_export.export.passes import pack_shared_input_gemms
from dflash_export.nn.draft import DraftWithRows

# Above this many bytes of initializers the graph stores its weights as external data, written one tensor at
# a time (protobuf caps a file at 2 GiB, and serializing weights into one message holds them twice more).
EXTERNAL_DATA_THRESHOLD = 64 << 20


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
    (INT4 weights, `quant.int4.rewrite_int4`; `packed` maps each packed weight to its parts) and write
    `model` to `path`: streamed weights are read only now, one at a time."""
    pack_and_rewrite(model, readers, rewrite)
    save_graph(model, Path(path), progress)


def pack_and_rewrite(model, readers: dict, rewrite) -> None:
    """What `_finish` does before saving: check the streamed weights are untouched, pack linear layers
    sharing an input into one GEMM and apply `rewrite(model, packed)` (INT4)."""
    _check_streamed(model, readers)
    packed = pack_shared_input_gemms(model)
    if rewrite is not None:
        rewrite(model, packed)


def _export(module, args, names, dynamic_shapes, path: Path, readers: dict | None = None,
            progress: bool = False, rewrite=None) -> None:
    """Trace `module` (all of it) and write it to `path` (see `_trace` and `_finish`)."""
    readers = readers or {}
    _finish(_trace(module, args, names, dynamic_shapes, readers), path, readers, progress, rewrite)


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
        replicate: "auto" traces a template with every layer kind twice (`export.replication`) and
            copies its layers to every layer (the same graph; tracing time independent of the depth),
            or, when the template's structure is not the expected one, warns (`ReplicationWarning`) and
            traces every layer; "always" raises `export.replication.ReplicationError` instead of falling
            back; "never" traces every layer.
        layout: the module's `export.replication.Layout` (default: `dense_layout(module)`, Llama / Qwen3).

    Raises:
        ValueError: an unknown `replicate`.
    """

    readers = readers or {}
    model, how = traced_graph(module, readers, layout or lr.dense_layout(module), replicate)
    t0 = time.perf_counter()
    _finish(model, path, readers, progress, rewrite)
    if progress:
        print(f"{Path(path).name}: {how}; packed and wrote it in {time.perf_counter() - t0:.1f}s",
              file=sys.stderr, flush=True)


def traced_graph(module, readers: dict, layout, replicate: str = "auto") -> tuple:
    """The optimized graph of a target export module with its `layout` (`export.replication.Layout`): a
    traced template's layers copied (`replicate` "auto": where the layout allows it, else every layer
    traced, with a ReplicationWarning; "always": or raise; "never"), and a line saying how long it took."""
    if replicate not in ("auto", "always", "never"):
        raise ValueError(f"replicate must be auto, always or never (got {replicate!r})")
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
    return model, how


def _replicated_target(module, readers: dict, layout) -> tuple:
    """The optimized target graph made from a traced template (`export.replication`), and a line saying
    how long tracing and replicating took."""

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


def export_selector_draft(module, path: Path, readers: dict | None = None, progress: bool = False,
                          rewrite=None, head_names: list[str] | None = None) -> None:
    """Export a :class:`nn.dflash2.DFlash2Draft` to `path` with dynamic C (>= 1), R (>= 1) and Pc (>= 0);
    the block B is the draft's block size, fixed (its selector walk is unrolled over B - 1 positions).
    `readers`, `rewrite`: as :func:`export_draft`; `head_names`: other names for the outputs before the
    K/V (a variant module that returns other things, as `eval.selector_walk` measures)."""
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    c, r, p = 3, 2, 5
    args = (
        torch.randn(c, len(spec.target_layer_ids) * a.hidden_size, dtype=dt),
        torch.randn(spec.block_size, a.hidden_size, dtype=dt),
        torch.arange(r, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    C = torch.export.Dim("context_len", min=1, max=1 << 20)
    R = torch.export.Dim("draft_rows", min=1, max=max(spec.block_size - 1, 2))
    P = torch.export.Dim("past_context_len", min=0, max=1 << 20)
    dyn = ({0: C}, None, {0: R}, None, tuple({0: P} for _ in range(2 * a.num_layers)))
    inputs, outputs = draft_io_names(a.num_layers, selects=True)
    if head_names is not None:
        outputs = [*head_names, *outputs[-2 * a.num_layers:]]
    _export(module, args, (inputs, outputs), dyn, path, readers, progress, rewrite)


def export_hybrid_target(module, path) -> None:
    """Export with the project's path (`_export`: dynamo, opset 20, optimized, shared-input
    GEMMs packed) with dynamic T, R, P and Pp. The runtime's graph wiring (proposals, sampling) is not
    here."""

    module.eval()
    _export(module, *hybrid_target_inputs(module), path)
