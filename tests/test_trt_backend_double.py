"""The TensorRT backend's and engine builder's OWN code, run against a TEST DOUBLE of TensorRT and CUDA.

THIS IS NOT TENSORRT VERIFICATION. `FakeTensorRT` implements only the few TensorRT Python calls
that dflash_export/engine.py and runtime/trt_backend.py make (both are written against TensorRT's
documented Python API, 10.3 through 11.x, and have run only through this double here), and
"executes" an engine with onnxruntime on the ONNX graph it was built from; `FakeCuda` stands in for Polygraphy's libcudart
wrapper with host memory. What this does check: profile derivation and selection (the double
refuses input shapes outside the active profile, as TensorRT does, and a profile that lacks a
dynamic input or contradicts a static dim of the ONNX graph), 256-byte address alignment
(the double refuses misaligned addresses, as TensorRT does) and the scratch-and-copy path, that
only device pointers are bound and copies go in the declared direction, the manifest's "trt"
section and its atomic update, the precision plan, and the version/GPU refusal. Real engines are
checked by scripts/gpu_check.sh on a machine with a GPU and TensorRT. Hybrid (Qwen3.5) artifacts
through the same double: tests/test_trt_hybrid_double.py.
"""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_profiles import tiny_artifact

GPU = {"name": "Fake Orin (test double)", "compute_capability": "8.7"}
ALIGN = 256


# ---- the doubles ----------------------------------------------------------------------------------
class FakeCuda:
    """Polygraphy's `cuda.wrapper()` interface (malloc/free/memcpy/streams) on host memory."""

    def __init__(self):
        self.blocks: dict[int, np.ndarray] = {}
        self.copies = {1: 0, 2: 0, 3: 0}

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


# ---- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A copy of the tiny fp32 artifact with fake "engines" built by dflash_export.trt.engine.build_engines."""
    from dflash_export.trt.engine import build_engines

    src = tiny_artifact(tmp_path_factory)
    out = tmp_path_factory.mktemp("trt_double") / "artifact"
    shutil.copytree(src, out)
    fake = FakeTensorRT("10.3.0.30")
    manifest = build_engines(out, precision="fp32", trt=fake, gpu=GPU, quiet=True)
    return out, manifest, fake


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


# ---- tests --------------------------------------------------------------------------------------------
def test_build_engines_records_profiles_and_device(engines):
    from runtime.backends.profiles import profiles_to_json, shape_ranges
    from runtime.manifest import load_manifest

    out, manifest, fake = engines
    assert load_manifest(out) == manifest  # written, atomically, and still a valid manifest
    t = manifest["trt"]
    assert t["tensorrt_version"] == "10.3.0.30" and t["gpu"] == GPU and t["precision"] == "fp32"
    assert t["profiles"] == profiles_to_json(shape_ranges(manifest))
    assert [p["name"] for p in t["profiles"]["target"]] == ["prefill", "verify", "extend"]
    assert (out / "target.plan").is_file() and (out / "draft.plan").is_file() and (out / "timing.cache").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary files left
    rec = {Path(r["onnx"]).name: r for r in fake.built}
    assert rec["target.onnx"]["profiles"][0]["past_key_0"] == [[0, 2, 24]] * 3  # prefill: empty past
    assert "TF32" not in rec["target.onnx"]["flags"] and not rec["target.onnx"]["strongly_typed"]


