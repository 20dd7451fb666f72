"""Model recipes: plain torch modules with random (seeded) weights, exported to ONNX.

Usage::

    recipe = build("gpt", "tiny")  # eval-mode module + example inputs + output names
    export("resnet", "resnet.onnx", size="small")

Every recipe comes in three sizes: "tiny" (tests), "small" and "realistic" (benchmarks).
Exported models have a symbolic batch dimension named "batch" on every input and output.
"""

from __future__ import annotations

import os
from pathlib import Path

from onnx_partition.progress import SILENT, Reporter

from . import bert, encdec, gpt, inception, resnet, unet
from ._export import export_recipe
from ._recipe import SIZES, Builder, Recipe

__all__ = ["RECIPES", "SIZES", "Recipe", "build", "export"]

_BUILDERS: dict[str, Builder] = {
    "resnet": resnet.build,
    "inception": inception.build,
    "unet": unet.build,
    "gpt": gpt.build,
    "bert": bert.build,
    "encdec": encdec.build,
}

RECIPES: tuple[str, ...] = tuple(_BUILDERS)


def _check(name: str, size: str, batch_size: int) -> None:
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(RECIPES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of: {', '.join(SIZES)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")


def build(name: str, size: str = "tiny", *, batch_size: int = 2) -> Recipe:
    """Build recipe ``name`` at ``size`` with example inputs of ``batch_size`` rows.

    Weights depend only on ``name`` and ``size`` (seeded), not on ``batch_size``.
    """
    _check(name, size, batch_size)
    return _BUILDERS[name](size, batch_size)


def export(
    name: str,
    path: str | os.PathLike[str],
    *,
    size: str = "tiny",
    batch_size: int = 2,
    opset: int | None = None,
    reporter: Reporter = SILENT,
) -> Path:
    """Export recipe ``name`` at ``size`` to the ONNX file ``path`` and return its path.

    The batch dimension is symbolic, so ``batch_size`` only sets the example used for
    tracing (at least 2: tracing with 1 would bake the batch size into the graph). The two
    steps (build; trace and convert) are reported to ``reporter``.
    """
    _check(name, size, batch_size)
    label = f"export {name}: build, trace and convert"
    reporter.step(label, 0, 2)
    recipe = build(name, size, batch_size=max(batch_size, 2))
    reporter.step(label, 1, 2)
    written = export_recipe(recipe, path, opset=opset)
    reporter.step(label, 2, 2)
    return written
