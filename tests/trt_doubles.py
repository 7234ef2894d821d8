"""Test doubles of TensorRT and CUDA for the TensorRT backend's and engine builder's own code.

THESE ARE NOT TENSORRT. `FakeTensorRT` implements only the few TensorRT Python calls that
dflash_export/trt/engine.py and runtime/backends/trt.py make, and "executes" an engine with
onnxruntime on the ONNX graph it was built from; `FakeCuda` stands in for Polygraphy's libcudart
wrapper with host memory. Like TensorRT, the doubles refuse input shapes outside the active profile, a
profile that lacks a dynamic input or contradicts a static dim of the ONNX graph, and addresses not
aligned to 256 bytes. The `doubles` fixture routes runtime.backends.trt's look-ups to them. Used by
test_trt_backend_double.py (what they check), test_trt_hybrid_double.py, test_batching.py and others.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest

GPU = {"name": "Fake Orin (test double)", "compute_capability": "8.7"}
ALIGN = 256


# ---- the doubles ----------------------------------------------------------------------------------
class FakeCuda:
    """Polygraphy's `cuda.wrapper()` interface (malloc/free/memcpy/streams) on host memory."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.copies = {1: 0, 2: 0, 3: 0}
        self.copies_2d = 0
        self.handle = _FakeCudart(self)  # the libcudart functions the backend calls directly

    def malloc(self, nbytes):
        raw = np.zeros(nbytes + ALIGN, np.uint8)
        start = (-raw.ctypes.data) % ALIGN
        ptr = raw.ctypes.data + start
        self.blocks[ptr] = raw[start : start + nbytes]
        return ptr

    def free(self, ptr):
        del self.blocks[ptr]

    def is_device(self, ptr, nbytes=1):
        return any(base <= ptr and ptr + nbytes <= base + blk.nbytes for base, blk in self.blocks.items())

    def memcpy(self, dst, src, nbytes, kind, stream_ptr=None):
        k = kind.value
        assert k in (1, 2, 3), k
        assert self.is_device(dst, nbytes) == (k in (1, 3)), f"memcpy kind {k}: destination is on the wrong side"
        assert self.is_device(src, nbytes) == (k in (2, 3)), f"memcpy kind {k}: source is on the wrong side"
        ctypes.memmove(dst, src, nbytes)
        self.copies[k] += 1

    def create_stream(self):
        return 0xC0DE

    def stream_synchronize(self, ptr):
        assert ptr == 0xC0DE

    def destroy_stream(self, ptr):
        pass


class _FakeCudart:
    """`wrapper().handle`: libcudart's cudaMemcpy2DAsync (and cudaGetDeviceCount) on host memory."""

    def __init__(self, cuda: FakeCuda):
        self.cuda = cuda

    def cudaGetDeviceCount(self, *args):
        return 0

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        dst, src = dst.value, src.value
        dpitch, spitch, width, height = dpitch.value, spitch.value, width.value, height.value
        assert kind.value == 3 and stream.value == 0xC0DE and width <= min(dpitch, spitch)
        for i in range(height):  # each destination and source row must lie in a device allocation
            assert self.cuda.is_device(dst + i * dpitch, width) and self.cuda.is_device(src + i * spitch, width)
            ctypes.memmove(dst + i * dpitch, src + i * spitch, width)
        self.cuda.copies_2d += 1
        return 0


