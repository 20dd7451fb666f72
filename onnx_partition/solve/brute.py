"""Brute-force reference for tiny DAGs: try all S^n stage assignments (tests only)."""

from __future__ import annotations

from onnx_partition.errors import PartitionError
from onnx_partition.solve.problem import DagProblem, topological_order

__all__ = ["MAX_BRUTE_NODES", "brute_force"]

# 3^8 = 6561 assignments; beyond this the enumeration gets slow for a test suite.
MAX_BRUTE_NODES = 8


def brute_force(problem: DagProblem, num_stages: int) -> tuple[list[int], float]:
    """Best valid assignment and its bottleneck (ms), by exhaustive enumeration.

    Valid means exactly ``num_stages`` non-empty stages and no tensor flowing backwards
    (:meth:`DagProblem.is_valid`); the cost is :meth:`DagProblem.bottleneck_ms`. Ties go to
    the lexicographically smallest assignment. Only for ``n <= MAX_BRUTE_NODES``.
    """
    n = problem.num_nodes
    if not 1 <= num_stages <= n:
        raise PartitionError(
            f"num_stages must be between 1 and the number of nodes ({n}), got {num_stages}"
        )
    if n > MAX_BRUTE_NODES:
        raise PartitionError(f"brute force is for at most {MAX_BRUTE_NODES} nodes, got {n}")
    # Enumerate only forward-only assignments: nodes in topological order, each at a stage no
    # earlier than any of its producers. Then keep those that use every stage.
    order = topological_order(problem)
    preds: list[list[int]] = [[] for _ in range(n)]
    for p, c in problem.edges():
        preds[c].append(p)
    stage_of = [0] * n
    best: tuple[list[int], float] | None = None

    def visit(pos: int) -> None:
        nonlocal best
        if pos == n:
            if len(set(stage_of)) == num_stages:
                value = problem.bottleneck_ms(stage_of, num_stages)
                if best is None or value < best[1] or (value == best[1] and stage_of < best[0]):
                    best = (list(stage_of), value)
            return
        node = order[pos]
        lowest = max((stage_of[p] for p in preds[node]), default=0)
        for k in range(lowest, num_stages):
            stage_of[node] = k
            visit(pos + 1)

    visit(0)
    if best is None:  # unreachable for an acyclic problem with num_stages <= n
        raise PartitionError(f"no valid split into {num_stages} stages exists")
    return best
