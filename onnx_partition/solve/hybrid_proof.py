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
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from onnx_partition.errors import PartitionError
from onnx_partition.solve.hybrid import HybridStage, plan_hybrid, price_stages
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

__all__ = ["OBJECTIVE", "PROOF_CELLS", "PROOF_DEVICES", "HybridProof", "plan_spans",
           "prove_hybrid"]

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
    blocks of the sequence (None otherwise).
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

    def to_json(self, budget_s: float) -> dict[str, Any]:
        """plan.json's ``exact`` entry of a hybrid plan (``kind``: ``hybrid-period``)."""
        body: dict[str, Any] = {"kind": "hybrid-period", "proven_optimal": self.proven,
                                "by": self.by, "objective": OBJECTIVE, "budget_s": budget_s}
        if self.ordering:
            body.update(ordering=self.ordering, positions=self.positions,
                        devices=self.devices)
        for name in ("period_ms", "lower_bound_ms", "gap", "plan_period_ms"):
            value = getattr(self, name)
            if value is not None:
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
    ``budget_s`` deterministic seconds on one worker (``<= 0``: off). The sequence is that of
    the plan's ordering when the DP proposed it, else of the planner's first ordering; where
    the planner's ``proposals`` (:func:`~.planner.proposals_for`'s, for this ``num_stages``)
    hold that ordering's DP run without recomputation, its sequence and plans are reused,
    not built and solved again."""
    if budget_s <= 0:
        return HybridProof(False, "off")
    if run.train and (run.recompute == "all" or any(s.recompute for s in plan.costs.stages)):
        return HybridProof(False, "recompute")  # the judge models no recomputation
    ordering = plan.source.partition(":")[2] if plan.source.startswith("dp") else ""
    ordering = ordering or HYBRID_ORDERINGS[0]
    devices = run.cluster.devices
    if devices > max_devices:  # said before sequencing a graph that may be large
        return HybridProof(False, "size", ordering, devices=devices,
                           limits=(max_cells, max_devices))
    solved = next((p.solved for p in proposals
                   if p.solved is not None and p.solved.ordering == ordering), None)
    sequence = (solved.sequence if solved is not None else
                dp_sequence(problem, arrays, run, sequence_for(problem, ordering), num_stages))
    n = len(sequence.bounds) - 1
    record = partial(HybridProof, ordering=ordering, positions=n, devices=devices,
                     limits=(max_cells, max_devices))
    depth = min(num_stages or run.max_stages, devices, n)  # the most stages a plan may have
    if n * n * depth > max_cells:
        return record(False, "size")
    started = time.perf_counter()
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
