"""What is proven of a hybrid plan (:mod:`onnx_partition.solve.hybrid_proof`, issue 22 item 3):
the hybrid DP's least bottleneck period over its sequence, proven by CP-SAT's judge asked for a
plan below it, or its gap to a bound; plan.json's ``exact`` and the summary say which."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.graphs import CHAIN, save
from support.problems import chain

from onnx_partition.cli import main
from onnx_partition.cli.summary.partition import proof_line
from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.plan import read_plan
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.hybrid_judge import judge_hybrid
from onnx_partition.solve.hybrid_proof import OBJECTIVE, HybridProof, prove_hybrid
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec


def heavy_chain() -> tuple[DagProblem, NodeArrays, RunSpec]:
    """Three nodes, 1 GB of weights each over 1 GB/s, 1 MB between nodes: training pipelines
    (all-reduce would cost seconds), so the least period is no trivial bound."""
    problem, arrays = chain([1.0, 2.0, 1.0], params=[1e9, 1e9, 1e9], nbytes=1e6)
    run = RunSpec(Cluster(1, 3, memory_gb=80, kind="cuda", intra=Link(1.0, 0.0)), train=True,
                  microbatches=8)
    return problem, arrays, run


def test_a_small_hybrid_plan_is_proven_by_the_judge() -> None:
    problem, arrays, run = heavy_chain()
    plan, _ = plan_cluster(problem, arrays, run)
    proof = prove_hybrid(problem, arrays, run, plan)
    assert (proof.proven, proof.by, proof.positions, proof.devices) == (True, "cp-sat", 3, 3)
    # stages 1 | 2 | 1 ms forward (3 | 6 | 3 with backward), 1 ms each way per boundary:
    # the middle stage's 6 + 4 ms; CP-SAT's plain optimum agrees
    assert proof.period_ms == pytest.approx(10.0)
    assert proof.plan_period_ms == pytest.approx(10.0)
    assert proof.gap == pytest.approx(0.0, abs=1e-8)
    assert proof.lower_bound_ms == pytest.approx(10.0)


def memory_bound() -> tuple[DagProblem, NodeArrays, RunSpec]:
    """Twelve nodes in training on 4 devices of 5 GB, where 1F1B's memory binds: the plan
    (replicas 2, 1, 1) is found only in front of its neighbours' warm-ups."""
    compute = [1.0 + (7 * i % 5) for i in range(12)]  # 34 ms forward, 68 ms backward
    problem, arrays = chain(compute, params=[1e8 + 3e7 * (i % 3) for i in range(12)],
                            nbytes=3e8)
    run = RunSpec(Cluster(1, 4, memory_gb=5.0, kind="cuda", intra=Link(10.0, 0.0)),
                  train=True, microbatches=8)
    return problem, arrays, run


def test_an_unproven_period_reports_its_gap_to_a_bound() -> None:
    problem, arrays, run = memory_bound()
    plan, _ = plan_cluster(problem, arrays, run)
    assert plan.replicas == [2, 1, 1]
    short = prove_hybrid(problem, arrays, run, plan, budget_s=1e-9)
    assert (short.proven, short.by) == (False, "budget")
    # the bound left: all compute, 102 ms, over the 4 devices
    assert short.lower_bound_ms == pytest.approx(25.5)
    assert short.period_ms == pytest.approx(144.0)
    assert short.gap == pytest.approx(1 - 25.5 / 144.0) and short.gap >= 0
    proof = prove_hybrid(problem, arrays, run, plan)
    assert (proof.proven, proof.by, proof.period_ms) == (True, "cp-sat", short.period_ms)


def test_sizes_and_switches_not_judged() -> None:
    problem, arrays, run = heavy_chain()
    plan, _ = plan_cluster(problem, arrays, run)
    size = prove_hybrid(problem, arrays, run, plan, max_cells=26)
    assert (size.proven, size.by, size.positions, size.period_ms) == (False, "size", 3, None)
    assert prove_hybrid(problem, arrays, run, plan, budget_s=0).by == "off"
    # data parallel inference: all compute over all devices, met without CP-SAT
    problem, arrays = chain([1.0, 3.0], nbytes=0.0)
    infer = RunSpec(Cluster(1, 2, memory_gb=80, kind="cuda", intra=Link(1000.0, 0.0)))
    plan, _ = plan_cluster(problem, arrays, infer)
    bound = prove_hybrid(problem, arrays, infer, plan)
    assert (bound.proven, bound.by, bound.period_ms) == (True, "bound", 2.0)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 6), devices=st.integers(1, 4), train=st.booleans(), data=st.data())
