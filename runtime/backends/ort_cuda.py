"""onnxruntime on the CUDA execution provider, with device-resident static buffers.

The same graphs as the CPU backend; buffers are device allocations (shared code with the TensorRT
backend: runtime/trt_backend.py `CudaMemoryBackend`, one CUDA stream, 256-byte aligned binding
with scratch-and-copy) and are bound to onnxruntime by device pointer through IO binding
(`bind_input(name, "cuda", 0, dtype, shape, ptr)`), so K/V rows are written in place on the GPU
and only token ids come back to the host. The execution provider is given the backend's stream
(`user_compute_stream`), so copies and graph runs are ordered on one stream.

Needs onnxruntime-gpu (its CUDA provider) and polygraphy (the ctypes allocator); neither torch nor
TensorRT. Not exercised in CI (no GPU there): keep it thin.
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.backends.base import View
from runtime.backends.ort import empty_rows_supported
from runtime.backends.profiles import max_block
from runtime.backends.trt import CudaMemoryBackend, gpu_info, load_cuda
from runtime.errors import DFlashError


class OrtCudaBackend(CudaMemoryBackend):
    """Runs the target and draft graphs with onnxruntime's CUDA execution provider.

    Raises:
        DFlashError: no GPU, no onnxruntime CUDA provider, or a graph that does not load.
    """

    name = "ort-cuda"

    def __init__(self, artifact_dir: Path, manifest: dict, threads: int | None = None, device_id: int = 0,
                 graphs: tuple[str, ...] = ("target", "draft")):
        try:
            import onnxruntime as ort
        except ImportError:
            raise DFlashError("onnxruntime is not installed: pip install onnxruntime-gpu") from None
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise DFlashError(
                "this onnxruntime has no CUDA execution provider (it is the CPU build): install onnxruntime-gpu "
                "(on Jetson, NVIDIA's JetPack wheel), or use --backend ort / trt"
            )
        gpu, why = gpu_info()
        if gpu is None:
            raise DFlashError(f"the ort-cuda backend needs an NVIDIA GPU: {why}")
        super().__init__(load_cuda(), scratch_rows=max_block(manifest))
        self.device_id, self.gpu, self._ort_version = device_id, gpu, ort.__version__
        self.greedy_without_uniforms = empty_rows_supported(ort)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads or os.cpu_count() or 1
        opts.log_severity_level = 3
        cuda_opts = {"device_id": str(device_id), "user_compute_stream": str(self.stream)}
        self.sessions = {}
        for graph in graphs:
            path = Path(artifact_dir) / manifest[graph]["graph"]
            try:
                sess = ort.InferenceSession(str(path), opts, providers=[("CUDAExecutionProvider", cuda_opts), "CPUExecutionProvider"])
            except Exception as exc:  # onnxruntime raises its own untyped errors
                raise DFlashError(f"onnxruntime (CUDA) cannot load {path}: {exc}") from None
            if "CUDAExecutionProvider" not in sess.get_providers():
                raise DFlashError(f"onnxruntime did not enable its CUDA provider for {path.name} (CUDA/cuDNN libraries missing?)")
            self.sessions[graph] = sess

    def _versions(self) -> dict:
        return {"onnxruntime": self._ort_version}

    def run(self, graph: str, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        binding = self.sessions[graph].io_binding()
        pending: list = []
        for name, v in inputs.items():
            ptr = self._bind(graph, name, v, False, pending)
            binding.bind_input(name, "cuda", self.device_id, v.buffer.dtype, list(v.shape), ptr)
        for name, v in outputs.items():
            ptr = self._bind(graph, name, v, True, pending)
            binding.bind_output(name, "cuda", self.device_id, v.buffer.dtype, list(v.shape), ptr)
        self.synchronize()  # host writes/copies queued on our stream are done before onnxruntime reads
        self.sessions[graph].run_with_iobinding(binding)
        binding.synchronize_outputs()
        self._finish(pending)
