"""Hybrid-parallel planning: stage boundaries *and* data-parallel replicas per stage, by DP.

Input is a sequence (operators or clustered blocks) with per-position costs; output is a list of
stages ``(start, end, replicas)``. A stage ``[i, j)`` on ``r`` replicas, the ``q``-th stage from
the pipeline's end, costs per micro-batch (its *period*, PipeDream's replicated-stage model,
Narayanan et al., SOSP 2019, with the transfers of every tensor crossing its boundaries counted):

    latency L = F + comm                       (infer)
              = F + B + 2 comm                 (train: activations forward, gradients back)
    period  P = ceil(M / r) L / M              (replicas take micro-batches in turn, the fullest
                + allreduce / M                 ceil(M / r) of them; r <= M; the ring
    allreduce = 2 (r-1)/r W / bw + 2 (r-1) lat  all-reduce of W gradient bytes once per iteration)

and needs per device the memory of :mod:`onnx_partition.pipeline.memory` (the one memory
model): in training ``opt * W + G + held * (A + R)``, where 1F1B's ``held`` micro-batches in
flight depend on the stage's replicas and the replicas and warm-up of the stages after it. The
DP builds plans from the pipeline's end; under a memory limit in training it keeps, per suffix
and depth, the fewest devices for each first replica count and warm-up
(:func:`~.hybrid_dp.exact_fewest`), so it checks every stage's memory exactly in front of every
suffix it could be placed before;
the plans it returns carry each stage's exact memory (``memory_per_device``), and the planner
checks again after widening. With ``recompute="auto"`` a stage may instead keep only its
inputs (one more forward, :func:`recompute_stage`), chosen per stage by the same exact DP
where keeping does not fit.

The DP runs over suffixes with the number of stages in the state (table shape written as in
Alpa's ``training_dp_impl``)::

    g[q, i, d] = min over j > i, r <= d - (q - 1) of max(P(i, j, r, q), g[q-1, j, d-r])

``g[q, i, d]``: the smallest bottleneck period of the suffix ``[i, n)`` cut into exactly ``q``
stages on at most ``d`` devices, every stage within memory; ``g[0, n, d] = 0``. Replica counts
are every one up to ``min(D, M)`` (a replica beyond the ``M``-th would get no micro-batch)
where memory binds, else only the dominant ones (:func:`dominant_counts`: one per value of
``ceil(M / r)`` with uniform links; the proof in ``docs/np_completeness.md``). Every ``q``
gives a plan; the caller scores each one with the event simulator, which counts fill and drain,
and keeps the fastest, so a shallow pipeline with replicas competes with a deep one.

Exact (where its tables fit in :data:`~.hybrid_tables.EXACT_CELLS`; beyond, bounded, with a
proven gap: :func:`solve_hybrid`) for: the least bottleneck period over contiguous splits of
*this* sequence, any replica
counts up to ``min(D, M)`` (and recomputation flags per stage, ``auto``: checked
against brute force), every stage within memory (a bisection over the sorted stage periods;
float32 period tables, about 1e-7 relative); "no plan fits" exactly when none does, checked
against the CP-SAT judge :mod:`.hybrid_judge` (without recomputation). Not for the problem
over the DAG with any replica counts, strongly NP-hard with a fixed depth, a memory bound or
all-reduce costs (``docs/np_completeness.md``). The code counts the fewest devices per bound
(:func:`plan_hybrid`) instead of indexing a table by ``d``, so its time is polynomial in
``log D``, not in ``D``.

Where each piece lives: the problem and the stage model (:mod:`.hybrid_model`), every stage
priced as (start, end) matrices (:mod:`.hybrid_tables`), the DPs for one bound
(:mod:`.hybrid_dp`), memory and the no-fit report (:mod:`.hybrid_memory`); here the bisection
over the bound and the plans proposed (:func:`plan_hybrid`), and pricing plans found elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import device_bytes
from onnx_partition.solve.hybrid_dp import BoundedTables, fewest_devices
from onnx_partition.solve.hybrid_exact import ExactTables, exact_fewest
from onnx_partition.solve.hybrid_memory import memory_report, stage_memory
from onnx_partition.solve.hybrid_model import (
    HybridConfig,
    HybridStage,
    SequenceCosts,
    dominant_counts,
    recompute_stage,
    replica_choices,
    shared_spans,
    stage_period,
)
from onnx_partition.solve.hybrid_tables import (
    EXACT_CELLS,
    MAX_DEVICES,
    NO_COUNT,
    StageTables,
    exact_cells,
    held_caps,
)

__all__ = ["EXACT_CELLS", "MAX_DEVICES", "BoundedNoPlan", "HybridConfig", "HybridSolution",
           "HybridStage", "SequenceCosts", "dominant_counts", "plan_hybrid", "price_plans",
           "price_stages", "recompute_stage", "replica_choices", "shared_spans", "solve_hybrid",
           "stage_memory", "stage_period"]


class _Probes:
    """The fewest devices per depth at a bound ``tau`` on the stage period, with the DP's
    tables: by the DP exact for this run (:meth:`probe`, cached), or by the one-suffix DP over
    a mask of the stages within memory (:meth:`fast`). The exact DP (:func:`exact_fewest`) is
    needed in training under a memory limit some stage could overflow (``capi`` set); else the
    one-suffix DP with ``fits`` is exact."""

    def __init__(self, tables: StageTables, config: HybridConfig, max_q: int) -> None:
        self.tables, self.max_q = tables, max_q
        fits: np.ndarray | None = None  # training with a memory limit: the exact DP
        if tables.memory_free:
            fits = device_bytes(tables.static, tables.stash, 1) <= config.memory_bytes
        self.fits = fits
        # the exact DP too large (tables.exact False): every probe is the one-suffix DP with
        # each stage checked in front of its suffix (fits None, capi None), whose plans fit
        self.capi = (held_caps(tables, config.memory_bytes)
                     if fits is None and tables.exact else None)
        # auto: every stage may recompute instead (not needed where nothing could overflow)
        self.capi_rc = (held_caps(tables, config.memory_bytes, rebuilt=True)
                        if self.capi is not None and tables.period_rc is not None else None)
        depths = [config.depth] if config.depth else list(range(1, max_q + 1))
        self.depths = [q for q in depths if q <= max_q]
        self.cache: dict[float, tuple[list[int], Any]] = {}
        # the least period (keeping or recomputing) of each stage that could overflow, and the
        # stages that cannot: at a bound under every such period memory does not bind
        self.risky_least = np.zeros(0)
        self.safe: np.ndarray | None = None
        if self.capi is not None:
            least = tables.needed[-1].reshape(-1)[tables.risky].astype(float)
            if tables.period_rc is not None:
                least = np.minimum(least, tables.period_rc.min(axis=0).reshape(-1)[tables.risky])
            self.risky_least = least
            safe = np.ones(tables.period.shape[1:], dtype=bool)
            safe.reshape(-1)[tables.risky] = False
            self.safe = safe

    def fast(self, tau: float, mask: np.ndarray | None) -> tuple[list[int], Any]:
        """Fewest devices per depth of ``depths`` by the one-suffix DP, and its tables."""
        found = fewest_devices(self.tables, tau, self.max_q, mask)
        return [found.fewest(q) for q in self.depths], found

    def probe(self, tau: float) -> tuple[list[int], Any]:
        """The exact answer at ``tau``: fewest devices per depth and the DP's tables."""
        if tau not in self.cache:
            if self.capi is None:
                self.cache[tau] = self.fast(tau, self.fits)
            elif not np.any(self.risky_least <= tau):
                # no stage that could overflow is within tau: every plan within tau fits, so
                # the one-suffix DP over the stages that cannot overflow is exact here
                self.cache[tau] = self.fast(tau, self.safe)
            else:
                exact = exact_fewest(self.tables, tau, self.max_q, self.capi, self.capi_rc)
                self.cache[tau] = ([exact.fewest(q) for q in self.depths], exact)
        return self.cache[tau]

    def periods(self) -> np.ndarray:
        """Every stage's period, sorted and unique (recomputing too where a DP chooses it per
        stage): the least bottleneck is one of them."""
        tables = self.tables
        # (the bounded DP too: its stages that could overflow may recompute)
        periods = [tables.period] + ([tables.period_rc] if tables.period_rc is not None
                                     and (self.capi_rc is not None or not tables.exact)
                                     else [])
        return np.unique(np.concatenate([p[np.isfinite(p)] for p in periods]))


