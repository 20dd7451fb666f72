"""Exact by default where it is cheap: prove a heuristic's pipeline split optimal, or better it.

``partition`` cuts a pipeline by the sequence DP (:mod:`.search`), a heuristic on DAGs (the
sequence is the NP-hard part, ``docs/np_completeness.md``). :func:`exact_split` then proves the
cut optimal, cheapest proof first:

1. one stage: there is one plan;
2. the bottleneck meets :func:`trivial_bound_ms` (heaviest node, average stage);
3. the DAG has one topological order (every node feeds the next: a chain): every convex split
   is contiguous in it, so the DP over it, one of the candidates, is exact;
4. CP-SAT (:func:`~onnx_partition.solve.ilp.solve_ilp`, imported only then), started from the
   cut, for a budget in *deterministic* seconds on one worker: the same problem gives the same
   plan at any load. Its plan is kept only when strictly faster, so the answer is never worse
   than the DP's; when the budget runs out the gap to CP-SAT's bound is reported. On problems
   of :data:`EXACT_ROUNDS_FROM` units or more it may run up to :data:`EXACT_ROUNDS` rounds, each
   restarted from the best plan so far (whose bottleneck narrows CP-SAT's precedence windows),
   while each round betters the plan and none proves it, then polishes the last plan by the
   local search of :mod:`.refine` and, still unproven, by CP-SAT on the nodes of a few
   adjacent stages around the slowest, the rest fixed (:func:`stage_neighbourhoods`), first
   lowering the bottleneck, then descending lexicographically on the sorted stage times.
   That polish of the plan so far runs on a thread beside each round (:class:`_Ahead`) and
   is kept when the round finds nothing better: the same answer as one after the other, the
   round that ends the search no longer paid on top of the polish.

Pure: plain arrays in, plain data out.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from onnx_partition.errors import PartitionError
from onnx_partition.settings.partition import SearchSpec
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.refine import refine
from onnx_partition.solve.search import split_order

__all__ = ["EXACT_BUDGET_S", "EXACT_NODES", "EXACT_ROUNDS", "EXACT_ROUNDS_FROM", "LNS_SOLVES",
           "LNS_WIDTH", "SPREAD_SOLVES", "Proof", "exact_rounds", "exact_split",
           "one_order", "stage_neighbourhoods", "trivial_bound_ms"]

#: The default exact pass's budget, in CP-SAT's deterministic seconds (see :func:`exact_split`;
#: written once, in :class:`~onnx_partition.settings.partition.SearchSpec`).
EXACT_BUDGET_S = SearchSpec.exact_budget_s
#: ... and the largest problem (units) it is tried on. On the recipes (tiny and small, 27-560
#: nodes, S = 2, 4, 8) the pass proves 27 of 36 cuts optimal and betters 16 by up to 1.4%, one
#: deterministic second taking 0.01-2.4 s of wall time unloaded; at 1,112 nodes (GPT
#: realistic, S = 8) CP-SAT does not even load the DP's cut in it. See docs/benchmarks.md.
EXACT_NODES = 600
#: Rounds of CP-SAT on problems of at least EXACT_ROUNDS_FROM units (one round below, without
#: windows, as before they came: those plans stand): each round restarts from the best plan
#: so far, whose bottleneck tightens the precedence windows
#: of :func:`~onnx_partition.solve.ilp.solve_ilp`; rounds stop at the first that proves the
#: optimum or finds nothing better (CP-SAT on one worker needs about a deterministic second
#: to better a plan, so shorter rounds find nothing); the last unproven plan is then polished
#: by :func:`~onnx_partition.solve.refine.refine`. On the recipe rows of 199-520 units this
#: closes the gap one round left open, but for encdec small at S = 8 (0.91% -> 0.6%); the
#: suite's graphs (150 units at most) keep one round. See docs/benchmarks.md.
EXACT_ROUNDS = 3
EXACT_ROUNDS_FROM = 160
#: ... and then, still unproven, CP-SAT on the nodes of LNS_WIDTH adjacent stages around the
#: slowest, the others fixed, each for half the budget, at most LNS_SOLVES times
#: (:func:`stage_neighbourhoods`): encdec small at S = 8 from 22.7723 to 22.7074 ms in 4
#: solves (widths 3 and 5, and 3 then 4, stopped higher or took longer; docs/benchmarks.md).
LNS_WIDTH = 4
LNS_SOLVES = 12
#: ... and then the lexicographic descent (``stage_neighbourhoods(spread=True)``) over the
#: same windows, at most SPREAD_SOLVES solves of half the budget: encdec small at S = 8 from
#: 22.7074 to 22.6450 ms, the best plan CP-SAT finds with 2 workers in 10-20 s (windows of 3
#: and 5 stages reach it too, slower; of 2, stop at 22.7060; docs/benchmarks.md).
SPREAD_SOLVES = 12
# A plan counts as better only when it beats the DP's by more than this (relative): the ILP's
# integer costs may rank two plans of nearly equal float cost the other way.
_BETTER = 1e-9


@dataclass(frozen=True)
class Proof:
    """The outcome of :func:`exact_split`: the plan to keep and what is known of its quality.

    ``proven`` means no plan is faster: one stage has one plan (``by == "single"``), the
    bottleneck meets the trivial bound (``"bound"``), the DAG is a chain (``"chain"``), or
    CP-SAT proved it (``"cp-sat"``: optimal for its integer-scaled costs, so for the float
    costs within the rounding, which ``gap`` then measures: ``rounding_ms`` per term summed,
    about 1e-5 of the bottleneck). ``gap`` is ``(bottleneck - lower_bound) / bottleneck`` with
    the best bound known (CP-SAT's when it ran, else the trivial one); unproven, ``by`` says
    why the search stopped short: ``"budget"`` (it ran out), ``"off"`` (budget 0) or
    ``"size"`` (more units than ``max_nodes``). ``dp_ms`` is the bottleneck of the plan given.
    """

    stage_of: list[int]
    bottleneck_ms: float
    lower_bound_ms: float
    proven: bool
    by: str
    gap: float
    dp_ms: float
    seconds: float = 0.0
    rounding_ms: float = 0.0

    def to_json(self, budget_s: float) -> dict[str, float | bool | str]:
        """plan.json's ``exact`` entry."""
        return {"proven_optimal": self.proven, "by": self.by,
                "bottleneck_ms": round(self.bottleneck_ms, 6),
                "lower_bound_ms": round(self.lower_bound_ms, 6), "gap": round(self.gap, 6),
                "dp_ms": round(self.dp_ms, 6), "budget_s": budget_s,
                "seconds": round(self.seconds, 3), "rounding_ms": self.rounding_ms}


def trivial_bound_ms(problem: DagProblem, num_stages: int) -> float:
    """No split into ``num_stages >= 2`` stages beats its heaviest node plus the latency every
    stage pays, or the average stage (all compute and the ``2 (S - 1)`` latencies shared)."""
    return max(
        max(problem.compute_ms, default=0.0) + problem.latency_ms,
        (sum(problem.compute_ms) + 2 * (num_stages - 1) * problem.latency_ms) / num_stages,
    )


def exact_rounds(num_nodes: int) -> int:
    """How many rounds of CP-SAT the exact pass may run on a problem of ``num_nodes`` units:
    one below :data:`EXACT_ROUNDS_FROM` units, :data:`EXACT_ROUNDS` from there."""
    return EXACT_ROUNDS if num_nodes >= EXACT_ROUNDS_FROM else 1


def one_order(problem: DagProblem) -> bool:
    """Whether the DAG has a single topological order (each node feeds the next), so that
    every convex split is a contiguous split of it."""
    order = topological_order(problem)
    edges = set(problem.edges())
    return all((a, b) in edges for a, b in itertools.pairwise(order))


def exact_split(
    problem: DagProblem, num_stages: int, stage_of: Sequence[int], *,
    budget_s: float = EXACT_BUDGET_S, max_nodes: int = EXACT_NODES, rounds: int | None = None,
) -> Proof:
    """Prove ``stage_of`` (a heuristic's plan) optimal or replace it by a better one: the
    default exact pass of ``partition``.

    Proven at once when one stage leaves one plan, the bottleneck meets
    :func:`trivial_bound_ms`, or the DAG is a chain (:func:`one_order`: the exact DP over its
    one order cuts it, and its cut replaces ``stage_of`` if strictly faster). Otherwise, on
    problems of at most ``max_nodes`` nodes, CP-SAT (:func:`solve_ilp`) searches from
    ``stage_of`` with one worker for ``budget_s`` deterministic seconds (work counted, not time
    elapsed: the same problem gives the same plan at any load; a wall limit of
    ``10 * budget_s + 10`` s only guards against the pathological), in up to
    ``rounds`` (default :func:`exact_rounds`) rounds, each from the best plan so far, while
    each betters the plan and none proves it. Its plan is kept only when
    strictly faster in the float cost model, so the answer is never worse than ``stage_of``.
    ``budget_s <= 0`` turns the search off.
    """
    started = time.perf_counter()
    plan = [int(s) for s in stage_of]
    dp_ms = problem.bottleneck_ms(plan, num_stages)

    def unproven(lower: float, by: str) -> Proof:
        lower = min(dp_ms, max(0.0, lower))
        return Proof(plan, dp_ms, lower, False, by, (dp_ms - lower) / dp_ms if dp_ms else 0.0,
                     dp_ms, time.perf_counter() - started)

    if num_stages == 1:
        return Proof(plan, dp_ms, dp_ms, True, "single", 0.0, dp_ms)
    trivial = trivial_bound_ms(problem, num_stages)
    if dp_ms <= trivial * (1 + _BETTER):
        return Proof(plan, dp_ms, min(dp_ms, trivial), True, "bound", 0.0, dp_ms)
    if one_order(problem):  # the DP over the one order is exact: keep the better cut
        cut = split_order(problem, topological_order(problem), num_stages)
        cut_ms = problem.bottleneck_ms(cut, num_stages)
        best, best_ms = (cut, cut_ms) if cut_ms < dp_ms * (1 - _BETTER) else (plan, dp_ms)
        return Proof(best, best_ms, best_ms, True, "chain", 0.0, dp_ms,
                     time.perf_counter() - started)
    if budget_s <= 0:
        return unproven(trivial, "off")
    if problem.num_nodes > max_nodes:
        return unproven(trivial, "size")
    from onnx_partition.solve.ilp import solve_ilp  # OR-Tools (1.5 s to import): only now

    best, best_ms = plan, dp_ms
    lower = trivial
    optimal, rounding = False, 0.0
    many = exact_rounds(problem.num_nodes) if rounds is None else rounds
    polished: list[int] | None = None
    for _ in range(many):
        # several rounds: the polish of the plan so far runs beside the round (_Ahead)
        ahead = _Ahead(problem, num_stages, best, budget_s, best is not plan) if many > 1 else None
        try:  # one round: as before windows came (its plans stand); several: all windowed
            found = solve_ilp(problem, num_stages, time_limit_s=10 * budget_s + 10, workers=1,
                              hint=best, deterministic_s=budget_s, windows=many > 1)
        except PartitionError:  # nothing within the limits: the plan given stands
            polished = ahead.result() if ahead else None
            break
        lower = max(lower, found.lower_bound_ms)
        optimal, rounding = found.optimal, found.rounding_ms
        better = found.bottleneck_ms < best_ms * (1 - _BETTER)
        if optimal or better:
            if ahead:
                ahead.cancel()
        elif ahead:
            polished = ahead.result()
        if better:
            best, best_ms = found.stage_of, found.bottleneck_ms
        if optimal or not better:
            break  # proven, or nothing better: another round would start where this one did
    if many > 1 and not optimal:
        best = polished if polished is not None else _polish(
            problem, num_stages, best, budget_s, best is not plan)
        best_ms = problem.bottleneck_ms(best, num_stages)
    lower = min(best_ms, lower)
    gap = (best_ms - lower) / best_ms if best_ms > 0 else 0.0
    return Proof(best, best_ms, lower, optimal, "cp-sat" if optimal else "budget",
                 gap, dp_ms, time.perf_counter() - started, rounding)


def _polish(problem: DagProblem, num_stages: int, plan: list[int], budget_s: float,
            refined: bool, stop: Callable[[], bool] = lambda: False) -> list[int]:
    """What the rounds' last plan gets when unproven: the local search of :mod:`.refine`
    (only after a round bettered the plan given; not between rounds: that changes the rounds'
    path, for the worse on encdec tiny at S = 4), then neighbourhoods of a few stages, each
    solved exactly, and, where they stop, the lexicographic descent over the same windows.
    ``stop``: asked between solves; true abandons the polish (its answer is then unused)."""
    best, best_ms = plan, problem.bottleneck_ms(plan, num_stages)
    if refined:
        again = refine(problem, best, num_stages)
        if problem.bottleneck_ms(again, num_stages) < best_ms * (1 - _BETTER):
            best = again
    best = stage_neighbourhoods(problem, num_stages, best, budget_s=budget_s / 2, stop=stop)
    return stage_neighbourhoods(problem, num_stages, best, budget_s=budget_s / 2,
                                solves=SPREAD_SOLVES, spread=True, stop=stop)


class _Ahead:
    """:func:`_polish` of ``plan`` started on a thread beside a round of CP-SAT from
    ``plan`` (CP-SAT and refine's numpy release the GIL): when the round finds nothing better,
    the polish is what the search does next, so it is taken as it is; otherwise it is
    stopped and dropped. The same plan as one step after the other, sooner."""

    def __init__(self, problem: DagProblem, num_stages: int, plan: list[int], budget_s: float,
                 refined: bool) -> None:
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="exact-polish")
        self._future = self._pool.submit(_polish, problem, num_stages, list(plan), budget_s,
                                         refined, self._stopped.is_set)
        self._pool.shutdown(wait=False)

    def result(self) -> list[int]:
        """The polished plan (waits for it)."""
        return self._future.result()

    def cancel(self) -> None:
        """Stop at the next solve and wait for the thread (it must not compete with the
        search that goes on)."""
        self._stopped.set()
        self._future.result()


