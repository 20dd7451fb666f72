"""The hybrid planner (:mod:`onnx_partition.solve.planner`): exact plans on tiny chains, never
worse than any of its own proposals, within memory, and its small helpers exactly."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.problems import Case, chain, dags, run_on

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.solve import planner
from onnx_partition.solve.hybrid import HybridStage
from onnx_partition.solve.order.blocks import cluster_blocks
from onnx_partition.solve.order.topo import assign
from onnx_partition.solve.planner import (
    _coarse_blocks,
    _replica_moves,
    downset_candidates,
    dp_candidates,
    estimate_ms,
    grid_candidates,
    machine_budgets,
    plan_cluster,
    polish_replicas,
)
from onnx_partition.solve.scoring import RunSpec, pipeline_costs, score
from onnx_partition.solve.search import sequence_for


def devices(n: int, *, train: bool, memory_gb: float = 80.0, microbatches: int = 8) -> RunSpec:
    """``n`` devices on one machine, free transfers (1 TB/s, no latency)."""
    cluster = Cluster(1, n, memory_gb=memory_gb, kind="cuda", intra=Link(1000.0, 0.0))
    return RunSpec(cluster, train=train, microbatches=microbatches)


# ------------------------------------------------------------------------------ exact plans


def test_inference_on_two_devices_replicates_the_whole_chain() -> None:
    """Nodes of 1 and 3 ms, 8 micro-batches: two replicas of one stage take 4 each, 16 ms; a
    pipeline 1 | 3 takes 1 + 8 x 3 = 25 ms; one device alone 32 ms."""
    problem, arrays = chain([1.0, 3.0], nbytes=0.0)
    plan, families = plan_cluster(problem, arrays, devices(2, train=False))
    assert (plan.stage_of, plan.replicas) == ([0, 0], [2])
    assert plan.sim.iteration_ms == pytest.approx(16.0)
    assert min(v.get("iteration_ms", math.inf) for v in families.values()) == pytest.approx(16.0)


def test_training_with_heavy_weights_pipelines_instead() -> None:
    """Forward 1 ms, backward 2 ms per node, 1 GB of weights each, 1 GB/s: data parallel pays a
    2,000 ms all-reduce; the pipeline 1 | 1 has none and runs (8 + 2 - 1) x 3 = 27 ms."""
    problem, arrays = chain([1.0, 1.0], params=[1e9, 1e9], nbytes=0.0)
    run = RunSpec(Cluster(1, 2, memory_gb=80, kind="cuda", intra=Link(1.0, 0.0)),
                  train=True, microbatches=8)
    plan, _ = plan_cluster(problem, arrays, run)
    assert (plan.stage_of, plan.replicas) == ([0, 1], [1, 1])
    assert plan.sim.iteration_ms == pytest.approx(27.0)
    assert score(problem, arrays, [0, 0], [2], run, "dp").sim.iteration_ms > 2000


def test_memory_rules_out_the_fastest_plan() -> None:
    """Inference, 30 GB of weights per node on 40 GB devices: replicating both nodes (60 GB a
    device) would be fastest but does not fit; the pipeline 1 | 1 does."""
    problem, arrays = chain([1.0, 1.0], params=[30e9, 30e9], nbytes=0.0)
    roomy, _ = plan_cluster(problem, arrays, devices(2, train=False, memory_gb=80))
    assert (roomy.stage_of, roomy.replicas) == ([0, 0], [2])
    tight, _ = plan_cluster(problem, arrays, devices(2, train=False, memory_gb=40))
    assert (tight.stage_of, tight.replicas) == ([0, 1], [1, 1])
    assert max(tight.memory_bytes) == pytest.approx(30e9, rel=0.01) and max(
        tight.sim.peak_memory_bytes.values()) <= 40e9


def test_nothing_fits_is_an_error() -> None:
    problem, arrays = chain([1.0] * 3, params=[50e9] * 3)  # 200 GB a node with Adam's state
    with pytest.raises(PartitionError, match=(
            r"no plan fits in 80 GB per device on 4 devices: the plan needing the least "
            r"\(3 stages, replicas \[1, 1, 1\]\) is over it in stage 0 \(position 0\) needs "
            r"200 GB, 120 GB over; stage 1 \(position 1\) needs 200 GB, 120 GB over; ")):
        plan_cluster(problem, arrays, devices(4, train=True))
    with pytest.raises(PartitionError, match=r"least \(2 stages, replicas \[1, 1\]\) is over "
                                             r"it in .* stage 1 \(positions 1..2\) needs 400 GB"):
        plan_cluster(problem, arrays, devices(4, train=True), num_stages=2)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_a_fixed_depth_is_kept(stages: int) -> None:
    problem, arrays = chain([1.0, 2.0, 3.0, 4.0])
    plan, _ = plan_cluster(problem, arrays, devices(4, train=True), num_stages=stages)
    assert plan.num_stages == stages and problem.is_valid(plan.stage_of, stages)
    assert sum(plan.replicas) <= 4


# ------------------------------------------------------------------------------ properties


def proposals(case: Case, run: RunSpec) -> list[tuple[list[int], list[int]]]:
    """Every proposal plan_cluster weighs, polished grid cuts included."""
    problem, arrays = case
    found = []
    for ordering in planner.HYBRID_ORDERINGS:
        found += dp_candidates(problem, arrays, run, ordering)
    found += grid_candidates(problem, arrays, run, budgets=machine_budgets(run.cluster))
    found += downset_candidates(problem, arrays, run)
    plans = [(p.stage_of, p.replicas) for p in found]
    plans += [(p.polish(), p.replicas) for p in found if p.polish is not None]
    return plans


@settings(max_examples=40, deadline=None)
@given(case=dags(max_nodes=7), count=st.sampled_from([1, 2, 4]), train=st.booleans(),
       machines=st.sampled_from([1, 2]))
def test_the_plan_is_never_worse_than_any_proposal(case: Case, count: int, train: bool,
                                                   machines: int) -> None:
    problem, arrays = case
    run = run_on(max(count, machines), train=train, gbps=10.0, machines=machines)
    plan, _ = plan_cluster(problem, arrays, run)
    assert problem.is_valid(plan.stage_of, plan.num_stages)
    assert sum(plan.replicas) <= run.cluster.devices
    assert max(plan.memory_bytes) <= run.cluster.memory_bytes
    again = score(problem, arrays, plan.stage_of, plan.replicas, run, plan.source)
    assert again.sim.iteration_ms == pytest.approx(plan.sim.iteration_ms)
    for stage_of, replicas in proposals(case, run):
        _, memory = pipeline_costs(problem, arrays, stage_of, replicas, run)
        if max(memory) <= run.cluster.memory_bytes:
            other = score(problem, arrays, stage_of, replicas, run, "proposal")
            # never worse, but for the devices rule: within 2% of the fastest, fewer devices
            assert plan.sim.iteration_ms <= other.sim.iteration_ms * (1.02 + 1e-9), (
                stage_of, replicas)
            if plan.sim.iteration_ms > other.sim.iteration_ms * (1 + 1e-9):
                assert sum(plan.replicas) < sum(replicas), (stage_of, replicas)


def test_polishing_replicas_never_slows_a_plan() -> None:
    problem, arrays = chain([1.0, 4.0, 1.0], params=[0.0, 1e6, 0.0])
    run = devices(6, train=True)
    start = score(problem, arrays, [0, 1, 2], [1, 1, 1], run, "start")
    polished = polish_replicas(problem, arrays, start, run)
    assert polished.stage_of == [0, 1, 2] and sum(polished.replicas) <= 6
    assert polished.sim.iteration_ms < start.sim.iteration_ms  # the 4 ms stage gets replicas
    assert polished.replicas[1] > 1
    assert polish_replicas(problem, arrays, start, run, budget=0) is start


# ------------------------------------------------------------------------------ helpers


def test_coarse_blocks_keep_narrow_points_down_to_max_positions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """50 unit nodes in a chain (every point narrow) and at most 10 positions: every 5th."""
    problem, _ = chain([1.0] * 50)
    order = list(range(50))
    assert _coarse_blocks(order, problem, 2).bounds == list(range(51))  # under the limit
    monkeypatch.setattr(planner, "MAX_POSITIONS", 10)
    assert _coarse_blocks(order, problem, 2).bounds == list(range(0, 51, 5))


@settings(max_examples=20, deadline=None)
@given(case=dags(max_nodes=12), limit=st.integers(1, 6))
def test_coarse_blocks_are_a_subset_of_the_narrow_points(case: Case, limit: int) -> None:
    problem, _ = case
    order = list(sequence_for(problem, "dfs"))
    allowed = cluster_blocks(problem, order, problem.compute_ms, 2).bounds
    original = planner.MAX_POSITIONS
    planner.MAX_POSITIONS = limit
    try:
        kept = _coarse_blocks(order, problem, 2).bounds
    finally:
        planner.MAX_POSITIONS = original
    assert kept[0] == 0 and kept[-1] == problem.num_nodes
    assert kept == sorted(set(kept)) and set(kept) <= set(allowed)
    if len(allowed) - 1 > limit:  # coarsened: every block but the last carries its share
        total = sum(problem.compute_ms)
        for lo, hi in itertools.pairwise(kept[:-1]):
            assert sum(problem.compute_ms[v] for v in order[lo:hi]) >= total / limit * (1 - 1e-9)


def test_assign_maps_sequence_positions_back_to_nodes() -> None:
    assert assign([2, 0, 1], [0, 1, 3]) == [1, 1, 0]
    assert assign([0, 1, 2, 3], [0, 2, 3, 4]) == [0, 0, 1, 2]


def test_replica_moves_are_one_device_away() -> None:
    assert list(_replica_moves([1, 2], 4)) == [[2, 2], [1, 3], [1, 1], [2, 1]]
    assert list(_replica_moves([1, 1], 2)) == []
    assert list(_replica_moves([3], 3)) == [[2]]


def test_machine_budgets_double_short_of_the_cluster() -> None:
    assert machine_budgets(Cluster(5, 4)) == [4, 8, 16]
    assert machine_budgets(Cluster(4, 2)) == [2, 4]
    assert machine_budgets(Cluster(1, 8)) == []


def test_estimate_is_fill_plus_periods_plus_the_slowest_allreduce() -> None:
    stages = [HybridStage(0, 1, 1, 2.0, 2.0, 0.0, 0.5, 0.0, 2.0),
              HybridStage(1, 3, 2, 6.0, 6.0, 0.0, 1.5, 0.0, 3.0)]
    # fill 2 + 6; the busiest replica's other micro-batches: stage 1's replicas take 4 of
    # the 8 each, 3 more of 6 ms (stage 0: 7 more of 2); all-reduce 1.5
    assert estimate_ms(stages, devices(3, train=True)) == pytest.approx(8 + 3 * 6 + 1.5)
