"""INT4 weight-only quantization (RTN and AWQ) in the one DequantizeLinear form TensorRT and onnxruntime load."""