class _Enum:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeTensorRT:
    """The TensorRT module as far as engine.py and trt_backend.py use it. Engines run on onnxruntime."""

    float32, float16, bfloat16 = np.dtype("float32"), np.dtype("float16"), "bfloat16"
    NetworkDefinitionCreationFlag = _Enum(STRONGLY_TYPED=5)
    BuilderFlag = _Enum(FP16="FP16", BF16="BF16", TF32="TF32", OBEY_PRECISION_CONSTRAINTS="OBEY_PRECISION_CONSTRAINTS")
    MemoryPoolType = _Enum(WORKSPACE="WORKSPACE")
    TensorIOMode = _Enum(INPUT="INPUT", OUTPUT="OUTPUT")

    def __init__(self, version="10.3.0.30", fail_graph=None):
        self.__version__ = version
        self.fail_graph = fail_graph
        self.built: list[dict] = []
        self.contexts: list[FakeContext] = []
        fake = self

        class Logger:
            WARNING = 2

            def __init__(self, severity):
                pass

        class Builder:
            def __init__(self, logger):
                pass

            def create_builder_config(self):
                return FakeConfig()

            def create_network(self, flags):
                return FakeNetwork(flags)

            def create_optimization_profile(self):
                return FakeProfile()

            def build_serialized_network(self, network, config):
                if fake.fail_graph and network.onnx.endswith(fake.fail_graph):
                    return None
                for i, prof in enumerate(config.profiles):  # what TensorRT refuses in a profile
                    for name, dims in network.inputs.items():
                        dynamic = any(not isinstance(d, int) for d in dims)
                        assert name in prof.shapes or not dynamic, f"profile {i}: no shape for dynamic input {name}"
                        if name not in prof.shapes:
                            continue
                        for which in prof.shapes[name]:
                            assert len(which) == len(dims), f"profile {i}: {name} rank {len(which)} != {len(dims)}"
                            assert all(not isinstance(d, int) or d == x for d, x in zip(dims, which)), \
                                f"profile {i}: {name} {which} contradicts its static dims {dims}"
                    assert set(prof.shapes) <= set(network.inputs), f"profile {i}: unknown inputs"
                rec = {"onnx": network.onnx, "flags": sorted(config.flags), "strongly_typed": bool(network.flags & 32),
                       "profiles": [p.shapes for p in config.profiles],
                       "pinned": [l.outputs[0].name for l in network.layers if l.precision is not None]}
                fake.built.append(rec)
                return json.dumps(rec).encode()

        class OnnxParser:
            def __init__(self, network, logger):
                self.network = network
                self.num_errors = 0

            def parse_from_file(self, path):
                import onnx

                self.network.onnx = path
                model = onnx.load(path, load_external_data=False)
                self.network.layers = [FakeLayer(n.output) for n in model.graph.node]
                self.network.inputs = {  # static dims as ints, symbolic ones by name
                    i.name: [d.dim_value if d.HasField("dim_value") else d.dim_param
                             for d in i.type.tensor_type.shape.dim]
                    for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}
                }
                return True

            def get_error(self, i):
                return "none"

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, blob):
                return FakeEngine(fake, json.loads(bytes(blob)))

        self.Logger, self.Builder, self.OnnxParser, self.Runtime = Logger, Builder, OnnxParser, Runtime

    @staticmethod
    def nptype(dtype):
        return dtype


class FakeTensor:
    def __init__(self, name):
        self.name, self.dtype = name, np.dtype("float32")


class FakeLayer:
    def __init__(self, outputs):
        self.outputs = [FakeTensor(o) for o in outputs if o]
        self.num_outputs = len(self.outputs)
        self.precision = None
        self.output_types = {}

    def get_output(self, j):
        return self.outputs[j]

    def set_output_type(self, j, dtype):
        self.output_types[j] = dtype


class FakeNetwork:
    def __init__(self, flags):
        self.flags, self.onnx, self.layers, self.inputs = flags, None, [], {}

    @property
    def num_layers(self):
        return len(self.layers)

    def get_layer(self, i):
        return self.layers[i]


class FakeCache:
    def serialize(self):
        return b"fake timing cache"


class FakeConfig:
    def __init__(self):
        self.flags, self.profiles = set(), []

    def create_timing_cache(self, blob):
        return FakeCache()

    def set_timing_cache(self, cache, ignore_mismatch):
        return True

    def set_flag(self, flag):
        self.flags.add(flag)

    def clear_flag(self, flag):
        self.flags.discard(flag)

    def set_memory_pool_limit(self, pool, size):
        pass

    def add_optimization_profile(self, profile):
        self.profiles.append(profile)
        return len(self.profiles) - 1


class FakeProfile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, lo, opt, hi):
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), (name, lo, opt, hi)
        self.shapes[name] = [list(lo), list(opt), list(hi)]


_ORT_TYPES = {"tensor(float)": np.dtype("float32"), "tensor(float16)": np.dtype("float16"), "tensor(int64)": np.dtype("int64")}


