"""The sequence DP: exact answers, and the same optimum as brute force on small sequences."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.errors import PartitionError
from onnx_partition.solve.dp import split_sequence, stage_times
from onnx_partition.solve.order.topo import assign, cut_bytes, is_topological
from onnx_partition.solve.problem import DagProblem


def brute_force(compute, cuts, stages, bandwidth, latency):
    n = len(compute)
    best = math.inf
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *inner, n]
        times = stage_times(compute, cuts, bounds, bandwidth_bytes_per_ms=bandwidth,
                            latency_ms=latency)
        best = min(best, max(times))
    return best


def recurrence(compute, cuts, stages, bandwidth, latency):
    """The textbook table f[s, j] = min_i max(f[s-1, i], time(i, j)), O(S n^2)."""
    n = len(compute)
    prefix = np.concatenate([[0.0], np.cumsum(compute)])
    cut = np.asarray(cuts, dtype=float) / bandwidth + latency
    cut[0] = cut[n] = 0.0
    f = np.full((stages + 1, n + 1), np.inf)
    f[0, 0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            starts = np.arange(s - 1, j)
            last = prefix[j] - prefix[starts] + cut[starts] + cut[j]
            f[s, j] = np.min(np.maximum(f[s - 1, starts], last))
    return float(f[stages, n])


def test_equal_costs_split_evenly():
    split = split_sequence([1.0] * 8, [0.0] * 9, 4)
    assert split.bounds == [0, 2, 4, 6, 8]
    assert split.bottleneck_ms == 2.0


def test_heavy_node_gets_its_own_stage():
    split = split_sequence([1, 1, 10, 1, 1], [0] * 6, 3)
    assert split.bottleneck_ms == 10
    assert split.bounds[1:3] == [2, 3]


def test_communication_moves_the_cut():
    # Without transfer cost the even cut wins; a fat tensor at boundary 2 pushes the cut away.
    compute = [1.0, 1.0, 1.0, 1.0]
    cuts = [0.0, 0.0, 100.0, 0.0, 0.0]
    assert split_sequence(compute, cuts, 2).bounds == [0, 2, 4]
    split = split_sequence(compute, cuts, 2, bandwidth_bytes_per_ms=10.0)
    assert split.bounds in ([0, 1, 4], [0, 3, 4])
    assert split.bottleneck_ms == 3.0


def test_latency_is_charged_per_interior_boundary():
    split = split_sequence([1.0, 1.0, 1.0], [0.0] * 4, 3, latency_ms=0.5)
    assert split.stage_ms == [1.5, 2.0, 1.5]


def test_bad_stage_counts():
    with pytest.raises(PartitionError, match="3 operators into 4"):
        split_sequence([1.0, 1.0, 1.0], [0.0] * 4, 4)
    with pytest.raises(PartitionError):
        split_sequence([1.0], [0.0, 0.0], 0)


def draw_case(data, n, max_stages, max_cut):
    """A stage count and n + 1 boundary sizes (the ends 0) for a sequence of n operators."""
    stages = data.draw(st.integers(1, min(n, max_stages)))
    interior = data.draw(st.lists(st.floats(0, max_cut, allow_nan=False), min_size=n - 1,
                                  max_size=n - 1))
    return stages, [0.0, *interior, 0.0]


@settings(max_examples=150, deadline=None)
@given(
    compute=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=9),
    data=st.data(),
    bandwidth=st.sampled_from([math.inf, 1.0, 5.0]),
    latency=st.sampled_from([0.0, 0.3]),
)
def test_dp_matches_brute_force(compute, data, bandwidth, latency):
    stages, cuts = draw_case(data, len(compute), len(compute), 20)
    split = split_sequence(compute, cuts, stages, bandwidth_bytes_per_ms=bandwidth,
                           latency_ms=latency)
    assert len(split.bounds) == stages + 1
    assert all(i < j for i, j in itertools.pairwise(split.bounds))
    assert split.bottleneck_ms == pytest.approx(
        brute_force(compute, cuts, stages, bandwidth, latency), rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    compute=st.lists(st.floats(0, 1e3, allow_nan=False), min_size=10, max_size=80),
    data=st.data(),
    bandwidth=st.sampled_from([math.inf, 0.5, 40.0]),
    latency=st.sampled_from([0.0, 0.01, 2.0]),
)
def test_parametric_search_matches_the_recurrence(compute, data, bandwidth, latency):
    stages, cuts = draw_case(data, len(compute), 16, 1e4)
    split = split_sequence(compute, cuts, stages, bandwidth_bytes_per_ms=bandwidth,
                           latency_ms=latency)
    assert len(split.bounds) == stages + 1
    assert split.stage_ms == stage_times(compute, cuts, split.bounds,
                                         bandwidth_bytes_per_ms=bandwidth, latency_ms=latency)
    assert split.bottleneck_ms == pytest.approx(
        recurrence(compute, cuts, stages, bandwidth, latency), rel=1e-9, abs=1e-9)


def test_cut_bytes_relay_model():
    # 0 -> 1 -> 2 and a skip 0 -> 2; input x feeds nodes 0 and 2; node 2 makes the output.
    producer = [-1, 0, 1, 2]
    consumers = [[0, 2], [1, 2], [2], []]
    is_output = [False, False, False, True]
    nbytes = [1.0, 10.0, 100.0, 1000.0]
    problem = DagProblem([1.0] * 3, producer, consumers, is_output, nbytes)
    cuts = cut_bytes(problem, [0, 1, 2])
    # boundary 1: x (needed by 2) + t1 ; boundary 2: x + t1 (skip) + t2
    np.testing.assert_array_equal(cuts, [0.0, 11.0, 111.0, 0.0])
    np.testing.assert_array_equal(cut_bytes(problem, [0, 1, 2], [2.0, 0.0, 1.0, 5.0]),
                                  [0.0, 2.0, 3.0, 0.0])
    assert assign([0, 1, 2], [0, 2, 3]) == [0, 0, 1]
    assert assign([2, 0, 1], [0, 1, 3]) == [1, 1, 0]
    assert is_topological(problem, [0, 1, 2])
    assert not is_topological(problem, [1, 0, 2])
    assert not is_topological(problem, [0, 1])


def test_a_cut_below_the_bounds_last_bit_still_splits():
    """Found by hypothesis: a cut of 1e-98 ms vanishes from ``total + 2 max(cut)`` in float,
    so that start bound was unreachable and the backtrack found no start."""
    split = split_sequence([0.0, 1.0], [0.0, 1.1267841127897931e-98, 0.0], 2,
                           bandwidth_bytes_per_ms=1.0)
    assert split.bounds == [0, 1, 2]
    assert split.bottleneck_ms == pytest.approx(1.0)
