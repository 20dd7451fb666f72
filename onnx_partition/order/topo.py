"""Topological orders of a DAG and the bytes crossing each position of one.

A sequence is a permutation of the DAG's nodes in which every edge points forward. Cutting it at
boundary ``b`` (between positions ``b - 1`` and ``b``) is crossed by every tensor made before ``b``
and still needed at or after ``b``: graph inputs count as made before position 0 and graph
outputs as needed after the last position (the relay model of :mod:`onnx_partition.solve.problem`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def cut_bytes(
    order: Sequence[int],
    producer: Sequence[int],
    consumers: Sequence[Sequence[int]],
    is_output: Sequence[bool],
    nbytes: Sequence[float],
) -> np.ndarray:
    """Bytes crossing each boundary ``0..n`` of ``order`` (ends included, always 0).

    ``producer[t]`` is a node index or -1 for a graph input. O(n + sum of consumers).
    """
    n = len(order)
    position = np.empty(n, dtype=np.int64)
    position[np.asarray(order, dtype=np.int64)] = np.arange(n)
    diff = np.zeros(n + 2)
    for t, size in enumerate(nbytes):
        first = position[producer[t]] if producer[t] >= 0 else -1
        last = n if is_output[t] else max((position[c] for c in consumers[t]), default=-1)
        # crosses boundaries b with first < b <= last, clipped to the interior 1..n-1
        lo, hi = first + 1, min(last, n - 1)
        if size and lo <= hi:
            diff[lo] += size
            diff[hi + 1] -= size
    cut = np.cumsum(diff)[: n + 1]
    cut[0] = cut[n] = 0.0
    return cut


def is_topological(order: Sequence[int], producer: Sequence[int],
                   consumers: Sequence[Sequence[int]]) -> bool:
    """Whether every tensor's consumers come after its producer in ``order``."""
    position = {node: i for i, node in enumerate(order)}
    return all(
        position[producer[t]] < position[c]
        for t in range(len(producer)) if producer[t] >= 0
        for c in consumers[t]
    )
