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

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from onnx_partition.errors import PartitionError
from onnx_partition.solve.problem import DagProblem, topological_order

__all__ = ["DagProblem", "IlpResult", "solve_ilp"]  # DagProblem re-exported from .problem

# The largest conceivable stage time maps to [_TARGET_UNITS, 10 * _TARGET_UNITS) integer units.
_TARGET_UNITS = 1_000_000
# A scaled term closer than this (in units) to an integer counts as exact (float noise).
_EXACT_EPS = 1e-6

# Full-problem CP-SAT subsolvers for 2..7 workers, best first (CP-SAT runs workers-1 of them
# beside one thread of large-neighbourhood search).
_SMALL_PORTFOLIO = ("max_lp", "reduced_costs", "quick_restart_no_lp", "default_lp", "no_lp")

# A CP-SAT linear expression or an integer constant.
_Expr = cp_model.LinearExpr | int


def topological_split(problem: DagProblem, num_stages: int) -> list[int]:
    """Best split of one fixed topological order into contiguous runs (exact DP, same cost model).

    Any contiguous split of a topological order is valid, so this is a cheap feasible plan;
    ``solve_ilp`` uses it as the CP-SAT hint and as the initial upper bound.
    """
    n, big_s = problem.num_nodes, num_stages
    if not 1 <= big_s <= n:
        raise PartitionError(f"num_stages must be between 1 and {n} (the node count), got {big_s}")
    order = topological_order(problem)
    pos = [0] * n
    for k, i in enumerate(order):
        pos[i] = k
    # Bytes crossing a cut placed before order position j (j = 1..n-1): the tensors with
    # first position < j <= last position (graph inputs start at -1, outputs end at n).
    diff = np.zeros(n + 2)
    for t, cs in enumerate(problem.consumers):
        if problem.is_output[t]:
            last = n
        elif cs:
            last = max(pos[c] for c in cs)
        else:
            continue
        p = problem.producer[t]
        first = -1 if p < 0 else pos[p]
        if first < last:
            diff[first + 1] += problem.nbytes[t]
            diff[last + 1] -= problem.nbytes[t]
    cut = np.cumsum(diff)[: n + 1]
    bw = problem.bandwidth_bytes_per_ms
    comm = cut / bw if math.isfinite(bw) else np.zeros(n + 1)
    pre = np.concatenate([[0.0], np.cumsum([problem.compute_ms[i] for i in order])])
    lat = problem.latency_ms

    # best[k][e]: least bottleneck with order[0:e] in stages 0..k; arg[k][e]: where stage k starts.
    best = np.full((big_s, n + 1), np.inf)
    arg = np.zeros((big_s, n + 1), dtype=np.int64)
    right0 = big_s > 1
    best[0, 1:] = pre[1:] + (comm[1:] + lat if right0 else 0.0)
    for k in range(1, big_s):
        right = k < big_s - 1
        e_range = range(k + 1, n + 1) if right else range(n, n + 1)
        for e in e_range:
            starts = np.arange(k, e)
            seg = pre[e] - pre[starts] + comm[starts] + lat
            if right:
                seg = seg + comm[e] + lat
            cand = np.maximum(best[k - 1, starts], seg)
            j = int(np.argmin(cand))
            best[k, e] = cand[j]
            arg[k, e] = starts[j]
    stage_of = [0] * n
    e = n
    for k in range(big_s - 1, -1, -1):
        a = int(arg[k, e]) if k > 0 else 0
        for q in range(a, e):
            stage_of[order[q]] = k
        e = a
    return stage_of


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
    n = problem.num_nodes
    succ: list[set[int]] = [set() for _ in range(n)]
    for p, c in problem.edges():
        succ[p].add(c)
    desc = [0] * n
    for i in reversed(topological_order(problem)):
        mask = 0
        for j in succ[i]:
            mask |= (1 << j) | desc[j]
        desc[i] = mask
    return desc


