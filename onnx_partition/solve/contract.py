"""Contract groups of nodes into units the solvers cannot split (one torch op = one unit).

A model exported from torch tags every ONNX node with the FX node it came from; one FX node
becomes several ONNX nodes (layer norm, attention, a reshape with its shape arithmetic), and a
stage boundary through them would cut a torch op in two, which training cannot execute. So the
solvers see the quotient graph: the nodes of one unit merged into one node whose compute time is
their sum. Tensors inside a unit lose their consumers (they cross no boundary); tensors between
units keep their bytes. Should a merge close a cycle (a unit reading a value that depends on its
own output through another unit), the units on the cycle are merged too: the strongly connected
components of the quotient graph (Tarjan, via ``networkx.condensation``) are the final units.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import networkx as nx

from onnx_partition.solve.problem import DagProblem

__all__ = ["contract", "expand"]


def contract(
    problem: DagProblem, label: Sequence[Hashable | None]
) -> tuple[DagProblem, list[list[int]]]:
    """The problem with the nodes of equal non-None ``label`` merged, and each new node's
    members (old node indices, ascending). New nodes are numbered in a topological order that
    keeps the old order where the graph allows (smallest first member first)."""
    n = problem.num_nodes
    if len(label) != n:
        raise ValueError(f"{len(label)} labels for {n} nodes")
    first: dict[Hashable, int] = {}
    unit = [first.setdefault(lab, i) if lab is not None else i for i, lab in enumerate(label)]
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(unit))
    quotient.add_edges_from((unit[p], unit[c]) for p, c in problem.edges() if unit[p] != unit[c])
    scc = nx.condensation(quotient)  # a DAG of components; "members" are first-member ids
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(scc.graph["mapping"][unit[i]], []).append(i)
    order = list(nx.lexicographical_topological_sort(scc, key=lambda c: groups[c][0]))
    new = {c: k for k, c in enumerate(order)}
    of = [new[scc.graph["mapping"][unit[i]]] for i in range(n)]
    producer = [of[p] if p >= 0 else -1 for p in problem.producer]
    consumers = [sorted({of[c] for c in cs} - {producer[t]})
                 for t, cs in enumerate(problem.consumers)]
    compute = [0.0] * len(order)
    for i, c in enumerate(problem.compute_ms):
        compute[of[i]] += c
    contracted = DagProblem(
        compute_ms=compute, producer=producer, consumers=consumers,
        is_output=problem.is_output, nbytes=problem.nbytes,
        bandwidth_bytes_per_ms=problem.bandwidth_bytes_per_ms, latency_ms=problem.latency_ms,
    )
    return contracted, [groups[c] for c in order]


def expand(stage_of: Sequence[int], members: Sequence[Sequence[int]], n: int) -> list[int]:
    """The stage of every old node, from the stage of every unit."""
    out = [-1] * n
    for unit, stage in enumerate(stage_of):
        for i in members[unit]:
            out[i] = stage
    assert all(s >= 0 for s in out), "every node belongs to a unit"
    return out
