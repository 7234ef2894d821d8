"""ONNX export: tracing, the checks every graph passes, graph passes and layer replication."""