def test_generate_matches_onnxruntime_through_the_double(engines, doubles):
    import runtime

    out, _, _ = engines
    ort_sess = runtime.load(out)
    trt_sess = runtime.load(out, backend="trt")
    assert type(trt_sess.backend).__name__ == "TrtBackend"
    prompt = [5, 17, 33, 8, 61]
    for kw in (dict(max_new_tokens=30), dict(max_new_tokens=10, block_size=1), dict(max_new_tokens=25, temperature=0.9, seed=4),
               dict(max_new_tokens=40, block_size=16)):
        verify = None if kw.get("block_size") == 1 else "all"  # auto's choices depend on each backend's timings
        a = ort_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len=verify, **kw)
        b = trt_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len=verify, **kw)
        assert b.output_ids == a.output_ids and b.acceptance_lengths == a.acceptance_lengths and b.steps == a.steps, kw
    for kw in (dict(max_new_tokens=30), dict(max_new_tokens=25, temperature=0.9, seed=4)):  # verify trees
        a = ort_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len="2+3", **kw)
        b = trt_sess.generate(prompt, stop_token_ids=[], record_steps=True, verify_len="2+3", **kw)
        assert b.output_ids == a.output_ids and b.steps == a.steps, kw
        assert max(len(s["proposed"]) for s in b.steps) == 5  # tree steps ran (2 + 3 nodes)
    # KV reuse: the new rows of a prompt extending the cached one go through the "extend" profile
    longer = prompt + a.output_ids[:5] + [9, 10, 11]
    a2 = ort_sess.generate(longer, stop_token_ids=[], max_new_tokens=12, verify_len="all", reuse_prefix=False)
    b2 = trt_sess.generate(longer, stop_token_ids=[], max_new_tokens=12, verify_len="all")
    assert b2.reused_tokens == len(prompt) + 5 and b2.output_ids == a2.output_ids
    # the default policy measures the double's step costs and still gives the target's output
    auto = trt_sess.generate(prompt, stop_token_ids=[], max_new_tokens=30)
    assert auto.policy == "auto" and auto.output_ids == ort_sess.generate(prompt, stop_token_ids=[], max_new_tokens=30, block_size=1).output_ids
    stats = trt_sess.backend.stats
    assert stats["direct"] > 0 and stats["scratch"] > 0  # both binding paths ran (192-byte K/V rows)
    cuda = doubles["cuda"]
    assert cuda.copies[3] > 0 and cuda.copies[2] > 0  # device->device (scratch, anchor) and device->host (ids)
    ctx = {c._graph(): c for c in doubles["trt"].contexts}
    assert ctx["target"].switches >= 2 and ctx["draft"].switches >= 2  # prefill <-> verify, first draft <-> step
    trt_sess.backend.close()
    assert not cuda.blocks  # every device buffer freed


def test_reads_move_only_token_ids_to_the_host(engines, doubles):
    import runtime

    out, _, _ = engines
    sess = runtime.load(out, backend="trt")
    reads = []
    inner = sess.backend.read
    sess.backend.read = lambda view: reads.append(view.buffer.dtype) or inner(view)
    sess.generate([5, 17, 33], max_new_tokens=20, stop_token_ids=[])
    assert reads and set(reads) == {np.dtype(np.int64)}


def test_engines_from_another_tensorrt_or_gpu_are_refused(engines, doubles):
    import runtime
    from runtime.errors import DFlashError

    out, _, _ = engines
    doubles["trt"] = FakeTensorRT("10.13.3.9")
    with pytest.raises(DFlashError, match=r"TensorRT 10\.3\.0\.30 .*this machine has TensorRT 10\.13\.3\.9.*rebuild them on this device"):
        runtime.load(out, backend="trt")
    doubles["trt"] = FakeTensorRT("10.3.0.30")
    doubles["gpu"] = {"name": "NVIDIA Thor", "compute_capability": "11.0"}
    with pytest.raises(DFlashError, match=r"this GPU is NVIDIA Thor .*rebuild them on this device"):
        runtime.load(out, backend="trt")


def test_artifact_without_engines_is_refused(tmp_path_factory, doubles):
    import runtime
    from runtime.errors import DFlashError

    with pytest.raises(DFlashError, match=r"no TensorRT engines.*dflash_export engine"):
        runtime.load(tiny_artifact(tmp_path_factory), backend="trt")


