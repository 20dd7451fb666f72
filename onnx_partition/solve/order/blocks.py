"""Sequencing by clustering non-sequential subgraphs into blocks.

Along a branch-contiguous order (:func:`~onnx_partition.solve.order.topo.depth_first_order`), a
fork-join
region (parallel branches, a residual or skip connection, attention heads) is a run of positions
where more than one tensor is alive; the positions where only the trunk's activation crosses are
the graph's narrow points. The blocks are the runs between narrow points: cutting inside one would
send its parallel tensors, cutting between two sends one activation.

Tensors that stay alive over a large share of the graph (an attention mask read by every layer, an
encoder output read by every decoder layer, U-Net's outermost skips) cross almost every position
whatever the order; they are left out when finding narrow points, or no point would be narrow.

A block heavier than a quarter of the ideal stage (total compute / S) is opened: its inner positions
become cut candidates too, so that stages can still be balanced to within a fraction of a block
(measured in ``tools/bench_quality.py``: opening only blocks heavier than a whole ideal stage left
the encoder-decoder 17% above the optimum at S = 4; a quarter, 1%). The DP then runs over the
blocks, a much shorter sequence than the nodes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_partition.solve.order.topo import crossing, live_spans
from onnx_partition.solve.problem import DagProblem

__all__ = ["Blocks", "cluster_blocks", "narrow_points"]


@dataclass(frozen=True)
class Blocks:
    """A sequence with the positions where it may be cut.

    ``bounds`` are the allowed boundaries ``0 = b_0 < b_1 < ... < b_m = n`` of ``order``.
    """

    order: list[int]
    bounds: list[int]

    def sums(self, values: Sequence[float]) -> list[float]:
        """Per block, the sum of a per-node ``values`` over its nodes; none for no values."""
        if not len(values):
            return []
        prefix = np.concatenate([[0.0], np.cumsum([values[v] for v in self.order])])
        return list(np.diff(prefix[np.asarray(self.bounds)]))

    def maxes(self, values: Sequence[float]) -> list[float]:
        """Per block, the largest of a per-node ``values`` over its nodes (a working set);
        none for no values."""
        if not len(values):
            return []
        ordered = np.asarray([values[v] for v in self.order], dtype=float)
        if not len(ordered):
            return [0.0] * (len(self.bounds) - 1)
        return [float(x) for x in np.maximum.reduceat(ordered, np.asarray(self.bounds[:-1]))]

    def compress(
        self, compute_ms: Sequence[float], cut_bytes: np.ndarray
    ) -> tuple[list[float], np.ndarray]:
        """Per-block compute and the bytes crossing each allowed boundary (the DP's input)."""
        return self.sums(compute_ms), cut_bytes[np.asarray(self.bounds)]

    def expand(self, block_bounds: Sequence[int]) -> list[int]:
        """Boundaries in blocks -> boundaries in positions of :attr:`order`."""
        return [self.bounds[b] for b in block_bounds]


def narrow_points(problem: DagProblem, order: Sequence[int], *, long_span: float = 0.25
                  ) -> list[int]:
    """Interior boundaries of ``order`` crossed by the fewest short-lived tensors.

    A tensor is short-lived when it stays alive over at most ``long_span`` of the positions.
    """
    n = len(order)
    if n < 2:
        return []
    first, last = live_spans(problem, order)
    short = ((last > first) & (last - first <= long_span * n)).astype(float)
    counts = crossing(first, last, short, n)[1:n]  # boundaries 1..n-1
    threshold = max(1, int(counts.min()))
    return [b + 1 for b in np.flatnonzero(counts <= threshold).tolist()]


def cluster_blocks(
    problem: DagProblem, order: Sequence[int], compute_ms: Sequence[float], num_stages: int
) -> Blocks:
    """Blocks between narrow points, heavy ones opened, with at least ``num_stages`` blocks.
    ``compute_ms`` weighs the nodes (the problem's own, or forward plus backward)."""
    # A block heavier than a quarter of the ideal stage is opened (see the module docstring).
    n = len(order)
    narrow = narrow_points(problem, order)
    bounds = sorted({0, n, *narrow})
    ideal = sum(compute_ms) / max(1, num_stages)
    cost = np.concatenate([[0.0], np.cumsum([compute_ms[v] for v in order])])
    allowed = set(bounds)
    for lo, hi in itertools.pairwise(bounds):
        if cost[hi] - cost[lo] > ideal / 4:  # too coarse for balancing: open it
            allowed.update(range(lo + 1, hi))
    if len(allowed) - 1 < num_stages:  # too few blocks to give every stage one
        allowed = set(range(n + 1))
    return Blocks(list(order), sorted(allowed))
