"""Checkpoint weights read one tensor at a time, so an export holds the model at most once.

An export module is built with its parameters absent (`empty_module`, parameters on the meta
device) and then bound to a :class:`WeightSource` (`bind_weights`): small parameters get their
values at once, large ones a placeholder that costs one element (a stride-0 view) plus a reader
that loads the tensor from its safetensors shard, casts it to the parameter's dtype and is called
only when the ONNX writer streams that initializer to disk. Tracing needs shapes and dtypes only,
so the weights are read once, when they are written, and freed right after.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from runtime.errors import DFlashError

# Parameters with more elements than this are streamed; smaller ones (norms, biases) are loaded at
# once. It is above onnxscript's constant-folding input limit (8192 elements) and the initializer
# deduplication limit (1024), so the graph optimizer never needs a streamed tensor's values.
STREAM_MIN_ELEMENTS = 1 << 14

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

Reader = Callable[[], torch.Tensor]


class WeightSource:
    """The tensors of a checkpoint by name, with shapes known up front and values read on demand.

    Either safetensors files (each read opens the shard, copies one tensor out and closes it again,
    so no mapping of the whole file stays resident) or an in-memory state dict (an untrained draft).

    Args:
        where: how to name the checkpoint in errors.
        files: safetensors files (a checkpoint's shards).
        tensors: name -> torch.Tensor, instead of files.
        strip_prefix: removed from the front of every stored name (drafts store "model.").

    Raises:
        DFlashError: a file that is not a readable safetensors file (truncated, corrupted).
    """

    def __init__(self, where: str, files: list[Path] | None = None, tensors: dict | None = None,
                 strip_prefix: str = ""):
        self.where = where
        self._tensors = tensors
        self._files: dict[str, tuple[Path, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        if tensors is not None:
            for name, t in tensors.items():
                self.shapes[name], self.dtypes[name] = tuple(t.shape), t.dtype
            return
        for f in files or []:
            for key, shape, dtype in _read_header(Path(f)):
                name = key[len(strip_prefix):] if strip_prefix and key.startswith(strip_prefix) else key
                self._files[name] = (Path(f), key)
                self.shapes[name], self.dtypes[name] = shape, dtype

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def names(self) -> list[str]:
        """Every tensor name, in storage order."""
        return list(self.shapes)

    def nbytes(self, name: str) -> int:
        """Bytes of `name` as stored."""
        n = 1
        for s in self.shapes[name]:
            n *= s
        return n * torch.empty((), dtype=self.dtypes[name]).element_size()

    def read(self, name: str) -> torch.Tensor:
        """`name` as a CPU tensor in its stored dtype (a fresh copy for files).

        Raises:
            DFlashError: the shard cannot be read (it changed or was truncated since it was opened).
        """
        if self._tensors is not None:
            return self._tensors[name]
        from safetensors import SafetensorError, safe_open

        path, key = self._files[name]
        try:
            with safe_open(str(path), framework="pt") as fh:
                return fh.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise _unreadable(f"{key} from {path}", exc) from None

    def read_row(self, name: str, row: int) -> torch.Tensor:
        """Row `row` of a 2-D tensor `name` (an embedding row), without reading the rest."""
        if self._tensors is not None:
            return self._tensors[name][row].clone()
        from safetensors import SafetensorError, safe_open

        path, key = self._files[name]
        try:
            with safe_open(str(path), framework="pt") as fh:
                return fh.get_slice(key)[row : row + 1][0].clone()
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise _unreadable(f"{key} from {path}", exc) from None

    def renamed(self, rename: Callable[[str], str | None]) -> "WeightSource":
        """The same tensors under `rename(stored name)` (None: left out), read from the same shards: a
        Qwen3_5ForConditionalGeneration's text weights under the CausalLM names, for example."""
        out = WeightSource(self.where, tensors={} if self._tensors is not None else None)
        for name in self.names():
            new = rename(name)
            if new is None:
                continue
            out.shapes[new], out.dtypes[new] = self.shapes[name], self.dtypes[name]
            if self._tensors is not None:
                out._tensors[new] = self._tensors[name]
            else:
                out._files[new] = self._files[name]
        return out

    def mapped(self, transform: Callable[[str, torch.Tensor], torch.Tensor], what: str) -> "WeightSource":
        """The same names and shapes, each tensor read as `transform(name, tensor as stored)` (an INT4
        graph's dequantized weights, AWQ's scaled ones); `what` is added to the source's name in errors.
        Shares this source's index: nothing is read here. `read_row` still reads rows as stored (only
        the embedding's, which neither transform changes)."""
        out = WeightSource(f"{self.where} ({what})", tensors=self._tensors)
        out._files, out.shapes, out.dtypes = self._files, self.shapes, self.dtypes
        out.read = lambda name: transform(name, self.read(name))
        return out

    def read_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`name` cast to `dtype` (exact for bf16/fp16 -> fp32; one rounding for fp32/bf16 -> fp16)."""
        t = self.read(name)
        return t if t.dtype == dtype else t.to(dtype)


def _read_header(path: Path) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            out = []
            for key in fh.keys():
                sl = fh.get_slice(key)
                dtype = _ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise DFlashError(f"{path}: tensor {key} has dtype {sl.get_dtype()}, which no exporter reads; "
                                      "convert the checkpoint to bf16, fp16 or fp32")
                out.append((key, tuple(sl.get_shape()), dtype))
            return out
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _unreadable(str(path), exc) from None


def _unreadable(what: str, exc: Exception) -> DFlashError:
    return DFlashError(f"cannot read {what}: {exc}. The file is corrupted or truncated; re-download or re-convert it.")


def empty_module(factory: Callable[[], nn.Module]) -> nn.Module:
    """Build `factory()` with every parameter on the meta device (no memory); buffers stay real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return factory()


def _ignored_source_name(name: str) -> bool:
    return "rotary_emb" in name or name.endswith("inv_freq")  # computed, never exported from the checkpoint


def check_weight_names(own: dict[str, tuple[int, ...]], source: WeightSource, where: str, tied: bool) -> None:
    """Every parameter has a source tensor of its shape, and the source has nothing else.

    Args:
        own: parameter name -> shape of the module.
        tied: the module ties its LM head to the embedding (a stored `lm_head.weight` is ignored:
            Hugging Face ties a stored copy too).

    Raises:
        DFlashError: missing or unexpected names, a shape mismatch or a non-float tensor, named.
    """
    names = [n for n in source.names() if not (tied and n == "lm_head.weight")]
    missing = [k for k in own if k not in source]
    unexpected = [k for k in names if k not in own and not _ignored_source_name(k)]
    if missing or unexpected:
        raise DFlashError(
            f"{where}: weights do not match the architecture (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for k, shape in own.items():
        if tuple(source.shapes[k]) != tuple(shape):
            raise DFlashError(f"{where}: {k} has shape {tuple(source.shapes[k])}, expected {tuple(shape)}")
        if not source.dtypes[k].is_floating_point:  # an integer tensor here is packed or quantized data
            raise DFlashError(f"{where}: {k} is stored as {source.dtypes[k]}, not floating point (a quantized or "
                              "damaged checkpoint?); convert it to bf16, fp16 or fp32")


def set_parameter(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter `name` (dotted) of `module` by a frozen parameter holding `value`."""
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, nn.Parameter(value, requires_grad=False))


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` that costs one element: tracing reads only its metadata.

    Each placeholder has its own storage, so the exporter never takes two of them for one weight."""
    return torch.zeros(1, dtype=dtype).expand(*shape)


def bind_weights(module: nn.Module, source: WeightSource, where: str,
                 load_whole: Callable[[str], bool] = lambda name: False) -> dict[str, Reader]:
    """Give an :func:`empty_module`'s parameters their checkpoint values, in each parameter's dtype.

    Parameters of at most `STREAM_MIN_ELEMENTS` elements, and those `load_whole(name)` names (small
    weights the graph transforms, whose derived values the optimizer must compute), are loaded now;
    larger ones become placeholders whose reader is returned, to be called when the initializer is
    written.

    Returns:
        parameter name -> reader returning the tensor in the parameter's dtype.

    Raises:
        DFlashError: the checkpoint does not match the module (see :func:`check_weight_names`).
    """
    params = dict(module.named_parameters())
    tied = getattr(module, "lm_head", 0) is None
    check_weight_names({k: tuple(p.shape) for k, p in params.items()}, source, where, tied)
    readers: dict[str, Reader] = {}
    for name, p in params.items():
        read = partial(source.read_as, name, p.dtype)
        if p.numel() > STREAM_MIN_ELEMENTS and not load_whole(name):
            readers[name] = read
            set_parameter(module, name, placeholder(p.shape, p.dtype))
        else:
            set_parameter(module, name, read().clone())
    return readers


def load_module_weights(module: nn.Module, source: WeightSource, where: str) -> nn.Module:
    """Give an :func:`empty_module` every checkpoint tensor as stored (no dtype cast, no second copy).

    For a reference that computes in fp32 from bf16 storage, see `families.shared.upcast_weights_on_use`.

    Raises:
        DFlashError: the checkpoint does not match the module.
    """
    params = dict(module.named_parameters())
    tied = getattr(module, "lm_head", 0) is None
    check_weight_names({k: tuple(p.shape) for k, p in params.items()}, source, where, tied)
    for name in params:
        set_parameter(module, name, source.read(name))
    return module
