"""dflash_export: export a target and its DFlash draft to ONNX (and TensorRT engines).

See README.md. Entry point: ``python -m dflash_export build|generate|check``.
"""

__version__ = "0.1.0"