def solve_ilp(
    problem: DagProblem,
    num_stages: int,
    *,
    time_limit_s: float = 60.0,
    workers: int = 2,
    hint: Sequence[int] | None = None,
) -> IlpResult:
    """Split ``problem`` into exactly ``num_stages`` convex stages minimising the slowest stage.

    ``time_limit_s`` bounds the whole call (model building included, the search gets what is
    left); when it runs out the best plan found so far is returned with ``optimal=False``.
    ``hint`` is an optional valid assignment to start from; the better of it and a
    topological-order split (:func:`topological_split`) seeds the search.

    Raises :class:`PartitionError` when ``num_stages`` is not in ``1..n``, when the hint is not
    a valid assignment, or when CP-SAT finds no feasible plan within the time limit.
    """
    started = time.perf_counter()
    n, big_s = problem.num_nodes, num_stages
    if not 1 <= big_s <= n:
        raise PartitionError(
            f"num_stages must be between 1 and the number of nodes ({n}), got {big_s}"
        )
    if workers < 1:
        raise PartitionError(f"workers must be >= 1, got {workers}")
    if hint is not None:
        hint = [int(s) for s in hint]
        if not problem.is_valid(hint, big_s):
            raise PartitionError(
                f"hint is not a valid {big_s}-stage assignment (length {n}, every stage "
                "non-empty, no tensor flowing backwards)"
            )

    # Starting plan: the better (by exact float cost) of the caller's hint and a topo split.
    start_plan = topological_split(problem, big_s)
    if hint is not None and problem.bottleneck_ms(hint, big_s) <= problem.bottleneck_ms(
        start_plan, big_s
    ):
        start_plan = list(hint)
    if big_s == 1:
        value = problem.bottleneck_ms(start_plan, 1)
        return IlpResult(
            stage_of=start_plan,
            bottleneck_ms=value,
            lower_bound_ms=value,
            optimal=True,
            gap=0.0,
            wall_s=time.perf_counter() - started,
        )

    # ------------------------------------------------------------------ data
    # Integer costs (units): w[i] node compute, lat latency per existing boundary, and one
    # transfer weight per group of tensors that cross exactly the same boundaries.
    scale = _scale_for(problem)
    bw = problem.bandwidth_bytes_per_ms
    rounding = _Rounding(scale)
    w = [rounding.units(c) for c in problem.compute_ms]
    lat = rounding.units(problem.latency_ms, 2)  # a stage pays at most two latencies
    boundaries = range(big_s - 1)

    # A tensor's crossing depends only on its producer (-1: graph input), on whether it is a
    # graph output, and on its *maximal* consumers: a consumer that is an ancestor of another
    # consumer is never in a later stage, so it cannot decide last(t). Tensors with the same
    # key are merged; zero-cost tensors (free transfers, empty tensors) are dropped.
    desc = _descendants(problem)
    groups: dict[tuple[int, bool, tuple[int, ...]], float] = {}
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
    group_units: dict[tuple[int, bool, tuple[int, ...]], int] = {}
    for key, ms in groups.items():
        units = rounding.units(ms, 2)  # a tensor can weigh on both boundaries of one stage
        if units > 0:
            group_units[key] = units
    rounding_ms = max(rounding.up, rounding.down) / scale

    model = cp_model.CpModel()

    # ------------------------------------------------------------------ variables
    # y[i][b] = 1  <=>  node i is in stage <= b  (b = 0..S-2). So stage(i) = sum_b (1 - y[i][b])
    # and "node i is in stage k" is y[i][k] - y[i][k-1] (with y[i][-1] = 0, y[i][S-1] = 1).
    y = [[model.new_bool_var(f"y[{i},{b}]") for b in boundaries] for i in range(n)]

    def le(i: int, b: int) -> _Expr:
        """[stage(i) <= b] for any b, constant outside 0..S-2."""
        if b < 0:
            return 0
        if b >= big_s - 1:
            return 1
        return y[i][b]

    # cross[key][b]: 0/1 linear expression, 1 iff the tensors of group `key` cross boundary b.
    # Single-consumer and output/input cases are linear in y; only tensors with several
    # maximal consumers need an auxiliary boolean v = [some consumer is in a stage > b].
    cross: dict[tuple[int, bool, tuple[int, ...]], list[_Expr]] = {}
    aux: list[tuple[cp_model.IntVar, int, tuple[int, ...], int]] = []  # (v, producer, cs, b)
    for key in group_units:
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
    makespan = model.new_int_var(0, sum(w) + 2 * lat + 2 * sum(group_units.values()), "makespan")

    # ------------------------------------------------------------------ constraints
    # Stage encoding is monotone: stage(i) <= b implies stage(i) <= b + 1.
    for i in range(n):
        for b in range(big_s - 2):
            model.add_implication(y[i][b], y[i][b + 1])

    # Forward-only (convexity): stage(producer) <= stage(consumer) for every edge,
    # i.e. stage(c) <= b implies stage(p) <= b.
    for p, c in problem.edges():
        if p != c:
            for b in boundaries:
                model.add_implication(y[c][b], y[p][b])

    # Every stage is non-empty: #{stage <= k} - #{stage <= k-1} >= 1.
    for k in range(big_s):
        model.add(sum(le(i, k) for i in range(n)) - sum(le(i, k - 1) for i in range(n)) >= 1)

    # Multi-consumer crossing: v = OR_c [stage(c) > b]  (exact in both directions).
    for v, _p, cs, b in aux:
        for c in cs:
            model.add_bool_or([v, y[c][b]])  # stage(c) > b  ->  v
        model.add_bool_or([~v, *(~y[c][b] for c in cs)])  # v -> some stage(c) > b

    # Stage time: compute + transfers on each existing boundary + latency <= makespan.
    stage_time: list[_Expr] = []
    for k in range(big_s):
        expr: _Expr = sum(w[i] * (le(i, k) - le(i, k - 1)) for i in range(n))
        hops = (k > 0) + (k < big_s - 1)
        for key, units in group_units.items():
            if k > 0:
                expr += units * cross[key][k - 1]
            if k < big_s - 1:
                expr += units * cross[key][k]
        expr += lat * hops
        stage_time.append(expr)
        model.add(expr <= makespan)

    # Redundant bounds: the starting plan is feasible, and no stage beats the average or
    # the heaviest single node (plus the one latency every stage pays when S >= 2).
    start_units = _int_stage_times(problem, start_plan, big_s, w, lat, group_units)
    model.add(makespan <= max(start_units))
    model.add(makespan * big_s >= sum(w) + 2 * (big_s - 1) * lat)
    model.add(makespan >= max(w) + lat)

    # ------------------------------------------------------------------ objective
    model.minimize(makespan)

    # Hint: the starting plan, complete (every variable) so CP-SAT can take it at once.
    for i in range(n):
        for b in boundaries:
            model.add_hint(y[i][b], start_plan[i] <= b)
    for v, _p, cs, b in aux:
        model.add_hint(v, any(start_plan[c] > b for c in cs))
    model.add_hint(makespan, max(start_units))

    # ------------------------------------------------------------------ solve
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
    status = solver.solve(model)

    # ------------------------------------------------------------------ status check
    if status == cp_model.INFEASIBLE:
        raise PartitionError(f"no valid split into {big_s} stages exists")
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {model.validate()}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise PartitionError(
            f"CP-SAT found no feasible {big_s}-stage split within {time_limit_s:g} s"
        )

    # ------------------------------------------------------------------ extract + check
    stage_of = [sum(1 - int(solver.boolean_value(y[i][b])) for b in boundaries) for i in range(n)]
    assert problem.is_valid(stage_of, big_s), "CP-SAT returned an invalid assignment"
    units_now = _int_stage_times(problem, stage_of, big_s, w, lat, group_units)
    model_units = [int(solver.value(e)) for e in stage_time]
    assert units_now == model_units, f"crossing encoding mismatch: {units_now} != {model_units}"
    assert max(units_now) <= solver.value(makespan)
    bottleneck = problem.bottleneck_ms(stage_of, big_s)
    slack = 1e-6 * max(1.0, bottleneck * scale)  # float noise
    assert -rounding.down - slack <= max(units_now) - bottleneck * scale <= rounding.up + slack, (
        "scaled objective disagrees with the float cost model"
    )

    optimal = status == cp_model.OPTIMAL
    trivial_ms = max(
        max(problem.compute_ms) + problem.latency_ms,
        (sum(problem.compute_ms) + 2 * (big_s - 1) * problem.latency_ms) / big_s,
    )
    bound_ms = (solver.best_objective_bound - rounding.up) / scale
    lower = min(bottleneck, max(0.0, bound_ms, trivial_ms))
    gap = 0.0 if optimal or bottleneck <= 0.0 else (bottleneck - lower) / bottleneck
    return IlpResult(
        stage_of=stage_of,
        bottleneck_ms=bottleneck,
        lower_bound_ms=lower,
        optimal=optimal,
        gap=gap,
        wall_s=time.perf_counter() - started,
        rounding_ms=rounding_ms,
    )


def _int_stage_times(
    problem: DagProblem,
    stage_of: Sequence[int],
    num_stages: int,
    w: Sequence[int],
    lat: int,
    group_units: dict[tuple[int, bool, tuple[int, ...]], int],
) -> list[int]:
    """Stage times in integer units, recomputed directly from an assignment (model check)."""
    times = [0] * num_stages
    for i, s in enumerate(stage_of):
        times[s] += w[i]
    for (p, out, cs), units in group_units.items():
        first = 0 if p < 0 else stage_of[p]
        last = num_stages - 1 if out else max(stage_of[c] for c in cs)
        for b in range(first, last):
            times[b] += units
            times[b + 1] += units
    for k in range(num_stages):
        times[k] += lat * ((k > 0) + (k < num_stages - 1))
    return times
