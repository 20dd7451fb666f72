"""Micro-batches: split feeds along the batch axis, merge outputs back (inverse functions)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np

Feeds = Mapping[str, np.ndarray]


def batch_size(feeds: Feeds) -> int:
    """The leading dim shared by the batched feeds (0-d feeds are broadcast, not split)."""
    sizes = {v.shape[0] for v in feeds.values() if np.ndim(v) >= 1}
    if not sizes:
        return 1
    if len(sizes) > 1:
        raise ValueError(f"inputs disagree on the batch (leading) dim: {sorted(sizes)}")
    return sizes.pop()


def split(feeds: Feeds, chunks: int) -> list[dict[str, np.ndarray]]:
    """Split every batched feed into ``chunks`` near-equal micro-batches along axis 0.

    Fewer micro-batches come back when the batch is smaller than ``chunks``.
    """
    if chunks < 1:
        raise ValueError(f"need at least one micro-batch, got {chunks}")
    size = batch_size(feeds)
    chunks = min(chunks, size)
    edges = np.linspace(0, size, chunks + 1).round().astype(int)
    return [
        {k: (v[lo:hi] if np.ndim(v) >= 1 else v) for k, v in feeds.items()}
        for lo, hi in itertools.pairwise(edges)
    ]


def merge(parts: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate per-micro-batch outputs along axis 0 (the inverse of :func:`split`)."""
    if not parts:
        return {}
    if len(parts) == 1:
        return dict(parts[0])
    merged = {}
    for name in parts[0]:
        pieces = [p[name] for p in parts]
        if np.ndim(pieces[0]) == 0:
            raise ValueError(f"output {name!r} is a scalar and cannot be merged across batches")
        merged[name] = np.concatenate(pieces, axis=0)
    return merged
