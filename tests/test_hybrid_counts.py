"""Exact replica counts (issue 36 item 2): the hybrid and fleet DPs try every replica count up
to ``min(D, M)`` (or only the dominant ones, where memory does not depend on the plan), checked
against brute force at 9 to 16 devices."""

from __future__ import annotations

import math
import random

import pytest
from support.fleet_brute import brute_fleet
from support.hybrid_brute import brute_hybrid

from onnx_partition.cost.cluster import Fleet, GpuGroup, Link
from onnx_partition.errors import PartitionError
from onnx_partition.solve.fleet_dp import FleetSequence, fleet_dp
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.hybrid_model import dominant_counts
from onnx_partition.solve.hybrid_tables import StageTables
from onnx_partition.solve.scoring import RunSpec


def best_period(costs: SequenceCosts, config: HybridConfig) -> float:
    try:
        return max(s.period_ms for s in plan_hybrid(costs, config)[0])
    except PartitionError:
        return math.inf


def test_twelve_replicas_of_one_position_halve_the_period():
    """The issue's case: 12 devices, one position of 12 ms, 12 micro-batches. 1..8 and powers
    of two (the old counts) reach 2.0 ms at best (8 replicas: ceil(12/8) = 2 micro-batches on
    the fullest); 12 replicas take one each: 1.0 ms."""
    costs = SequenceCosts([12.0], [0.0], [0.0], [0.0], [0.0, 0.0])
    config = HybridConfig(devices=12, microbatches=12)
    plan = plan_hybrid(costs, config)[0]
    assert [(s.start, s.end, s.replicas) for s in plan] == [(0, 1, 12)]
    assert plan[0].period_ms == 1.0


def test_ten_replicas_under_memory_where_powers_of_two_fit_none():
    """Training under memory: a stage of 5 positions holds ``ceil(min(W + 1, M) / r)``
    micro-batches; with 10 micro-batches, 10 replicas of the whole model hold 1 each and
    fit; 8 replicas (the old counts' most under 10) hold 2 and do not."""
    n = 2
    costs = SequenceCosts([1.0] * n, [1.0] * n, [0.0] * n, [10.0] * n, [0.0, 100.0, 0.0])
    config = HybridConfig(devices=10, microbatches=10, train=True, memory_bytes=30.0)
    plan = plan_hybrid(costs, config)[0]
    assert [(s.start, s.end, s.replicas) for s in plan] == [(0, 2, 10)]
    assert max(s.memory_bytes for s in plan) <= 30.0
    assert brute_hybrid(costs, config)[0] == pytest.approx(plan[0].period_ms)


def test_dominant_counts_keep_one_per_micro_batch_share_and_any_cheaper_all_reduce():
    assert dominant_counts(HybridConfig(devices=12, microbatches=12)) == [1, 2, 3, 4, 6, 12]
    assert dominant_counts(HybridConfig(devices=16, microbatches=12)) == [1, 2, 3, 4, 6, 12]
    assert dominant_counts(HybridConfig(devices=5, microbatches=12)) == [1, 2, 3, 4]
    # a count whose all-reduce is cheaper than the smaller one's with the same share stays
    bw = [1.0] * 13
    bw[5] = 4.0  # 2*4/5/4 = 0.4 < 2*3/4/1 = 1.5 bytes-ms per byte
    faster = HybridConfig(devices=12, microbatches=12, train=True, group_bytes_per_ms=bw,
                          group_latency_ms=[0.0] * 13, link_bytes_per_ms=1.0)
    assert 5 in dominant_counts(faster)
    assert 7 not in dominant_counts(faster)


def random_case(rng: random.Random) -> tuple[SequenceCosts, HybridConfig]:
    """A sequence of 1..4 positions on 9..16 devices, 9..16 micro-batches; inference, training
    with memory free, or training under a memory limit that binds; per-count links sometimes."""
    n = rng.randint(1, 4)
    devices, m = rng.randint(9, 16), rng.randint(9, 16)
    costs = SequenceCosts([float(rng.randint(1, 20)) for _ in range(n)],
                          [float(rng.randint(0, 20)) for _ in range(n)],
                          [float(rng.randint(0, 30)) for _ in range(n)],
                          [float(rng.randint(0, 9)) for _ in range(n)],
                          [0.0, *(float(rng.randint(0, 9)) for _ in range(n - 1)), 0.0])
    kind = rng.choice(["infer", "train", "memory"])
    group: dict[str, list[float]] = {}
    if kind != "infer" and rng.random() < 0.5:
        group = {"group_bytes_per_ms": [rng.choice([1.0, 2.0, 8.0]) for _ in range(devices + 1)],
                 "group_latency_ms": [rng.choice([0.0, 0.1]) for _ in range(devices + 1)]}
    memory = math.inf
    if kind == "memory":
        memory = 4.0 * sum(costs.param_bytes) / n + rng.uniform(10.0, 60.0)
    config = HybridConfig(devices=devices, microbatches=m, train=kind != "infer",
                          memory_bytes=memory, link_bytes_per_ms=rng.choice([math.inf, 4.0]),
                          link_latency_ms=rng.choice([0.0, 0.2]), **group)
    return costs, config


@pytest.mark.parametrize("seed", range(24))
def test_hybrid_dp_equals_brute_force_at_9_to_16_devices(seed):
    costs, config = random_case(random.Random(seed))
    expected, _ = brute_hybrid(costs, config)
    assert best_period(costs, config) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_fleet_dp_equals_brute_force_with_every_count(seed):
    """A group of 9..12 devices and one of 1..2: every count of the large group is tried (the
    old counts skipped 9..12 below 16)."""
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, rng.randint(9, 12), None, Link(4.0, 0.01)),
                          GpuGroup("v100", 1, rng.randint(1, 2), None, Link(2.0, 0.01))),
                  inter=Link(1.0, 0.02))
    run = RunSpec(fleet.clusters[0], train=rng.random() < 0.5, microbatches=rng.randint(9, 16))
    fwd = [rng.uniform(0.5, 3.0) for _ in range(n)]
    seq = FleetSequence([fwd, [f * 2 for f in fwd]], [[2 * f for f in fwd], [4 * f for f in fwd]],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [0.0, *(rng.uniform(0, 5e3) for _ in range(n - 1)), 0.0])
    for ordering in [(0, 1), (1, 0)]:
        value, _ = fleet_dp(seq, fleet, run, ordering)
        assert value == pytest.approx(brute_fleet(seq, fleet, run, ordering), rel=1e-9)


def test_where_only_long_stages_could_overflow_the_bound_below_them_is_exact():
    """Training under a memory limit that only stages of 3 or more positions could overflow
    (4 x 4 bytes of weights, 10 bytes of activations per micro-batch per position), whose
    all-reduce on a slow link keeps them above 3.3 ms: at the optimum's bound (2.44 ms, 4
    stages of 3) none of them is within it, so the one-suffix DP answers there, equal to brute
    force; at 2 devices the long stages are back in play (the exact DP)."""
    n = 4
    costs = SequenceCosts([3.0] * n, [3.0] * n, [4.0] * n, [10.0] * n, [0.0] * (n + 1))
    for devices in (12, 2):
        config = HybridConfig(devices=devices, microbatches=12, train=True, memory_bytes=300.0,
                              link_bytes_per_ms=1.0)
        assert not StageTables(costs, config).memory_free
        assert best_period(costs, config) == pytest.approx(brute_hybrid(costs, config)[0])
