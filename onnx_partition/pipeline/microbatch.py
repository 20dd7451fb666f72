"""Micro-batches: split feeds along the batch axis, merge outputs back (inverse functions).

**One split rule** (:func:`row_ranges`): ``rows`` rows make ``min(chunks, rows)`` micro-batches,
micro-batch ``m`` being rows ``[round(m rows / chunks), round((m + 1) rows / chunks))`` (the
edges of ``numpy.linspace``, rounded half to even). When ``chunks`` divides ``rows`` (every step
of the training runtime, ``B x M`` rows) micro-batch ``m`` is rows ``m B .. (m + 1) B``. The
threaded and multi-process runtimes (:func:`split`, numpy), the training ranks
(:func:`rows_of`, torch tensors or numpy arrays) and the single-process training reference all
cut by it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from onnx_partition.plan import Plan

__all__ = ["Axes", "Feeds", "batch_axes", "batch_size", "merge", "row_ranges", "rows_of",
           "split"]

Feeds = Mapping[str, np.ndarray]
#: Name -> its batch axis, or None for a tensor that is not split (given whole to every
#: micro-batch; an output taken from the first); a name not listed has its batch on axis 0.
Axes = Mapping[str, int | None]


T = TypeVar("T")


def row_ranges(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges ``[lo, hi)`` of ``chunks`` near-equal micro-batches of ``rows`` rows, fewer
    when ``rows < chunks``: the one split rule (see the module docstring)."""
    if chunks < 1:
        raise ValueError(f"need at least one micro-batch, got {chunks}")
    chunks = min(chunks, rows)
    edges = np.linspace(0, rows, chunks + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in itertools.pairwise(edges)]


def rows_of(batch: Mapping[str, T], m: int, count: int) -> dict[str, T]:
    """Micro-batch ``m`` of ``count`` of a batch whose tensors (numpy arrays or torch tensors)
    all have their rows on axis 0, cut by :func:`row_ranges`; no tensors (the targets of a
    model computing its own loss), none. A batch that cuts itself (a ``microbatch(m, count)``
    method: the training runtime's ``StepRows``) gives its own, reading only those rows."""
    if not batch:
        return {}
    own = getattr(batch, "microbatch", None)
    if own is not None:
        return dict(own(m, count))
    rows = {len(t) for t in batch.values()}  # type: ignore[arg-type]
    if len(rows) > 1:
        raise ValueError(f"tensors disagree on the batch dim: {sorted(rows)}")
    lo, hi = row_ranges(rows.pop() if rows else 0, count)[m]
    out: dict[str, Any] = {n: t[lo:hi] for n, t in batch.items()}  # type: ignore[index]
    return out


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
    parts = []
    for lo, hi in row_ranges(batch_size(feeds, axes), chunks):
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
