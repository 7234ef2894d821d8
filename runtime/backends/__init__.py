"""Backends that run the two graphs on static buffers: onnxruntime (CPU, CUDA) and TensorRT."""
