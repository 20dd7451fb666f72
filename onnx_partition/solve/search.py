"""Sequence the DAG several ways, cut each sequence by DP, polish, and keep the best plan.

Step (a) of the two-step method: turn the DAG into a sequence, by a topological order or by
clustering non-sequential subgraphs into blocks; step (b): the DP of :mod:`.dp` cuts it. Every
candidate is scored with the same DAG cost model, so they compare fairly; ``auto`` keeps the best
(ties go to the plain topological order, so ``auto`` is never worse than ``topo``).

A heuristic: the DP is exact for each sequence, but the best split of the DAG need not be
contiguous in any sequence tried, and choosing the sequence is the strongly NP-hard part
(``docs/np_completeness.md``); :mod:`.ilp` solves the DAG problem exactly, within a time limit.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from onnx_partition.errors import PartitionError
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.settings.partition import SearchSpec
from onnx_partition.solve.dp import split_sequence
from onnx_partition.solve.order.blocks import cluster_blocks
from onnx_partition.solve.order.topo import assign, cut_bytes, depth_first_order, min_live_order
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.refine import refine

__all__ = ["ORDERINGS", "Candidate", "Polished", "best_split", "polish_split", "sequence_for",
           "solve_ordering", "split_order"]

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
    if ordering == "topo":  # the identity where nodes are numbered topologically (OpGraph's)
        return topological_order(problem)
    if ordering in ("dfs", "cluster"):
        return depth_first_order(problem)
    if ordering == "minlive":
        return min_live_order(problem)
    raise PartitionError(f"unknown ordering {ordering!r}; choose auto or one of {ORDERINGS}")


def split_order(problem: DagProblem, order: Sequence[int], num_stages: int) -> list[int]:
    """Node -> stage of the best contiguous split of one sequence (the exact DP of :mod:`.dp`)."""
    split = split_sequence([problem.compute_ms[v] for v in order], cut_bytes(problem, order),
                           num_stages, bandwidth_bytes_per_ms=problem.bandwidth_bytes_per_ms,
                           latency_ms=problem.latency_ms)
    return assign(order, split.bounds)


#: Polished splits by (sequence, DP split): orderings whose DP cuts the same sequence the same
#: way (``dfs`` and ``cluster`` often do) polish it once; :func:`polish_split` is
#: deterministic, so the answer is the same.
Polished = dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]


def solve_ordering(
    problem: DagProblem, num_stages: int, ordering: str, *, polish: bool = True,
    polished: Polished | None = None,
) -> Candidate:
    """Cut one ordering's sequence by DP (over blocks for ``cluster``), then refine (reusing
    ``polished``'s answer for the same sequence and split, and adding its own)."""
    started = time.perf_counter()
    order = sequence_for(problem, ordering)
    if ordering == "cluster":
        blocks = cluster_blocks(problem, order, problem.compute_ms, num_stages)
        block_compute, block_cuts = blocks.compress(problem.compute_ms,
                                                    cut_bytes(problem, order))
        split = split_sequence(block_compute, block_cuts, num_stages,
                               bandwidth_bytes_per_ms=problem.bandwidth_bytes_per_ms,
                               latency_ms=problem.latency_ms)
        stage_of = assign(order, blocks.expand(split.bounds))
        positions = len(blocks.bounds) - 1
    else:
        stage_of = split_order(problem, order, num_stages)
        positions = len(order)
    dp_ms = problem.bottleneck_ms(stage_of, num_stages)
    if polish:
        memo = {} if polished is None else polished
        key = (tuple(order), tuple(stage_of))
        if key not in memo:
            memo[key] = polish_split(problem, stage_of, num_stages, order)
        stage_of = list(memo[key])
    refined = problem.bottleneck_ms(stage_of, num_stages)
    assert refined <= dp_ms * (1 + 1e-9) + 1e-12
    return Candidate(ordering, stage_of, dp_ms, refined, time.perf_counter() - started,
                     positions)


def polish_split(
    problem: DagProblem, stage_of: Sequence[int], num_stages: int, order: Sequence[int],
    *, rounds: int = 8,
) -> list[int]:
    """Alternate local moves on the DAG (:func:`refine`) with the exact DP on the sequence the
    moved assignment induces (stages in order, each in ``order``'s order: still topological).

    The DP can only improve on the refined split, which is one of its candidates; then new moves
    open up. Stops when a round gains nothing.
    """
    position = {v: i for i, v in enumerate(order)}
    best = refine(problem, stage_of, num_stages)
    best_ms = problem.bottleneck_ms(best, num_stages)
    for _ in range(rounds):
        seq = sorted(range(problem.num_nodes), key=lambda v: (best[v], position[v]))
        moved = refine(problem, split_order(problem, seq, num_stages), num_stages)
        moved_ms = problem.bottleneck_ms(moved, num_stages)
        if moved_ms >= best_ms * (1 - 1e-12):
            break
        best, best_ms = moved, moved_ms
    return best


def best_split(
    problem: DagProblem,
    num_stages: int,
    ordering: str = SearchSpec.ordering,
    *,
    polish: bool = True,
    reporter: Reporter = SILENT,
) -> tuple[Candidate, list[Candidate]]:
    """The best candidate over ``ordering`` (``auto`` = all of :data:`ORDERINGS`), and all;
    each ordering done is reported to ``reporter``."""
    names: Sequence[str] = ORDERINGS if ordering == "auto" else (ordering,)
    candidates = []
    polished: Polished = {}
    for done, name in enumerate(names, 1):
        candidates.append(solve_ordering(problem, num_stages, name, polish=polish,
                                         polished=polished))
        reporter.step("planning: orderings", done, len(names))
    best = min(candidates, key=lambda c: c.refined_ms)  # first minimum: topo wins ties
    return best, candidates