@dataclass(frozen=True)
class HybridSolution:
    """:func:`solve_hybrid`'s answer: the plans, best bottleneck period first; whether the DP
    was exact; the least period it found on all the devices (``period_ms``) and a proven lower
    bound on every plan's (``lower_ms``: the same where exact; else the relaxation of
    :meth:`~.hybrid_tables.StageTables.relaxed_fits`); and the exact DP's cells."""

    plans: list[list[HybridStage]]
    exact: bool
    period_ms: float
    lower_ms: float
    cells: int

    @property
    def gap(self) -> float:
        """How far above the lower bound the least period found may be, relative."""
        return (self.period_ms - self.lower_ms) / self.period_ms if self.period_ms > 0 else 0.0


class BoundedNoPlan(PartitionError):
    """The bounded DP (the exact one too large) found no plan within memory; one may exist."""


def plan_hybrid(costs: SequenceCosts, config: HybridConfig) -> list[list[HybridStage]]:
    """:func:`solve_hybrid`'s plans."""
    return solve_hybrid(costs, config).plans


def solve_hybrid(costs: SequenceCosts, config: HybridConfig) -> HybridSolution:
    """Candidate plans, best bottleneck period first: for the smallest reachable bottleneck and
    a few looser ones, every pipeline depth that fits on the devices, and the same on each of
    ``config.budgets`` devices. The caller scores them with the event simulator (fill and
    drain included) and keeps the fastest.

    The least bottleneck is one of the stages' periods: a bisection over their sorted values
    finds it exactly; for a fixed ``tau`` the fewest devices per suffix and depth is a
    shortest-path DP (``h[q, i] = min_j reps(i, j, tau) + h[q-1, j]``), or in training under
    a memory limit the exact DP of :func:`~.hybrid_dp.exact_fewest`. Raises :class:`PartitionError`
    naming the stages that run out of memory, and by how much, exactly when no plan fits.

    Where the exact DP's tables would exceed :data:`~.hybrid_tables.EXACT_CELLS` (memory binds,
    ``M`` and the counts large: ``min(D, M) (M + 1)`` states per suffix) the DP is *bounded*,
    and says so (``exact`` False): every probe is the one-suffix DP over the dominant counts
    with each stage checked in front of its suffix (its plans fit), and the same DP over the
    relaxation :meth:`~.hybrid_tables.StageTables.relaxed_fits` bounds the least period from
    below (``lower_ms``); no plan found raises :class:`BoundedNoPlan`.
    """
    n, devices = len(costs.forward_ms), config.devices
    if not 1 <= devices <= MAX_DEVICES:
        raise PartitionError(f"need 1 to {MAX_DEVICES} devices, got {devices}")
    if len(costs.cut_bytes) != n + 1:
        raise ValueError(f"cut_bytes needs {n + 1} entries, got {len(costs.cut_bytes)}")
    tables = StageTables(costs, config)
    max_q = min(config.max_stages, devices, n)
    probes = _Probes(tables, config, max_q)
    values = probes.periods()
    if not values.size or not probes.depths:
        raise PartitionError(f"no plan fits: {config.depth} stages need {config.depth} "
                             f"positions and devices; the sequence has {n}, the cluster "
                             f"{devices}")
    least = min(probes.probe(float(values[-1]))[0])
    cells = exact_cells(n, config)
    if least > devices and tables.exact:
        raise PartitionError(memory_report(tables, config, max_q, costs))
    if least > devices:
        raise BoundedNoPlan(f"the bounded hybrid DP found no plan within memory (the exact one "
                            f"would need {cells:,} cells, over {EXACT_CELLS:,})")

    # No plan uses more than max_q stages of at most M replicas: budgets above are one.
    usable = min(devices, max_q * tables.choices[-1])
    budgets = sorted({usable, *(b for b in config.budgets if least <= b < usable)})
    brackets = {b: [-1, len(values) - 1] for b in budgets}  # (fails, suffices) indices
    if probes.capi is not None:
        _narrow(brackets, values, probes)
    _bisect(brackets, values, probes.probe, probes)
    found = float(values[brackets[usable][1]])
    lower = found
    if not tables.exact:  # the relaxation's least period: no plan's is below it
        relaxed = tables.relaxed_fits()
        low = {usable: [-1, len(values) - 1]}
        _bisect(low, values, lambda tau: probes.fast(tau, relaxed), probes)
        # lo fails: the relaxation's least is one of values(lo, hi] (hi, where bisected
        # to adjacent indices)
        lower = min(float(values[low[usable][0] + 1]), found)
    return HybridSolution(_proposals(probes, values, budgets, brackets), tables.exact, found,
                          lower, cells)