class FakeEngine:
    def __init__(self, fake, rec):
        import onnxruntime as ort

        self.fake, self.rec = fake, rec
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(rec["onnx"], opts, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: _ORT_TYPES[i.type] for i in self.session.get_inputs()}
        self.outputs = {o.name: _ORT_TYPES[o.type] for o in self.session.get_outputs()}
        self.names = [*self.inputs, *self.outputs]
        self.num_io_tensors = len(self.names)
        self.num_optimization_profiles = len(rec["profiles"])

    def get_tensor_name(self, i):
        return self.names[i]

    def get_tensor_mode(self, name):
        return FakeTensorRT.TensorIOMode.INPUT if name in self.inputs else FakeTensorRT.TensorIOMode.OUTPUT

    def get_tensor_dtype(self, name):
        return self.inputs.get(name, self.outputs.get(name))

    def get_tensor_profile_shape(self, name, p):
        return [tuple(s) for s in self.rec["profiles"][p][name]]

    def create_execution_context(self):
        ctx = FakeContext(self)
        self.fake.contexts.append(ctx)
        return ctx


class FakeContext:
    """Refuses what TensorRT refuses: shapes outside the active profile, misaligned or host addresses."""

    cuda: FakeCuda = None  # set by the fixture

    def __init__(self, engine):
        self.engine, self.profile = engine, 0
        self.shapes, self.addresses = {}, {}
        self.switches = self.runs = 0
        self.history: list[tuple[int, dict]] = []  # (profile, input shapes) of every execute

    def set_optimization_profile_async(self, p, stream):
        assert stream == 0xC0DE
        self.profile, self.shapes = p, {}
        self.switches += 1
        return True

    def set_input_shape(self, name, shape):
        lo, _, hi = self.engine.get_tensor_profile_shape(name, self.profile)
        if len(shape) != len(lo) or not all(a <= s <= b for a, s, b in zip(lo, shape, hi)):
            return False
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name, ptr):
        assert ptr % ALIGN == 0, f"{name}: address {ptr:#x} is not {ALIGN}-byte aligned (TensorRT would refuse it)"
        assert self.cuda.is_device(ptr), f"{name}: {ptr:#x} is not a device address"
        self.addresses[name] = ptr
        return True

    def get_tensor_shape(self, name):
        return self._output_shapes()[name]

    def _output_shapes(self):
        from runtime.backends.profiles import output_shapes

        return output_shapes(self._manifest(), self._graph(), {n: self.shapes[n] for n in self.engine.inputs})

    def _graph(self):
        return Path(self.engine.rec["onnx"]).stem  # target, draft or target_batched

    def _manifest(self):
        if not hasattr(self, "_m"):
            self._m = json.loads((Path(self.engine.rec["onnx"]).parent / "manifest.json").read_text())
        return self._m

    def execute_async_v3(self, stream):
        assert stream == 0xC0DE
        assert set(self.shapes) == set(self.engine.inputs), "an input shape was not set for this profile"
        out_shapes = self._output_shapes()
        binding = self.engine.session.io_binding()
        for name, dtype in self.engine.inputs.items():
            binding.bind_input(name, "cpu", 0, dtype, list(self.shapes[name]), self.addresses[name])
        for name, dtype in self.engine.outputs.items():
            binding.bind_output(name, "cpu", 0, dtype, list(out_shapes[name]), self.addresses[name])
        self.engine.session.run_with_iobinding(binding)
        self.runs += 1
        self.history.append((self.profile, dict(self.shapes)))
        return True


@pytest.fixture
def doubles(monkeypatch):
    """Route runtime.backends.trt's TensorRT/CUDA/GPU look-ups to the doubles."""
    import runtime.backends.trt as tb

    cuda = FakeCuda()
    FakeContext.cuda = cuda
    state = {"trt": FakeTensorRT("10.3.0.30"), "gpu": dict(GPU)}
    monkeypatch.setattr(tb, "import_tensorrt", lambda: state["trt"])
    monkeypatch.setattr(tb, "load_cuda", lambda: cuda)
    monkeypatch.setattr(tb, "gpu_info", lambda: (state["gpu"], ""))
    state["cuda"] = cuda
    return state
