"""Export a `Recipe` through :func:`onnx_partition.export` (ONNX + exported program, atomic)."""

from __future__ import annotations

import os
from pathlib import Path

from onnx_partition.graph.export import BATCH, quiet, weight_bytes
from onnx_partition.graph.export import export as export_module

from ._recipe import Recipe

__all__ = ["BATCH", "EXTERNAL_DATA_BYTES", "export_recipe", "quiet", "weight_bytes"]

#: Models with more weight bytes than this keep their weights in ``<path>.data``.
EXTERNAL_DATA_BYTES = 100 * 2**20


def export_recipe(
    recipe: Recipe, path: str | os.PathLike[str], *, opset: int | None = None
) -> Path:
    """Export ``recipe`` to ``path`` (weights in ``<path>.data`` above 100 MB) and its
    train-mode program to ``path.with_suffix(".pt2")``; see :func:`onnx_partition.export`."""
    return export_module(
        recipe.module, tuple(recipe.inputs.values()), path,
        input_names=list(recipe.inputs), output_names=recipe.output_names, opset=opset,
        external_data=weight_bytes(recipe.module) > EXTERNAL_DATA_BYTES,
    )
