"""The backend interface the decoding loop drives, and the buffer arithmetic every backend shares.

A backend owns memory (host or device) and two executable graphs ("target" and "draft"). The
decoding loop never touches graph outputs except through :class:`View`\\ s of buffers that it
allocated once per session, so the same loop runs on onnxruntime (CPU or CUDA) and TensorRT.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np

# TensorRT requires 256-byte aligned tensor addresses; we use the same rule everywhere.
ADDRESS_ALIGNMENT = 256


class View(NamedTuple):
    """A typed window on a backend buffer: `shape` elements starting `offset` elements in.

    Because the sequence axis is outermost, a prefix of rows or the rows from row P on are both
    contiguous, so a View is just (buffer, element offset, shape). Immutable; a named tuple rather
    than a frozen dataclass because a decoding step makes ~130 of them (creation 3x cheaper).
    """

    buffer: "Buffer"
    offset: int
    shape: tuple[int, ...]

    @property
    def byte_offset(self) -> int:
        """Offset from the buffer start in bytes."""
        return self.offset * self.buffer.itemsize

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


class Buffer:
    """A fixed-size allocation of `capacity` elements of `dtype`, owned by a backend.

    Attributes:
        dtype: numpy dtype of the elements.
        capacity: elements.
        row_shape: trailing shape of one sequence row (for `rows()`).
    """

    def __init__(self, dtype: np.dtype, capacity: int, row_shape: tuple[int, ...] = ()):
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.capacity = int(capacity)
        self.row_shape = tuple(int(n) for n in row_shape)
        self._row_elems = math.prod(self.row_shape)  # computed once: rows() runs ~130 times per decoding step

    @property
    def row_elems(self) -> int:
        """Elements in one sequence row."""
        return self._row_elems

    def rows(self, start: int, count: int) -> View:
        """View of rows `[start, start + count)` (shape `[count, *row_shape]`).

        Raises:
            IndexError: the rows do not fit in the buffer (a bug in capacity planning).
        """
        row = self._row_elems
        if start < 0 or count < 0 or (start + count) * row > self.capacity:
            raise IndexError(f"rows [{start}, {start + count}) exceed a buffer of {self.capacity // row} rows")
        return View(self, start * row, (count, *self.row_shape))


def is_aligned(view: View, alignment: int = ADDRESS_ALIGNMENT) -> bool:
    """Whether a view's start lands on an `alignment`-byte boundary (its buffer base is aligned)."""
    return view.byte_offset % alignment == 0


