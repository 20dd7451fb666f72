"""Micro-batches: split feeds along the batch axis, merge outputs back (inverse functions)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from onnx_partition.plan import Plan

__all__ = ["Axes", "Feeds", "batch_axes", "batch_size", "merge", "split"]

Feeds = Mapping[str, np.ndarray]
#: Name -> its batch axis, or None for a tensor that is not split (given whole to every
#: micro-batch; an output taken from the first); a name not listed has its batch on axis 0.
Axes = Mapping[str, int | None]


def batch_axes(plan: Plan) -> dict[str, int | None]:
    """Where the batch lies in each graph input and output that does not have it on axis 0.

    The batch is the symbol of the first input whose leading dim is symbolic; a tensor has it
    where its shape names that symbol (a Loop's scan output: axis 1), and not at all when it
    does not (a weight fed as an input, an initializer given as an output). A model whose inputs
    have no symbolic leading dim is split on axis 0 throughout."""
    symbol = next((s.shape[0] for s in plan.inputs if s.shape and isinstance(s.shape[0], str)),
                  None)
    if symbol is None:
        return {}
    axes: dict[str, int | None] = {}
    for spec in [*plan.inputs, *plan.outputs]:
        axis = next((i for i, d in enumerate(spec.shape) if d == symbol), None)
        if axis != 0:
            axes[spec.name] = axis
    return axes


def _axis(axes: Axes, name: str, value: np.ndarray) -> int | None:
    axis = axes.get(name, 0)
    return axis if axis is not None and np.ndim(value) > axis else None


def batch_size(feeds: Feeds, axes: Axes | None = None) -> int:
    """The batch shared by the batched feeds (0-d feeds and unbatched ones are broadcast)."""
    axes = axes or {}
    sizes = {v.shape[a] for k, v in feeds.items() if (a := _axis(axes, k, v)) is not None}
    if not sizes:
        return 1
    if len(sizes) > 1:
        raise ValueError(f"inputs disagree on the batch dim: {sorted(sizes)}")
    return sizes.pop()


def split(feeds: Feeds, chunks: int, axes: Axes | None = None) -> list[dict[str, np.ndarray]]:
    """Split every batched feed into ``chunks`` near-equal micro-batches along its batch axis
    (axis 0 unless ``axes`` says otherwise; unbatched feeds go whole to every micro-batch).

    Fewer micro-batches come back when the batch is smaller than ``chunks``.
    """
    if chunks < 1:
        raise ValueError(f"need at least one micro-batch, got {chunks}")
    axes = axes or {}
    size = batch_size(feeds, axes)
    chunks = min(chunks, size)
    edges = np.linspace(0, size, chunks + 1).round().astype(int)
    parts = []
    for lo, hi in itertools.pairwise(edges):
        part = {}
        for k, v in feeds.items():
            axis = _axis(axes, k, v)
            if axis is None:
                part[k] = v
            elif axis == 0:
                part[k] = v[lo:hi]
            else:
                part[k] = np.take(v, np.arange(lo, hi), axis=axis)
        parts.append(part)
    return parts


def merge(
    parts: Sequence[Mapping[str, np.ndarray]], axes: Axes | None = None
) -> dict[str, np.ndarray]:
    """Concatenate per-micro-batch outputs along their batch axis (the inverse of
    :func:`split`); an unbatched output is the same in every part and taken from the first."""
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0])
    axes = axes or {}
    merged = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if name in axes and axes[name] is None:
            merged[name] = pieces[0]
            continue
        if np.ndim(pieces[0]) == 0:
            raise ValueError(f"output {name!r} is a scalar and cannot be merged across batches")
        merged[name] = np.concatenate(pieces, axis=axes.get(name) or 0)
    return merged
