"""Exact reference solver: split an operator DAG into S convex pipeline stages (CP-SAT).

This is the problem of Tarnawski et al., "Efficient algorithms for device placement of
DNN graph operators" (NeurIPS 2020), restricted to *contiguous* (convex) splits for
pipelining: every node gets a stage ``0..S-1``, every stage is non-empty, and no tensor
flows backwards (``stage(producer) <= stage(consumer)``), so the stages form a chain.
The objective is the time of the slowest stage (the pipeline's steady-state period).

The module is pure: it sees plain arrays, never ONNX.

The cost model is the relay model written down once in :mod:`onnx_partition.solve.problem`
(:meth:`DagProblem.stage_times`); the DP, the refinement and the brute force share it.

Integer scaling. CP-SAT needs integers, so every time (node compute, ``nbytes/bandwidth`` per
tensor, latency) is multiplied by a power of ten ``scale`` chosen so that the largest
conceivable stage time (all compute plus twice all transfers plus two latencies) maps to
between 1e6 and 1e7 units, and rounded to the nearest integer. Inputs that are multiples of
``1/scale`` (integers, halves, ... for ordinary magnitudes) are therefore represented exactly.
Otherwise the integer cost of any assignment differs from its float cost by at most
``IlpResult.rounding_ms`` (the larger of the summed upward and the summed downward rounding
errors, transfers and latency counted twice), so the returned plan is optimal within
``2 * rounding_ms``. Transfers are rounded per group of tensors that cross the same
boundaries (same producer, same last consumers), not per tensor. The reported
``bottleneck_ms`` is always the exact float cost of the returned assignment, and
``lower_bound_ms`` is a valid bound on the float optimum (the rounding is subtracted).

Performance (2 cores, random layered DAGs of width 10, 60 s limit). The LP relaxation is weak
(spreading every node evenly over the stages makes every crossing vanish), so the bound comes
from search plus the LP with all boolean constraints linearised ("max_lp", which CP-SAT's
default portfolio only runs from 8 workers up; we ask for it with fewer). With transfers:
20 nodes, S=4 proves optimal in ~1 s; 40-60 nodes in ~2-30 s; 200 nodes stops at the limit
with a 2.6 % (S=4) / 4.7 % (S=8) gap, 8-12 % better than a topological split. With free
transfers the problem is number partitioning: the gap closes to ~1e-5 quickly, but float
costs are rarely *proved* optimal. Results vary run to run (parallel search).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ortools.sat.python import cp_model

from onnx_partition.errors import PartitionError
from onnx_partition.settings.partition import SearchSpec
from onnx_partition.solve.problem import DagProblem, topological_order
from onnx_partition.solve.search import split_order

__all__ = ["IlpResult", "solve_ilp", "stage_windows"]

# The largest conceivable stage time maps to [_TARGET_UNITS, 10 * _TARGET_UNITS) integer units.
_TARGET_UNITS = 1_000_000
_STOP_POLL_S = 0.01  # how often a search given ``stop`` asks it (seconds)
# A scaled term closer than this (in units) to an integer counts as exact (float noise).
_EXACT_EPS = 1e-6

# Full-problem CP-SAT subsolvers for 2..7 workers, best first (CP-SAT runs workers-1 of them
# beside one thread of large-neighbourhood search).
_SMALL_PORTFOLIO = ("max_lp", "reduced_costs", "quick_restart_no_lp", "default_lp", "no_lp")

# A CP-SAT linear expression or an integer constant.
_Expr = cp_model.LinearExpr | int


@dataclass(frozen=True)
class IlpResult:
    """Outcome of :func:`solve_ilp`.

    ``optimal`` means CP-SAT proved the integer-scaled model optimal; the plan is then optimal
    for the float cost model within ``2 * rounding_ms`` (exactly, when ``rounding_ms == 0``).
    ``gap`` is ``(bottleneck - lower_bound) / bottleneck``, reported as 0 when optimal.
    """

    stage_of: list[int]
    bottleneck_ms: float
    lower_bound_ms: float
    optimal: bool
    gap: float
    wall_s: float
    rounding_ms: float = 0.0


def _scale_for(problem: DagProblem) -> float:
    """Power of ten mapping the largest conceivable stage time to [1e6, 1e7) units."""
    bw = problem.bandwidth_bytes_per_ms
    comm_total = sum(problem.nbytes) / bw if math.isfinite(bw) else 0.0
    upper = sum(problem.compute_ms) + 2.0 * comm_total + 2.0 * problem.latency_ms
    if upper <= 0.0:
        return 1.0
    return float(10.0 ** math.ceil(math.log10(_TARGET_UNITS / upper)))


class _Rounding:
    """Scaled integer costs plus the worst drift they can cause in one stage's time.

    ``up`` / ``down`` are the sums of the positive / negative rounding errors (in units) over
    all terms, each counted as often as it can appear in a single stage; so for any
    assignment, ``integer_time - scale * float_time`` lies in ``[-down, up]`` for every stage.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.up = 0.0
        self.down = 0.0

    def units(self, value_ms: float, times_per_stage: int = 1) -> int:
        exact = value_ms * self.scale
        rounded = round(exact)
        drift = rounded - exact
        if abs(drift) > _EXACT_EPS:  # smaller is float noise, not rounding
            if drift > 0:
                self.up += times_per_stage * drift
            else:
                self.down -= times_per_stage * drift
        return rounded


