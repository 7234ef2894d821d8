"""Shared fixtures: tiny checkpoints, their export modules and ONNX graphs, built once per test run.

Each tiny export takes seconds, so every distinct graph is exported at most once per test run
(`tiny` caches by key) and shared by all test files and, through `shared_cache.shared_dir`, by all
pytest-xdist workers: the checkpoints and graphs on disk are built by the first worker that needs
them and read by the others (tests never change them: copy one first). The modules are loaded in
each worker from those same checkpoints.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# The suite never reads or writes the user's cache of measured step costs (runtime.graphs.costs); each
# test process removes its own directory when it exits.
os.environ["DFLASH_EXPORT_CALL_COSTS"] = tempfile.mkdtemp(prefix="dflash-test-costs-")
atexit.register(shutil.rmtree, os.environ["DFLASH_EXPORT_CALL_COSTS"], ignore_errors=True)

# Under `pytest -n N` the workers share the cores: each worker's torch (and the subprocesses it starts)
# gets cores / N intra-op threads. Two OpenMP threads per worker on 2 busy cores spin for one another:
# the SmolLM2 PyTorch loop ran 4x slower with the other core loaded (38.6 s vs 9.3 s for 2 prompts).
# onnxruntime's threads are the runtime's choice (they stop spinning after each run) and stay as they are.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Under `--dist worksteal` (the Makefile's), the `slow` and `nightly` tests (the longest: up to minutes each) run
    first, in their usual order: one worker starts on them while the other runs the rest and then takes
    over half of the first one's queue, so no long test is left to run alone at the end. (Under the default
    `--dist load` this order would hand every slow test to the first worker: files keep their order.)"""
    if config.getoption("dist", "no") == "worksteal":
        long = ("slow", "nightly")
        items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in long))  # stable: else file order


# Tiny targets used by the suite. Taps include layer 0, a middle layer and the LAST layer (whose
# feature is post-final-norm), so every tap rule is exercised.
TARGET_KINDS = {
    "qwen3": dict(family="qwen3", tie=False),
    "qwen3_tied": dict(family="qwen3", tie=True),
    "llama": dict(family="llama", tie=False),
}
TARGET_TAPS = (0, 1, 3)


@dataclass
class TinyTarget:
    kind: str
    hf_dir: Path
    spec: object  # dflash_export.checkpoint.target.TargetSpec
    state: dict
    module: object  # TargetForExport, fp32, eval
    taps: tuple[int, ...]
    _tmp: object = None  # the tmp_path_factory, for the shared export
    _onnx: Path | None = None

    @property
    def onnx_path(self) -> Path:
        if self._onnx is None:
            from dflash_export.export.graphs import export_target

            from shared_cache import shared_dir

            self._onnx = shared_dir(self._tmp, f"tiny_target_{self.kind}_onnx",
                                    lambda d: export_target(self.module, d / "target.onnx")) / "target.onnx"
        return self._onnx


@dataclass
class TinyDraft:
    draft_dir: Path
    target: TinyTarget
    spec: object  # DraftSpec
    state: dict
    config: dict
    module: object  # DFlashDraft, fp32, eval
    kind: str = "default"
    _tmp: object = None  # the tmp_path_factory, for the shared export
    _onnx: Path | None = None

    @property
    def onnx_path(self) -> Path:
        if self._onnx is None:
            from dflash_export.export.graphs import export_draft

            from shared_cache import shared_dir

            self._onnx = shared_dir(self._tmp, f"tiny_draft_{self.kind}_onnx",
                                    lambda d: export_draft(self.module, d / "draft.onnx")) / "draft.onnx"
        return self._onnx


class TinyFactory:
    """Builds tiny checkpoints/modules lazily and caches them (and their ONNX graphs) by key."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._targets: dict[str, TinyTarget] = {}
        self._drafts: dict[str, TinyDraft] = {}

    def target(self, kind: str = "qwen3") -> TinyTarget:
        if kind not in self._targets:
            import torch

            import tiny_models
            from dflash_export.checkpoint.target import load_state_dict
            from dflash_export.families.registry import load_target_spec
            from dflash_export.nn.layers import TargetForExport, load_weights

            from shared_cache import shared_dir

            hf_dir = shared_dir(self._tmp, f"tiny_target_{kind}",
                                lambda root: tiny_models.make_target(root / "hf", **TARGET_KINDS[kind])) / "hf"
            spec = load_target_spec(hf_dir)
            state = load_state_dict(hf_dir)
            module = TargetForExport(spec, TARGET_TAPS, torch.float32).eval()
            load_weights(module, state, f"target {hf_dir}")
            self._targets[kind] = TinyTarget(kind, hf_dir, spec, state, module, TARGET_TAPS, _tmp=self._tmp)
        return self._targets[kind]

    def draft(self, kind: str = "default") -> TinyDraft:
        """`default`: make_draft's defaults (rope_theta 500000 != target 10000, taps [1, 3], block 8)."""
        if kind not in self._drafts:
            import json

            import torch

            import tiny_models
            from dflash_export.checkpoint.draft import load_draft_spec
            from dflash_export.nn.draft import DFlashDraft
            from dflash_export.nn.layers import load_weights

            from shared_cache import shared_dir

            target = self.target("qwen3")
            # A larger weight scale than the default makes attention far from uniform, so position
            # (RoPE) and masking errors show up clearly.
            ddir = shared_dir(self._tmp, f"tiny_draft_{kind}",
                              lambda root: tiny_models.make_draft(root / "hf", target.hf_dir, scale=0.15)) / "hf"
            spec, state = load_draft_spec(ddir, target.spec)
            module = DFlashDraft(spec, torch.float32).eval()
            load_weights(module, state, f"draft {ddir}")
            config = json.loads((ddir / "config.json").read_text())
            self._drafts[kind] = TinyDraft(ddir, target, spec, state, config, module, kind, _tmp=self._tmp)
        return self._drafts[kind]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyFactory:
    """Session cache of tiny targets/drafts and their exported graphs (each built at most once per run)."""
    return TinyFactory(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory) -> Path:
    """The real pair (embedded SmolLM2-135M-Instruct + the shipped draft), fp32, max_seq_len 256: one
    export per test run (shared by the xdist workers, read-only), for the slow tests (it takes about
    a minute)."""
    from dflash_export.build import BuildOptions, build

    from shared_cache import shared_dir

    return shared_dir(tmp_path_factory, "smollm2", lambda d: build(BuildOptions(None, None, d / "art", max_seq_len=256,
                                                                                 quiet=True))) / "art"


@pytest.fixture(scope="session")
def hybrid_pair(tmp_path_factory):
    """A tiny random Qwen3.5 hybrid checkpoint and its artifact (`hybrid_fixtures.make_hybrid`), built
    once per test run (shared by the xdist workers, read-only) for the hybrid runtime, check and
    TensorRT-double tests."""
    from hybrid_fixtures import make_hybrid

    return make_hybrid(tmp_path_factory)