class Backend(ABC):
    """What the decoding loop needs from an execution engine.

    Implementations: :class:`runtime.backends.ort.OrtBackend` (onnxruntime CPU/CUDA) and
    :class:`runtime.backends.trt.TrtBackend` (TensorRT engines).
    """

    name: str = "abstract"
    # whether greedy target calls may bind 0 uniforms (skipping the sampling branch); False for
    # engines known to mishandle that empty branch (see OrtBackend)
    greedy_without_uniforms: bool = True
    # whether the target's kernels round activations to int8 (onnxruntime's MatMulNBits at level 4):
    # then a one-ulp difference between a row's calls becomes a whole int8 step, and Session pads
    # one-row calls where they round differently from multi-row ones (`runtime.graphs.row_exact`)
    int8_activations: bool = False
    # batched calls round keys per sequence up to a multiple of `key_bucket`, and rows per sequence of
    # multi-row calls up to a multiple of `row_bucket` (prefill chunks) or, below it, a power of two
    # (verify steps): for backends that prepare each new input shape (OpenVINO's, in
    # scripts/int4_rows_cost.py; the padding keys and rows change no result on onnxruntime's CPU provider)
    key_bucket: int = 1
    row_bucket: int = 1

    @abstractmethod
    def alloc(self, dtype, rows: int, row_shape: tuple[int, ...] = ()) -> Buffer:
        """Allocate a zeroed buffer of `rows` rows of `row_shape` (once per session)."""

    def alloc_stack(self, count: int, dtype, rows: int, row_shape: tuple[int, ...] = ()) -> list[Buffer]:
        """`count` buffers as :meth:`alloc` makes them; a host backend lays them out in one allocation, so
        :meth:`scatter_heads_stack` can write all of them in one copy."""
        return [self.alloc(dtype, rows, row_shape) for _ in range(count)]

    @abstractmethod
    def write(self, view: View, values: np.ndarray) -> None:
        """Copy host `values` (shape `view.shape`) into the view."""

    @abstractmethod
    def read(self, view: View) -> np.ndarray:
        """Copy the view to a new host array (used for token ids only on greedy steps)."""

    @abstractmethod
    def copy(self, dst: View, src: View) -> None:
        """Copy `src` into `dst` within the backend's memory (same element count)."""

    def scatter_heads(self, dst: "Buffer", rows: np.ndarray | slice, src: View, src_rows: np.ndarray | slice) -> None:
        """Write row `src_rows[i]` of `src` (`[n, H, D]`) to row `rows[i]` of every head of `dst` (a
        head-major `[H, N, D]` cache): a batched step's new K/V rows into their slots
        (`runtime.batching`). `rows` and `src_rows`: int64 index arrays, or slices (one sequence's rows
        are a strided run: host backends then copy without an index array). One copy per row and head
        here; host-memory backends do it in one assignment."""
        heads, d = src.shape[1], src.shape[2]
        per_head = dst.capacity // heads
        for row, s in zip(row_indices(rows, per_head // d), row_indices(src_rows, src.shape[0])):
            for h in range(heads):
                self.copy(View(dst, h * per_head + int(row) * d, (d,)), View(src.buffer, src.offset + (int(s) * heads + h) * d, (d,)))

    def scatter_heads_stack(self, dsts: list["Buffer"], rows: np.ndarray | slice, srcs: list[View],
                            src_rows: np.ndarray | slice) -> None:
        """:meth:`scatter_heads` for each (dst, src) pair, the same rows in each: a batched step's new
        K/V rows of every layer. `dsts` and `srcs` from :meth:`alloc_stack` let a host backend do it
        in one copy (one per layer and kind here)."""
        for dst, src in zip(dsts, srcs):
            self.scatter_heads(dst, rows, src, src_rows)

    def gather_heads(self, dst: View, src: "Buffer", rows: np.ndarray | slice) -> None:
        """Read row `rows[i]` of every head of `src` (a head-major `[H, N, D]` cache) into row i of `dst`
        (`[n, H, D]`): `scatter_heads` the other way (a slot's rows into a position-major copy,
        `runtime.batching.lone`). One copy per row and head here."""
        heads, d = dst.shape[1], dst.shape[2]
        per_head = src.capacity // heads
        for i, row in enumerate(row_indices(rows, per_head // d)):
            for h in range(heads):
                self.copy(View(dst.buffer, dst.offset + (i * heads + h) * d, (d,)), View(src, h * per_head + row * d, (d,)))

    @abstractmethod
    def run(self, graph: str, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        """Run graph "target" or "draft" reading `inputs` and writing `outputs` in place.

        Graph outputs missing from `outputs` are not wanted: a backend drops them or writes them to
        scratch memory of its own."""

    def max_call_rows(self, graph: str) -> int | None:
        """The most new rows one call of `graph` may take on top of a non-empty cache (None: any).
        TensorRT engines are limited by their optimization profiles (`profiles.call_row_limit`)."""
        return None

    def describe(self) -> dict:
        """What call timings on this backend depend on (name, versions, device, settings): the
        key of the cached call costs (`runtime.graphs.costs`). JSON-ready."""
        return {"name": self.name}

    def close(self) -> None:
        """Release graphs and memory (the backend is unusable afterwards)."""


def row_indices(rows: np.ndarray | slice, length: int) -> list[int]:
    """`scatter_heads`' rows as a list of ints (a slice taken over `length` rows)."""
    return list(range(*rows.indices(length))) if isinstance(rows, slice) else np.asarray(rows).tolist()
