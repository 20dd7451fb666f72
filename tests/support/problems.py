"""Solver inputs built by hand: chains, random DAGs (a hypothesis strategy) and clusters."""

from __future__ import annotations

from hypothesis import strategies as st

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec, node_arrays

__all__ = ["Case", "chain", "dags", "run_on"]

Case = tuple[DagProblem, NodeArrays]


def chain(compute: list[float], params: list[float] | None = None,
          nbytes: float = 10.0) -> Case:
    """Node i reads tensor i (tensor 0 is the graph input) and makes tensor i + 1."""
    n = len(compute)
    problem = DagProblem(compute, list(range(-1, n)), [[i] for i in range(n)] + [[]],
                         [False] * n + [True], [nbytes] * (n + 1))
    return problem, node_arrays(problem, [2.0 * c for c in compute], params or [0.0] * n)


def run_on(devices: int, *, train: bool = True, gbps: float = 1.0, machines: int = 1,
           inter_gbps: float = 0.1) -> RunSpec:
    cluster = Cluster(machines, devices // machines, memory_gb=80, kind="cuda",
                      intra=Link(gbps, 0.0), inter=Link(inter_gbps, 0.01))
    return RunSpec(cluster, train=train, microbatches=8)


@st.composite
def dags(draw: st.DrawFn, max_nodes: int = 9) -> Case:
    """A random DAG: each node makes one tensor read by some later nodes; one graph input."""
    n = draw(st.integers(2, max_nodes))
    consumers: list[list[int]] = [[0]]
    for i in range(n):
        later = list(range(i + 1, n))
        consumers.append(draw(st.lists(st.sampled_from(later), unique=True, max_size=3))
                         if later else [])
    compute = draw(st.lists(st.floats(0.1, 5.0), min_size=n, max_size=n))
    params = draw(st.lists(st.sampled_from([0.0, 1e6, 5e7]), min_size=n, max_size=n))
    nbytes = draw(st.lists(st.floats(0.0, 4e6), min_size=n + 1, max_size=n + 1))
    outputs = [False] * n + [True]
    problem = DagProblem(compute, list(range(-1, n)), consumers, outputs, nbytes)
    return problem, node_arrays(problem, [2.0 * c for c in compute], params)