def _descendants(problem: DagProblem) -> list[int]:
    """Bitmask of strict descendants for every node (Python ints as bitsets)."""
    desc = [0] * problem.num_nodes
    for i in reversed(topological_order(problem)):
        mask = 0
        for j in problem.successors[i]:
            mask |= (1 << j) | desc[j]
        desc[i] = mask
    return desc


def solve_ilp(
    problem: DagProblem,
    num_stages: int,
    *,
    time_limit_s: float = SearchSpec.time_limit_s,
    workers: int = 2,
    hint: Sequence[int] | None = None,
    deterministic_s: float | None = None,
    windows: bool = True,
    free: Sequence[bool] | None = None,
    focus: Sequence[int] | None = None,
    stop: Callable[[], bool] | None = None,
) -> IlpResult:
    """Split ``problem`` into exactly ``num_stages`` convex stages minimising the slowest stage.

    ``time_limit_s`` bounds the whole call (model building included, the search gets what is
    left); when it runs out the best plan found so far is returned with ``optimal=False``.
    ``hint`` is an optional valid assignment to start from; the better of it and the best split
    of the topological order (:func:`~onnx_partition.solve.search.split_order`) seeds the search.

    Raises :class:`PartitionError` when ``num_stages`` is not in ``1..n``, when the hint is not
    a valid assignment, or when CP-SAT finds no feasible plan within the time limit.

    ``deterministic_s`` also bounds the search in CP-SAT's *deterministic* time (work counted,
    not seconds elapsed): with ``workers=1`` and a limit reached in deterministic time first,
    the same problem gives the same answer on any machine and load. The start plan is always
    feasible, so a search stopped early still returns a plan no worse than it (in units).

    ``windows`` fixes each node's stage outside its :func:`stage_windows` under the start
    plan's bottleneck (valid for every plan at least as fast, so the optimum stays; it changes
    the path of a search stopped early, for better on most problems, not on all).

    ``free``: only these nodes move; every other keeps its stage in ``hint`` (a neighbourhood
    of the hint searched exactly, large-neighbourhood search by hand).

    ``focus``: minimise the slowest of these stages instead, every other stage kept within its
    time in the start plan (a descent on the sorted stage times when several stages tie at
    the top, where the bottleneck itself cannot move); ``optimal`` then says that objective was
    proven, and ``lower_bound_ms`` is the trivial bound. ``stop``: polled every few
    milliseconds from another thread; once true the search stops with its best plan so far.
    """
    started = time.perf_counter()
    big_s = num_stages
    start_plan = _checked_start(problem, big_s, workers, hint, free)
    if big_s == 1:
        value = problem.bottleneck_ms(start_plan, 1)
        return IlpResult(stage_of=start_plan, bottleneck_ms=value, lower_bound_ms=value,
                         optimal=True, gap=0.0, wall_s=time.perf_counter() - started)

    costs = _IntegerCosts.of(problem)
    enc = _encoded(problem, big_s, costs, start_plan, windows, free, focus)
    solver = _solver(workers, started, time_limit_s, deterministic_s)
    status = _solve(solver, enc.model, stop)
    if status == cp_model.INFEASIBLE:
        raise PartitionError(f"no valid split into {big_s} stages exists")
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {enc.model.validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PartitionError(
            f"CP-SAT found no feasible {big_s}-stage split within {time_limit_s:g} s"
        )
    stage_of = enc.checked_solution(solver)
    bottleneck = problem.bottleneck_ms(stage_of, big_s)
    optimal = status == cp_model.OPTIMAL
    lower = _lower_bound_ms(problem, big_s, costs,
                            0.0 if focus else solver.best_objective_bound, bottleneck)
    gap = 0.0 if optimal or bottleneck <= 0.0 else (bottleneck - lower) / bottleneck
    return IlpResult(stage_of=stage_of, bottleneck_ms=bottleneck, lower_bound_ms=lower,
                     optimal=optimal, gap=gap, wall_s=time.perf_counter() - started,
                     rounding_ms=costs.rounding_ms)


def _solve(solver: cp_model.CpSolver, model: cp_model.CpModel,
           stop: Callable[[], bool] | None) -> Any:
    """``solver.solve(model)``, stopped (``stop_search``) once ``stop()`` is true."""
    if stop is None:
        return solver.solve(model)
    done = threading.Event()

    def watch() -> None:  # again and again: a stop before the search starts is lost
        while not done.wait(_STOP_POLL_S):
            if stop():
                solver.stop_search()

    watcher = threading.Thread(target=watch, name="cp-sat-stop", daemon=True)
    watcher.start()
    try:
        return solver.solve(model)
    finally:
        done.set()
        watcher.join()


def _checked_start(problem: DagProblem, big_s: int, workers: int, hint: Sequence[int] | None,
                   free: Sequence[bool] | None) -> list[int]:
    """The plan the search starts from (:func:`_start_plan`, or the hint itself where only
    ``free`` nodes move), the arguments checked."""
    n = problem.num_nodes
    if not 1 <= big_s <= n:
        raise PartitionError(
            f"num_stages must be between 1 and the number of nodes ({n}), got {big_s}"
        )
    if workers < 1:
        raise PartitionError(f"workers must be >= 1, got {workers}")
    start_plan = _start_plan(problem, big_s, hint)
    if free is not None:  # a neighbourhood of the hint: it is the start, whatever is better
        if hint is None or len(free) != n:
            raise PartitionError("free needs a hint and one flag per node")
        start_plan = [int(s) for s in hint]
    return start_plan


def _encoded(problem: DagProblem, big_s: int, costs: _IntegerCosts, start_plan: list[int],
             windows: bool, free: Sequence[bool] | None, focus: Sequence[int] | None
             ) -> _Encoding:
    """The CP-SAT model: the convex-split constraints, the stage times, the bounds and hint
    from the start plan, and the objective (the slowest stage, or the slowest of ``focus``
    with every other stage kept within its start time)."""
    enc = _Encoding.new(problem, big_s, costs)
    enc.add_monotone_stages()
    enc.add_forward_only()
    enc.add_nonempty_stages()
    enc.add_multi_consumer_crossings()
    enc.add_stage_times()
    start_units = _int_stage_times(problem, start_plan, big_s, costs)
    enc.add_redundant_bounds(max(start_units))
    if windows:
        enc.add_stage_windows(max(start_units))
    if free is not None:
        enc.fix_outside(start_plan, free)
    enc.add_hint(start_plan, max(start_units))
    if focus:
        top = enc.model.new_int_var(0, max(start_units), "focus")
        for k in focus:
            enc.model.add(enc.stage_time[k] <= top)
        for k in set(range(big_s)) - set(focus):
            enc.model.add(enc.stage_time[k] <= start_units[k])
        enc.model.add_hint(top, max(start_units[k] for k in focus))
        enc.model.minimize(top)
    else:
        enc.model.minimize(enc.makespan)
    return enc


def _solver(workers: int, started: float, time_limit_s: float, deterministic_s: float | None
            ) -> cp_model.CpSolver:
    """CP-SAT with its portfolio for ``workers`` and what is left of the time limit."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    # Portfolio: the bound comes from the LP with every boolean constraint linearised
    # ("max_lp"); CP-SAT's default portfolio only runs it from 8 workers up, and with fewer
    # workers it proved optimality 5-20x faster on 40-60 node DAGs (see module docstring).
    if workers == 1:
        solver.parameters.linearization_level = 2
    elif workers < 8:
        solver.parameters.subsolvers.extend(_SMALL_PORTFOLIO)
    remaining_s = time_limit_s - (time.perf_counter() - started)
    solver.parameters.max_time_in_seconds = max(0.01, remaining_s)
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = max(0.0, deterministic_s)
    return solver


def _start_plan(problem: DagProblem, num_stages: int, hint: Sequence[int] | None) -> list[int]:
    """The better (by exact float cost) of the caller's hint and the best topological split."""
    plan = split_order(problem, topological_order(problem), num_stages)
    if hint is None:
        return plan
    given = [int(s) for s in hint]
    if not problem.is_valid(given, num_stages):
        raise PartitionError(
            f"hint is not a valid {num_stages}-stage assignment (length {problem.num_nodes}, "
            "every stage non-empty, no tensor flowing backwards)"
        )
    if problem.bottleneck_ms(given, num_stages) <= problem.bottleneck_ms(plan, num_stages):
        return given
    return plan


#: Tensors that cross the same boundaries: (producer or -1, is a graph output, maximal consumers).
_GroupKey = tuple[int, bool, tuple[int, ...]]


@dataclass(frozen=True)
class _IntegerCosts:
    """The problem's times in integer units: ``w`` per node, ``lat`` per existing boundary, and
    one transfer weight per group of tensors that cross exactly the same boundaries."""

    scale: float
    w: list[int]
    lat: int
    group_units: dict[_GroupKey, int]
    up: float  # worst upward / downward drift of one stage's time (units), see _Rounding
    down: float

    @property
    def rounding_ms(self) -> float:
        return max(self.up, self.down) / self.scale

    @staticmethod
    def of(problem: DagProblem) -> _IntegerCosts:
        """A tensor's crossing depends only on its producer (-1: graph input), on whether it is
        a graph output, and on its *maximal* consumers: a consumer that is an ancestor of
        another consumer is never in a later stage, so it cannot decide last(t). Tensors with
        the same key are merged; zero-cost tensors (free transfers, empty tensors) dropped."""
        scale = _scale_for(problem)
        bw = problem.bandwidth_bytes_per_ms
        rounding = _Rounding(scale)
        w = [rounding.units(c) for c in problem.compute_ms]
        lat = rounding.units(problem.latency_ms, 2)  # a stage pays at most two latencies
        desc = _descendants(problem)
        groups: dict[_GroupKey, float] = {}
        for t, cs in enumerate(problem.consumers):
            if not math.isfinite(bw) or problem.nbytes[t] == 0.0:
                continue
            distinct = set(cs)
            if not distinct and not problem.is_output[t]:
                continue  # crosses nothing
            if problem.is_output[t]:
                key_cs: tuple[int, ...] = ()  # last(t) = S-1 whatever the consumers are
            else:
                key_cs = tuple(
                    sorted(c for c in distinct if not any(desc[c] >> d & 1 for d in distinct))
                )
            key = (problem.producer[t], problem.is_output[t], key_cs)
            groups[key] = groups.get(key, 0.0) + problem.nbytes[t] / bw
        group_units: dict[_GroupKey, int] = {}
        for key, ms in groups.items():
            units = rounding.units(ms, 2)  # a tensor can weigh on both boundaries of one stage
            if units > 0:
                group_units[key] = units
        return _IntegerCosts(scale, w, lat, group_units, rounding.up, rounding.down)


@dataclass
class _Encoding:
    """The CP-SAT model, its variables, and one ``add_*`` method per constraint family.

    ``y[i][b] = 1  <=>  node i is in stage <= b`` (b = 0..S-2). So stage(i) = sum_b (1 - y[i][b])
    and "node i is in stage k" is y[i][k] - y[i][k-1] (with y[i][-1] = 0, y[i][S-1] = 1).
    ``cross[key][b]`` is a 0/1 linear expression, 1 iff the tensors of group ``key`` cross
    boundary b. Single-consumer and output/input cases are linear in y; only tensors with
    several maximal consumers need an auxiliary boolean v = [some consumer is in a stage > b],
    listed in ``aux`` as (v, producer, consumers, b).
    """

    problem: DagProblem
    num_stages: int
    costs: _IntegerCosts
    model: cp_model.CpModel
    y: list[list[cp_model.IntVar]]
    cross: dict[_GroupKey, list[_Expr]]
    aux: list[tuple[cp_model.IntVar, int, tuple[int, ...], int]]
    makespan: cp_model.IntVar
    stage_time: list[_Expr]

    @staticmethod
    def new(problem: DagProblem, num_stages: int, costs: _IntegerCosts) -> _Encoding:
        model = cp_model.CpModel()
        boundaries = range(num_stages - 1)
        y = [[model.new_bool_var(f"y[{i},{b}]") for b in boundaries]
             for i in range(problem.num_nodes)]
        cross: dict[_GroupKey, list[_Expr]] = {}
        aux: list[tuple[cp_model.IntVar, int, tuple[int, ...], int]] = []
        for key in costs.group_units:
            p, out, cs = key
            exprs: list[_Expr] = []
            for b in boundaries:
                made = 1 if p < 0 else y[p][b]  # first(t) <= b
                if out:
                    exprs.append(made)  # last(t) = S-1 > b
                elif len(cs) == 1:
                    # Forward-only makes y[c][b] -> made, so this difference is 0 or 1.
                    exprs.append(made - y[cs[0]][b])
                else:
                    v = model.new_bool_var(f"later[{p},{cs},{b}]")
                    aux.append((v, p, cs, b))
                    exprs.append(made - 1 + v if p >= 0 else v)
            cross[key] = exprs
        top = sum(costs.w) + 2 * costs.lat + 2 * sum(costs.group_units.values())
        makespan = model.new_int_var(0, top, "makespan")
        return _Encoding(problem, num_stages, costs, model, y, cross, aux, makespan, [])

    def le(self, i: int, b: int) -> _Expr:
        """[stage(i) <= b] for any b, constant outside 0..S-2."""
        if b < 0:
            return 0
        if b >= self.num_stages - 1:
            return 1
        return self.y[i][b]

    def add_monotone_stages(self) -> None:
        """stage(i) <= b implies stage(i) <= b + 1."""
        for row in self.y:
            for b in range(self.num_stages - 2):
                self.model.add_implication(row[b], row[b + 1])

    def add_forward_only(self) -> None:
        """Convexity: stage(producer) <= stage(consumer) for every edge, i.e. stage(c) <= b
        implies stage(p) <= b."""
        for p, c in self.problem.edges():
            if p != c:
                for b in range(self.num_stages - 1):
                    self.model.add_implication(self.y[c][b], self.y[p][b])

    def add_nonempty_stages(self) -> None:
        """#{stage <= k} - #{stage <= k-1} >= 1 for every stage k."""
        nodes = range(self.problem.num_nodes)
        for k in range(self.num_stages):
            self.model.add(sum(self.le(i, k) for i in nodes)
                           - sum(self.le(i, k - 1) for i in nodes) >= 1)

    def add_multi_consumer_crossings(self) -> None:
        """v = OR_c [stage(c) > b], exact in both directions."""
        for v, _p, cs, b in self.aux:
            for c in cs:
                self.model.add_bool_or([v, self.y[c][b]])  # stage(c) > b  ->  v
            self.model.add_bool_or([~v, *(~self.y[c][b] for c in cs)])  # v -> some c later

    def add_stage_times(self) -> None:
        """compute + transfers on each existing boundary + latency <= makespan, per stage."""
        big_s, costs = self.num_stages, self.costs
        for k in range(big_s):
            expr: _Expr = sum(w * (self.le(i, k) - self.le(i, k - 1))
                              for i, w in enumerate(costs.w))
            for key, units in costs.group_units.items():
                if k > 0:
                    expr += units * self.cross[key][k - 1]
                if k < big_s - 1:
                    expr += units * self.cross[key][k]
            expr += costs.lat * ((k > 0) + (k < big_s - 1))
            self.stage_time.append(expr)
            self.model.add(expr <= self.makespan)

    def add_redundant_bounds(self, start_units: int) -> None:
        """The starting plan is feasible, and no stage beats the average or the heaviest single
        node (plus the one latency every stage pays when S >= 2)."""
        w, lat, big_s = self.costs.w, self.costs.lat, self.num_stages
        self.model.add(self.makespan <= start_units)
        self.model.add(self.makespan * big_s >= sum(w) + 2 * (big_s - 1) * lat)
        self.model.add(self.makespan >= max(w) + lat)

    def add_stage_windows(self, upper_units: int) -> None:
        """Fix every y outside its node's :func:`stage_windows` for plans of at most
        ``upper_units`` (in the model's integer costs, so exact for the model)."""
        windows = stage_windows(self.problem, self.num_stages, upper_units,
                                weights=self.costs.w, latency=self.costs.lat)
        for row, (first, last) in zip(self.y, windows, strict=True):
            for b, var in enumerate(row):
                if b < first:
                    self.model.add(var == 0)
                elif b >= last:
                    self.model.add(var == 1)

    def fix_outside(self, plan: Sequence[int], free: Sequence[bool]) -> None:
        """Every node not ``free`` keeps its stage in ``plan``."""
        for row, stage, movable in zip(self.y, plan, free, strict=True):
            if not movable:
                for b, var in enumerate(row):
                    self.model.add(var == int(stage <= b))

    def add_hint(self, plan: Sequence[int], plan_units: int) -> None:
        """The starting plan, complete (every variable) so CP-SAT can take it at once."""
        for i, row in enumerate(self.y):
            for b, var in enumerate(row):
                self.model.add_hint(var, plan[i] <= b)
        for v, _p, cs, b in self.aux:
            self.model.add_hint(v, any(plan[c] > b for c in cs))
        self.model.add_hint(self.makespan, plan_units)

    def checked_solution(self, solver: cp_model.CpSolver) -> list[int]:
        """The solved assignment, checked against the model and the float cost model."""
        big_s, problem, costs = self.num_stages, self.problem, self.costs
        stage_of = [sum(1 - int(solver.boolean_value(var)) for var in row) for row in self.y]
        assert problem.is_valid(stage_of, big_s), "CP-SAT returned an invalid assignment"
        units_now = _int_stage_times(problem, stage_of, big_s, costs)
        model_units = [int(solver.value(e)) for e in self.stage_time]
        assert units_now == model_units, f"crossing encoding mismatch: {units_now} != {model_units}"
        assert max(units_now) <= solver.value(self.makespan)
        bottleneck = problem.bottleneck_ms(stage_of, big_s)
        slack = 1e-6 * max(1.0, bottleneck * costs.scale)  # float noise
        drift = max(units_now) - bottleneck * costs.scale
        assert -costs.down - slack <= drift <= costs.up + slack, (
            "scaled objective disagrees with the float cost model"
        )
        return stage_of


def stage_windows(
    problem: DagProblem, num_stages: int, upper: float, *,
    weights: Sequence[float] | None = None, latency: float | None = None,
) -> list[tuple[int, int]]:
    """The stages ``(first, last)`` each node may take in a plan whose slowest stage is at most
    ``upper``: the earliest and latest start of scheduling (e.g. Brucker, *Scheduling
    Algorithms*, ch. 4) with stages as machines in a row. A node and all its ancestors lie in
    stages ``0..stage``, each holding at most ``upper`` less the latencies it pays (one at
    either end of the pipeline, two between), transfers only adding; so ``first`` is the
    first stage whose prefix of stages can hold that compute, ``last`` likewise from the end
    with the descendants. ``weights`` and ``latency`` (default: the problem's compute and
    latency) may be given in other units, e.g. CP-SAT's integers. ``first > last`` means no
    plan that fast exists.
    """
    w = list(problem.compute_ms if weights is None else weights)
    lat = problem.latency_ms if latency is None else latency
    big_s = num_stages
    room = [max(0.0, upper - lat * ((k > 0) + (k < big_s - 1))) for k in range(big_s)]
    prefix = list(itertools.accumulate(room))
    suffix = list(itertools.accumulate(reversed(room)))[::-1]
    desc = _descendants(problem)
    n = problem.num_nodes
    anc = [0] * n
    for i in range(n):
        bits = desc[i]
        while bits:
            low = bits & -bits
            anc[low.bit_length() - 1] |= 1 << i
            bits ^= low
    windows = []
    for i in range(n):
        before = w[i] + _weight(anc[i], w)
        after = w[i] + _weight(desc[i], w)
        first = next((k for k in range(big_s) if prefix[k] >= before), big_s)
        last = next((k for k in reversed(range(big_s)) if suffix[k] >= after), -1)
        windows.append((first, last))
    return windows


def _weight(bits: int, w: Sequence[float]) -> float:
    """The summed ``w`` of the nodes in bitset ``bits``."""
    total = 0.0
    while bits:
        low = bits & -bits
        total += w[low.bit_length() - 1]
        bits ^= low
    return total


def _lower_bound_ms(problem: DagProblem, num_stages: int, costs: _IntegerCosts,
                    bound_units: float, bottleneck_ms: float) -> float:
    """A valid bound on the float optimum: CP-SAT's bound less the rounding, or the trivial one
    (the heaviest node, the average stage), never above the plan found."""
    trivial_ms = max(
        max(problem.compute_ms) + problem.latency_ms,
        (sum(problem.compute_ms) + 2 * (num_stages - 1) * problem.latency_ms) / num_stages,
    )
    bound_ms = (bound_units - costs.up) / costs.scale
    return min(bottleneck_ms, max(0.0, bound_ms, trivial_ms))


def _int_stage_times(
    problem: DagProblem, stage_of: Sequence[int], num_stages: int, costs: _IntegerCosts
) -> list[int]:
    """Stage times in integer units, recomputed directly from an assignment (model check)."""
    lat = costs.lat
    times = [0] * num_stages
    for i, s in enumerate(stage_of):
        times[s] += costs.w[i]
    for (p, out, cs), units in costs.group_units.items():
        first = 0 if p < 0 else stage_of[p]
        last = num_stages - 1 if out else max(stage_of[c] for c in cs)
        for b in range(first, last):
            times[b] += units
            times[b + 1] += units
    for k in range(num_stages):
        times[k] += lat * ((k > 0) + (k < num_stages - 1))
    return times