def _narrow(brackets: dict[int, list[int]], values: np.ndarray, probes: _Probes) -> None:
    """Narrow the brackets with two cheap DPs first: fitting with one micro-batch in flight (a
    relaxation: where it needs more devices, so does the exact DP), and one suffix per device
    count checked in front of (its plans fit: where it suffices, so does the exact DP, checked
    once); where memory does not bind at the optimum the relaxation is exact: gallop up from
    it."""
    capi, capi_rc = probes.capi, probes.capi_rc
    assert capi is not None
    low = {b: [-1, len(values) - 1] for b in brackets}
    one = capi >= 1 if capi_rc is None else (capi >= 1) | (capi_rc >= 1)
    if one.ndim == 3:  # sharded optimizer state: fits on some count (still a relaxation)
        one = np.any(one, axis=0, keepdims=False).astype(bool)
    _bisect(low, values, lambda tau: probes.fast(tau, one), probes)
    high = {b: [-1, len(values) - 1] for b in brackets}
    _bisect(high, values, lambda tau: probes.fast(tau, None), probes)
    for b, bracket in brackets.items():
        bracket[0] = low[b][0]  # fails (adjacent to where the relaxation suffices)
        if high[b][1] > bracket[0] and min(probes.probe(float(values[high[b][1]]))[0]) <= b:
            bracket[1] = high[b][1]
        # where memory does not bind at the optimum the relaxation is exact: gallop up
        step = 1
        while bracket[1] - bracket[0] > 1:
            mid = min(bracket[0] + step, bracket[1] - 1)
            if min(probes.probe(float(values[mid]))[0]) <= b:
                bracket[1] = mid
                break
            bracket[0], step = mid, 2 * step


