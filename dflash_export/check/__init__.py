"""Numerical parity of exported graphs and engines against the PyTorch reference, and quantization drift."""
