"""TensorRT backend: the two engines, static device buffers and one CUDA stream.

Nothing here imports TensorRT or touches CUDA at import time: `import runtime` stays torch- and
GPU-free. :class:`TrtBackend` imports `tensorrt` and Polygraphy's ctypes wrapper of libcudart
(`polygraphy.cuda`, a torch-free allocator) when it is constructed.

Memory: every buffer is one `cudaMalloc` made once per session (256-byte aligned), plus, lazily,
a scratch buffer per tensor that once needed one. Graph inputs and outputs are bound by address
straight into the session's buffers (past K/V as a prefix view, new K/V rows at row P), as the
onnxruntime backend does; where a view's address is not 256-byte aligned (TensorRT's rule), the
tensor goes through its scratch buffer and one device-to-device copy. Only token ids (greedy
steps) cross device -> host. The hot loop per call: pick the optimization profile covering the
shapes (runtime/profiles.py), `set_input_shape`, `set_tensor_address`, `execute_async_v3(stream)`.

Engines are tied to the TensorRT version and GPU that built them: the manifest records both
(`dflash_export/engine.py`) and loading elsewhere raises a DFlashError that says to rebuild.

Hybrid targets (Qwen3.5, Gated DeltaNet layers): the session binds each GDN layer's states and
pending/recorded rows through `runtime/recurrent.RecurrentState` like any other tensor: whole-buffer
views for `conv_state_i` / `recurrent_state_i` and their outputs (offset 0, so always in place), row
views from row 0 for `pending_*_i` and `qkv_i` / `a_i` / `b_i`; inputs and outputs are different
buffers (two sets used in turn), so nothing is read and written in place. The recurrent state is
fp32 in every engine (also fp16 ones): the engine's IO dtypes are checked against the manifest at
load and against the bound buffers once per call shape. The attention layers' K/V keep the model's
layer indices (`past_key_3`, ...). The profiles are `runtime.backends.profiles.shape_ranges`' (pending rows,
T + N <= max_call_rows).

Everything here is written against TensorRT's documented Python API (10.3 through 11.x:
`deserialize_cuda_engine`, `get_tensor_profile_shape`, `set_optimization_profile_async`,
`set_input_shape`, `set_tensor_address`, `execute_async_v3`) and, in this repository, has run only
through the test double in tests/test_trt_backend_double.py (and tests/test_trt_hybrid_double.py for
hybrid artifacts), never on TensorRT itself: scripts/gpu_check.sh is the check on a device.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from runtime.backends.base import ADDRESS_ALIGNMENT, Backend, Buffer, View, is_aligned, row_indices
from runtime.backends.profiles import Profile, call_row_limit, max_block, select_profile
from runtime.errors import DFlashError

# cudaMemcpyKind values (CUDA runtime API).
H2D, D2H, D2D = 1, 2, 3
# CUdevice_attribute values (CUDA driver API).
_CC_MAJOR, _CC_MINOR = 75, 76

REBUILD_HINT = "rebuild them on this device: `python -m dflash_export engine {dir}` (the ONNX graphs are in the artifact)"


# ---- what is installed -------------------------------------------------------------------------
def import_tensorrt():
    """Import the TensorRT Python package.

    Raises:
        DFlashError: it is missing, or is PyPI's placeholder without the TensorRT libraries.
    """
    try:
        import tensorrt as trt
    except ImportError:
        raise DFlashError(
            "the TensorRT Python package is not installed (Jetson: it comes with JetPack as python3-libnvinfer; "
            "x86_64: pip install tensorrt-cu12)"
        ) from None
    except Exception as exc:  # a broken install raises OSError/RuntimeError while loading libnvinfer
        raise DFlashError(f"the TensorRT Python package cannot be loaded: {exc}") from None
    if not hasattr(trt, "Runtime") or not hasattr(trt, "Builder"):
        raise DFlashError(
            f"the installed `tensorrt` package ({getattr(trt, '__file__', '?')}) is a placeholder without the TensorRT "
            "libraries; install TensorRT itself (JetPack on Jetson, tensorrt-cu12 elsewhere)"
        )
    return trt


def gpu_info() -> tuple[dict | None, str]:
    """Name and compute capability of CUDA device 0, via the CUDA driver (libcuda), without torch.

    Returns:
        ({"name": str, "compute_capability": "8.7"}, "") or (None, why there is none).
    """
    lib = None
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        return None, "no NVIDIA driver (libcuda.so.1 not found)"
    try:
        if lib.cuInit(0) != 0:
            return None, "the NVIDIA driver found no usable GPU (cuInit failed)"
        count = ctypes.c_int(0)
        if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
            return None, "no CUDA GPU visible (check CUDA_VISIBLE_DEVICES)"
        dev = ctypes.c_int(0)
        lib.cuDeviceGet(ctypes.byref(dev), 0)
        buf = ctypes.create_string_buffer(256)
        lib.cuDeviceGetName(buf, 256, dev)
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        lib.cuDeviceGetAttribute(ctypes.byref(major), _CC_MAJOR, dev)
        lib.cuDeviceGetAttribute(ctypes.byref(minor), _CC_MINOR, dev)
    except AttributeError as exc:
        return None, f"the CUDA driver library lacks {exc}"
    return {"name": buf.value.decode(errors="replace"), "compute_capability": f"{major.value}.{minor.value}"}, ""


def load_cuda():
    """Polygraphy's ctypes wrapper of libcudart (malloc/free/memcpy/streams).

    Raises:
        DFlashError: polygraphy or the CUDA runtime library is missing.
    """
    try:
        from polygraphy import cuda as pcuda
    except ImportError:
        raise DFlashError("the GPU backends need polygraphy for device memory: pip install polygraphy") from None
    try:
        wrapper = pcuda.wrapper()
        wrapper.handle.cudaGetDeviceCount  # noqa: B018 - fails early if libcudart did not load
    except Exception as exc:  # PolygraphyException / OSError / AttributeError
        raise DFlashError(f"the CUDA runtime (libcudart) cannot be loaded: {exc}") from None
    return wrapper


def check_engine_compat(trt_section: dict, trt_version: str, gpu: dict, artifact_dir) -> None:
    """Refuse engines built by another TensorRT version or on another GPU.

    Raises:
        DFlashError: naming what the engines were built with, what this machine has, and how to rebuild.
    """
    built_v = trt_section.get("tensorrt_version")
    built_gpu = trt_section.get("gpu", {})
    hint = REBUILD_HINT.format(dir=artifact_dir)
    if built_v != trt_version:
        raise DFlashError(
            f"{artifact_dir}: the TensorRT engines were built with TensorRT {built_v} on {built_gpu.get('name')} "
            f"(compute capability {built_gpu.get('compute_capability')}); this machine has TensorRT {trt_version}. "
            f"Engines only load on the TensorRT version that built them: {hint}"
        )
    if (built_gpu.get("name"), built_gpu.get("compute_capability")) != (gpu.get("name"), gpu.get("compute_capability")):
        raise DFlashError(
            f"{artifact_dir}: the TensorRT engines were built on {built_gpu.get('name')} (compute capability "
            f"{built_gpu.get('compute_capability')}); this GPU is {gpu.get('name')} (compute capability "
            f"{gpu.get('compute_capability')}). Engines are specific to the GPU that built them: {hint}"
        )


# ---- device memory shared by the GPU backends ------------------------------------------------------
class DeviceBuffer(Buffer):
    """A Buffer in device memory (`ptr`, 256-byte aligned by cudaMalloc)."""

    def __init__(self, cuda, dtype, capacity: int, row_shape=()):
        super().__init__(dtype, capacity, row_shape)
        self.nbytes = self.capacity * self.dtype.itemsize
        self.ptr = int(cuda.malloc(max(self.nbytes, ADDRESS_ALIGNMENT)))
        if self.ptr % ADDRESS_ALIGNMENT:
            raise DFlashError(f"cudaMalloc returned an address not aligned to {ADDRESS_ALIGNMENT} bytes")

    def address(self, view: View) -> int:
        return self.ptr + view.byte_offset


class CudaMemoryBackend(Backend):
    """Device buffers, one CUDA stream, and the aligned-binding / scratch-and-copy rule.

    Subclasses implement `run` with :meth:`_bind` for every tensor and :meth:`_finish` after.

    Attributes:
        stats: counts of tensors bound in place ("direct") and through scratch ("scratch").
    """

    def __init__(self, cuda, scratch_rows: int):
        self.cuda = cuda
        self.stream = int(cuda.create_stream())
        self._scratch: dict[tuple[str, str], DeviceBuffer] = {}
        self._scratch_rows = scratch_rows
        self._buffers: list[DeviceBuffer] = []
        self.stats = {"direct": 0, "scratch": 0}

    def _memcpy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        if nbytes:
            self.cuda.memcpy(dst, src, nbytes, ctypes.c_int(kind), self.stream)

    def alloc(self, dtype, rows: int, row_shape=()) -> DeviceBuffer:
        buf = DeviceBuffer(self.cuda, dtype, rows * int(np.prod(row_shape, dtype=np.int64) if row_shape else 1), row_shape)
        zeros = np.zeros(max(1, min(buf.nbytes, 64 << 20)), np.uint8)  # >= 1 byte: range() needs a step
        for start in range(0, buf.nbytes, zeros.nbytes):  # zero it (once per session)
            n = min(zeros.nbytes, buf.nbytes - start)
            self._memcpy(buf.ptr + start, zeros.ctypes.data, n, H2D)
        self.cuda.stream_synchronize(self.stream)
        self._buffers.append(buf)
        return buf

    def write(self, view: View, values: np.ndarray) -> None:
        host = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=view.buffer.dtype), view.shape))
        # From pageable memory the copy has left `host` when cudaMemcpyAsync returns.
        self._memcpy(view.buffer.address(view), host.ctypes.data, host.nbytes, H2D)

    def read(self, view: View) -> np.ndarray:
        out = np.empty(view.shape, view.buffer.dtype)
        self._memcpy(out.ctypes.data, view.buffer.address(view), out.nbytes, D2H)
        self.cuda.stream_synchronize(self.stream)
        return out

    def copy(self, dst: View, src: View) -> None:
        if dst.size != src.size or dst.buffer.dtype != src.buffer.dtype:
            raise ValueError(f"copy of {src.shape} {src.buffer.dtype} into {dst.shape} {dst.buffer.dtype}")
        self._memcpy(dst.buffer.address(dst), src.buffer.address(src), src.size * src.buffer.dtype.itemsize, D2D)

    def scatter_heads(self, dst: Buffer, rows: np.ndarray | slice, src: View, src_rows: np.ndarray | slice) -> None:
        """One strided copy (cudaMemcpy2DAsync) per row, all heads at once: the row's `[H, D]` block in
        `src` to row `rows[i]` of each head of `dst`. The base class's copy per row and head would be
        36 layers x 2 x 8 heads = 576 calls per decoded token of a Qwen3-8B batch."""
        heads, d = src.shape[1], src.shape[2]
        item = src.buffer.dtype.itemsize
        per_head = dst.capacity // heads * item  # bytes between heads in the head-major cache
        src_base = src.buffer.address(src)
        for row, s in zip(row_indices(rows, dst.capacity // heads // d), row_indices(src_rows, src.shape[0])):
            status = self.cuda.handle.cudaMemcpy2DAsync(
                ctypes.c_void_p(dst.ptr + int(row) * d * item), ctypes.c_size_t(per_head),
                ctypes.c_void_p(src_base + int(s) * heads * d * item), ctypes.c_size_t(d * item),
                ctypes.c_size_t(d * item), ctypes.c_size_t(heads), ctypes.c_int(D2D), ctypes.c_void_p(self.stream))
            if status:
                raise DFlashError(f"cudaMemcpy2DAsync failed with CUDA error {status} while writing new K/V rows")

    def gather_heads(self, dst: View, src: Buffer, rows: np.ndarray | slice) -> None:
        """One strided copy per row (`scatter_heads` the other way): row `rows[i]` of every head of
        `src` into row i (`[H, D]`) of `dst`."""
        heads, d = dst.shape[1], dst.shape[2]
        item = dst.buffer.dtype.itemsize
        per_head = src.capacity // heads * item
        dst_base = dst.buffer.address(dst)
        for i, row in enumerate(row_indices(rows, src.capacity // heads // d)):
            status = self.cuda.handle.cudaMemcpy2DAsync(
                ctypes.c_void_p(dst_base + i * heads * d * item), ctypes.c_size_t(d * item),
                ctypes.c_void_p(src.ptr + int(row) * d * item), ctypes.c_size_t(per_head),
                ctypes.c_size_t(d * item), ctypes.c_size_t(heads), ctypes.c_int(D2D), ctypes.c_void_p(self.stream))
            if status:
                raise DFlashError(f"cudaMemcpy2DAsync failed with CUDA error {status} while reading K/V rows")

    def synchronize(self) -> None:
        self.cuda.stream_synchronize(self.stream)

    def _scratch_view(self, graph: str, name: str, view: View) -> View:
        return self._scratch_for(graph, name, view.buffer.dtype, view.shape)

    def _scratch_for(self, graph: str, name: str, dtype, shape: tuple) -> View:
        """A view of `shape` on the (graph, name) scratch buffer, grown when too small."""
        buf = self._scratch.get((graph, name))
        size = int(np.prod(shape, dtype=np.int64))
        if buf is None or buf.capacity < size or buf.dtype != np.dtype(dtype):
            rows = max(shape[0] if shape else 1, self._scratch_rows)
            row_shape = tuple(shape[1:]) if shape else ()
            buf = DeviceBuffer(self.cuda, dtype, rows * int(np.prod(row_shape, dtype=np.int64)), row_shape)
            self._scratch[(graph, name)] = buf
        return View(buf, 0, tuple(shape))

    def describe(self) -> dict:
        return {"name": self.name, "gpu": getattr(self, "gpu", None), **self._versions()}

    def _versions(self) -> dict:
        return {}

    def _bind(self, graph: str, name: str, view: View, output: bool, pending: list) -> int:
        """Device address to bind for `view`: in place when 256-byte aligned, else a scratch buffer
        (inputs are copied in now; outputs are queued in `pending` for :meth:`_finish`)."""
        if view.size == 0:
            return view.buffer.ptr  # an empty tensor: any valid aligned address
        if is_aligned(view):
            self.stats["direct"] += 1
            return view.buffer.address(view)
        self.stats["scratch"] += 1
        scratch = self._scratch_view(graph, name, view)
        if output:
            pending.append((view, scratch))
        else:
            self.copy(scratch, view)
        return scratch.buffer.ptr

    def _finish(self, pending: list) -> None:
        for dst, scratch in pending:
            self.copy(dst, scratch)

    def close(self) -> None:
        """Free every device buffer and the stream (the session is unusable afterwards)."""
        try:
            self.cuda.stream_synchronize(self.stream)
        finally:
            for buf in [*self._buffers, *self._scratch.values()]:
                self.cuda.free(buf.ptr)
            self._buffers, self._scratch = [], {}
            self.cuda.destroy_stream(self.stream)


# ---- TensorRT ------------------------------------------------------------------------------------
class TrtBackend(CudaMemoryBackend):
    """Runs `target.plan` and `draft.plan` (built by `dflash_export.trt.engine`) with TensorRT.

    Args:
        artifact_dir: the artifact directory.
        manifest: its manifest; must have a "trt" section.
        trt, cuda, gpu: the tensorrt module, the CUDA wrapper and the GPU description; default to
            the real ones (tests pass doubles: tests/test_trt_backend_double.py).

    Raises:
        DFlashError: no engines, TensorRT/GPU missing, engines from another TensorRT version or
            GPU, an engine that does not deserialize, or engine IO that does not match the manifest.
    """

    name = "trt"
    # the greedy form (0 uniforms: reductions over empty tensors) has not run on TensorRT yet, and
    # onnxruntime 1.23 gets it wrong: bind 1 + N uniforms (the sampling branch runs, results are equal)
    # until scripts/gpu_check.sh has run on a device
    greedy_without_uniforms = False

    def __init__(self, artifact_dir: Path, manifest: dict, trt=None, cuda=None, gpu: dict | None = None,
                 graphs: tuple[str, ...] = ("target", "draft")):
        artifact_dir = Path(artifact_dir)
        section = manifest.get("trt")
        if not section:
            raise DFlashError(
                f"{artifact_dir} has no TensorRT engines; build them on the device: "
                f"`python -m dflash_export engine {artifact_dir}` (or `build ... --engine trt`)"
            )
        trt = trt or import_tensorrt()
        if gpu is None:
            gpu, why = gpu_info()
            if gpu is None:
                raise DFlashError(f"the TensorRT backend needs an NVIDIA GPU: {why}")
        check_engine_compat(section, str(trt.__version__), gpu, artifact_dir)
        super().__init__(cuda or load_cuda(), scratch_rows=max_block(manifest))
        self.trt, self.gpu = trt, gpu
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engines, self.contexts, self.profiles, self.active, self.io_dtypes = {}, {}, {}, {}, {}
        self.output_names: dict[str, list[str]] = {}
        self._checked: set = set()
        expected = {g: {t["name"]: t["dtype"] for t in [*manifest["io"][g]["inputs"], *manifest["io"][g]["outputs"]]}
                    for g in graphs}
        for graph in graphs:
            if graph not in section["plans"]:
                raise DFlashError(f"{artifact_dir} has no TensorRT engine of its {graph} graph; "
                                  f"{REBUILD_HINT.format(dir=artifact_dir)}")
            path = artifact_dir / section["plans"][graph]
            if not path.is_file():
                raise DFlashError(f"{path} is missing; {REBUILD_HINT.format(dir=artifact_dir)}")
            engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
            if engine is None:
                raise DFlashError(f"TensorRT could not load {path} (see its log above); {REBUILD_HINT.format(dir=artifact_dir)}")
            ctx = engine.create_execution_context()
            if ctx is None:
                raise DFlashError(f"TensorRT could not create an execution context for {path.name} (out of GPU memory?)")
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            self.output_names[graph] = [n for n in names if n not in inputs]
            dtypes = {n: np.dtype(trt.nptype(engine.get_tensor_dtype(n))) for n in names}
            bad = {n: (str(dtypes[n]), want) for n, want in expected[graph].items() if n not in dtypes or dtypes[n] != np.dtype(want)}
            if bad:
                raise DFlashError(f"{path.name}: engine IO {bad} (engine, manifest) does not match the artifact; "
                                  f"{REBUILD_HINT.format(dir=artifact_dir)}")
            names_by_index = [p["name"] for p in section.get("profiles", {}).get(graph, [])]
            self.profiles[graph] = [
                Profile(
                    names_by_index[p] if p < len(names_by_index) else f"profile{p}",
                    {},
                    {n: tuple(tuple(int(x) for x in s) for s in engine.get_tensor_profile_shape(n, p)) for n in inputs},
                )
                for p in range(engine.num_optimization_profiles)
            ]
            self.engines[graph], self.contexts[graph], self.io_dtypes[graph] = engine, ctx, dtypes
            self.active[graph] = 0  # a new context starts on profile 0

    def max_call_rows(self, graph: str) -> int | None:
        return call_row_limit(self.profiles[graph], graph)

    def run(self, graph: str, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        ctx = self.contexts[graph]
        shapes = {n: v.shape for n, v in inputs.items()}
        prof = select_profile(self.profiles[graph], shapes, graph)
        if prof != self.active[graph]:
            if not ctx.set_optimization_profile_async(prof, self.stream):
                raise DFlashError(f"TensorRT refused optimization profile {prof} of the {graph} engine")
            self.active[graph] = prof
        pending: list = []
        for name, v in inputs.items():
            if not ctx.set_input_shape(name, v.shape):
                raise DFlashError(f"TensorRT refused shape {list(v.shape)} for {graph} input {name}")
            ctx.set_tensor_address(name, self._bind(graph, name, v, False, pending))
        for name, v in outputs.items():
            ctx.set_tensor_address(name, self._bind(graph, name, v, True, pending))
        for name in (n for n in self.output_names[graph] if n not in outputs):  # TensorRT writes every output somewhere
            shape = tuple(int(x) for x in ctx.get_tensor_shape(name))
            ctx.set_tensor_address(name, self._scratch_for(graph, name, self.io_dtypes[graph][name], shape).buffer.ptr)
        key = (graph, tuple(shapes.items()), tuple((n, v.shape) for n, v in outputs.items()))
        if key not in self._checked:  # once per distinct call shape: dtypes match, outputs fit their views
            self._check_io(graph, ctx, inputs, outputs)
            self._checked.add(key)
        if not ctx.execute_async_v3(self.stream):
            raise DFlashError(f"TensorRT failed to run the {graph} engine (see its log above)")
        self._finish(pending)

    def _versions(self) -> dict:
        return {"tensorrt": str(self.trt.__version__)}

    def _check_io(self, graph: str, ctx, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        """The bound buffers' dtypes are the engine's (e.g. a hybrid's fp32 recurrent state in an fp16
        engine), and each output view has exactly the shape the engine will write."""
        for name, v in inputs.items():
            want = self.io_dtypes[graph].get(name)  # (an unknown name has no profile: select_profile refused it)
            if want is not None and want != v.buffer.dtype:
                raise DFlashError(f"{graph} input {name}: the engine takes {want}, the runtime bound {v.buffer.dtype}")
        for name, v in outputs.items():
            shape = tuple(int(x) for x in ctx.get_tensor_shape(name))
            if shape != tuple(v.shape) or self.io_dtypes[graph][name] != v.buffer.dtype:
                raise DFlashError(
                    f"{graph} output {name}: the engine produces {list(shape)} {self.io_dtypes[graph][name]}, the runtime "
                    f"bound {list(v.shape)} {v.buffer.dtype}"
                )
