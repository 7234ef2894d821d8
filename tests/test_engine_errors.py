"""Clear, immediate errors when TensorRT or a GPU is missing, and the engine precision rules.

Runs on any machine: TensorRT and the GPU probe are replaced by monkeypatching where the real
machine could have them, so the messages are checked whatever is installed.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from runtime.errors import DFlashError

ROOT = Path(__file__).resolve().parents[1]


def _no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def _no_gpu(monkeypatch):
    import runtime.backends.trt as tb

    monkeypatch.setattr(tb, "gpu_info", lambda: (None, "no NVIDIA driver (libcuda.so.1 not found)"))
    import dflash_export.trt.engine as eng

    monkeypatch.setattr(eng, "gpu_info", tb.gpu_info)


def _minimal_artifact(path: Path, trt_section: dict | None = None) -> Path:
    """A manifest that passes runtime.manifest validation (graph files are empty placeholders)."""
    from runtime.manifest import MANIFEST_FORMAT, MANIFEST_VERSION

    path.mkdir(parents=True, exist_ok=True)
    (path / "target.onnx").write_bytes(b"")
    (path / "draft.onnx").write_bytes(b"")
    manifest = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "dtype": "fp32", "max_seq_len": 64,
        "target": {"graph": "target.onnx", "num_layers": 1, "hidden_size": 8, "num_kv_heads": 1, "head_dim": 8, "vocab_size": 16},
        "draft": {"graph": "draft.onnx", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "block_size": 4,
                  "mask_token_id": 15, "target_layer_ids": [0]},
        "mask_embedding": "mask_embedding.npy",
    }
    if trt_section is not None:
        manifest["trt"] = trt_section
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_require_tensorrt_names_both_missing_pieces(monkeypatch):
    from dflash_export.trt.engine import require_tensorrt

    _no_tensorrt(monkeypatch)
    _no_gpu(monkeypatch)
    with pytest.raises(DFlashError) as err:
        require_tensorrt()
    msg = str(err.value)
    assert "TensorRT Python package is not installed" in msg and "NVIDIA GPU" in msg and "libcuda" in msg
    assert "docs/jetson.md" in msg  # says what to do instead


def test_require_tensorrt_placeholder_package(monkeypatch):
    from dflash_export.trt.engine import require_tensorrt

    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))  # PyPI's placeholder has no Builder
    _no_gpu(monkeypatch)
    with pytest.raises(DFlashError, match="placeholder"):
        require_tensorrt()


def test_require_tensorrt_gpu_only_missing(monkeypatch):
    import dflash_export.trt.engine as eng

    fake = types.SimpleNamespace(__version__="10.3.0.30")
    monkeypatch.setattr(eng, "import_tensorrt", lambda: fake)
    _no_gpu(monkeypatch)
    with pytest.raises(DFlashError) as err:
        eng.require_tensorrt()
    assert "NVIDIA GPU" in str(err.value) and "not installed" not in str(err.value)
    monkeypatch.setattr(eng, "gpu_info", lambda: ({"name": "X", "compute_capability": "8.7"}, ""))
    assert eng.require_tensorrt() == (fake, {"name": "X", "compute_capability": "8.7"})
    with pytest.raises(DFlashError, match="TensorRT 11"):  # refused before any export when asked
        monkeypatch.setattr(fake, "__version__", "11.1.0")
        eng.require_tensorrt(precision="fp16", dtype="fp32")


def test_build_engine_trt_fails_before_exporting(monkeypatch, tmp_path, capsys):
    import dflash_export.build as build_mod
    from dflash_export.cli import main

    _no_tensorrt(monkeypatch)
    _no_gpu(monkeypatch)
    monkeypatch.setattr(build_mod, "build", lambda *a, **k: pytest.fail("export ran although TensorRT is missing"))
    out = tmp_path / "art"
    assert main(["build", "--engine", "trt", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "TensorRT" in err and "GPU" in err
    assert "Export here without --engine trt" in err and "`python -m dflash_export engine DIR` there" in err
    assert not out.exists()


def test_real_machine_without_tensorrt_fails_fast(tmp_path):
    """On this machine as it is (no monkeypatching): `build --engine trt` stops in seconds."""
    import subprocess
    import time

    try:
        import tensorrt  # noqa: F401

        if hasattr(tensorrt, "Builder"):
            pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dflash_export", "build", "--engine", "trt", "--out", str(tmp_path / "a")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "TensorRT" in proc.stderr and "error:" in proc.stderr
    assert time.perf_counter() - t0 < 60 and not (tmp_path / "a").exists()


def test_precision_plan_table():
    from dflash_export.trt.engine import precision_plan

    assert precision_plan("10.3.0.30", "fp16", "fp16") == {"strongly_typed": True, "flag": None, "pin_fp32": False, "tf32": False}
    assert precision_plan("11.0.0", "fp16", "fp16")["strongly_typed"]
    weak = precision_plan("10.3.0.30", "fp32", "fp16")
    assert weak["flag"] == "FP16" and weak["pin_fp32"] and not weak["strongly_typed"]
    assert precision_plan("10.13.3", "fp32", "bf16")["flag"] == "BF16"
    assert precision_plan("10.3.0", "fp32", "fp32")["flag"] is None
    assert precision_plan("11.2.0", "fp32", "fp32")["strongly_typed"]
    for args, pattern in [
        (("11.0.0", "fp32", "fp16"), r"strongly typed networks only.*--dtype fp16"),
        (("11.0.0", "fp32", "bf16"), "bf16 graphs are not exported"),
        (("10.3.0", "fp16", "fp32"), "--dtype fp32"),
        (("8.6.1", "fp32", "fp32"), "TensorRT 10 or newer"),
        (("10.3.0", "fp32", "int8"), "--precision must be one of"),
    ]:
        with pytest.raises(DFlashError, match=pattern):
            precision_plan(*args)


def test_fp32_onnx_values_finds_fc_and_norms(tmp_path):
    import onnx
    from onnx import helper

    def node(op, out, scopes, hierarchy):
        n = helper.make_node(op, ["x"], [out], name=f"node_{out}")
        for k, v in (("pkg.torch.onnx.name_scopes", repr(scopes)), ("pkg.torch.onnx.class_hierarchy", repr(hierarchy))):
            n.metadata_props.add(key=k, value=v)
        return n

    nodes = [
        node("Gemm", "linear", ["", "fc", "linear"], ["DFlashDraft", "torch.nn.modules.linear.Linear"]),
        node("Pow", "pow_1", ["", "hidden_norm", "pow_1"], ["DFlashDraft", "dflash_export.nn.layers.RMSNorm"]),
        node("Gemm", "linear_1", ["", "layers.0.self_attn.q_proj", "linear_1"], ["DFlashDraft", "torch.nn.modules.linear.Linear"]),
    ]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("linear_1", onnx.TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), tmp_path / "m.onnx")
    from dflash_export.trt.engine import fp32_onnx_values

    assert fp32_onnx_values(tmp_path / "m.onnx") == {"linear", "pow_1"}


def test_trt_backend_errors_without_engines_or_tensorrt(monkeypatch, tmp_path):
    import runtime

    with pytest.raises(DFlashError, match=r"no TensorRT engines.*python -m dflash_export engine"):
        runtime.load(_minimal_artifact(tmp_path / "plain"), backend="trt")
    _no_tensorrt(monkeypatch)
    built = {"tensorrt_version": "10.3.0.30", "gpu": {"name": "Orin", "compute_capability": "8.7"},
             "plans": {"target": "target.plan", "draft": "draft.plan"}}
    with pytest.raises(DFlashError, match="TensorRT Python package is not installed"):
        runtime.load(_minimal_artifact(tmp_path / "engines", built), backend="trt")


def test_trt_backend_without_gpu(monkeypatch, tmp_path):
    import runtime
    import runtime.backends.trt as tb

    monkeypatch.setattr(tb, "import_tensorrt", lambda: types.SimpleNamespace(__version__="10.3.0.30"))
    _no_gpu(monkeypatch)
    built = {"tensorrt_version": "10.3.0.30", "gpu": {"name": "Orin", "compute_capability": "8.7"},
             "plans": {"target": "target.plan", "draft": "draft.plan"}}
    with pytest.raises(DFlashError, match="needs an NVIDIA GPU: no NVIDIA driver"):
        runtime.load(_minimal_artifact(tmp_path / "a", built), backend="trt")


def test_ort_cuda_without_cuda_provider(tmp_path):
    import onnxruntime

    import runtime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(DFlashError, match="no CUDA execution provider.*onnxruntime-gpu"):
        runtime.load(_minimal_artifact(tmp_path / "a"), backend="ort-cuda")


def test_unknown_backend_lists_the_choices(tmp_path):
    import runtime

    with pytest.raises(DFlashError, match="available: ort, ort-cuda, trt"):
        runtime.load(_minimal_artifact(tmp_path / "a"), backend="tensorrt")


def test_gpu_probe_never_raises():
    from runtime.backends.trt import gpu_info

    info, why = gpu_info()
    assert (info is None and why) or (set(info) == {"name", "compute_capability"} and not why)


def test_runtime_import_stays_free_of_tensorrt_and_torch():
    import subprocess

    code = ("import sys, runtime, runtime.backends.trt, runtime.backends.ort_cuda, runtime.backends.profiles; "
            "bad = [m for m in ('torch', 'tensorrt', 'polygraphy', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_engine_command_without_tensorrt(monkeypatch, tmp_path, capsys):
    from dflash_export.trt.engine import main

    _no_tensorrt(monkeypatch)
    _no_gpu(monkeypatch)
    art = _minimal_artifact(tmp_path / "a")
    before = (art / "manifest.json").read_bytes()
    assert main([str(art), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: building TensorRT engines needs TensorRT and an NVIDIA GPU")
    # the advice fits the command: run `engine` on the device (not build's "export here without --engine trt")
    assert "Run this command on the device that will run the engines" in err and "without --engine trt" not in err
    assert (art / "manifest.json").read_bytes() == before and not (art / "target.plan").exists()
