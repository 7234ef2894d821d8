"""Export of the batched graphs (`nn.batched.BatchedTarget`, `nn.batched_draft.BatchedDraft`), which
read their weights from the one-sequence graph's own external data file: the artifact holds the weights
once however many graphs use them."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_export.export.graphs import (
    _trace,
    pack_and_rewrite,
    save_graph,
    traced_graph,
)
from dflash_export.nn.batched import batched_io_names
from dflash_export.nn.batched_draft import batched_draft_io_names
from dflash_export.nn.batched_hybrid import batched_hybrid_io_names

# initializers up to this size may be the batched graph's own (index constants); every larger one must
# be one of the one-sequence graph's weights
OWN_INITIALIZER_BYTES = 1 << 20


def batched_target_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a BatchedTarget with. Sizes are distinct and
    >= 2 (B=2, T=3, L=9 keys, K=5, U=4, C=40 cache rows) so no dimension is specialised."""
    a = module.spec.arch
    args = batched_target_inputs_of(module.spec.vocab_size, a.num_kv_heads, a.head_dim, a.num_layers, module.compute_dtype)
    B, T, L, K, U, C = _dims(batch=(1, 10), rows_per_sequence=(1, 20), keys=(1, 21), logit_rows=(1, 20),
                             sampled_rows=(0, 20), cache_rows=(1, 30))
    dyn = ({0: B, 1: T}, {0: B}, {0: B, 1: L}, {0: K}, {0: K}, {0: U}, tuple({1: C} for _ in range(2 * a.num_layers)))
    return args, batched_io_names(a.num_layers), dyn


def batched_target_inputs_of(vocab_size: int, kv_heads: int, head_dim: int, layers: int, dtype) -> tuple:
    """The dummy args of `batched_target_inputs` (B=2, T=3, L=9, K=5, U=4, C=40) with `layers` layers'
    caches."""
    b, t, n_keys, k, u, c = 2, 3, 9, 5, 4, 40
    past = torch.tensor([6, 2], dtype=torch.int64)
    index = torch.zeros(b, n_keys, dtype=torch.int64)
    for i in range(b):
        index[i, : past[i]] = torch.arange(int(past[i])) * 4 + i
        index[i, past[i]: past[i] + t] = c + i * t + torch.arange(t)
    return (torch.randint(0, vocab_size, (b, t), dtype=torch.int64), past, index,
            torch.tensor([0, 2, 3, 4, 5], dtype=torch.int64), torch.rand(k, dtype=torch.float32),
            torch.rand(u, dtype=torch.float32),
            *[torch.randn(kv_heads, c, head_dim, dtype=dtype) for _ in range(2 * layers)])


