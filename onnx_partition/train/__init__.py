"""Alias package kept for ``onnx_partition.train.runtime`` (``train_plan`` and the torchrun entry);
training lives in :mod:`onnx_partition.runtime.train`."""

__all__ = ["runtime"]
