"""The bound on the simulated iteration of every plan of a sequence
(:func:`onnx_partition.solve.hybrid_proof.iteration_bound`, issue 36 item 4): brute force over
every split and replica count of tiny chains, the record's ``gap`` and the summary's words."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.graphs import CHAIN, save
from support.hybrid_brute import compositions
from support.problems import chain

from onnx_partition.cli import main
from onnx_partition.cli.summary.partition import proof_line
from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.cost.engine_price import EngineTerms
from onnx_partition.plan import read_plan
from onnx_partition.solve.hybrid_proof import (
    HybridProof,
    iteration_bound,
    least_counts,
    prove_hybrid,
)
from onnx_partition.solve.planner import dp_sequence, plan_cluster
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec, lower_bound_ms, score


def heavy_chain() -> tuple[DagProblem, NodeArrays, RunSpec]:
    """Three nodes, 1 GB of weights each over 1 GB/s, 1 MB between nodes, in training."""
    problem, arrays = chain([1.0, 2.0, 1.0], params=[1e9, 1e9, 1e9], nbytes=1e6)
    run = RunSpec(Cluster(1, 3, memory_gb=80, kind="cuda", intra=Link(1.0, 0.0)), train=True,
                  microbatches=8)
    return problem, arrays, run


def test_the_tiny_chains_record_says_the_plan_is_not_proven_optimal() -> None:
    """Stages 1 | 2 | 1 ms forward (3 | 6 | 3 with backward), 1 ms per transfer, 8
    micro-batches: the DP's period (10 ms) is proven least, yet the plan simulates 57 ms and
    nothing proves that least. The middle stage forces 53 ms on any plan: micro-batch 0's
    forward over block 0 and its transfer (2 ms), its 8 x 6 ms, the last gradient's transfer
    and backward over block 0 (3 ms); two replicas of it would all-reduce 1 GB at 1 GB/s."""
    problem, arrays, run = heavy_chain()
    plan, _ = plan_cluster(problem, arrays, run)
    assert (plan.replicas, plan.sim.iteration_ms) == ([1, 1, 1], pytest.approx(57.0))
    proof = prove_hybrid(problem, arrays, run, plan)
    assert (proof.proven, proof.period_ms) == (True, pytest.approx(10.0))
    assert proof.iteration_bound_ms == pytest.approx(53.0)
    assert proof.iteration_gap == pytest.approx(4.0 / 57.0)
    body = proof.to_json(1.0)
    assert (body["proven_optimal"], body["period_proven"]) == (False, True)
    assert (body["gap"], body["iteration_bound_ms"], body["iteration_ms"]) == (
        round(4.0 / 57.0, 6), 53.0, 57.0)


def test_least_counts_keep_the_least_of_each_share() -> None:
    # ceil(8 / r) for r = 1..8: 8 4 3 2 2 2 2 1
    assert least_counts(16, 8).tolist() == [1, 2, 3, 4, 8]
    assert least_counts(3, 8).tolist() == [1, 2, 3]


def plans_of(bounds: list[int], devices: int, microbatches: int, most_stages: int):
    """Every split of the blocks into contiguous stages and every replica count per stage
    (at most ``min(D, M)`` each, ``D`` in all)."""
    n = len(bounds) - 1
    for depth in range(1, min(n, most_stages, devices) + 1):
        for cuts in itertools.combinations(range(1, n), depth - 1):
            edges = [0, *cuts, n]
            for total in range(depth, devices + 1):
                for replicas in compositions(total, depth, min(devices, microbatches)):
                    yield edges, list(replicas)


@settings(max_examples=60, deadline=None)
@example(compute=[0.5, 0.5, 0.5], params=0.0, nbytes=0.0, shape=(1, 3), train=True,
         schedule="zb-h1", microbatches=1, memory_gb=80.0, engine=False)  # a hop's latency
@given(compute=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=4),
       params=st.sampled_from([0.0, 1e6, 3e7]), nbytes=st.sampled_from([0.0, 1e5, 2e6]),
       shape=st.sampled_from([(1, 2), (1, 3), (2, 2), (1, 4)]), train=st.booleans(),
       schedule=st.sampled_from(["1f1b", "zb-h1"]), microbatches=st.sampled_from([1, 2, 3, 5]),
       memory_gb=st.sampled_from([80.0, 0.05]), engine=st.booleans())
def test_no_plan_of_the_sequence_simulates_below_the_bound(
        compute, params, nbytes, shape, train, schedule, microbatches, memory_gb,
        engine) -> None:
    """Brute force: every plan of the sequence within memory simulates at or above the
    bound; with free links, no engine and memory not binding it is at least the least of the
    plans' own lower bounds (:func:`lower_bound_ms`, whose every term it counts), so its
    search over the splits misses no plan."""
    problem, arrays = chain(compute, params=[params] * len(compute), nbytes=nbytes)
    machines, per = shape
    free = nbytes == 0.0
    terms = EngineTerms(1e-9, 0.3, 1e-9, 0.05, 0.1, {}) if engine and train else None
    latency = 0.0 if free else 1.0  # free links: no bytes and no latency per hop
    cluster = Cluster(machines, per, memory_gb=memory_gb, kind="cuda",
                      intra=Link(2.0, 0.01 * latency), inter=Link(0.5, 0.05 * latency))
    run = RunSpec(cluster, train=train, microbatches=microbatches, train_schedule=schedule,
                  engine=terms)
    sequence = dp_sequence(problem, arrays, run, list(range(problem.num_nodes)))
    bound = iteration_bound(sequence, run)
    least, least_lb = math.inf, math.inf
    for edges, replicas in plans_of(sequence.bounds, cluster.devices, microbatches,
                                    run.max_stages):
        stage_of = [0] * problem.num_nodes
        for k, (lo, hi) in enumerate(itertools.pairwise(edges)):
            for v in sequence.order[sequence.bounds[lo]:sequence.bounds[hi]]:
                stage_of[v] = k
        plan = score(problem, arrays, stage_of, replicas, run, "brute")
        if max(plan.memory_bytes) > cluster.memory_bytes:
            continue
        least = min(least, plan.sim.iteration_ms)
        least_lb = min(least_lb, lower_bound_ms(plan.costs, microbatches, train,
                                                split=run.schedule == "zb-h1"))
    assert bound <= least * (1 + 1e-9)
    if free and terms is None and memory_gb == 80.0 and machines == 1:
        assert bound >= least_lb * (1 - 1e-9)


def test_the_summary_says_proven_optimal_only_of_a_plan_meeting_the_bound(tmp_path) -> None:
    model = save(CHAIN, tmp_path / "m.onnx")
    assert main(["partition", str(model), "--devices", "2", "--mode", "train", "--no-program",
                 "--batch-size", "2", "-o", str(tmp_path / "a")]) == 0
    plan = read_plan(tmp_path / "a")
    problem, arrays, run = heavy_chain()
    scored, _ = plan_cluster(problem, arrays, run)
    plan.extra["exact"] = prove_hybrid(problem, arrays, run, scored).to_json(1.0)
    line = proof_line(plan)
    assert line is not None and line.startswith(
        "plan quality: not proven optimal; simulated iteration 57 ms, within 7.02% of 53 ms, "
        "a bound no plan over the topo sequence (3 blocks")
    assert "the DP's least bottleneck period, 10 ms per micro-batch, proven least (CP-SAT" in line
    assert "proven optimal " not in line
    met = HybridProof(True, "cp-sat", "topo", 3, 3, 10.0, 10.0, 0.0, 10.0, 0.1,
                      iteration_bound_ms=53.0, iteration_ms=53.0)
    plan.extra["exact"] = met.to_json(1.0)
    assert (proof_line(plan) or "").startswith(
        "plan quality: proven optimal over the topo sequence (3 blocks")
