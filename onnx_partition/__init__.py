"""onnx-partition: cut ONNX models into pipeline stages and run them."""

__version__ = "0.1.0"