def test_the_judge_finds_no_plan_below_the_dps_period(n, devices, train, data) -> None:
    """Differential: asked for a plan below the DP's least period CP-SAT proves there is none;
    asked at the DP's period it finds one (memory binding or not)."""
    ints = st.integers(0, 9).map(float)
    costs = SequenceCosts(*(data.draw(st.lists(ints, min_size=n, max_size=n)) for _ in range(4)),
                          [0.0, *data.draw(st.lists(ints, min_size=n - 1, max_size=n - 1)),
                           0.0])
    config = HybridConfig(
        devices=devices, train=train, microbatches=data.draw(st.sampled_from([1, 2, 4, 8])),
        memory_bytes=data.draw(st.sampled_from([math.inf, 40.0, 150.0])),
        link_bytes_per_ms=data.draw(st.sampled_from([math.inf, 2.0])), link_latency_ms=0.5)
    try:
        least = max(s.period_ms for s in plan_hybrid(costs, config)[0])
    except PartitionError:
        return  # no plan fits: test_hybrid_judge checks the judge agrees
    below = judge_hybrid(costs, config, below_ms=least * (1 - 1e-9))
    assert (below.period_ms, below.optimal, below.bound_ms) == (math.inf, True,
                                                                least * (1 - 1e-9))
    at = judge_hybrid(costs, config, below_ms=least * (1 + 1e-9) + 1e-12)
    assert at.period_ms == pytest.approx(least, rel=1e-9, abs=1e-12)


def test_the_record_round_trips_through_plan_json(tmp_path, capsys) -> None:
    model = save(CHAIN, tmp_path / "m.onnx")
    argv = ["partition", str(model), "--devices", "2", "--mode", "train", "--no-program",
            "--batch-size", "2"]
    assert main([*argv, "-o", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    body = json.loads((tmp_path / "a" / "plan.json").read_text())["exact"]
    assert body["kind"] == "hybrid-period" and body["objective"] == OBJECTIVE
    assert body["proven_optimal"] and body["by"] in ("bound", "cp-sat")
    assert body["budget_s"] == 1.0 and body["devices"] == 2
    plan = read_plan(tmp_path / "a")
    assert plan.extra["exact"] == body
    line = proof_line(plan)
    assert line is not None and line in out and "proven optimal" in line
    assert "least bottleneck period" in line and "proven least" in line
    # each outcome's line, from the record alone
    plan.extra["exact"] = HybridProof(False, "size", "dfs", devices=16).to_json(1.0)
    assert proof_line(plan) == (
        "plan quality: not proven; CP-SAT judges the DP's bottleneck period up to 20000 stage "
        "choices (blocks squared times stages) and 8 devices: here on 16 devices")
    plan.extra["exact"] = HybridProof(False, "budget", "dfs", 30, 4, 2.0, 1.5, 0.25,
                                      2.2).to_json(1.0)
    assert proof_line(plan) == (
        "plan quality: the DP's least bottleneck period over the dfs sequence (30 blocks of 6 "
        "ONNX nodes, 4 devices), 2 ms per micro-batch, within 25.00% of the bound 1.5 ms (all "
        "compute over all devices); CP-SAT's budget ran out (--exact-budget SECONDS to search "
        "longer); the plan's own period 2.2 ms (+10.00%)")
    assert main([*argv, "--exact-budget", "0", "-o", str(tmp_path / "b")]) == 0
    assert "plan quality: not proven; exact search off" in capsys.readouterr().out
    off = json.loads((tmp_path / "b" / "plan.json").read_text())["exact"]
    assert (off["proven_optimal"], off["by"]) == (False, "off")


def test_the_json_of_each_outcome() -> None:
    proven = HybridProof(True, "cp-sat", "dfs", 12, 4, 2.0, 2.0, 0.0, 2.5, 0.25, 2e-9)
    body = proven.to_json(1.0)
    assert body["period_ms"] == 2.0 and body["plan_period_ms"] == 2.5 and body["seconds"] == 0.25
    size = HybridProof(False, "size", "topo", 90, 8, limits=(20_000, 8)).to_json(1.0)
    assert (size["max_cells"], size["max_devices"]) == (20_000, 8) and "period_ms" not in size
    assert HybridProof(False, "fleet").to_json(1.0).keys() == {
        "kind", "proven_optimal", "period_proven", "by", "objective", "budget_s"}


def test_more_devices_than_the_judge_takes_is_said_before_sequencing() -> None:
    problem, arrays, run = heavy_chain()
    plan, _ = plan_cluster(problem, arrays, run)
    many = prove_hybrid(problem, arrays, run, plan, max_devices=2)
    assert (many.by, many.positions, many.devices) == ("size", 0, 3)
