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


def successors(
    n: int, producer: Sequence[int], consumers: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Node -> sorted distinct consumer nodes of its outputs."""
    succ: list[set[int]] = [set() for _ in range(n)]
    for t, prod in enumerate(producer):
        if prod >= 0:
            succ[prod].update(c for c in consumers[t] if c != prod)
    return [sorted(s) for s in succ]


def depth_first_order(
    n: int, producer: Sequence[int], consumers: Sequence[Sequence[int]]
) -> list[int]:
    """A topological order that finishes a branch before starting the next (LIFO ready set).

    After a fork, one branch runs to the join before the next begins, so parallel branches stay
    contiguous and a cut inside a fork-join region crosses few of its tensors.
    """
    succ = successors(n, producer, consumers)
    indegree = [0] * n
    for node in range(n):
        for s in succ[node]:
            indegree[s] += 1
    stack = [v for v in range(n - 1, -1, -1) if indegree[v] == 0]
    order: list[int] = []
    while stack:
        node = stack.pop()
        order.append(node)
        for s in reversed(succ[node]):
            indegree[s] -= 1
            if indegree[s] == 0:
                stack.append(s)
    assert len(order) == n, "the graph has a cycle"
    return order


def min_live_order(
    n: int,
    producer: Sequence[int],
    consumers: Sequence[Sequence[int]],
    nbytes: Sequence[float],
    is_output: Sequence[bool],
) -> list[int]:
    """A greedy topological order keeping the bytes alive at each position low.

    Among the ready nodes it runs the one whose step grows the live set least: the bytes it
    makes (that anyone needs) minus the bytes of inputs it is the last consumer of. Ties go to
    the earliest node. The live set at a position is what a cut there must send.
    """
    succ = successors(n, producer, consumers)
    made: list[list[int]] = [[] for _ in range(n)]
    reads: list[list[int]] = [[] for _ in range(n)]
    for t, prod in enumerate(producer):
        if prod >= 0:
            made[prod].append(t)
        for c in set(consumers[t]):
            reads[c].append(t)
    pending = [len(set(c)) for c in consumers]  # consumers of each tensor still to run
    indegree = [0] * n
    for node in range(n):
        for s in succ[node]:
            indegree[s] += 1
    ready = {v for v in range(n) if indegree[v] == 0}
    order: list[int] = []

    def growth(v: int) -> float:
        grown = sum(nbytes[t] for t in made[v] if consumers[t] or is_output[t])
        freed = sum(nbytes[t] for t in reads[v] if pending[t] == 1 and not is_output[t])
        return grown - freed

    while ready:
        node = min(ready, key=lambda v: (growth(v), v))
        ready.remove(node)
        order.append(node)
        for t in reads[node]:
            pending[t] -= 1
        for s in succ[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.add(s)
    assert len(order) == n, "the graph has a cycle"
    return order
