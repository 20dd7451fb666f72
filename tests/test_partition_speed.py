"""The planner made faster without changing its plans (issue 36 item 5): the local search's
incremental frontier and stage sums against their definitions and against the search as it
was written before (:mod:`support.refine_reference`), move for move; the hybrid proof reusing
the planner's DP run, its record the same as solving again."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.problems import chain, dags, run_on
from support.refine_reference import reference_refine

from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.errors import PartitionError
from onnx_partition.solve import hybrid_proof, search
from onnx_partition.solve.hybrid_proof import prove_hybrid
from onnx_partition.solve.planner import HYBRID_ORDERINGS, Proposal, plan_cluster, proposals_for
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.refine import _State, refine
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec
from onnx_partition.solve.search import ORDERINGS, best_split, solve_ordering, split_order


@st.composite
def whole_dags(draw: st.DrawFn, max_nodes: int = 24) -> DagProblem:
    """Random DAGs in whole numbers (every float sum exact): each node reads 1-3 earlier
    tensors or graph inputs, some tensors are outputs, a finite link and a latency."""
    n = draw(st.integers(3, max_nodes))
    inputs = draw(st.integers(1, 2))
    producer = [-1] * inputs + list(range(n))
    consumers: list[list[int]] = [[] for _ in producer]
    for v in range(n):
        for t in draw(st.lists(st.integers(0, inputs + v - 1), min_size=1, max_size=3,
                               unique=True)):
            consumers[t].append(v)
    is_output = [False] * len(producer)
    is_output[-1] = True
    for t in draw(st.lists(st.integers(inputs, len(producer) - 1), max_size=2)):
        is_output[t] = True
    return DagProblem(
        compute_ms=draw(st.lists(st.integers(0, 12).map(float), min_size=n, max_size=n)),
        producer=producer, consumers=consumers, is_output=is_output,
        nbytes=draw(st.lists(st.integers(0, 16).map(float), min_size=len(producer),
                             max_size=len(producer))),
        bandwidth_bytes_per_ms=draw(st.sampled_from([math.inf, 4.0, 1.0])),
        latency_ms=draw(st.sampled_from([0.0, 1.0])))


def layered(n: int, seed: int) -> DagProblem:
    """A seeded DAG of ``n`` nodes in whole numbers, each reading the last node and up to two
    of the eight before it (a transformer's skips and forks, in miniature)."""
    rng = random.Random(seed)
    producer = [-1, *range(n)]  # tensor 0 is the graph input; tensor v + 1 is node v's
    consumers: list[list[int]] = [[] for _ in producer]
    for v in range(n):
        reads = {v} | {rng.randint(max(0, v - 8), v) for _ in range(rng.randint(0, 2))}
        for t in reads:
            consumers[t].append(v)
    return DagProblem([float(rng.randint(1, 20)) for _ in range(n)], producer, consumers,
                      [False] * n + [True], [float(rng.randint(0, 64)) for _ in producer],
                      bandwidth_bytes_per_ms=8.0, latency_ms=1.0)


def _start(problem: DagProblem, stages: int) -> list[int]:
    """The exact DP's split of the topological order (what the planner refines)."""
    return split_order(problem, topological_order(problem), stages)


def _lopsided(problem: DagProblem, stages: int) -> list[int]:
    """All but the last ``stages - 1`` nodes (topologically) in stage 0, then one per stage:
    far from balanced, so that the search's chains and swaps have work."""
    order = topological_order(problem)
    stage_of = [0] * problem.num_nodes
    for k, v in enumerate(order[problem.num_nodes - stages + 1:], 1):
        stage_of[v] = k
    return stage_of


@settings(max_examples=150, deadline=None)
@given(problem=whole_dags(), data=st.data())
def test_refine_makes_the_moves_the_search_made_before(problem, data):
    stages = data.draw(st.integers(2, min(6, problem.num_nodes)))
    for start in (_start(problem, stages), _lopsided(problem, stages)):
        assert refine(problem, start, stages) == reference_refine(problem, start, stages)


@pytest.mark.parametrize(("n", "stages", "seed"), [(160, 8, 1), (240, 6, 2), (120, 4, 3)])
def test_refine_matches_the_reference_on_larger_dags(n, stages, seed):
    problem = layered(n, seed)
    for start in (_start(problem, stages), _lopsided(problem, stages)):
        refined = refine(problem, start, stages)
        assert refined == reference_refine(problem, start, stages)
    assert problem.bottleneck_ms(refined, stages) < problem.bottleneck_ms(start, stages)


@settings(max_examples=80, deadline=None)
@given(problem=whole_dags(), data=st.data())
def test_the_incremental_state_agrees_with_its_definitions(problem, data):
    """After any walk of frontier moves: each stage's movable nodes are those
    :meth:`_State.can_move` allows, :meth:`_State.peek` foretells the times the move gives,
    and the sums and spans are those of a state built afresh on the same assignment."""
    stages = data.draw(st.integers(2, min(5, problem.num_nodes)))
    state = _State(problem, _start(problem, stages), stages)
    for _ in range(data.draw(st.integers(1, 12))):
        k = data.draw(st.integers(0, stages - 1))
        to = data.draw(st.sampled_from(state.neighbours(k)))
        movable = state.movable(k, to)
        assert movable == [v for v in sorted(state.members[k]) if state.can_move(v, to)]
        if not movable:
            continue
        v = data.draw(st.sampled_from(movable))
        foretold = state.peek(v, to)
        state.move(v, to)
        assert state.times() == pytest.approx(foretold)
        assert problem.is_valid(state.stage_of, stages)
        fresh = _State(problem, state.stage_of, stages)
        assert state.span == fresh.span
        assert state.frontier == fresh.frontier
        assert state.cross == pytest.approx(fresh.cross)
        assert state.times() == pytest.approx(problem.stage_times(state.stage_of, stages))


class _Calls:
    """Counts the calls of a function, and makes them (a spy, not a stand-in)."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function, self.count = function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.function(*args, **kwargs)


def _planned(problem: DagProblem, arrays: NodeArrays, run: RunSpec,
             num_stages: int | None = None) -> tuple[HybridPlan, list[Proposal]]:
    proposals = proposals_for(problem, arrays, run, num_stages, HYBRID_ORDERINGS)
    plan, _ = plan_cluster(problem, arrays, run, num_stages=num_stages, proposals=proposals)
    return plan, proposals


def test_the_proof_reuses_the_planners_dp_run(monkeypatch) -> None:
    """The proof of an inference plan solves no DP and builds no sequence of its own: the
    planner's are handed to it, and the record is the one it made solving them again."""
    problem, arrays = chain([1.0, 3.0, 2.0, 2.0, 1.0], nbytes=1e6)
    run = run_on(4, train=False)
    plan, proposals = _planned(problem, arrays, run)
    fresh = prove_hybrid(problem, arrays, run, plan)
    solves = _Calls(hybrid_proof.plan_hybrid)
    sequences = _Calls(hybrid_proof.dp_sequence)
    monkeypatch.setattr(hybrid_proof, "plan_hybrid", solves)
    monkeypatch.setattr(hybrid_proof, "dp_sequence", sequences)
    reused = prove_hybrid(problem, arrays, run, plan, proposals=proposals)
    assert (solves.count, sequences.count) == (0, 0)
    assert reused.by in ("bound", "cp-sat") and reused.proven
    assert replace(reused, seconds=0.0) == replace(fresh, seconds=0.0)
    # without the planner's proposals (or with recomputation in play) it solves its own
    assert prove_hybrid(problem, arrays, run, plan).by == fresh.by
    assert (solves.count, sequences.count) == (1, 1)


@settings(max_examples=30, deadline=None)
@given(case=dags(max_nodes=8), devices=st.integers(1, 4), train=st.booleans(),
       recompute=st.sampled_from(["none", "auto"]), memory_gb=st.sampled_from([80.0, 0.2]),
       data=st.data())
def test_a_reused_proof_is_the_proof_solved_again(case, devices, train, recompute, memory_gb,
                                                  data) -> None:
    """Differential: whatever the planner hands the proof, its record is the one the proof
    makes solving its sequence afresh (up to its seconds)."""
    problem, arrays = case
    cluster = Cluster(1, devices, memory_gb=memory_gb, kind="cuda", intra=Link(1.0, 0.0))
    run = RunSpec(cluster, train=train, microbatches=data.draw(st.sampled_from([1, 4, 8])),
                  recompute=recompute if train else "none")
    depth = data.draw(st.sampled_from([None, *range(1, min(devices, problem.num_nodes) + 1)]))
    try:
        plan, proposals = _planned(problem, arrays, run, depth)
    except PartitionError:
        return  # nothing fits: no plan to prove
    fresh = prove_hybrid(problem, arrays, run, plan, num_stages=depth)
    reused = prove_hybrid(problem, arrays, run, plan, num_stages=depth, proposals=proposals)
    assert replace(reused, seconds=0.0) == replace(fresh, seconds=0.0)


def test_orderings_cut_alike_are_polished_once(monkeypatch) -> None:
    """``dfs`` and ``cluster`` cut the same sequence; where their DP splits agree the polish
    runs once, and every candidate is what its ordering gives alone."""
    problem = layered(120, 4)
    alone = {o: solve_ordering(problem, 4, o) for o in ORDERINGS}
    cuts = {o: solve_ordering(problem, 4, o, polish=False).stage_of for o in ORDERINGS}
    assert cuts["dfs"] == cuts["cluster"]
    polishes = _Calls(search.polish_split)
    monkeypatch.setattr(search, "polish_split", polishes)
    _, candidates = best_split(problem, 4)
    assert polishes.count == len({tuple(c) for c in cuts.values()}) < len(ORDERINGS)
    assert [c.stage_of for c in candidates] == [alone[o].stage_of for o in ORDERINGS]
