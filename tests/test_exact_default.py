"""Exact by default where it is cheap (issue 22 item 3): the DP's pipeline cut proven optimal by
the cheapest proof that holds, or bettered by CP-SAT within a deterministic budget, never worse;
plan.json's ``exact`` and the summary say which."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.graphs import CHAIN, save
from support.problems import chain, dags

from onnx_partition.cli import main
from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.exact import (
    EXACT_ROUNDS,
    exact_rounds,
    exact_split,
    one_order,
    trivial_bound_ms,
)
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.search import best_split

# A DAG of 8 nodes whose best 3-stage cut no sequence the DP tries holds: auto's cut has a
# bottleneck of 46 ms, the optimum (brute force) 38 ms.
_CONSUMERS = [[0], [7, 3], [7, 5, 4], [6, 3], [6, 4], [5, 7], [7], [7], []]
MISSED = DagProblem([5.0, 7.0, 5.0, 9.0, 5.0, 7.0, 5.0, 7.0], [-1, *range(8)], _CONSUMERS,
                    [False] * 8 + [True], [5.0, 7.0, 3.0, 7.0, 6.0, 6.0, 1.0, 1.0, 2.0],
                    bandwidth_bytes_per_ms=1.0)


def test_cp_sat_finds_the_cut_the_dp_misses() -> None:
    dp, _ = best_split(MISSED, 3)
    assert dp.refined_ms == 46.0
    proof = exact_split(MISSED, 3, dp.stage_of)
    assert (proof.proven, proof.by, proof.dp_ms) == (True, "cp-sat", 46.0)
    assert proof.bottleneck_ms == MISSED.bottleneck_ms(proof.stage_of, 3) == 38.0
    assert proof.bottleneck_ms == brute_force(MISSED, 3)[1]
    assert proof.gap == 0.0 and proof.lower_bound_ms == 38.0  # integers: no rounding


def test_budget_zero_keeps_the_dp_cut_and_reports_the_trivial_gap() -> None:
    dp, _ = best_split(MISSED, 3)
    proof = exact_split(MISSED, 3, dp.stage_of, budget_s=0)
    assert (proof.proven, proof.by, proof.stage_of) == (False, "off", dp.stage_of)
    bound = trivial_bound_ms(MISSED, 3)
    assert bound == 50.0 / 3  # all compute over three stages beats the heaviest node (9)
    assert proof.lower_bound_ms == bound
    assert proof.gap == pytest.approx((46.0 - bound) / 46.0)


def test_graphs_over_the_size_limit_are_not_searched() -> None:
    dp, _ = best_split(MISSED, 3)
    proof = exact_split(MISSED, 3, dp.stage_of, max_nodes=7)
    assert (proof.proven, proof.by, proof.bottleneck_ms) == (False, "size", 46.0)


def test_a_stopped_search_is_deterministic_and_never_worse() -> None:
    # a 24-node layered DAG at 4 stages; a budget too small to prove anything
    width, layers = 4, 6
    n = width * layers
    consumers: list[list[int]] = [list(range(width))] + [[] for _ in range(n)]
    for v in range(width, n):
        layer, j = divmod(v, width)
        for u in ((layer - 1) * width + j, (layer - 1) * width + (j + 1) % width):
            consumers[1 + u].append(v)
    problem = DagProblem([1.0 + (7 * i % 5) + i / 10 for i in range(n)], [-1, *range(n)],
                         consumers, [False] + [i >= n - width for i in range(n)],
                         [float(1 + 3 * i % 7) for i in range(n + 1)],
                         bandwidth_bytes_per_ms=2.0, latency_ms=0.1)
    dp, _ = best_split(problem, 4)
    runs = [exact_split(problem, 4, dp.stage_of, budget_s=0.002) for _ in range(2)]
    assert runs[0].stage_of == runs[1].stage_of
    one = exact_split(problem, 4, dp.stage_of, budget_s=0.002, rounds=1)  # the default here
    assert (one.stage_of, one.lower_bound_ms) == (runs[0].stage_of, runs[0].lower_bound_ms)
    # windowed rounds restarted from the best plan so far, the last plan polished by local
    # moves: deterministic too, valid, never worse
    more = [exact_split(problem, 4, dp.stage_of, budget_s=0.002, rounds=5) for _ in range(2)]
    assert more[0].stage_of == more[1].stage_of
    assert more[0].bottleneck_ms <= dp.refined_ms and problem.is_valid(more[0].stage_of, 4)
    assert more[0].bottleneck_ms == problem.bottleneck_ms(more[0].stage_of, 4)
    assert exact_rounds(n) == exact_rounds(159) == 1
    assert exact_rounds(160) == exact_rounds(600) == EXACT_ROUNDS
    assert runs[0].lower_bound_ms == runs[1].lower_bound_ms
    assert runs[0].bottleneck_ms <= dp.refined_ms
    if not runs[0].proven:
        assert runs[0].by == "budget"
        assert runs[0].gap == pytest.approx(
            (runs[0].bottleneck_ms - runs[0].lower_bound_ms) / runs[0].bottleneck_ms)


def test_cheap_proofs_need_no_cp_sat() -> None:
    line, _ = chain([1.0, 2.0, 3.0, 4.0], nbytes=1.0)
    assert one_order(line) and not one_order(MISSED)
    dp, _ = best_split(line, 2)
    proof = exact_split(line, 2, dp.stage_of, budget_s=0)  # budget 0: no search, still proven
    assert (proof.proven, proof.by) == (True, "chain")
    assert proof.bottleneck_ms == brute_force(line, 2)[1]
    single = exact_split(MISSED, 1, [0] * 8, budget_s=0)
    assert (single.proven, single.by, single.bottleneck_ms) == (True, "single", 50.0)
    # four equal nodes side by side: two per stage meets the average, whatever the order
    flat = DagProblem([2.0] * 4, [-1, 0, 1, 2, 3], [[0, 1, 2, 3], [], [], [], []],
                      [False, True, True, True, True], [0.0] * 5)
    dp, _ = best_split(flat, 2)
    proof = exact_split(flat, 2, dp.stage_of, budget_s=0)
    assert (proof.proven, proof.by, proof.bottleneck_ms) == (True, "bound", 4.0)


@settings(max_examples=25, deadline=None)
@given(case=dags(max_nodes=8), data=st.data())
def test_never_worse_than_the_dp_and_optimal_when_proven(case, data) -> None:
    problem, _ = case
    stages = data.draw(st.integers(1, min(3, problem.num_nodes)))
    dp, _ = best_split(problem, stages)
    proof = exact_split(problem, stages, dp.stage_of)
    assert problem.is_valid(proof.stage_of, stages)
    assert proof.bottleneck_ms == problem.bottleneck_ms(proof.stage_of, stages)
    assert proof.bottleneck_ms <= dp.refined_ms
    assert proof.proven  # 8 nodes: always within the budget
    _, optimum = brute_force(problem, stages)
    assert proof.bottleneck_ms == pytest.approx(optimum, rel=1e-6, abs=1e-9)
    assert proof.lower_bound_ms <= optimum * (1 + 1e-6) + 1e-9


def test_partition_says_what_is_proven(exported, tmp_path, capsys) -> None:
    model = exported("gpt")
    argv = ["partition", str(model), "-s", "4", "--gpu", "h100", "--batch-size", "8", "-o"]
    assert main([*argv, str(tmp_path / "a")]) == 0
    assert re.search(r"plan quality: proven optimal over \d+ ONNX nodes \(CP-SAT",
                     capsys.readouterr().out)  # inference: over ONNX nodes, not torch ops
    exact = json.loads((tmp_path / "a" / "plan.json").read_text())["exact"]
    assert exact["proven_optimal"] and exact["by"] == "cp-sat" and exact["budget_s"] == 1.0
    assert exact["bottleneck_ms"] <= exact["dp_ms"]
    assert main([*argv, str(tmp_path / "c"), "--exact-budget", "0"]) == 0
    out = capsys.readouterr().out
    assert "exact search off (--exact-budget 0)" in out and "plan quality: within" in out
    off = json.loads((tmp_path / "c" / "plan.json").read_text())["exact"]
    assert (off["proven_optimal"], off["by"], off["bottleneck_ms"]) == (
        False, "off", exact["dp_ms"])
    assert 0 < off["gap"] < 1


def test_a_negative_budget_is_one_error_line(exported, tmp_path, capsys) -> None:
    code = main(["partition", str(exported("gpt")), "-s", "2", "--batch-size", "8",
                 "--exact-budget", "-1", "-o", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--exact-budget must be" in err[0], err
    assert not (tmp_path / "o").exists()


def test_the_summary_of_a_chain_and_of_the_ilp_solver(tmp_path, capsys) -> None:
    model = save(CHAIN, tmp_path / "m.onnx")
    argv = ["partition", str(model), "-s", "3", "--batch-size", "2", "-o"]
    assert main([*argv, str(tmp_path / "a")]) == 0
    assert ("plan quality: proven optimal over 6 ONNX nodes (the DAG is a chain, cut exactly "
            "by the DP)" in capsys.readouterr().out)
    assert json.loads((tmp_path / "a" / "plan.json").read_text())["exact"]["by"] == "chain"
    assert main([*argv, str(tmp_path / "b"), "--solver", "ilp", "--time-limit", "10"]) == 0
    assert "plan quality: proven optimal over 6 ONNX nodes (CP-SAT, " in capsys.readouterr().out
    assert "exact" not in json.loads((tmp_path / "b" / "plan.json").read_text())