def _proposals(probes: _Probes, values: np.ndarray, budgets: Sequence[int],
               brackets: dict[int, list[int]]) -> list[list[HybridStage]]:
    """The plans at each budget's least bound and at looser ones, every depth that fits the
    budget, each lean and widened onto spare devices, best bottleneck period first."""
    tables, config = probes.tables, probes.tables.c
    plans: list[list[HybridStage]] = []
    seen: set[tuple[tuple[int, int, int], ...]] = set()
    for budget in reversed(budgets):
        tau = float(values[brackets[budget][1]])
        for slack in (1.0, 1.05, 1.25, 1.5):
            # looser bounds under memory: the one-suffix DP's plans (proposals, all fit)
            if probes.capi is None or slack == 1.0:
                counts, found = probes.probe(tau * slack)
            else:
                counts, found = probes.fast(tau * slack, None)
            for q, fewest in zip(probes.depths, counts, strict=True):
                if fewest > budget:
                    continue
                stages = _recovered(tables, found, q)
                assert stages[-1].end == tables.n
                stages = tables.with_memory(stages)
                # Both the lean plan and the one widened onto spare devices: more replicas
                # shorten the period but lengthen the all-reduce, which the simulator, not the
                # period, sees.
                # Widening changes the warm-ups upstream: a variant over memory is dropped.
                for variant in (stages, tables.widen(stages, budget)):
                    key = tuple((s.start, s.end, s.replicas) for s in variant)
                    within = max(s.memory_bytes for s in variant) <= config.memory_bytes
                    if key not in seen and within:
                        seen.add(key)
                        plans.append(variant)
    plans.sort(key=lambda p: max(s.period_ms for s in p))
    return plans


def _recovered(tables: StageTables, found: ExactTables | BoundedTables, q: int
               ) -> list[HybridStage]:
    """The plan of depth ``q`` from a DP's tables: the exact DP's (:class:`ExactTables`), or
    the bounded one's back-pointers (:class:`BoundedTables`)."""
    return found.stages(tables, q)


#: Budgets short of the whole cluster settle their bound to within this, relative (their
#: plans are proposals; the whole cluster's least bound is found exactly).
BUDGET_TOLERANCE = 1e-3


