"""Choosing a backend by name (`load(..., backend=)`); TensorRT and CUDA are imported only when one is loaded."""

from __future__ import annotations

import operator
from pathlib import Path

from runtime.backends.base import Backend
from runtime.backends.ort import OrtBackend
from runtime.backends.ort_cuda import OrtCudaBackend
from runtime.backends.trt import TrtBackend
from runtime.errors import DFlashError

BACKEND_NAMES = ("ort", "ort-cuda", "trt")
MAX_THREADS = 4096  # (onnxruntime takes a C int; far above any core count this runs on)


def make_backend(name: str, artifact_dir: Path, manifest: dict, threads: int | None,
                 int4_accuracy_level: int | None = None, graphs: tuple[str, ...] = ("target", "draft")) -> Backend:
    """The backend `name` ("ort", "ort-cuda" or "trt") for an artifact, loading `graphs`; its modules (and
    TensorRT or CUDA) are imported only when chosen.

    Raises:
        DFlashError: an unknown name, `threads` neither None nor a positive integer, or the backend's
            own load errors.
    """
    if threads is not None:
        try:
            count = None if isinstance(threads, bool) else operator.index(threads)  # (numpy integers too)
        except TypeError:
            count = None
        if count is None or not 1 <= count <= MAX_THREADS:
            raise DFlashError(f"threads must be a positive integer up to {MAX_THREADS}, or None for all cores; "
                              f"got {threads!r}")
        threads = count
    if name == "ort":
        return OrtBackend(artifact_dir, manifest, threads=threads, int4_accuracy_level=int4_accuracy_level, graphs=graphs)
    if name == "trt":  # TensorRT and CUDA are imported only here
        return TrtBackend(artifact_dir, manifest, graphs=graphs)
    if name == "ort-cuda":
        return OrtCudaBackend(artifact_dir, manifest, threads=threads, graphs=graphs)
    raise DFlashError(f"unknown backend {name!r}; available: {', '.join(BACKEND_NAMES)}")
