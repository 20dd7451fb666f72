"""The one topological walk on plain successor lists, shared by the ONNX loader (node order) and
the solvers (:func:`onnx_partition.solve.problem.topological_order`): Kahn's algorithm taking the
smallest ready index first, so an order that is already topological is kept as it is (what
networkx's ``lexicographical_topological_sort`` does; written out because importing networkx
costs every command about 0.1 s)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

__all__ = ["kahn_order"]


def kahn_order(successors: Sequence[Iterable[int]]) -> list[int]:
    """Indices ``0..n-1`` in Kahn's order, smallest ready index first; shorter than ``n`` iff the
    graph has a cycle (a self-loop included)."""
    indegree = [0] * len(successors)
    for targets in successors:
        for j in targets:
            indegree[j] += 1
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in successors[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                heapq.heappush(ready, j)
    return order
