"""Devices cost (issue 22 item 5): no stage more replicas than micro-batches, the fewest devices
among plans within 2% of the fastest, and the summary's lines on devices."""

from __future__ import annotations

import pytest
from support.problems import chain

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.planner import DEVICE_SLACK, estimate_ms, fewest_devices, plan_cluster
from onnx_partition.solve.scoring import RunSpec, score


def devices(n: int, microbatches: int, *, train: bool = False) -> RunSpec:
    cluster = Cluster(1, n, memory_gb=80.0, kind="cuda", intra=Link(1000.0, 0.0))
    return RunSpec(cluster, train=train, microbatches=microbatches)


def test_no_stage_gets_more_replicas_than_microbatches_and_the_summary_says_why():
    """Nodes of 1 and 3 ms on 8 devices with 2 micro-batches: a replica beyond the second of a
    stage would get none, so at most 2 per stage; the summary names the micro-batches."""
    problem, arrays = chain([1.0, 3.0], nbytes=0.0)
    run = devices(8, 2)
    plan, _ = plan_cluster(problem, arrays, run)
    assert max(plan.replicas) <= 2 and sum(plan.replicas) < 8
    unused = 8 - sum(plan.replicas)
    assert any(note.startswith(f"devices: {unused} of 8 unused: 2 micro-batches feed at most 2 "
                               "replicas of a stage") for note in plan.notes), plan.notes


def test_within_two_percent_the_fewest_devices_win():
    """Inference, 4 micro-batches: 8 replicas of the whole chain run no faster than 4 (replica
    j takes micro-batches m = j mod r: 4 of the 8 get none)."""
    problem, arrays = chain([1.0, 3.0], nbytes=0.0)
    run = devices(8, 4)
    wide = score(problem, arrays, [0, 0], [8], run, "wide")
    lean = score(problem, arrays, [0, 0], [4], run, "lean")
    assert wide.sim.iteration_ms == pytest.approx(lean.sim.iteration_ms) == pytest.approx(4.0)
    chosen = fewest_devices(wide, [lean], run)
    assert chosen.replicas == [4]
    assert chosen.notes[0] == ("devices: 8 devices would buy 0.00% (4 ms per iteration against "
                               "4 ms on 4); within 2% of the fastest the fewest devices win")
    # a plan more than DEVICE_SLACK slower does not win on devices
    slow = score(problem, arrays, [0, 0], [2], run, "slow")
    assert slow.sim.iteration_ms > lean.sim.iteration_ms * (1 + DEVICE_SLACK)
    assert fewest_devices(lean, [slow], run).replicas == [4]


def test_plans_using_every_device_usefully_are_kept():
    """8 micro-batches on 8 devices: every replica works, the plan and its time are those the
    planner gave before devices had a cost (issue 22)."""
    problem, arrays = chain([1.0, 3.0], nbytes=0.0)
    plan, _ = plan_cluster(problem, arrays, devices(8, 8))
    assert (plan.stage_of, plan.replicas) == ([0, 0], [8])
    assert plan.sim.iteration_ms == pytest.approx(4.0) and plan.notes == []


@pytest.mark.parametrize("train", [False, True])
def test_closed_form_is_the_simulated_iteration_when_microbatches_are_few(train: bool):
    """8 stages, 2 micro-batches: the bottleneck alone says 2 periods, the iteration is fill
    and drain, (M + S - 1) stage times; the planner's closed form counts them as the
    simulator does."""
    problem, arrays = chain([1.0] * 8, nbytes=0.0)
    run = devices(8, 2, train=train)
    costs = SequenceCosts([1.0] * 8, [2.0] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 9)
    (stages,) = plan_hybrid(costs, HybridConfig(devices=8, microbatches=2, train=train,
                                                depth=8))
    simulated = score(problem, arrays, list(range(8)), [1] * 8, run, "pipeline").sim
    per_stage = 3.0 if train else 1.0
    assert estimate_ms(stages, run) == simulated.iteration_ms == pytest.approx(9 * per_stage)
