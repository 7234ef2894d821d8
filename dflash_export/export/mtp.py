"""Writing the MTP head's graph (`nn.mtp.MTPHead`) as `mtp.onnx`.

The head reads the target's embedding and LM head. Where the target graph keeps its weights in an
external data file, `mtp.onnx` points its copies of those two tensors at that file (same name, type and
shape; nothing is written twice); its own weights (fc, the layer, the norms) go to `mtp.onnx.data`.
A small target stores its weights inline, and the head then keeps its own copy.
"""

from __future__ import annotations

from pathlib import Path

from dflash_export.export.graphs import _trace, pack_and_rewrite, save_graph
from dflash_export.nn.mtp import MTPHead, mtp_export_inputs


def export_mtp(module: MTPHead, path: Path, weights_of: Path | None = None, readers: dict | None = None,
               rewrite=None) -> list[str]:
    """Trace `module` and write it to `path`, its placeholder weights read from `readers`
    (`weights.bind_weights`) one at a time as they are written; with `weights_of` (the target graph),
    the tensors it shares with the target refer to the target's data file instead (never read).
    Returns those names."""
    readers = readers or {}
    args, names, dyn = mtp_export_inputs(module)
    model = _trace(module, args, names, dyn, readers)
    pack_and_rewrite(model, readers, rewrite)
    shared = _link_shared_weights(model, Path(weights_of)) if weights_of is not None else []
    if not shared:
        save_graph(model, Path(path))
        return shared
    _own_weights_to_file(model, Path(path))  # (ir.save's external_data would copy the linked ones too)
    import onnx_ir as ir

    ir.save(model, str(path))
    return shared


def _own_weights_to_file(model, path: Path) -> None:
    """Write the head's own initializers above 1 KiB to `<path>.data` and point them there (the linked
    ones already point at the target's file)."""
    import onnx_ir as ir

    data = path.with_name(path.name + ".data")
    with open(data, "wb") as f:
        for name, value in model.graph.initializers.items():
            tensor = value.const_value
            if isinstance(tensor, ir.ExternalTensor) or tensor is None or tensor.nbytes <= 1024:
                continue
            offset = f.tell()
            f.write(tensor.tobytes())
            value.const_value = ir.ExternalTensor(data.name, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                  name=name, base_dir=str(path.parent))


def _link_shared_weights(model, target_path: Path) -> list[str]:
    """Point each initializer of `model` that the target graph stores externally under the same name,
    type and shape at the target's tensor. Returns the names linked."""
    import onnx
    import onnx_ir as ir

    target = onnx.load(str(target_path), load_external_data=False)
    linked = []
    for t in target.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL or t.name not in model.graph.initializers:
            continue
        value = model.graph.initializers[t.name]
        tensor = value.const_value
        if t.data_type != tensor.dtype.value or tuple(t.dims) != tuple(tensor.shape.numpy()):
            continue  # (transformed differently in the two graphs: the head keeps its own copy)
        info = {e.key: e.value for e in t.external_data}
        value.const_value = ir.ExternalTensor(info["location"], int(info.get("offset", 0)), int(info["length"]),
                                              tensor.dtype, shape=tensor.shape, name=t.name,
                                              base_dir=str(target_path.parent))
        linked.append(t.name)
    return linked