def test_weakly_typed_fp16_pins_fc_and_norms(tmp_path, tmp_path_factory):
    from dflash_export.trt.engine import build_engines

    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact(tmp_path_factory), out)
    fake = FakeTensorRT("10.3.0.30")
    manifest = build_engines(out, precision="fp16", trt=fake, gpu=GPU, quiet=True)
    rec = {Path(r["onnx"]).name: r for r in fake.built}
    assert set(rec["draft.onnx"]["flags"]) == {"FP16", "OBEY_PRECISION_CONSTRAINTS"}
    assert manifest["trt"]["builder_flag"] == "FP16" and not manifest["trt"]["strongly_typed"]
    assert manifest["trt"]["build"]["draft"]["fp32_pinned_layers"] > 0
    assert any(name.startswith("linear") for name in rec["draft.onnx"]["pinned"])  # the draft's fc


def test_tensorrt11_refuses_fp32_graphs_for_fp16_and_failed_builds_change_nothing(tmp_path, tmp_path_factory):
    from dflash_export.trt.engine import build_engines
    from runtime.errors import DFlashError

    out = tmp_path / "artifact"
    shutil.copytree(tiny_artifact(tmp_path_factory), out)
    before = (out / "manifest.json").read_bytes()
    with pytest.raises(DFlashError, match=r"strongly typed networks only.*--dtype fp16"):
        build_engines(out, precision="fp16", trt=FakeTensorRT("11.0.0"), gpu=GPU, quiet=True)
    with pytest.raises(DFlashError, match="could not build draft.plan"):
        build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0", fail_graph="draft.onnx"), gpu=GPU, quiet=True)
    assert (out / "manifest.json").read_bytes() == before
    assert not (out / "target.plan").exists() and not [p for p in out.iterdir() if p.name.startswith(".")]
    m = build_engines(out, precision="fp32", trt=FakeTensorRT("11.0.0"), gpu=GPU, quiet=True)
    assert m["trt"]["strongly_typed"]


def test_check_runs_engines_through_the_backend(engines, doubles):
    """`check --backend trt` drives the TrtBackend (here: the double) like the loop does: K/V rows at
    row P = 13 (13 * 192 bytes is not 256-aligned, so through scratch)."""
    from dflash_export.check.parity import run_check

    out, _, _ = engines
    rep = run_check(out, backend="trt")
    assert rep.passed and rep.precision == "fp32" and len(rep.results) == 36


@pytest.mark.parametrize("proposing", [False, True], ids=["hidden-rows", "proposing-draft"])
def test_accepted_blocks_through_the_double(tmp_path_factory, doubles, proposing):
    """A pair that accepts whole blocks (the context-free pair) through the TensorRT path: the engines'
    verify profile, the scratch bindings and the one-read ids commit every accepted proposal; also
    where the draft ends in the proposal head (its [R, 4] outputs, the target's `proposal_ids`)."""
    import runtime_fixtures as rf

    import runtime
    from dflash_export.trt.engine import build_engines

    pair = rf.proposing_artifact("ctxfree", tmp_path_factory) if proposing else rf.artifact("ctxfree", tmp_path_factory)
    out = tmp_path_factory.mktemp("trt_double_blocks") / "artifact"
    shutil.copytree(pair.artifact, out)
    build_engines(out, precision="fp32", trt=FakeTensorRT("10.3.0.30"), gpu=GPU, quiet=True)
    m = pair.mask_id
    with runtime.load(out, backend="trt") as sess:
        assert sess.draft_proposes == proposing
        res = sess.generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len="all")
    assert res.output_ids == [m] * 14
    assert res.acceptance_lengths == rf.expected_acceptance(14, pair.block_size) and max(res.acceptance_lengths) == pair.block_size
    assert not doubles["cuda"].blocks  # closed: every device buffer freed
    if proposing:  # check through the engines: greedy cases get uniforms (TensorRT needs them), ids by rank margin
        from dflash_export.check.parity import run_check

        rep = run_check(out, backend="trt")
        assert rep.passed and {(r.case, r.output) for r in rep.results} >= {("draft_step", "draft_top_ids"),
                                                                            ("verify", "next_ids")}
