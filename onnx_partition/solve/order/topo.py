"""Topological orders of a DAG, the bytes crossing each position of one, and splits of one.

A sequence is a permutation of the DAG's nodes in which every edge points forward. Cutting it at
boundary ``b`` (between positions ``b - 1`` and ``b``) is crossed by every tensor made before ``b``
and still needed at or after ``b``: graph inputs count as made before position 0 and graph
outputs as needed after the last position (the relay model of :mod:`onnx_partition.solve.problem`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnx_partition.solve.problem import DagProblem

__all__ = ["assign", "crossing", "cut_bytes", "depth_first_order", "is_topological",
           "live_spans", "min_live_order"]


def live_spans(problem: DagProblem, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per tensor, the position of ``order`` that makes it (-1: a graph input) and the last that
    needs it (``n``: a graph output; -1: nobody)."""
    n = len(order)
    position = np.empty(n, dtype=np.int64)
    position[np.asarray(order, dtype=np.int64)] = np.arange(n)
    read_tensor, read_by, producer, is_output, _ = problem.arrays
    last = np.full(len(producer), -1, dtype=np.int64)
    np.maximum.at(last, read_tensor, position[read_by])
    last[is_output] = n
    first = np.where(producer >= 0, position[np.maximum(producer, 0)], -1)
    return first, last


def crossing(first: np.ndarray, last: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Per boundary ``0..n`` of a sequence, the summed ``weights`` of the spans crossing it: a
    span crosses ``b`` when ``first < b <= last``; the ends cross nothing (always 0)."""
    lo, hi = first + 1, np.minimum(last, n - 1)
    keep = (lo <= hi) & (weights != 0)
    # one bincount over (start, +w), (end, -w) pairs in tensor order: the sums of a running loop
    at = np.stack([lo[keep], hi[keep] + 1], axis=1).ravel()
    signed = np.stack([weights[keep], -weights[keep]], axis=1).ravel()
    cut = np.cumsum(np.bincount(at, signed, minlength=n + 2))[: n + 1]
    cut[0] = cut[n] = 0.0
    return cut


def cut_bytes(
    problem: DagProblem, order: Sequence[int], nbytes: Sequence[float] | None = None
) -> np.ndarray:
    """Bytes crossing each boundary ``0..n`` of ``order`` (ends included, always 0); ``nbytes``
    replaces the problem's tensor sizes. O(n + sum of consumers)."""
    first, last = live_spans(problem, order)
    sizes = problem.arrays.nbytes if nbytes is None else np.asarray(nbytes, dtype=float)
    return crossing(first, last, sizes, len(order))


def assign(order: Sequence[int] | np.ndarray, bounds: Sequence[int]) -> list[int]:
    """Node -> stage for stage boundaries ``bounds`` (``0 .. n``) over the sequence ``order``
    (an int64 array is taken as is: callers assigning many splits of one order convert once)."""
    stage_of = np.empty(len(order), dtype=np.int64)
    stage_of[np.asarray(order, dtype=np.int64)] = np.repeat(np.arange(len(bounds) - 1),
                                                           np.diff(bounds))
    return stage_of.tolist()


def is_topological(problem: DagProblem, order: Sequence[int]) -> bool:
    """Whether ``order`` holds every node once and every edge points forward in it."""
    if sorted(order) != list(range(problem.num_nodes)):
        return False
    position = {node: i for i, node in enumerate(order)}
    return all(position[p] < position[c] for p, c in problem.edges())


def depth_first_order(problem: DagProblem) -> list[int]:
    """A topological order that finishes a branch before starting the next (LIFO ready set).

    After a fork, one branch runs to the join before the next begins, so parallel branches stay
    contiguous and a cut inside a fork-join region crosses few of its tensors.
    """
    succ, indegree = problem.successors, problem.in_degrees()
    stack = [v for v in range(problem.num_nodes - 1, -1, -1) if indegree[v] == 0]
    order: list[int] = []
    while stack:
        node = stack.pop()
        order.append(node)
        for s in reversed(succ[node]):
            indegree[s] -= 1
            if indegree[s] == 0:
                stack.append(s)
    assert len(order) == problem.num_nodes, "the graph has a cycle"
    return order


def min_live_order(problem: DagProblem) -> list[int]:
    """A greedy topological order keeping the bytes alive at each position low.

    Among the ready nodes it runs the one whose step grows the live set least: the bytes it
    makes (that anyone needs) minus the bytes of inputs it is the last consumer of. Ties go to
    the earliest node. The live set at a position is what a cut there must send.
    """
    n, consumers, nbytes, is_output = (problem.num_nodes, problem.consumers, problem.nbytes,
                                       problem.is_output)
    made, reads = problem.made_by, problem.read_by
    pending = [len(set(c)) for c in consumers]  # consumers of each tensor still to run
    indegree = problem.in_degrees()
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
        for s in problem.successors[node]:
            indegree[s] -= 1
            if indegree[s] == 0:
                ready.add(s)
    assert len(order) == n, "the graph has a cycle"
    return order

