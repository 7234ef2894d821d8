"""JetPack 6 stand-in: the runtime on Python 3.10 with onnxruntime 1.23.2 and no torch.

JetPack 6 ships Python 3.10, and 1.23.2 is the newest onnxruntime wheel for it on aarch64. That
version crashes (SIGFPE) on these graphs at the default optimisation level, which this test caught;
the runtime picks a level that works. Runs where a Python 3.10 interpreter exists (pyenv here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import runtime_fixtures as rf
from shared_cache import shared_dir

pytestmark = pytest.mark.slow


def _python310() -> str | None:
    for cand in (shutil.which("python3.10"), os.path.expanduser("~/.pyenv/versions/3.10.13/bin/python")):
        if cand and Path(cand).exists():
            probe = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == "(3, 10)":
                return cand
    return None


@pytest.fixture(scope="module")
def py310_env(tmp_path_factory):
    py = _python310()
    if py is None:
        pytest.skip("no Python 3.10 interpreter on this machine")

    def make(root: Path) -> None:  # once per test run, shared by the xdist workers
        venv = root / "venv"
        subprocess.run([py, "-m", "venv", str(venv)], check=True)
        pip = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "numpy", "onnxruntime==1.23.2", "onnx", "tokenizers", "jinja2",
             "starlette>=0.40", "uvicorn>=0.30"],  # the runtime and its serve extra (+ onnx to read optimized graphs)
            capture_output=True, text=True, timeout=600,
        )
        if pip.returncode != 0:
            pytest.skip(f"cannot install the JetPack-6 runtime set from PyPI: {pip.stderr[-300:]}")

    return shared_dir(tmp_path_factory, "py310_venv", make) / "venv" / "bin" / "python"


def test_runtime_on_python310_onnxruntime_1_23(py310_env, tmp_path_factory):
    import runtime

    pair = rf.artifact("qwen3", tmp_path_factory)
    ctxfree = rf.artifact("ctxfree", tmp_path_factory)  # accepts whole blocks
    expected = runtime.load(pair.artifact).generate([5, 7, 9], max_new_tokens=12, stop_token_ids=[])
    script = (
        "import json, sys, runtime\n"
        "s = runtime.load(sys.argv[1])\n"
        "a = s.generate([5, 7, 9], max_new_tokens=12, stop_token_ids=[])\n"
        "b = s.generate([5, 7, 9], max_new_tokens=12, stop_token_ids=[], block_size=1)\n"
        "m = int(sys.argv[3])\n"
        "c = runtime.load(sys.argv[2]).generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len='all')\n"
        "import onnxruntime\n"
        "print(json.dumps({'spec': a.output_ids, 'plain': b.output_ids, 'torch': 'torch' in sys.modules,"
        " 'blocks': [c.output_ids, c.acceptance_lengths], 'ort': onnxruntime.__version__, 'py': sys.version_info[:2]}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.run([str(py310_env), "-c", script, str(pair.artifact), str(ctxfree.artifact), str(ctxfree.mask_id)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["py"] == [3, 10] and out["ort"] == "1.23.2" and out["torch"] is False
    assert out["spec"] == expected.output_ids
    assert out["plain"] == expected.output_ids
    # onnxruntime 1.23.2 commits accepted blocks (verify calls of 1 + N rows with the sampling branch bound)
    assert out["blocks"] == [[ctxfree.mask_id] * 14, rf.expected_acceptance(14, ctxfree.block_size)]
    assert max(out["blocks"][1]) == ctxfree.block_size


def test_server_on_python310_onnxruntime_1_23(py310_env, tmp_path_factory):
    """`python -m runtime serve` under Python 3.10 with onnxruntime 1.23.2 and no torch: a greedy
    completion (plain HTTP, no client library) equals the in-process reply; Ctrl-C ends it with 130."""
    import signal
    import urllib.request

    import runtime

    pair = rf.artifact("qwen3", tmp_path_factory)
    want = runtime.load(pair.artifact).generate("t5 t6 t7", max_new_tokens=8, stop_token_ids=[]).text
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.Popen([str(py310_env), "-m", "runtime", "serve", str(pair.artifact), "--port", "0",
                             "--model-name", "m"], stderr=subprocess.PIPE, text=True, env=env,
                            # Ctrl-C must reach it even when the tests run as a background job (SIGINT ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("serving"):
                break
        assert lines and lines[-1].startswith("serving"), "".join(lines[-20:])
        url = lines[-1].split(" on ")[1].split(" ")[0]
        body = json.dumps({"model": "m", "prompt": "t5 t6 t7", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            reply = json.loads(r.read())
        assert reply["choices"][0]["text"] == want and reply["usage"]["completion_tokens"] == 8
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 130


@pytest.mark.parametrize("dtype", ["fp32"])
def test_int4_weights_fuse_on_onnxruntime_1_23(py310_env, tmp_path_factory, dtype):
    """onnxruntime 1.23.2 (JetPack 6's newest wheel) turns every INT4 weight of both graphs into
    MatMulNBits, with the options the runtime loads them with (fp32 graphs, INT4 LM head). fp16
    graphs do not fuse on 1.23.2's CPU provider (they do on 1.32): docs/performance.md."""
    from dflash_export.build import BuildOptions, build

    pair = rf.artifact("qwen3", tmp_path_factory)
    out = tmp_path_factory.mktemp(f"int4_{dtype}") / "art"
    build(BuildOptions(str(pair.target_dir), str(pair.draft_dir), out, max_seq_len=64, dtype=dtype, quiet=True, quant="int4",
          quant_block=16, quant_lm_head=True))
    script = ("import json, sys, tempfile\nfrom int4_fusion import optimized_ops\n"
              "print(json.dumps({g: optimized_ops(sys.argv[1], g, tempfile.mkdtemp()) for g in ('target', 'draft')}))\n")
    root = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=f"{root.parent}{os.pathsep}{root}")
    proc = subprocess.run([str(py310_env), "-c", script, str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-1500:]}"
    ops = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [ops[g].get("DequantizeLinear", 0) for g in ("target", "draft")] == [0, 0], ops
    assert ops["target"]["MatMulNBits"] > 0 and ops["draft"]["MatMulNBits"] > 0