def _bisect(brackets: dict[int, list[int]], values: np.ndarray, probe: Any,
            probes: _Probes) -> None:
    """Narrow each budget's bracket ``[fails, suffices]`` of indices into the sorted
    ``values`` to adjacent indices (the largest budget where the DP is exact; the others,
    and all where it is bounded, to within :data:`BUDGET_TOLERANCE`: the 405B row's bounded
    DP probed 63 times, 4 s each); ``probe(tau)`` gives the fewest devices per depth at ``tau``
    (monotone) and the DP's tables, and one probe narrows every bracket (tau suffices for
    budget ``b`` iff the fewest devices are at most ``b``). Where it suffices, the plans it
    found have a bottleneck at or below ``tau``, one of the values: the bracket's top drops
    to the best of them at once (they meet their own bottleneck). Probes rotate between the
    midpoint, where the devices, log-linear in the bound between the bracket's ends, reach
    the budget (a period falls about as the devices grow), and the value just under the top
    (is anything better than the best plan found?): a few probes settle what ``log2`` of a
    million periods would, never more than three times as many."""
    turns: dict[int, int] = {}
    need: dict[int, int] = {}
    largest = max(brackets)
    exact = probes.tables.exact  # bounded: no answer is proven, each probe costs the most

    def open_(b: int) -> bool:
        lo, hi = brackets[b]
        return hi - lo > 1 and ((b == largest and exact) or lo < 0
                                or values[hi] > values[lo] * (1 + BUDGET_TOLERANCE))

    while True:
        wide = [b for b in brackets if open_(b)]
        if not wide:
            return
        budget = max(wide, key=lambda b: brackets[b][1] - brackets[b][0])
        lo, hi = brackets[budget]
        turns[budget] = turns.get(budget, 0) + 1
        mid = (lo + hi) // 2
        if turns[budget] % 3 == 2 and lo in need and hi in need:
            mid = _interpolated(values, lo, hi, need[lo], need[hi], budget)
        elif turns[budget] % 3 == 0:
            mid = hi - 1
        counts, found = probe(float(values[mid]))
        need[mid] = min(counts)
        plans: dict[int, float] = {}  # depth index -> its plan's bottleneck
        for b, bracket in brackets.items():
            if need[mid] <= b:
                top = min(bracket[1], mid)
                for k, fewest in enumerate(counts):
                    if fewest <= b:
                        if k not in plans:
                            stages = _recovered(probes.tables, found, probes.depths[k])
                            plans[k] = max(s.period_ms for s in stages)
                        at = int(np.searchsorted(values, plans[k]))  # values[at] >= it
                        top = min(top, max(at, bracket[0] + 1))
                if top < bracket[1]:
                    need[top] = min(need.get(top, need[mid]), need[mid])
                bracket[1] = top
            elif mid < bracket[1]:
                bracket[0] = max(bracket[0], mid)


def _interpolated(values: np.ndarray, lo: int, hi: int, need_lo: int, need_hi: int,
                  budget: int) -> int:
    """The index in ``(lo, hi)`` where ``log devices``, linear in ``log tau`` through the
    bracket's ends, falls to ``budget + 1/2``; the midpoint where that is undefined."""
    mid = (lo + hi) // 2
    tau_lo, tau_hi = float(values[lo]), float(values[hi])
    if not (0 < tau_lo < tau_hi and 1 <= need_hi < need_lo < NO_COUNT):
        return mid
    y_lo, y_hi, target = math.log(need_lo), math.log(need_hi), math.log(budget + 0.5)
    x = math.log(tau_lo) + (y_lo - target) / (y_lo - y_hi) * math.log(tau_hi / tau_lo)
    return min(max(int(np.searchsorted(values, math.exp(x))), lo + 1), hi - 1)


def price_stages(costs: SequenceCosts, config: HybridConfig,
                 spans: Sequence[tuple[int, int, int]],
                 recompute: Sequence[bool] = ()) -> list[HybridStage]:
    """Stages ``(start, end, replicas)`` of the sequence priced as the DP prices them, each with
    its memory per device (:func:`memory_per_device`): a plan found elsewhere, in the DP's
    model; recomputing where ``recompute`` flags a stage (empty: as ``config.recompute``
    says: ``all``, none, or per stage where keeping does not fit, ``auto``)."""
    tables = StageTables(costs, config)
    if recompute:
        return tables.with_memory([tables.stage(i, j, r, f)
                                   for (i, j, r), f in zip(spans, recompute, strict=True)])
    return tables.decide([tables.stage(i, j, r) for i, j, r in spans])


def price_plans(costs: SequenceCosts, config: HybridConfig,
                plans: Sequence[Sequence[tuple[int, int, int]]]) -> list[list[HybridStage]]:
    """:func:`price_stages` of each of ``plans`` (the tables built once)."""
    tables = StageTables(costs, config)
    return [tables.decide([tables.stage(i, j, r) for i, j, r in spans]) for spans in plans]
