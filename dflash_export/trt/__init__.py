"""TensorRT engines built from an exported artifact, on the device."""
