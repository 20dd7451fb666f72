"""Sequence the DAG several ways, cut each sequence by DP, polish, and keep the best plan.

Step (a) of the two-step method: turn the DAG into a sequence, by a topological order or by
clustering non-sequential subgraphs into blocks; step (b): the DP of :mod:`.dp` cuts it. Every
candidate is scored with the same DAG cost model, so they compare fairly; ``auto`` keeps the best
(ties go to the plain topological order, so ``auto`` is never worse than ``topo``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from onnx_partition.errors import PartitionError
from onnx_partition.order.cluster import cluster_blocks
from onnx_partition.order.topo import cut_bytes, depth_first_order, min_live_order
from onnx_partition.solve.dp import split_sequence
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.refine import refine

ORDERINGS = ("topo", "dfs", "minlive", "cluster")


@dataclass(frozen=True)
class Candidate:
    """One ordering's result: the DP's bottleneck on its sequence, then after refinement."""

    ordering: str
    stage_of: list[int]
    dp_ms: float
    refined_ms: float
    seconds: float
    positions: int  # cut positions the DP considered


def sequence_for(problem: DagProblem, ordering: str) -> list[int]:
    """The node order an ordering strategy gives (``cluster`` starts from depth-first)."""
    n = problem.num_nodes
    if ordering == "topo":
        return list(range(n))  # OpGraph numbers nodes in a (file-stable) topological order
    if ordering in ("dfs", "cluster"):
        return depth_first_order(n, problem.producer, problem.consumers)
    if ordering == "minlive":
        return min_live_order(n, problem.producer, problem.consumers, problem.nbytes,
                              problem.is_output)
    raise PartitionError(f"unknown ordering {ordering!r}; choose auto or one of {ORDERINGS}")


def solve_ordering(
    problem: DagProblem, num_stages: int, ordering: str, *, polish: bool = True
) -> Candidate:
    """Cut one ordering's sequence by DP (over blocks for ``cluster``), then refine."""
    started = time.perf_counter()
    order = sequence_for(problem, ordering)
    cuts = cut_bytes(order, problem.producer, problem.consumers, problem.is_output,
                     problem.nbytes)
    compute = [problem.compute_ms[v] for v in order]
    link = {"bandwidth_bytes_per_ms": problem.bandwidth_bytes_per_ms,
            "latency_ms": problem.latency_ms}
    if ordering == "cluster":
        blocks = cluster_blocks(order, problem.producer, problem.consumers, problem.is_output,
                                problem.compute_ms, num_stages)
        block_compute, block_cuts = blocks.compress(problem.compute_ms, cuts)
        bounds = blocks.expand(split_sequence(block_compute, block_cuts, num_stages,
                                              **link).bounds)
        positions = len(blocks.bounds) - 1
    else:
        bounds = split_sequence(compute, cuts, num_stages, **link).bounds
        positions = len(order)
    stage_of = [0] * problem.num_nodes
    for k, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        for pos in range(lo, hi):
            stage_of[order[pos]] = k
    dp_ms = problem.bottleneck_ms(stage_of, num_stages)
    if polish:
        stage_of = refine(problem, stage_of, num_stages)
    refined = problem.bottleneck_ms(stage_of, num_stages)
    assert refined <= dp_ms * (1 + 1e-9) + 1e-12
    return Candidate(ordering, stage_of, dp_ms, refined, time.perf_counter() - started,
                     positions)


def best_split(
    problem: DagProblem,
    num_stages: int,
    ordering: str = "auto",
    *,
    polish: bool = True,
) -> tuple[Candidate, list[Candidate]]:
    """The best candidate over ``ordering`` (``auto`` = all of :data:`ORDERINGS`), and all."""
    names: Sequence[str] = ORDERINGS if ordering == "auto" else (ordering,)
    candidates = [solve_ordering(problem, num_stages, name, polish=polish) for name in names]
    best = min(candidates, key=lambda c: c.refined_ms)  # first minimum: topo wins ties
    return best, candidates
