"""The one memory model (pipeline/memory.py): closed forms equal to the simulator, and the
planner never returns a plan its simulator finds over the device memory."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.problems import Case, dags

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import (
    StageBytes,
    memory_per_device,
    peak_inflight,
    ring_allreduce_ms,
)
from onnx_partition.pipeline.schedules import gpipe, inference, one_f_one_b
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts
from onnx_partition.pipeline.simulate import simulate as play
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.scoring import RunSpec, pipeline_costs

BUILDERS = {"1f1b": one_f_one_b, "gpipe": gpipe, "infer": inference}


def per_stage(values: dict[tuple[int, int], float], num_stages: int) -> list[float]:
    """The fullest replica's figure per stage."""
    return [max(v for (s, _), v in values.items() if s == k) for k in range(num_stages)]


def test_ring_allreduce_exact():
    assert ring_allreduce_ms(1000.0, 1, 10.0, 0.5) == 0.0
    # 2 (4-1)/4 * 1000 / 10 + 2 * 3 * 0.5 = 150 + 3
    assert ring_allreduce_ms(1000.0, 4, 10.0, 0.5) == pytest.approx(153.0)


def test_inflight_closed_forms_on_small_cases():
    assert peak_inflight("1f1b", [1, 1, 1, 1], 8) == [4, 3, 2, 1]  # Megatron: p - s
    assert peak_inflight("1f1b", [1, 1, 1, 1], 2) == [2, 2, 2, 1]  # min(p - s, M)
    assert peak_inflight("1f1b", [2, 2, 2], 16) == [3, 2, 1]  # each replica its own 1F1B
    # issue 10's plan: steps 1, 1, 2, 2+3-1 -> warm-up 8 at stage 0, 9 in flight
    assert peak_inflight("1f1b", [1, 1, 1, 2, 3], 32) == [9, 8, 7, 3, 1]
    assert peak_inflight("gpipe", [1, 3], 8) == [8, 3]
    assert peak_inflight("infer", [1, 3], 8) == [1, 1]


def test_closed_form_equals_the_simulator_exhaustively():
    """Every replica shape of up to 4 stages of 1-3 replicas, 1-9 micro-batches, three
    schedules: the simulator's peak per stage is the closed form's, byte for byte."""
    for p in range(1, 5):
        for replicas in itertools.product((1, 2, 3), repeat=p):
            for m in (1, 2, 3, 5, 9):
                sizes = [StageBytes(10.0 * (k + 1), 100.0 + k, 7.0 * k, 3.0 * (k + 1 < p))
                         for k in range(p)]
                for schedule, build in BUILDERS.items():
                    train = schedule != "infer"
                    memory = memory_per_device(sizes, replicas, m, schedule=schedule)
                    costs = PipelineCosts(
                        [StageCosts(1.0 + k, 2.0 if train else 0.0, d, 0.0,
                                    s.activations + s.received,
                                    4.0 * s.params + s.sent if train else s.params)
                         for k, (s, d) in enumerate(zip(sizes, replicas))], [0.1] * (p - 1))
                    sim = play(build(p, m, list(replicas)), costs)
                    assert per_stage(sim.peak_memory_bytes, p) == memory, (
                        schedule, replicas, m)


@st.composite
def replica_shapes(draw: st.DrawFn, n: int, devices: int) -> tuple[list[int], list[int]]:
    """A contiguous split of nodes 0..n-1 (a topological order) and replicas per stage."""
    p = draw(st.integers(1, min(n, devices, 4)))
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=p - 1, max_size=p - 1,
                                unique=True))) if p > 1 else []
    bounds = [0, *cuts, n]
    stage_of = [k for k, (i, j) in enumerate(itertools.pairwise(bounds)) for _ in range(i, j)]
    replicas = draw(st.lists(st.integers(1, 4), min_size=len(bounds) - 1,
                             max_size=len(bounds) - 1))
    return stage_of, replicas