def batched_hybrid_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a BatchedHybridTarget with: `batched_target_inputs`'
    sizes, S=3 state slots, P=4 pending rows of M=24 buffer rows (sequences with 4 and 1 pending rows)."""
    s, dt = module.spec, module.compute_dtype
    args = batched_target_inputs_of(s.vocab_size, s.num_kv_heads, s.head_dim, 0, dt)
    slots, m, c = 3, 24, 40  # (B=2 and P=4: the state inputs below)
    caches, dyn_caches = [], []
    B, T, L, K, U, C, P, M = _dims(batch=(1, 10), rows_per_sequence=(1, 6), keys=(1, 21), logit_rows=(1, 20),
                                   sampled_rows=(0, 20), cache_rows=(1, 30), pending_rows=(1, 6), pending_buffer=(1, 30))
    S = torch.export.Dim("state_slots", min=1, max=1 << 10)
    for kind in s.layer_types:
        if kind == "full_attention":
            caches += [torch.randn(s.num_kv_heads, c, s.head_dim, dtype=dt) for _ in range(2)]
            dyn_caches += [{1: C}, {1: C}]
        else:
            caches += [torch.randn(slots, s.conv_kernel - 1, s.conv_dim, dtype=dt),
                       torch.randn(slots, s.num_v_heads, s.key_head_dim, s.value_head_dim) * 0.1,
                       torch.randn(m, s.conv_dim, dtype=dt), torch.randn(m, s.num_v_heads, dtype=dt),
                       torch.randn(m, s.num_v_heads, dtype=dt)]
            dyn_caches += [{0: S}, {0: S}, {0: M}, {0: M}, {0: M}]
    state = (torch.tensor([2, 0], dtype=torch.int64), torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3]], dtype=torch.int64),
             torch.tensor([4, 1], dtype=torch.int64))
    dyn = ({0: B, 1: T}, {0: B}, {0: B, 1: L}, {0: K}, {0: K}, {0: U}, {0: B}, {0: B, 1: P}, {0: B}, tuple(dyn_caches))
    return (*args, *state, *caches), batched_hybrid_io_names(s.layer_types), dyn


def batched_draft_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a BatchedDraft with: B=2 sequences with 4 and 1
    cached rows and 2 and 3 new context rows (Ctot=5 packed of N=9 pending rows), L=6 keys, C=3, a
    block of Bk=7 rows, R=4 proposal rows, M=40 cache rows: distinct sizes, so none is specialised."""
    a = module.spec.arch
    dt = module.compute_dtype
    feat = module.fc.in_features
    args = (
        torch.randn(9, feat, dtype=dt),
        torch.tensor([0, 1, 4, 5, 6], dtype=torch.int64),
        torch.tensor([4, 5, 1, 2, 3], dtype=torch.int64),
        torch.tensor([[0, 1, 0], [2, 3, 4]], dtype=torch.int64),
        torch.tensor([2, 3], dtype=torch.int64),
        torch.tensor([4, 1], dtype=torch.int64),
        torch.tensor([[0, 1, 2, 3, 0, 0], [20, 0, 0, 0, 0, 0]], dtype=torch.int64),
        torch.randn(2, 7, a.hidden_size, dtype=dt),
        torch.arange(4, dtype=torch.int64),
        *[torch.randn(40, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    B, N, T, C, L, K, R, M = _dims(batch=(1, 10), tap_rows=(1, 24), context_rows=(1, 20), context_keys=(1, 20),
                                   past_keys=(1, 21), block_size=(2, 10), draft_rows=(1, 10), cache_rows=(1, 30))
    dyn = ({0: N}, {0: T}, {0: T}, {0: B, 1: C}, {0: B}, {0: B}, {0: B, 1: L}, {0: B, 1: K}, {0: R},
           tuple({0: M} for _ in range(2 * a.num_layers)))
    return args, batched_draft_io_names(a.num_layers), dyn


def _dims(**ranges: tuple[int, int]) -> list:
    """`torch.export.Dim`s named as the keyword arguments, each (min, log2 of max)."""
    return [torch.export.Dim(name, min=lo, max=1 << bits) for name, (lo, bits) in ranges.items()]


def export_batched_target(module, path: Path, readers: dict, rewrite=None, weights_of: Path | None = None) -> None:
    """Trace `module` (a BatchedTarget whose weights stream from `readers`), pack and `rewrite` it as the
    target graph was (`export.graphs._finish`), and write it to `path`. With `weights_of` (the target
    graph, saved with external data), every weight refers to that graph's data file instead of being
    written again.

    Raises:
        AssertionError: a large initializer of this graph that the target graph does not store with
            the same type and shape (the two exports diverged: a bug).
    """
    _export_batched(module, batched_target_inputs(module), path, readers, rewrite, weights_of)


def export_batched_hybrid(module, path: Path, readers: dict, rewrite=None, weights_of: Path | None = None,
                          layout=None) -> None:
    """:func:`export_batched_target` for a BatchedHybridTarget (`weights_of`: the hybrid target graph).
    With its `layout` (`export.replication.Layout`), a template's layers are traced and copied, as for
    the one-sequence hybrid graph: Gated DeltaNet layers trace slowly."""
    if layout is None:
        _export_batched(module, batched_hybrid_inputs(module), path, readers, rewrite, weights_of)
        return
    _save_batched(traced_graph(module, readers, layout)[0], path, readers, rewrite, weights_of)


def export_batched_draft(module, path: Path, readers: dict | None, rewrite=None, weights_of: Path | None = None) -> None:
    """:func:`export_batched_target` for a BatchedDraft (`weights_of`: the draft graph)."""
    _export_batched(module, batched_draft_inputs(module), path, readers or {}, rewrite, weights_of)


def _export_batched(module, inputs: tuple, path: Path, readers: dict, rewrite, weights_of: Path | None) -> None:
    args, names, dyn = inputs
    _save_batched(_trace(module, args, names, dyn, readers), path, readers, rewrite, weights_of)


def _save_batched(model, path: Path, readers: dict, rewrite, weights_of: Path | None) -> None:
    pack_and_rewrite(model, readers, rewrite)
    if weights_of is not None and _link_external_weights(model, Path(weights_of)):
        import onnx_ir as ir

        ir.save(model, str(path))
        return
    save_graph(model, Path(path))


def _link_external_weights(model, target_path: Path) -> bool:
    """Point each initializer of `model` at the tensor of the same name in `target_path`'s external data.
    Returns False where the target graph stores its weights inline (a small model: nothing to share)."""
    import onnx
    import onnx_ir as ir

    target = onnx.load(str(target_path), load_external_data=False)
    stored = {}
    for t in target.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            stored[t.name] = (info["location"], int(info.get("offset", 0)), int(info["length"]), t.data_type, tuple(t.dims))
    if not stored:
        return False
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if name not in stored:
            if tensor.nbytes > OWN_INITIALIZER_BYTES:
                raise AssertionError(f"batched graph weight {name} ({tensor.nbytes} bytes) is not in {target_path.name}")
            continue
        location, offset, length, dtype, dims = stored[name]
        if dtype != tensor.dtype.value or dims != tuple(tensor.shape.numpy()):
            raise AssertionError(f"batched graph weight {name} differs from {target_path.name}'s "
                                 f"({tensor.dtype}, {tensor.shape} against type {dtype}, {dims})")
        value.const_value = ir.ExternalTensor(location, offset, length, tensor.dtype, shape=tensor.shape, name=name,
                                              base_dir=str(target_path.parent))
    return True
