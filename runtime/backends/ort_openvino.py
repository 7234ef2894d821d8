"""onnxruntime's OpenVINO execution provider on an x86 CPU, for the batched engine.

The same standard graphs and host buffers as the CPU backend (`OrtBackend`); OpenVINO's CPU plugin
runs them. What it is for: its INT4 kernel shares the weights across a batch's rows (a step's INT4
matrices at 8 rows cost 1.7-1.9x one row's time, onnxruntime's own kernel 2.9-3.5x on the same CPU),
so batched INT4 decoding gains more per added sequence (`docs/performance.md`).

Needs the `onnxruntime-openvino` package, which replaces `onnxruntime` (install it in an environment
of its own). OpenVINO prepares each new input shape, so the batched calls round their key count up to
`key_bucket` (masked padding keys, exact zeros) and their rows per sequence up to a multiple of
`row_bucket`, or a power of two below it (padding rows nobody reads); the one-sequence Session's
calls grow by a key every step, so this backend serves the batched graph only. Its INT4 products
round activations to int8 per block, as onnxruntime's level 4 does, with other rounding: replies
equal this backend's own batch-1 replies, not necessarily the CPU backend's.
"""

from __future__ import annotations

from pathlib import Path

from runtime.backends.ort import OrtBackend
from runtime.errors import DFlashError
from runtime.manifest import BATCHED_GRAPH

PROVIDER = "OpenVINOExecutionProvider"


def provider_options(threads: int | None) -> list[dict]:
    """onnxruntime's provider options for [OpenVINO, CPU]: OpenVINO's CPU device at fp32 inference
    precision (a lower one would change the artifact's numbers), `threads` OpenVINO threads (None: all)."""
    options = {"device_type": "CPU", "precision": "FP32"}
    if threads:
        options["num_of_threads"] = str(int(threads))
    return [options, {}]


class OpenVinoBackend(OrtBackend):
    """The batched target (and draft) graphs on onnxruntime's OpenVINO execution provider (CPU device,
    fp32 inference precision).

    Args:
        artifact_dir: an artifact built with `--batched` by this version.
        manifest: its validated manifest.
        threads: OpenVINO's threads and onnxruntime's intra-op threads (default: all cores).
        graphs: the graphs to load: the batched target, and the draft graph where the engine speculates.

    Raises:
        DFlashError: no OpenVINO provider in this onnxruntime, a one-sequence graph asked for, a batched
            graph exported before its greedy pick was a TopK (ArgMax is slow there: rebuild), or a graph
            that does not load.
    """

    name = "ort-openvino"
    key_bucket = 64  # keys per sequence: a multiple of this (one prepared shape per 64 steps)
    row_bucket = 16  # rows per sequence: a multiple of this above it, a power of two below

    def __init__(self, artifact_dir: Path, manifest: dict, threads: int | None = None,
                 graphs: tuple[str, ...] = (BATCHED_GRAPH,)):
        try:
            import onnxruntime as ort
        except ImportError:
            raise DFlashError("onnxruntime is not installed: pip install onnxruntime-openvino") from None
        if PROVIDER not in ort.get_available_providers():
            raise DFlashError("this onnxruntime has no OpenVINO execution provider: install onnxruntime-openvino in an "
                              "environment of its own (it replaces the onnxruntime package), or use --backend ort")
        if "target" in graphs:
            raise DFlashError("the ort-openvino backend runs the batched graph only (`python -m runtime serve`, or "
                              "runtime.batching.BatchEngine); runtime.load, generate and chat run on --backend ort")
        if (manifest.get(BATCHED_GRAPH) or {}).get("greedy") != "topk":
            raise DFlashError("this artifact's batched graph picks greedy ids with an ArgMax, which OpenVINO runs slowly "
                              "on several rows; rebuild it with this version (`python -m dflash_export build ... --batched`)")
        super().__init__(artifact_dir, manifest, providers=[PROVIDER, "CPUExecutionProvider"], threads=threads,
                         graphs=graphs, provider_options=provider_options(threads))
        # OpenVINO's INT4 products round activations to int8: BatchedCalls probes one-row calls
        self.int8_activations = True
