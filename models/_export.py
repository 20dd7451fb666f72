"""Export a `Recipe` to ONNX with a symbolic batch dimension, written atomically."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from ._recipe import Recipe

#: Name of the symbolic batch dimension (``dim_param``) in the exported model.
BATCH = "batch"

#: Models with more weight bytes than this keep their weights in ``<path>.data``.
EXTERNAL_DATA_BYTES = 100 * 2**20

_QUIET_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the exporters' warnings, log records and Python-level prints."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    sink = io.StringIO()
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def weight_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def _export_to(recipe: Recipe, file: Path, *, opset: int | None) -> None:
    args = tuple(recipe.inputs.values())
    batch = torch.export.Dim(BATCH)
    torch.onnx.export(
        recipe.module,
        args,
        file,
        input_names=list(recipe.inputs),
        output_names=recipe.output_names,
        opset_version=opset,
        dynamo=True,
        dynamic_shapes=tuple({0: batch} for _ in args),
        external_data=weight_bytes(recipe.module) > EXTERNAL_DATA_BYTES,
        verbose=False,
    )


def export_recipe(
    recipe: Recipe, path: str | os.PathLike[str], *, opset: int | None = None
) -> Path:
    """Export ``recipe`` to ``path``; weights go to ``<path>.data`` above 100 MB.

    The exporter writes into a temporary folder next to ``path`` under the final file
    name (so any external-data location recorded in the model is already right); the
    data file, then the model, are moved into place with `os.replace`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        staged = Path(tmp) / path.name
        with quiet(), torch.no_grad():
            _export_to(recipe, staged, opset=opset)
        sidecars = [p for p in Path(tmp).iterdir() if p != staged]
        for sidecar in sidecars:
            os.replace(sidecar, path.parent / sidecar.name)
        os.replace(staged, path)
    stale = path.with_name(path.name + ".data")
    if not sidecars and stale.exists():
        stale.unlink()  # left by an earlier export of this path with external data
    return path
