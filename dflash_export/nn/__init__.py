"""Export-friendly PyTorch modules: target layers, the DFlash draft, the Qwen3.5 hybrid's layers."""