@settings(max_examples=25, deadline=None)
@given(case=dags(max_nodes=10), machines=st.sampled_from([1, 2]),
       per_machine=st.sampled_from([2, 3, 4]), train=st.booleans(),
       microbatches=st.sampled_from([1, 3, 8, 16]),
       share=st.sampled_from([0.2, 0.4, 0.7, 1.0, math.inf]), data=st.data())
def test_planner_fits_means_simulator_fits(case: Case, machines: int, per_machine: int,
                                           train: bool, microbatches: int, share: float,
                                           data: st.DataObject) -> None:
    """Random DAGs, clusters, memory limits (a share of what one device would need for the
    whole model) and replica shapes. Any replica shape: the scorer's memory per stage equals
    the simulator's. The planner's plan: within the limit in the simulator, same figures."""
    problem, arrays = case
    whole = memory_per_device(
        [StageBytes(sum(arrays.param_bytes), sum(arrays.activation_bytes))], [1],
        microbatches, schedule="1f1b" if train else "infer")[0]
    limit = share * whole if share < math.inf and whole >= 1 else math.inf  # whole bytes
    cluster = Cluster(machines, per_machine, memory_gb=limit / 1e9, kind="cuda",
                      intra=Link(10.0, 0.01), inter=Link(1.0, 0.05))
    run = RunSpec(cluster, train=train, microbatches=microbatches)
    stage_of, replicas = data.draw(replica_shapes(problem.num_nodes, cluster.devices))
    if sum(replicas) <= cluster.devices:
        costs, memory = pipeline_costs(problem, arrays, stage_of, replicas, run)
        build = BUILDERS[run.schedule]
        sim = play(build(len(replicas), microbatches, replicas), costs)
        assert per_stage(sim.peak_memory_bytes, len(replicas)) == memory
    try:
        plan, _ = plan_cluster(problem, arrays, run)
    except PartitionError as exc:
        assert "fit" in str(exc)
        return
    simulated = per_stage(plan.sim.peak_memory_bytes, plan.num_stages)
    assert max(simulated) <= cluster.memory_bytes
    assert plan.memory_bytes == simulated


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_partition_table_and_simulate_state_the_same_memory(tmp_path, mode):
    """plan.json's ``predicted.memory_bytes`` (partition's table, report) is what ``simulate``
    replays from the plan for every stage, on a plan with unequal replicas."""
    from support.graphs import CHAIN, save

    from onnx_partition.partition import partition
    from onnx_partition.pipeline.from_plan import simulate_plan

    model = save(CHAIN, tmp_path / "m.onnx")
    plan = partition(model, 2, tmp_path / "out", batch_size=64, mode=mode, microbatches=6,
                     cluster=Cluster(devices_per_machine=5, memory_gb=1.0))
    result, _ = simulate_plan(plan)
    stated = [s.predicted.memory_bytes for s in plan.stages if s.predicted]
    assert stated == [int(m) for m in per_stage(result.peak_memory_bytes, len(plan.stages))]


def test_memory_parts_add_up_to_the_one_formula() -> None:
    from onnx_partition.pipeline.memory import StageBytes, memory_parts, memory_per_device

    stages = [StageBytes(100.0, 40.0, 0.0, 8.0), StageBytes(60.0, 30.0, 8.0, 0.0)]
    peaks = memory_per_device(stages, [1, 1], 4, schedule="1f1b")
    parts = [memory_parts(s, h, train=True) for s, h in zip(stages, [2, 1], strict=True)]
    assert [p["memory_bytes"] for p in parts] == [int(m) for m in peaks] == [488, 278]
    first = parts[0]
    assert (first["weights_bytes"], first["grad_bytes"], first["optimizer_bytes"],
            first["activation_bytes"], first["inflight"], first["buffer_bytes"]) == (
        100, 100, 200, 40, 2, 8)
    assert parts[1]["buffer_bytes"] == 8  # one micro-batch in flight: its received input
    for p in parts:
        assert p["memory_bytes"] == (p["weights_bytes"] + p["grad_bytes"] + p["optimizer_bytes"]
                                     + p["inflight"] * p["activation_bytes"]
                                     + p["buffer_bytes"])
