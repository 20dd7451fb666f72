"""onnx-partition: cut ONNX models into pipeline stages and run them."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "export"]


def __getattr__(name: str) -> Any:
    """``onnx_partition.export`` imports torch on first use only (the CLI's other verbs don't)."""
    if name == "export":
        from onnx_partition.graph.export import export

        return export
    raise AttributeError(f"module 'onnx_partition' has no attribute {name!r}")
