"""The exact pass's large-neighbourhood search (:func:`~onnx_partition.solve.exact.
stage_neighbourhoods`) and CP-SAT with only some nodes free (``solve_ilp(free=...)``): fixed
nodes stay, free ones are placed optimally, never worse than the start."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.problems import chain, dags

from onnx_partition.errors import PartitionError
from onnx_partition.solve.brute import brute_force
from onnx_partition.solve.exact import stage_neighbourhoods
from onnx_partition.solve.ilp import solve_ilp
from onnx_partition.solve.search import best_split


def test_the_window_around_the_slowest_stage_is_recut() -> None:
    """Six nodes of 2 ms, free transfers, cut 4 | 1 | 1: the slowest stage (8 ms) and its
    neighbour are re-cut with the last node fixed, reaching the optimum 2 | 2 | 2 (4 ms)."""
    problem, _ = chain([2.0] * 6, nbytes=0.0)
    start = [0, 0, 0, 0, 1, 2]
    assert problem.bottleneck_ms(start, 3) == 8.0
    found = stage_neighbourhoods(problem, 3, start, budget_s=1.0)
    assert problem.bottleneck_ms(found, 3) == 4.0 and found[5] == 2


def test_two_stages_have_no_smaller_window() -> None:
    problem, _ = chain([2.0] * 4, nbytes=0.0)
    assert stage_neighbourhoods(problem, 2, [0, 0, 0, 1], budget_s=1.0) == [0, 0, 0, 1]


def test_free_needs_a_hint() -> None:
    problem, _ = chain([1.0] * 3)
    with pytest.raises(PartitionError, match="free needs a hint"):
        solve_ilp(problem, 2, free=[True] * 3)


@settings(max_examples=25, deadline=None)
@given(case=dags(max_nodes=8), data=st.data())
def test_fixed_nodes_stay_and_free_ones_are_placed_optimally(case, data) -> None:
    problem, _ = case
    stages = data.draw(st.integers(2, min(3, problem.num_nodes)))
    start = best_split(problem, stages)[0].stage_of
    free = data.draw(st.lists(st.booleans(), min_size=problem.num_nodes,
                              max_size=problem.num_nodes))
    found = solve_ilp(problem, stages, workers=1, hint=start, free=free, windows=False)
    assert problem.is_valid(found.stage_of, stages)
    assert all(f or a == b for f, a, b in zip(free, found.stage_of, start, strict=True))
    assert found.bottleneck_ms <= problem.bottleneck_ms(start, stages) * (1 + 1e-9)
    everything = solve_ilp(problem, stages, workers=1, hint=start,
                           free=[True] * problem.num_nodes, windows=False)
    assert found.optimal and everything.optimal  # 8 nodes: always proven
    _, optimum = brute_force(problem, stages)
    assert everything.bottleneck_ms == pytest.approx(optimum, rel=1e-6, abs=1e-9)
    assert found.bottleneck_ms >= optimum * (1 - 1e-6) - 1e-9
    neighbourhoods = stage_neighbourhoods(problem, stages, start, budget_s=1.0)
    assert problem.is_valid(neighbourhoods, stages)
    assert (problem.bottleneck_ms(neighbourhoods, stages)
            <= problem.bottleneck_ms(start, stages) * (1 + 1e-9))


def _focus_optimum(problem, stages, start, free, focus, slack):
    """Brute force: the least slowest stage among ``focus`` over every valid plan that moves
    only ``free`` nodes, keeps the focus stages within the start's bottleneck and every other
    stage within its start time (each limit times ``1 + slack``)."""
    times = problem.stage_times(start, stages)
    caps = [(max(times) if k in focus else t) * (1 + slack) + abs(slack)
            for k, t in enumerate(times)]
    best = math.inf
    movable = [i for i, f in enumerate(free) if f]
    for choice in itertools.product(range(stages), repeat=len(movable)):
        plan = list(start)
        for i, s in zip(movable, choice, strict=True):
            plan[i] = s
        if problem.is_valid(plan, stages):
            found = problem.stage_times(plan, stages)
            if all(t <= cap for t, cap in zip(found, caps, strict=True)):
                best = min(best, max(found[k] for k in focus))
    return best


@settings(max_examples=25, deadline=None)
@given(case=dags(max_nodes=7), data=st.data())
def test_focus_minimises_its_stages_keeping_the_others(case, data) -> None:
    """``solve_ilp(focus=...)`` against brute force: the slowest of the focus stages is the
    least any plan reaches with the same nodes fixed, no focus stage above the start's
    bottleneck and no other stage slower than at the start (bounds widened by CP-SAT's integer
    rounding, 1e-6 relative), with or without the precedence windows of that bottleneck."""
    problem, _ = case
    stages = data.draw(st.integers(2, min(3, problem.num_nodes)))
    start = best_split(problem, stages)[0].stage_of
    free = data.draw(st.lists(st.booleans(), min_size=problem.num_nodes,
                              max_size=problem.num_nodes))
    focus = sorted(data.draw(st.sets(st.integers(0, stages - 1), min_size=1)))
    found = solve_ilp(problem, stages, workers=1, hint=start, free=free,
                      windows=data.draw(st.booleans()), focus=focus)
    assert problem.is_valid(found.stage_of, stages) and found.optimal
    assert all(f or a == b for f, a, b in zip(free, found.stage_of, start, strict=True))
    before = problem.stage_times(start, stages)
    times = problem.stage_times(found.stage_of, stages)
    assert max(times) <= max(before) * (1 + 1e-6) + 1e-9
    assert all(t <= b * (1 + 1e-6) + 1e-9
               for k, (t, b) in enumerate(zip(times, before, strict=True)) if k not in focus)
    value = max(times[k] for k in focus)
    loose = _focus_optimum(problem, stages, start, free, focus, 1e-6)
    tight = _focus_optimum(problem, stages, start, free, focus, 0.0)
    assert loose * (1 - 1e-6) - 1e-9 <= value <= tight * (1 + 1e-6) + 1e-9


def test_spread_lowers_ties_the_plain_search_cannot() -> None:
    """Eight nodes of 1 ms, free transfers, cut 3 | 1 | 1 | 3: stages 0 and 3 tie at 3 ms, so
    no window of 3 stages lowers the bottleneck and the plain search stops; the lexicographic
    descent first makes 2 | 2 | 1 | 3 (slowest first: 3, 2, 2, 1 < 3, 3, 1, 1), then re-cuts
    the last three stages to the optimum 2 | 2 | 2 | 2."""
    problem, _ = chain([1.0] * 8, nbytes=0.0)
    start = [0, 0, 0, 1, 2, 3, 3, 3]
    assert stage_neighbourhoods(problem, 4, start, budget_s=1.0, width=3) == start
    found = stage_neighbourhoods(problem, 4, start, budget_s=1.0, width=3, spread=True)
    assert found == [0, 0, 1, 1, 2, 2, 3, 3]


@settings(max_examples=25, deadline=None)
@given(case=dags(max_nodes=8), data=st.data())
def test_spread_never_raises_the_bottleneck(case, data) -> None:
    """The descent's plan is valid, no slower, and its stage times, slowest first, are never
    lexicographically above the start's."""
    problem, _ = case
    stages = data.draw(st.integers(2, min(4, problem.num_nodes)))
    start = best_split(problem, stages)[0].stage_of
    found = stage_neighbourhoods(problem, stages, start, budget_s=1.0,
                                 width=data.draw(st.integers(2, 3)), spread=True)
    assert problem.is_valid(found, stages)
    before = sorted(problem.stage_times(start, stages), reverse=True)
    after = sorted(problem.stage_times(found, stages), reverse=True)
    assert after[0] <= before[0]
    assert after == before or after < before
