"""The exact pass polishes the plan so far beside each round (:func:`~onnx_partition.solve.
exact.exact_split`, several rounds): the same proof, plan and bound as the rounds, then the
polish, one after the other; and a polish asked to stop solves nothing more."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.problems import chain, dags

from onnx_partition.errors import PartitionError
from onnx_partition.solve.exact import SPREAD_SOLVES, exact_split, stage_neighbourhoods
from onnx_partition.solve.ilp import solve_ilp
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.refine import refine
from onnx_partition.solve.search import best_split

_BETTER = 1e-9


def one_after_the_other(problem: DagProblem, stages: int, plan: list[int], budget: float,
                        rounds: int) -> tuple[list[int], float, bool]:
    """The exact pass's CP-SAT part as written before the polish ran ahead: rounds, then
    refine (if a round bettered the plan), neighbourhoods and the descent."""
    best, best_ms, lower, optimal = plan, problem.bottleneck_ms(plan, stages), 0.0, False
    for _ in range(rounds):
        try:
            found = solve_ilp(problem, stages, time_limit_s=10 * budget + 10, workers=1,
                              hint=best, deterministic_s=budget, windows=True)
        except PartitionError:
            break
        lower, optimal = max(lower, found.lower_bound_ms), found.optimal
        better = found.bottleneck_ms < best_ms * (1 - _BETTER)
        if better:
            best, best_ms = found.stage_of, found.bottleneck_ms
        if optimal or not better:
            break
    if not optimal and best is not plan:
        polished = refine(problem, best, stages)
        if problem.bottleneck_ms(polished, stages) < best_ms * (1 - _BETTER):
            best = polished
    if not optimal:
        best = stage_neighbourhoods(problem, stages, best, budget_s=budget / 2)
        best = stage_neighbourhoods(problem, stages, best, budget_s=budget / 2,
                                    solves=SPREAD_SOLVES, spread=True)
    return best, lower, optimal


@settings(max_examples=20, deadline=None)
@given(case=dags(max_nodes=30), data=st.data())
def test_the_polish_ahead_gives_what_one_after_the_other_gives(case, data) -> None:
    problem, _ = case
    if problem.num_nodes < 3:
        return
    stages = data.draw(st.integers(3, min(6, problem.num_nodes)))
    budget = data.draw(st.sampled_from([0.0005, 0.002, 0.01]))  # short: often unproven
    start = best_split(problem, stages)[0].stage_of
    proof = exact_split(problem, stages, start, budget_s=budget, rounds=3)
    if proof.by not in ("cp-sat", "budget"):
        return  # proven before CP-SAT (bound, chain)
    best, lower, optimal = one_after_the_other(problem, stages, start, budget, 3)
    assert proof.stage_of == best
    assert proof.proven == optimal
    assert proof.lower_bound_ms >= min(lower, proof.bottleneck_ms) - 1e-12


def test_a_stopped_neighbourhood_search_solves_nothing() -> None:
    """The window search would re-cut 4 | 1 | 1 to 2 | 2 | 2; stopped, it keeps the start."""
    problem, _ = chain([2.0] * 6, nbytes=0.0)
    start = [0, 0, 0, 0, 1, 2]
    assert stage_neighbourhoods(problem, 3, start, budget_s=1.0, stop=lambda: True) == start
    assert problem.bottleneck_ms(stage_neighbourhoods(problem, 3, start, budget_s=1.0), 3) == 4.0
