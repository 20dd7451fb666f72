"""The fleet DP and its scoring under ZB-H1 (issue 33 item 3): the output gradients kept from
``I`` to ``W`` count in a stage's memory (none in stage 0), in the DP as a bound like its held
micro-batches and in the scoring exactly as pipeline/memory.py counts them."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from support.fleet_brute import brute_fleet, two_groups
from support.problems import chain

from onnx_partition.cost.cluster import Fleet, GpuGroup, Link
from onnx_partition.pipeline.memory import StageBytes, kept_held, memory_per_device
from onnx_partition.solve.fleet_dp import FleetSequence, fleet_dp, stage_period
from onnx_partition.solve.fleet_scoring import KindCosts, place_on_groups, score_fleet
from onnx_partition.solve.scoring import RunSpec

#: Two positions on one group of two A100s of 9000 B, two micro-batches, Adam (x4): the DP
#: bounds held micro-batches by ceil(M / r) = 2 on one replica. Stage [0, 1): 4 x 1000 + 1000
#: (the gradient buffer of its send) + 2 x 1000 = 7000 B; stage [1, 2): 4000 + 2 x (1000 +
#: 1000 received) = 8000 B, and under ZB-H1 + 2 x 3000 kept = 14000 B (its 5000 B at stage 0
#: are not kept: it receives no activation). One stage on both positions: 8000 + 2 x 2000 =
#: 12000 B on one replica, 8000 + 2000 = 10000 B on two. So only the two-stage plan fits, and
#: only without the kept gradients.
SEQ = FleetSequence([[1.0, 1.0]], [[1.0, 1.0]], [1000.0, 1000.0], [1000.0, 1000.0],
                    [0.0, 1000.0, 0.0], kept_bytes=[5000.0, 3000.0])
FLEET = Fleet(groups=(GpuGroup("a100-80gb", 1, 2, 9e-6, Link(0.0, 0.0)),),
              inter=Link(0.0, 0.0))
ZB = RunSpec(FLEET.clusters[0], train=True, microbatches=2, train_schedule="zb-h1")


def test_the_fleet_dp_fits_zb_without_the_kept_term_and_not_with_it():
    two = [(0, 1, 0, 1, False), (1, 2, 0, 1, False)]
    assert fleet_dp(SEQ, FLEET, ZB, (0,)) == (math.inf, [])
    unkept = replace(SEQ, kept_bytes=[])
    assert fleet_dp(unkept, FLEET, ZB, (0,)) == (2.0, two)
    one_f = replace(ZB, train_schedule="1f1b")  # 1F1B keeps nothing from I to W
    assert fleet_dp(SEQ, FLEET, one_f, (0,)) == (2.0, two)
    # the scalar statement agrees: the second stage is out only with the kept gradients
    assert stage_period(SEQ, FLEET, ZB, 0, 1, 2, 1, Link(0.0, 0.0), None) == math.inf
    assert stage_period(SEQ, FLEET, ZB, 0, 0, 1, 1, None, Link(0.0, 0.0)) == 2.0
    assert stage_period(unkept, FLEET, ZB, 0, 1, 2, 1, Link(0.0, 0.0), None) == 2.0
    # a recomputing stage keeps its inputs and, under ZB-H1, rebuilds the activations of the
    # micro-batches whose gradients it keeps: 4000 + 2 x 1000 + 2 x (1000 + 3000) > 9000
    assert fleet_dp(SEQ, FLEET, ZB, (0,), recompute="auto") == (math.inf, [])
    roomy = Fleet(groups=(GpuGroup("a100-80gb", 1, 2, 14e-6, Link(0.0, 0.0)),),
                  inter=Link(0.0, 0.0))
    assert fleet_dp(SEQ, roomy, replace(ZB, cluster=roomy.clusters[0]), (0,)) == (2.0, two)


def test_the_fleet_scoring_counts_the_kept_gradients_as_the_memory_model_does():
    """A four-node chain cut 2 + 2 on one A100 and one V100: scored under ZB-H1, each stage's
    memory is memory_per_device's of its bytes with the kept gradients (stage 0's none), the
    simulator is handed them, and a memory that fits the plan without them refuses it."""
    problem, arrays = chain([4.0, 4.0, 1.0, 1.0], [100.0] * 4)
    kept = [50.0, 60.0, 70.0, 80.0]
    arrays = replace(arrays, kept_bytes=kept)
    fwd, bwd = list(problem.compute_ms), list(arrays.backward_ms)
    kinds = {"a100-80gb": KindCosts(fwd, bwd), "v100": KindCosts(fwd, bwd)}

    def scored(memory_gb: float, keeps: list[float], schedule: str = "zb-h1"):
        fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, 1, memory_gb),
                              GpuGroup("v100", 1, 1, memory_gb)), inter=Link(1.0, 0.01))
        run = RunSpec(fleet.clusters[0], train=True, microbatches=4, train_schedule=schedule)
        return score_fleet(problem, replace(arrays, kept_bytes=keeps), kinds, fleet, run,
                           [0, 0, 1, 1], place_on_groups(fleet, [0, 1], [1, 1]), "fleet:test")

    plan = scored(1.0, kept)
    assert plan is not None
    sizes = [StageBytes(200.0, 20.0, 0.0, 10.0, None, 0.0),
             StageBytes(200.0, 20.0, 10.0, 0.0, None, 150.0)]
    assert plan.memory_bytes == memory_per_device(sizes, [1, 1], 4, schedule="zb-h1")
    unkept = scored(1.0, [])
    assert unkept is not None
    assert [a - b for a, b in zip(plan.memory_bytes, unkept.memory_bytes)] == [
        0.0, kept_held("zb-h1", [1, 1], 4)[1] * 150.0]
    assert [s.kept_bytes for s in plan.costs.stages] == [0.0, 150.0]
    unkept_sizes = [replace(s, kept=0.0) for s in sizes]
    assert unkept.memory_bytes == memory_per_device(unkept_sizes, [1, 1], 4, schedule="zb-h1")
    one_f = scored(1.0, kept, "1f1b")  # 1F1B: no kept gradients
    assert one_f is not None
    assert one_f.memory_bytes == memory_per_device(sizes, [1, 1], 4, schedule="1f1b")
    limit = max(unkept.memory_bytes) / 1e9
    assert scored(limit, []) is not None and scored(limit, kept) is None


@pytest.mark.parametrize("seed", range(40))
def test_the_zb_fleet_dp_is_exact_against_brute_force(seed):
    """Random sequences with kept gradients on two groups under ZB-H1: the DP's least period is
    the enumeration's over :func:`stage_period` (the DP's scalar statement, with the kept
    term), every ordering (the kept gradients change ordering (0, 1)'s answer on 12 seeds)."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    fleet = two_groups(rng)
    run = RunSpec(fleet.clusters[0], train=True, microbatches=rng.randint(1, 4),
                  train_schedule="zb-h1")
    fwd = [rng.uniform(0.1, 3.0) for _ in range(n)]

    def draw() -> list[float]:
        return [rng.uniform(0, 3e3) for _ in range(n)]

    seq = FleetSequence([fwd, [2 * f for f in fwd]], [[2 * f for f in fwd], [4 * f for f in fwd]],
                        draw(), draw(), [0.0, *(rng.uniform(0, 3e3) for _ in range(n - 1)), 0.0],
                        kept_bytes=[3 * k for k in draw()])
    for ordering in [(0, 1), (1, 0)]:
        value, _ = fleet_dp(seq, fleet, run, ordering)
        assert value == pytest.approx(brute_fleet(seq, fleet, run, ordering), rel=1e-9)
