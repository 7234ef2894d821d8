"""The runtime runs without torch and transformers (as on a Jetson with only onnxruntime)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
import runtime_fixtures as rf

BLOCKED = ("torch", "transformers", "safetensors.torch", "dflash_export")

# A meta-path finder installed before anything else refuses every blocked module, so any import of
# them (direct or from a dependency) raises ImportError, as on a machine without them.
CHILD = r"""
import importlib.abc, json, sys

BLOCKED = {blocked!r}
attempts = []

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            attempts.append(name)
            raise ImportError(f"{{name}} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
for b in BLOCKED:
    try:
        __import__(b)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{b}} is importable despite the blocker")
attempts.clear()

import runtime

sess = runtime.load(sys.argv[1])
out = {{}}
out["greedy"] = sess.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[]).output_ids
out["plain"] = sess.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[], block_size=1).output_ids
out["sampled"] = sess.generate([1, 40, 33], max_new_tokens=12, stop_token_ids=[], temperature=0.8, seed=7, verify_len="all").output_ids
# a pair that accepts whole blocks: the torch-free loop commits accepted proposals too
m = int(sys.argv[3])
blocks = runtime.load(sys.argv[2]).generate([5, 7, m], max_new_tokens=14, stop_token_ids=[], verify_len="all")
out["blocks"] = [blocks.output_ids, blocks.acceptance_lengths]
res = sess.generate("t5 t6 t7", max_new_tokens=6, stop_token_ids=[])
out["text"] = [res.output_ids, res.text]
# the one-shot command line, torch-free: `python -m runtime generate`
import contextlib, io
from runtime.__main__ import main as runtime_main
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    status = runtime_main(["generate", sys.argv[1], "--prompt-ids", "5,6,7", "--max-new-tokens", "6", "--json"])
out["cli"] = [status, json.loads(printed.getvalue())["output_ids"]]
out["loaded"] = sorted(m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in BLOCKED))
out["attempts"] = attempts
print(json.dumps(out))
"""


@pytest.fixture(scope="session")
def qwen(tmp_path_factory) -> rf.Pair:
    return rf.artifact("qwen3", tmp_path_factory)


def test_runtime_generates_without_torch_or_transformers(qwen, tmp_path, tmp_path_factory):
    ctxfree = rf.artifact("ctxfree", tmp_path_factory)
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(blocked=BLOCKED))
    proc = subprocess.run(
        [sys.executable, str(script), str(qwen.artifact), str(ctxfree.artifact), str(ctxfree.mask_id)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(rf.ROOT), os.environ.get("PYTHONPATH")]))},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    assert child["loaded"] == []
    assert [a for a in child["attempts"] if a.split(".")[0] in ("torch", "transformers")] == [], (
        f"the runtime tried to import {child['attempts']}"
    )
    sess = runtime.load(qwen.artifact)
    assert child["greedy"] == sess.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[]).output_ids
    assert child["plain"] == child["greedy"]
    assert child["sampled"] == sess.generate(
        [1, 40, 33], max_new_tokens=12, stop_token_ids=[], temperature=0.8, seed=7, verify_len="all"
    ).output_ids
    assert child["blocks"] == [[ctxfree.mask_id] * 14, rf.expected_acceptance(14, ctxfree.block_size)]
    assert max(child["blocks"][1]) == ctxfree.block_size  # whole blocks accepted
    res = sess.generate("t5 t6 t7", max_new_tokens=6, stop_token_ids=[])
    assert child["text"] == [res.output_ids, res.text]
    assert child["cli"] == [0, sess.generate([5, 6, 7], max_new_tokens=6).output_ids]


def test_exporter_command_without_torch_says_what_to_install(qwen):
    """`python -m dflash_export` on a runtime-only install: one error line naming the extra (no
    traceback), except `generate`, which is the runtime's command and runs."""
    run = "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('dflash_export', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", run, "build", "--out", "x"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: the exporter needs torch and the export extra: pip install '.[export]'")
    proc = subprocess.run([sys.executable, "-c", run, "generate", str(qwen.artifact), "--prompt-ids", "5,6,7",
                           "--max-new-tokens", "6", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["output_ids"] == runtime.load(qwen.artifact).generate([5, 6, 7], max_new_tokens=6).output_ids


def _module_level_imports(tree: ast.Module) -> list[str]:
    """Modules imported by statements that run at import time (not inside a def or class body)."""
    names = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                names.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0 and node.module:
                    names.append(node.module)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []) or [])

    visit(tree.body)
    return names


def test_runtime_sources_import_no_torch_at_module_level():
    src = Path(runtime.__file__).resolve().parent
    files = sorted(src.glob("*.py"))
    assert files
    offenders = {}
    for f in files:
        bad = [
            m
            for m in _module_level_imports(ast.parse(f.read_text(), str(f)))
            if m.split(".")[0] in ("torch", "transformers", "dflash_export") or m == "safetensors.torch"
        ]
        if bad:
            offenders[f.name] = bad
    assert offenders == {}, f"module-level torch/transformers/exporter imports in runtime/: {offenders}"