def stage_neighbourhoods(
    problem: DagProblem, num_stages: int, stage_of: Sequence[int], *, budget_s: float,
    width: int = LNS_WIDTH, solves: int = LNS_SOLVES, spread: bool = False,
    stop: Callable[[], bool] = lambda: False,
) -> list[int]:
    """Large-neighbourhood search over adjacent stages (Shaw, CP 1998): the nodes of ``width``
    adjacent stages that hold the slowest one may move (to any stage a valid plan allows),
    every other node keeps its stage, and CP-SAT (:func:`~onnx_partition.solve.ilp.solve_ilp`,
    one worker, ``budget_s`` deterministic seconds) places them; a window must hold the
    slowest stage for its nodes to leave it. The first window that lowers the bottleneck is
    taken, and the search starts again from the new slowest stage; at most ``solves`` solves.
    Never worse than ``stage_of``. ``stop`` is asked before and during each solve: true ends
    the search.

    ``spread``: when the stages tie near the top the bottleneck cannot fall by re-cutting a
    few of them, so each solve instead minimises the slowest stage of its window, every other
    stage no slower than now (``solve_ilp(focus=...)``, with the precedence windows of the
    bottleneck, which hold for every such plan), and a plan is taken when its stage times,
    slowest first, are lexicographically lower: a descent on the sorted stage times, each step
    never raising the bottleneck, until the tied stages can all fall together."""
    best = [int(s) for s in stage_of]
    best_ms = problem.bottleneck_ms(best, num_stages)
    width = min(width, num_stages - 1)  # all the stages would be the plain search
    if width < 2:
        return best
    from onnx_partition.solve.ilp import solve_ilp

    def rank(plan: list[int]) -> list[float]:  # the stage times, slowest first
        return sorted(problem.stage_times(plan, num_stages), reverse=True)

    best_rank = rank(best)
    spent, improved = 0, True
    while improved and spent < solves:
        improved = False
        times = problem.stage_times(best, num_stages)
        slowest = max(range(num_stages), key=times.__getitem__)
        for first in sorted({max(0, min(num_stages - width, slowest - k))
                             for k in range(width)}):
            if spent == solves or stop():
                break
            spent += 1
            free = [first <= s < first + width for s in best]
            try:
                found = solve_ilp(problem, num_stages, time_limit_s=10 * budget_s + 10,
                                  workers=1, hint=best, deterministic_s=budget_s,
                                  windows=spread, free=free,
                                  focus=range(first, first + width) if spread else None,
                                  stop=stop)
            except PartitionError:  # nothing within the limits: this window stands
                continue
            if spread:
                found_rank = rank(found.stage_of)
                if (found_rank[0] <= best_rank[0]
                        and _lexicographically_lower(found_rank, best_rank)):
                    best, best_rank, improved = found.stage_of, found_rank, True
                    break
            elif found.bottleneck_ms < best_ms * (1 - _BETTER):
                best, best_ms, improved = found.stage_of, found.bottleneck_ms, True
                break
    return best


def _lexicographically_lower(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether ``a`` comes before ``b`` lexicographically, entries equal within a relative
    :data:`_BETTER` of ``b``'s first counting as equal (float noise must not cycle)."""
    tolerance = _BETTER * max(abs(b[0]), 1e-300)
    for x, y in zip(a, b, strict=True):
        if abs(x - y) > tolerance:
            return x < y
    return False
