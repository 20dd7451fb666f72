"""What is proven of a hybrid plan: the hybrid DP's objective checked by the CP-SAT judge.

A hybrid plan (stages x replicas, :mod:`.planner`) is the fastest *simulated* iteration among
proposals; no solver here proves that iteration optimal (the simulator overlaps transfers with
compute, fills and drains the pipeline; the models below charge each stage its transfers and
rank by the period). What can be proven, and is, is the hybrid DP's own objective
(:mod:`.hybrid`): the least bottleneck period per micro-batch,

    max over stages of  ceil(M / r) (F [+ B] + comm) / M + allreduce(r) / M,

over the contiguous splits of one ordering's sequence of narrow-point blocks, any replica counts
(up to ``min(D, M)``, on at most ``D`` devices), every stage within the device memory under
1F1B's warm-up, without recomputation, every boundary priced at the intra-machine link. The
DP's least period is compared with :func:`~onnx_partition.solve.hybrid_judge.judge_hybrid`
(CP-SAT, written from the model's definition, one worker, a budget in *deterministic* seconds,
so the same record at any load), on models of at most :data:`PROOF_CELLS` choices (blocks
squared times the stages there may be) on at most :data:`PROOF_DEVICES` devices. The record
(plan.json's ``exact``) says whether it is proven, the gap to CP-SAT's bound otherwise, or why
it was not attempted, and the chosen plan's own period in that model where its stages are
blocks of that sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from onnx_partition.cost.cluster import Cluster
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import ring_allreduce_ms
from onnx_partition.solve.hybrid import HybridStage, plan_hybrid, price_stages
from onnx_partition.solve.hybrid_tables import StageTables
from onnx_partition.solve.planner import (
    HYBRID_ORDERINGS,
    DpSequence,
    Proposal,
    SolvedSequence,
    dp_sequence,
)
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec
from onnx_partition.solve.search import sequence_for

__all__ = ["BOUND_CELLS", "OBJECTIVE", "PROOF_CELLS", "PROOF_DEVICES", "HybridProof",
           "bounded_iteration", "iteration_bound", "least_counts", "plan_spans", "prove_hybrid"]

#: The judge runs where the blocks squared times the stages there may be (its stage choices)
#: are at most this many ... (on the recipes' tiny plans: 9,500 choices proven in 0.1 s,
#: 17,400 in 0.6 s, 29,000 in 1 s, 35,000 in 2.5 s at load 3; docs/benchmarks.md)
PROOF_CELLS = 20_000
#: ... on at most this many devices (the replica counts the judge tries: every one up to D).
PROOF_DEVICES = 8
#: What the record proves, in words (plan.json's ``exact.objective``).
OBJECTIVE = ("least bottleneck period per micro-batch, max over stages of ceil(M/r) (F + B + "
             "transfers) / M + all-reduce / M, over contiguous splits of one ordering's "
             "sequence of blocks and any replica counts, every stage within memory (1F1B "
             "warm-up, no recomputation), transfers at the intra-machine link; not the "
             "simulated iteration the plan is chosen by")
# a plan "below" the DP's period is below it by more than this, relative
_BELOW = 1e-9
#: a plan's iteration within this of the iteration bound (relative) meets it: proven optimal
_MEETS = 1e-9


@dataclass(frozen=True)
class HybridProof:
    """The outcome of :func:`prove_hybrid`.

    ``proven``: no plan of the sequence has a period below ``period_ms``, the DP's least:
    it meets the bound that no stage runs faster than its compute over its replicas on ``D``
    devices in all (``by == "bound"``), or CP-SAT proved it (``"cp-sat"``); else ``by`` says
    why not: ``"budget"`` (CP-SAT ran out; ``gap`` is ``(period_ms - lower_bound_ms) /
    period_ms`` with the bound of all compute over all devices), ``"size"`` (more than
    :data:`PROOF_CELLS` stage choices or :data:`PROOF_DEVICES` devices), ``"off"`` (budget 0),
    ``"recompute"`` (a stage of the plan recomputes, or every stage may: the judge models no
    recomputation), ``"fleet"`` (mixed device kinds), ``"none-fits"`` (no plan of the
    sequence fits without recomputation) or
    ``"disagree"`` (CP-SAT found a smaller period than the DP's: a bug, said, never hidden).
    ``plan_period_ms``: the chosen plan's period in the same model, where its stages are
    blocks of the sequence (None otherwise). ``proven`` is of the period, not of the plan:
    ``iteration_bound_ms`` (:func:`iteration_bound`) bounds the simulated iteration of every
    plan of the sequence, ``iteration_ms`` is the chosen plan's, and only where it meets the
    bound is the plan proven optimal (:attr:`plan_proven`; plan.json's ``proven_optimal``).
    """

    proven: bool
    by: str
    ordering: str = ""
    positions: int = 0
    devices: int = 0
    period_ms: float | None = None
    lower_bound_ms: float | None = None
    gap: float | None = None
    plan_period_ms: float | None = None
    seconds: float = 0.0
    rounding_ms: float = 0.0
    limits: tuple[int, int] = (PROOF_CELLS, PROOF_DEVICES)  # the judge's choices, devices
    iteration_bound_ms: float | None = None
    iteration_ms: float | None = None

    @property
    def iteration_gap(self) -> float | None:
        """``(iteration_ms - iteration_bound_ms) / iteration_ms``: how far the plan may be
        from the fastest plan of the sequence (None where either is unknown)."""
        it, bound = self.iteration_ms, self.iteration_bound_ms
        if it is None or bound is None or not math.isfinite(bound):
            return None
        gap = (it - bound) / it if it > 0 else 0.0
        return 0.0 if -_MEETS < gap < 0 else gap  # the last bits of sums taken apart

    @property
    def plan_proven(self) -> bool:
        """Whether the chosen plan's simulated iteration meets the bound: no plan of the
        sequence simulates faster."""
        gap = self.iteration_gap
        return gap is not None and gap <= _MEETS

    def to_json(self, budget_s: float) -> dict[str, Any]:
        """plan.json's ``exact`` entry of a hybrid plan (``kind``: ``hybrid-period``):
        ``proven_optimal`` of the plan's simulated iteration and ``gap`` its gap to the bound;
        ``period_proven`` and ``period_gap`` of the DP's period."""
        body: dict[str, Any] = {"kind": "hybrid-period", "proven_optimal": self.plan_proven,
                                "period_proven": self.proven, "by": self.by,
                                "objective": OBJECTIVE, "budget_s": budget_s}
        if self.ordering:
            body.update(ordering=self.ordering, positions=self.positions,
                        devices=self.devices)
        named = {"period_ms": self.period_ms, "lower_bound_ms": self.lower_bound_ms,
                 "period_gap": self.gap, "plan_period_ms": self.plan_period_ms,
                 "iteration_bound_ms": self.iteration_bound_ms,
                 "iteration_ms": self.iteration_ms, "gap": self.iteration_gap}
        for name, value in named.items():
            if value is not None and math.isfinite(value):
                body[name] = round(value, 6)
        if self.by == "size":
            body.update(max_cells=self.limits[0], max_devices=self.limits[1])
        if self.by in ("bound", "cp-sat", "budget", "disagree", "none-fits"):
            body.update(seconds=round(self.seconds, 3), rounding_ms=self.rounding_ms)
        return body


def plan_spans(sequence: DpSequence, stage_of: list[int], replicas: list[int]
               ) -> list[tuple[int, int, int]] | None:
    """The plan's stages as ``(start, end, replicas)`` over the sequence's blocks, or None
    where a block is split between stages or the stages are not contiguous in it."""
    stages = np.asarray(stage_of, dtype=np.int64)
    order = np.asarray(sequence.order, dtype=np.int64)
    of_block = []
    for lo, hi in zip(sequence.bounds[:-1], sequence.bounds[1:], strict=True):
        held = np.unique(stages[order[lo:hi]])
        if len(held) != 1:
            return None
        of_block.append(int(held[0]))
    if of_block != sorted(of_block) or sorted(set(of_block)) != list(range(len(replicas))):
        return None
    return [(of_block.index(k), len(of_block) - of_block[::-1].index(k), r)
            for k, r in enumerate(replicas)]


def prove_hybrid(problem: DagProblem, arrays: NodeArrays, run: RunSpec, plan: HybridPlan, *,
                 num_stages: int | None = None, budget_s: float = 1.0,
                 max_cells: int = PROOF_CELLS, max_devices: int = PROOF_DEVICES,
                 proposals: Sequence[Proposal] = ()) -> HybridProof:
    """Prove the hybrid DP's least period over the sequence ``plan`` came from optimal (the
    module docstring says which objective), or give its gap to CP-SAT's bound, within
    ``budget_s`` deterministic seconds on one worker (``<= 0``: off); and bound the simulated
    iteration of every plan of that sequence (:func:`iteration_bound`), the plan's own
    iteration's gap to it the record's ``gap``. The sequence is that of the plan's ordering
    when the DP proposed it, else of the planner's first ordering; where the planner's
    ``proposals`` (:func:`~.planner.proposals_for`'s, for this ``num_stages``) hold that
    ordering's DP run without recomputation, its sequence and plans are reused, not built
    and solved again (and beyond ``max_devices`` the iteration is still bounded)."""
    if budget_s <= 0:
        return HybridProof(False, "off")
    if run.train and (run.recompute == "all" or any(s.recompute for s in plan.costs.stages)):
        return HybridProof(False, "recompute")  # the judge models no recomputation
    ordering = plan.source.partition(":")[2] if plan.source.startswith("dp") else ""
    ordering = ordering or HYBRID_ORDERINGS[0]
    devices = run.cluster.devices
    solved = next((p.solved for p in proposals
                   if p.solved is not None and p.solved.ordering == ordering), None)
    if devices > max_devices and solved is None:  # said before sequencing a large graph
        return HybridProof(False, "size", ordering, devices=devices,
                           limits=(max_cells, max_devices))
    started = time.perf_counter()
    sequence = (solved.sequence if solved is not None else
                dp_sequence(problem, arrays, run, sequence_for(problem, ordering), num_stages))
    n = len(sequence.bounds) - 1
    bound = bounded_iteration(sequence, run)
    record = partial(HybridProof, ordering=ordering, positions=n, devices=devices,
                     limits=(max_cells, max_devices), iteration_bound_ms=bound,
                     iteration_ms=plan.sim.iteration_ms)
    depth = min(num_stages or run.max_stages, devices, n)  # the most stages a plan may have
    if devices > max_devices or n * n * depth > max_cells:  # the plan's period where cheap
        plan_ms = _plan_period(sequence, plan, solved.plans) if solved is not None else None
        return record(False, "size", plan_period_ms=plan_ms,
                      seconds=time.perf_counter() - started)
    dp_plans = _dp_plans(sequence, solved)
    dp_ms = max(s.period_ms for s in dp_plans[0]) if dp_plans else math.inf
    plan_ms = _plan_period(sequence, plan, dp_plans)
    costs, config = sequence.costs, sequence.config
    work = float(sum(costs.forward_ms)) + (float(sum(costs.backward_ms)) if config.train else 0)
    # no stage's period is below its compute over its replicas, on D devices in all
    trivial = work / config.speed / devices
    if dp_ms <= trivial * (1 + _BELOW):
        return record(True, "bound", period_ms=dp_ms, lower_bound_ms=min(dp_ms, trivial),
                      gap=0.0, plan_period_ms=plan_ms, seconds=time.perf_counter() - started)
    from onnx_partition.solve.hybrid_judge import judge_hybrid  # OR-Tools: only now

    # Is there a plan below the DP's period? None: the DP's is least (periods computed apart
    # may differ in the last bits: "below" is by more than _BELOW, relative).
    judged = judge_hybrid(sequence.costs, sequence.config, time_limit_s=10 * budget_s + 10,
                          deterministic_s=budget_s,
                          below_ms=dp_ms * (1 - _BELOW) if math.isfinite(dp_ms) else None)
    seconds = time.perf_counter() - started
    if math.isinf(dp_ms):  # the DP found no plan that fits: does CP-SAT agree?
        by = ("none-fits" if judged.optimal and math.isinf(judged.period_ms) else
              "budget" if math.isnan(judged.period_ms) else "disagree")
        return record(False, by, plan_period_ms=plan_ms, seconds=seconds)
    if math.isinf(judged.period_ms):  # proven: no plan below
        by, lower = "cp-sat", judged.bound_ms
    else:  # the budget ran out, or CP-SAT found a plan below the DP's least: a bug, said
        by, lower = ("budget" if math.isnan(judged.period_ms) else "disagree"), trivial
    lower = min(dp_ms, lower)
    return record(by == "cp-sat", by, period_ms=dp_ms, lower_bound_ms=lower,
                  gap=(dp_ms - lower) / dp_ms if dp_ms > 0 else 0.0, plan_period_ms=plan_ms,
                  seconds=seconds, rounding_ms=dp_ms * _BELOW if by == "cp-sat" else 0.0)


def _dp_plans(sequence: DpSequence, solved: SolvedSequence | None) -> list[list[HybridStage]]:
    """The hybrid DP's plans over ``sequence`` without recomputation, best period first: the
    planner's (``solved``), else solved here; none where no plan fits or the bounded DP
    found none."""
    if solved is not None:
        return solved.plans
    try:
        return plan_hybrid(sequence.costs, sequence.config)
    except PartitionError:
        return []


def _plan_period(sequence: DpSequence, plan: HybridPlan, dp_plans: list[list[HybridStage]]
                 ) -> float | None:
    """The chosen plan's period in the DP's model where its stages are blocks of
    ``sequence`` (None otherwise): that of the DP's own plan of the same stages, else
    priced."""
    spans = plan_spans(sequence, plan.stage_of, plan.replicas)
    if spans is None:
        return None
    for stages in dp_plans:
        if [(s.start, s.end, s.replicas) for s in stages] == spans:
            return max(s.period_ms for s in stages)
    return max(s.period_ms for s in price_stages(sequence.costs, sequence.config, spans))


def iteration_bound(sequence: DpSequence, run: RunSpec) -> float:
    """A lower bound on the simulated iteration (:func:`~.scoring.simulated`) of every plan
    whose stages are contiguous runs of ``sequence``'s blocks, on any replica counts up to
    ``min(D, M)`` on at most ``D`` devices, at most ``config.max_stages`` stages (exactly
    ``config.depth`` where set), within memory (keeping or, ``auto``, recomputing): inf where
    none fits. Proof in docs/np_completeness.md, "A bound on the simulated iteration".

    Per stage ``[i, j)`` on ``r`` replicas (:func:`~.scoring.lower_bound_ms`'s argument with
    only what depends on ``(i, j, r)``): replica 0 cannot start before micro-batch 0's
    forward over blocks ``[0, i)`` and the transfer into ``i``; it computes ``ceil(M / r)``
    micro-batches, and (1F1B) its last backward waits on that micro-batch's forward and
    backward over ``[i, n)`` and the transfers at ``j``; then the all-reduce, and in 1F1B also
    the last micro-batch's backward over ``[0, i)`` and its transfer, must still run
    (inference: the forward over ``[j, n)``); the engine's per-action work, accumulation and
    optimizer step where priced. A plan's
    iteration is at least its worst stage's term, so the least over plans of the worst term,
    found by bisection over the terms with the fewest devices per bound (a shortest path over
    the blocks), bounds every plan."""
    terms, counts = _stage_terms(sequence, run)
    config = sequence.config
    n = terms.shape[1] - 1
    depths = ([config.depth] if config.depth else
              list(range(1, min(config.max_stages, config.devices, n) + 1)))
    values = np.unique(terms[np.isfinite(terms)])
    lo, hi = -1, len(values)  # values[hi] suffices (hi = len: none does), values[lo] fails
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fewest(terms, counts, float(values[mid]), depths) <= config.devices:
            hi = mid
        else:
            lo = mid
    return float(values[hi]) if hi < len(values) else math.inf


def _fewest(terms: np.ndarray, counts: np.ndarray, tau: float, depths: list[int]) -> int:
    """The fewest devices of a plan of one of ``depths`` stages whose every stage's term is
    at most ``tau``: per stage the fewest replicas meeting it, summed by a shortest path."""
    ok = terms <= tau
    need = np.where(ok.any(axis=0), counts[ok.argmax(axis=0)], _NO_DEVICES)
    n = need.shape[0] - 1
    h = np.full(n + 1, _NO_DEVICES, dtype=np.int64)
    h[n] = 0  # h[i]: fewest devices covering [i, n) with q stages
    best = _NO_DEVICES
    for q in range(1, max(depths) + 1):
        h = np.minimum((need + h[None, :]).min(axis=1), _NO_DEVICES)
        if q in depths:
            best = min(best, int(h[0]))
    return best


_NO_DEVICES = 1 << 40
#: :func:`bounded_iteration` builds its terms (counts x blocks squared) up to this many
BOUND_CELLS = 1 << 23


def bounded_iteration(sequence: DpSequence, run: RunSpec) -> float | None:
    """:func:`iteration_bound`, or None where its terms would exceed :data:`BOUND_CELLS`."""
    n = len(sequence.bounds) - 1
    counts = least_counts(sequence.config.devices, sequence.config.microbatches)
    if len(counts) * (n + 1) ** 2 > BOUND_CELLS:
        return None
    return iteration_bound(sequence, run)


def _stage_terms(sequence: DpSequence, run: RunSpec) -> tuple[np.ndarray, np.ndarray]:
    """``terms[c, i, j]``: what stage ``[i, j)`` on ``counts[c]`` replicas forces the
    iteration to (:func:`iteration_bound`), inf where it is no stage or fits nowhere."""
    costs, config, cluster = sequence.costs, sequence.config, run.cluster
    train, m = config.train, max(config.microbatches, 1)
    tables = StageTables(costs, replace(config, recompute=(
        "auto" if train and run.recompute == "auto" else "none")))
    n = tables.n
    speed = config.speed
    prefix_f = np.concatenate([[0.0], np.cumsum(costs.forward_ms)]) / speed
    prefix_b = np.concatenate([[0.0], np.cumsum(costs.backward_ms)]) / speed
    links = [cluster.intra] + ([cluster.inter] if cluster.machines > 1 else [])
    hop = run.engine.hop_ms if train and run.engine else 0.0
    cut = np.asarray(costs.cut_bytes, dtype=float)
    send = np.min([cut / link.bytes_per_ms + link.latency_ms for link in links], axis=0) + hop
    send[0] = send[n] = 0.0  # no transfer into the first stage or out of the last
    compute = tables.keep[0]  # forward (and backward) of [i, j): no recomputation counted
    weights = tables.params if tables.weights is None else tables.weights
    engine = run.engine if train else None
    actions = (3 if run.schedule == "zb-h1" else 2) if train else 1
    counts = least_counts(config.devices, m)
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1) & tables.relaxed_fits()
    ahead = (prefix_f + send)[:, None]  # micro-batch 0 reaches block i
    step = (engine.step_fixed_ms + engine.step_per_byte * weights) if engine else 0.0
    # 1F1B: a replica's last backward waits on its micro-batch's way to the end and back
    trip = ((prefix_f[n] + prefix_b[n] - prefix_f - prefix_b)[:, None] + 2.0 * send[None, :]
            if train and run.schedule != "zb-h1" else 0.0)
    terms = np.empty((len(counts), n + 1, n + 1))
    for c, r in enumerate(counts):
        waves = -(-m // int(r))
        work = waves * compute
        if engine is not None:  # its actions and accumulations
            work = (work + waves * actions * engine.action_ms
                    + (waves - 1) * engine.accumulate_per_byte * weights)
        if train:
            allreduce = _allreduce_lb(tables.params, int(r), cluster)
            after = (allreduce if run.schedule == "zb-h1" else
                     np.maximum(allreduce, (prefix_b + send)[:, None]))
        else:
            after = (prefix_f[n] - prefix_f + send)[None, :]  # on to the last block
        terms[c] = np.where(valid, ahead + np.maximum(work, trip) + after + step, np.inf)
    return terms, counts


def _allreduce_lb(params: np.ndarray, r: int, cluster: Cluster) -> np.ndarray:
    """The ring all-reduce of every stage's gradients among ``r`` replicas at the fastest
    link a group of ``r`` may be placed on (the intra link only within one machine)."""
    if r <= 1:
        return params * 0.0
    links = ([cluster.intra] if r <= cluster.devices_per_machine else []) + (
        [cluster.inter] if cluster.machines > 1 else [])
    return np.min([ring_allreduce_ms(params, r, link.bytes_per_ms, link.latency_ms)
                   for link in links], axis=0)


def least_counts(devices: int, microbatches: int) -> np.ndarray:
    """The replica counts of ``1..min(D, M)`` the bound need try: the least of each value of
    ``ceil(M / r)``. A smaller count with the same ``ceil(M / r)`` has the same micro-batches,
    accumulations and step, an all-reduce no dearer (the ring's time grows with ``r`` on
    any one link, and fewer replicas may sit on no slower one) and fewer devices."""
    m = max(microbatches, 1)
    counts = [r for r in range(1, min(devices, m) + 1)
              if r == 1 or -(-m // r) < -(-m // (r - 1))]
    return np.asarray(counts, dtype=np.int64)
