"""Orderings, clustering, refinement and auto: each valid, auto never worse than topo, none
better than the exact optimum (brute force on tiny DAGs)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.order.blocks import cluster_blocks, narrow_points
from onnx_partition.solve.order.topo import depth_first_order, is_topological, min_live_order
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.refine import refine
from onnx_partition.solve.search import ORDERINGS, best_split, solve_ordering


@st.composite
def problems(draw: st.DrawFn, max_nodes: int = 8) -> DagProblem:
    """Random DAGs: each node reads 1-2 earlier tensors or graph inputs (branches, skips)."""
    n = draw(st.integers(2, max_nodes))
    inputs = draw(st.integers(1, 2))
    producer = [-1] * inputs + list(range(n))  # tensor i < inputs is a graph input
    consumers: list[list[int]] = [[] for _ in producer]
    for v in range(n):
        reads = draw(st.lists(st.integers(0, inputs + v - 1), min_size=1, max_size=2, unique=True))
        for t in reads:
            consumers[t].append(v)
    is_output = [False] * len(producer)
    is_output[-1] = True
    for t in draw(st.lists(st.integers(inputs, len(producer) - 1), max_size=2)):
        is_output[t] = True
    return DagProblem(
        compute_ms=draw(st.lists(st.integers(0, 9).map(float), min_size=n, max_size=n)),
        producer=producer,
        consumers=consumers,
        is_output=is_output,
        nbytes=draw(st.lists(st.integers(0, 20).map(float), min_size=len(producer),
                             max_size=len(producer))),
        bandwidth_bytes_per_ms=draw(st.sampled_from([math.inf, 4.0, 1.0])),
        latency_ms=draw(st.sampled_from([0.0, 0.5])),
    )


@settings(max_examples=120, deadline=None)
@given(problem=problems(), data=st.data())
def test_every_ordering_is_valid_and_auto_is_best(problem, data):
    stages = data.draw(st.integers(1, min(4, problem.num_nodes)))
    best, candidates = best_split(problem, stages)
    assert [c.ordering for c in candidates] == list(ORDERINGS)
    for c in candidates:
        assert problem.is_valid(c.stage_of, stages)
        assert c.refined_ms == pytest.approx(problem.bottleneck_ms(c.stage_of, stages))
        assert c.refined_ms <= c.dp_ms + 1e-9
    topo = candidates[0]
    assert best.refined_ms <= topo.refined_ms
    _, optimum = brute_force(problem, stages)
    assert best.refined_ms >= optimum - 1e-9  # no heuristic beats the exact optimum


@settings(max_examples=60, deadline=None)
@given(problem=problems(max_nodes=14))
def test_orders_are_topological(problem):
    n = problem.num_nodes
    for order in (depth_first_order(problem), min_live_order(problem)):
        assert sorted(order) == list(range(n))
        assert is_topological(problem, order)


def residual_chain(blocks: int) -> DagProblem:
    """x -> [a -> b -> add(a_in, b)] * blocks: each block a fork-join region."""
    producer: list[int] = [-1]
    consumers: list[list[int]] = [[]]
    trunk = 0  # tensor index of the current trunk activation
    node = 0
    for _ in range(blocks):
        a, b, add = node, node + 1, node + 2
        consumers[trunk] += [a, add]
        producer += [a, b, add]
        consumers += [[b], [add], []]
        trunk = len(producer) - 1
        node += 3
    return DagProblem(compute_ms=[1.0] * node, producer=producer, consumers=consumers,
                      is_output=[t == len(producer) - 1 for t in range(len(producer))],
                      nbytes=[1.0] * len(producer), bandwidth_bytes_per_ms=1.0)


def test_narrow_points_are_block_boundaries():
    problem = residual_chain(4)
    order = list(range(12))
    # Inside a block the skip and the branch cross; between blocks only the trunk does.
    assert narrow_points(problem, order) == [3, 6, 9]
    # a quarter of the ideal stage (3) is a block
    blocks = cluster_blocks(problem, order, problem.compute_ms, 1)
    assert blocks.bounds == [0, 3, 6, 9, 12]
    # a quarter of 6 < a block's 3: opened
    opened = cluster_blocks(problem, order, problem.compute_ms, 2)
    assert opened.bounds == list(range(13))


def test_cluster_cuts_at_narrow_points():
    problem = residual_chain(8)
    cand = solve_ordering(problem, 2, "cluster", polish=False)
    assert cand.positions == 8
    assert cand.stage_of == [0] * 12 + [1] * 12
    assert cand.dp_ms == 12.0 + 1.0  # four blocks plus the one trunk tensor sent


def test_refine_fixes_a_bad_split():
    problem = DagProblem(compute_ms=[1.0] * 6, producer=[-1, 0, 1, 2, 3, 4, 5],
                         consumers=[[0], [1], [2], [3], [4], [5], []],
                         is_output=[False] * 6 + [True], nbytes=[0.0] * 7)
    bad = [0, 1, 1, 1, 1, 1]
    assert problem.bottleneck_ms(bad, 2) == 5.0
    good = refine(problem, bad, 2)
    assert problem.is_valid(good, 2)
    assert problem.bottleneck_ms(good, 2) == 3.0
