"""Planning on a mixed fleet: stages and replicas on groups of different GPUs.

A :class:`~onnx_partition.cost.cluster.Fleet` holds groups of one GPU kind each. A plan puts
every stage's replicas on one group, and each group hosts one contiguous run of stages (the
pipeline visits the groups in some *ordering*, possibly skipping some): the device-group
assignment of HetPipe (Park et al., ATC'20: one virtual worker per group of like GPUs) and the
stage-to-device-type search of Metis (Um et al., ATC'24: "Metis: Fast Automatic Distributed
Training on Heterogeneous GPUs", which orders device groups along the pipeline and balances
stages by each type's speed and memory). Each stage is priced by its own group's costs (its
GPU's roofline, or the costs file measured on that kind), so a fast kind gets longer stages.

**The DP** (:func:`~.fleet_dp.fleet_dp`, its recurrence in :mod:`.fleet_dp`), per ordering of
the groups, minimises the bottleneck period (the hybrid DP's objective, PipeDream's
replicated-stage model) over every split of a sequence of narrow-point blocks into stages on the
groups, each stage priced by its own group's times, links and memory.

**The choice** (:func:`plan_fleet`): every ordering's DP plan (the best one's replica counts
then hill-climbed, :func:`polish_fleet`), each group alone planned by the one-kind planner
(:func:`~.planner.plan_cluster`, so "only the fastest group" is among the candidates), and
the one-kind plan of every device as the slowest kind (:func:`as_slowest`) are simulated on
the fleet (:func:`~.fleet_scoring.fleet_costs`: each stage's times on its kind, each transfer
and all-reduce on the link it crosses once placed) and the fastest wins; the last makes it never
slower than that baseline (the same schedule, no action longer, no link slower). A train
candidate is scored under each schedule asked, with each stage's engine work (step,
accumulation, work per action and per hop: :class:`~onnx_partition.cost.engine_price.FleetEngine`)
on its own kind, the figure ``partition`` then prints.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from onnx_partition.cost.cluster import Fleet
from onnx_partition.errors import PartitionError
from onnx_partition.solve.fleet_baselines import (
    as_slowest,
    fastest_alone,
    kind_problem,
    slowest_cluster,
    slowest_costs,
)
from onnx_partition.solve.fleet_dp import (
    ALL_ORDERINGS,
    FleetSequence,
    FleetStage,
    fleet_dp,
    group_orderings,
    stage_period,
)
from onnx_partition.solve.fleet_scoring import (
    FleetPlan,
    KindCosts,
    fleet_costs,
    place_on_groups,
    score_fleet,
)
from onnx_partition.solve.order.blocks import Blocks, cluster_blocks
from onnx_partition.solve.order.topo import assign, cut_bytes
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec
from onnx_partition.solve.search import sequence_for

__all__ = ["ALL_ORDERINGS", "FLEET_POSITIONS", "POLISH_SIMULATIONS", "FleetPlan",
           "FleetSequence", "FleetStage", "KindCosts", "as_slowest", "fastest_alone",
           "fleet_costs", "fleet_dp", "group_orderings", "kind_problem", "place_on_groups",
           "plan_fleet", "polish_fleet", "score_fleet", "slowest_cluster", "slowest_costs",
           "stage_period"]

#: The fleet DP's positions: the sequence's narrow-point blocks merged down to this many.
FLEET_POSITIONS = 96
#: Simulations the replica polish of the best DP plan may spend.
POLISH_SIMULATIONS = 24


def _sequence(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
              fleet: Fleet, order: Sequence[int]) -> tuple[FleetSequence, Blocks]:
    """``order``'s narrow-point blocks, merged down to :data:`FLEET_POSITIONS`, as the DP's
    sequence (times per group)."""
    blocks = cluster_blocks(problem, order, problem.compute_ms, max(1, min(fleet.devices, 16)))
    bounds = blocks.bounds
    if len(bounds) - 1 > FLEET_POSITIONS:
        prefix = np.concatenate([[0.0], np.cumsum([problem.compute_ms[v] for v in order])])
        target = prefix[-1] / FLEET_POSITIONS
        kept = [0]
        for b in bounds[1:-1]:
            if prefix[b] - prefix[kept[-1]] >= target:
                kept.append(b)
        blocks = Blocks(list(order), [*kept, len(order)])
    gpus = [g.gpu for g in fleet.groups]
    seq = FleetSequence([blocks.sums(kinds[k].forward_ms) for k in gpus],
                        [blocks.sums(kinds[k].backward_ms) for k in gpus],
                        blocks.sums(arrays.param_bytes), blocks.sums(arrays.activation_bytes),
                        list(cut_bytes(problem, order)[np.asarray(blocks.bounds)]),
                        *_counted(arrays, blocks),
                        kept_bytes=blocks.sums(arrays.kept_bytes) if len(arrays.kept_bytes)
                        else [],
                        working_bytes=blocks.maxes(arrays.working_bytes))
    return seq, blocks


def _counted(arrays: NodeArrays, blocks: Blocks
             ) -> tuple[list[float], list[float], float, list[tuple[float, float, list[int]]]]:
    """The one count's arrays over ``blocks`` (empty where ``arrays`` do not carry it)."""
    if not arrays.counted:
        return [], [], 0.0, []
    return (blocks.sums(arrays.weight_bytes), blocks.sums(arrays.trainable_bytes),
            arrays.input_bytes, arrays.shared_in(blocks))


def plan_fleet(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
               fleet: Fleet, run: RunSpec, *, orderings: Sequence[str] = ("dfs", "topo"),
               alone: bool = True, slowest: bool = True, schedules: Sequence[str] = (),
               num_stages: int | None = None
               ) -> tuple[FleetPlan, dict[str, dict[str, float]]]:
    """The fastest simulated plan on ``fleet`` (see the module docstring) and per candidate
    family its best ``iteration_ms`` on the fleet (``as-slowest`` also ``planned_ms``, its
    iteration on the all-slowest cluster it was planned for). ``kinds`` prices every node on
    each group's GPU; ``alone``: also plan each group by itself with the one-kind planner (the
    baseline "only the fastest group" among them); ``slowest``: also the one-kind plan of
    every device as the slowest kind (:func:`as_slowest`), placed on the fleet's devices in
    file order (there a stage may hold replicas of two kinds, priced at the slower). A train
    plan is planned for each of ``schedules`` (none: ``run``'s), every candidate scored under
    each (the DP's splits do not depend on it) and the fastest kept, the first schedule on a
    tie (:attr:`FleetPlan.schedule`); its stages recompute per ``run.recompute``, each against
    its own kind's memory under the schedule scored (under ``auto`` the DP splits knowing
    which stages must recompute, :func:`fleet_dp`; under ``all`` it also splits for every
    stage recomputing). ``num_stages``: every candidate exactly that deep (the DP's fixed
    depth, the one-kind planner's)."""
    runs = [replace(run, train_schedule=name) for name in (schedules or [run.train_schedule])
            ] if run.train else [run]
    pool = _Candidates()
    _weigh_dp_plans(problem, arrays, kinds, fleet, run, runs, orderings, num_stages, pool)
    for each in runs:
        if alone:
            _weigh_alone(problem, arrays, kinds, fleet, each, num_stages, pool)
        if slowest:
            _weigh_slowest(problem, arrays, kinds, fleet, each, pool.weigh, pool.families,
                           num_stages)
    if not pool.candidates:
        under = f" under {' or '.join(r.schedule for r in runs)}" if run.train else ""
        if num_stages is not None:
            raise PartitionError(f"no {num_stages}-stage plan fits the fleet{under}: too few "
                                 "positions or devices, or a stage over its group's memory")
        raise PartitionError(f"no plan fits the fleet's memory{under}: no stage of the model "
                             "fits any group's devices")
    best = min(pool.candidates, key=lambda p: p.sim.iteration_ms)
    return best, pool.families


@dataclass
class _Candidates:
    """Every candidate plan scored on the fleet, and per family its best ``iteration_ms``."""

    candidates: list[FleetPlan] = field(default_factory=list)
    families: dict[str, dict[str, float]] = field(default_factory=dict)

    def weigh(self, plan: FleetPlan | None, family: str) -> None:
        if plan is not None:
            self.candidates.append(plan)
            done = self.families.get(family, {}).get("iteration_ms", math.inf)
            self.families[family] = {"iteration_ms": round(min(done, plan.sim.iteration_ms), 6)}


def _weigh_dp_plans(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                    fleet: Fleet, run: RunSpec, runs: Sequence[RunSpec],
                    orderings: Sequence[str], num_stages: int | None, pool: _Candidates
                    ) -> None:
    """Every distinct sequence's DP plans over every ordering of the groups (each also with
    one micro-batch in flight in training: an optimistic pass the scoring checks), scored
    under each of ``runs``; then the best one's replica counts hill-climbed on the simulated
    iteration itself (:func:`polish_fleet`). The DP's memory is that of each kind of
    schedule scored: without kept gradients, and with ZB-H1's where it is among ``runs``
    (:func:`_memory_runs`)."""
    work = {gpu: float(sum(c.forward_ms) + (sum(c.backward_ms) if run.train else 0.0))
            for gpu, c in kinds.items()}
    speed = [1.0 / max(work[g.gpu], 1e-12) for g in fleet.groups]
    helds = [None, (lambda r: 1)] if run.train else [None]
    dp_plans: list[tuple[FleetPlan, list[int], RunSpec]] = []  # with each stage's group
    sequences: dict[tuple[int, ...], str] = {}  # an ordering equal to an earlier one adds nothing
    for name in orderings:
        sequences.setdefault(tuple(sequence_for(problem, name)), name)
    for order, name in sequences.items():
        seq, blocks = _sequence(problem, arrays, kinds, fleet, order)
        for ordering in group_orderings(fleet, speed):
            for stages in (s for dp_run in _memory_runs(run, runs) for held in helds
                           for s in _dp_plans(seq, fleet, dp_run, ordering, held, num_stages)):
                stage_of = assign(order, blocks.expand([s[0] for s in stages] + [seq.n]))
                groups = [s[2] for s in stages]
                placed = place_on_groups(fleet, groups, [s[3] for s in stages])
                for each in runs:
                    scored = score_fleet(problem, arrays, kinds, fleet, each, stage_of, placed,
                                         f"fleet:{name}")
                    pool.weigh(scored, f"fleet:{name}")
                    if scored is not None:
                        dp_plans.append((scored, groups, each))
    # the best DP plan's replica counts, hill-climbed on the simulated iteration itself
    if dp_plans:
        plan, groups, each = min(dp_plans, key=lambda e: e[0].sim.iteration_ms)
        pool.weigh(polish_fleet(problem, arrays, kinds, fleet, each, plan, groups), plan.source)


def _memory_runs(run: RunSpec, runs: Sequence[RunSpec]) -> list[RunSpec]:
    """``run`` under each memory the fleet DP counts for the schedules of ``runs``: 1F1B's
    (no kept gradients) for any but ZB-H1, ZB-H1's (held micro-batches' gradients kept)."""
    if not run.train:
        return [run]
    names = dict.fromkeys("zb-h1" if r.schedule == "zb-h1" else "1f1b" for r in runs)
    return [replace(run, train_schedule=name) for name in names]


def _weigh_alone(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                 fleet: Fleet, run: RunSpec, num_stages: int | None, pool: _Candidates
                 ) -> None:
    """Each group alone, planned by the one-kind planner (:func:`~.planner.plan_cluster`) on
    its own devices under ``run`` and scored on the fleet (among them "only the fastest
    group")."""
    from onnx_partition.solve.planner import plan_cluster

    for g, group in enumerate(fleet.groups):
        sub_problem, sub_arrays = kind_problem(problem, arrays, kinds[group.gpu])
        sub_run = replace(run, cluster=group.cluster(fleet.inter),
                          engine=kinds[group.gpu].engine)
        try:
            alone_plan, _ = plan_cluster(sub_problem, sub_arrays, sub_run,
                                         num_stages=num_stages)
        except PartitionError:
            continue
        placed = place_on_groups(fleet, [g] * alone_plan.num_stages, alone_plan.replicas)
        pool.weigh(score_fleet(problem, arrays, kinds, fleet, run, alone_plan.stage_of, placed,
                               f"alone:{group.gpu}"), f"alone:{group.gpu}")


def _dp_plans(seq: FleetSequence, fleet: Fleet, run: RunSpec, ordering: Sequence[int],
              held: Callable[[int], int] | None, depth: int | None = None
              ) -> list[list[FleetStage]]:
    """The fleet DP's plans :func:`plan_fleet` scores for one ordering: its stages recomputing
    per ``run.recompute``. Under ``auto`` exactly where keeping does not fit (the cuts chosen
    knowing which stages pay the extra forward), and where that plan recomputes a stage also
    the keep-only plan (the schedule scored may hold fewer micro-batches than the DP's bound,
    so keeping there may fit and simulate faster: never fewer candidates than keeping alone;
    where memory does not bind, one pass, the keep-only plan itself). Under ``all`` also the
    keep-only splits (the scoring recomputes every stage either way; the forward twice moves
    the best split where the backward is not proportional to it). ``depth``: exactly that
    many stages."""
    mode = run.recompute if run.train else "none"
    first = fleet_dp(seq, fleet, run, ordering, held, "none" if mode == "all" else mode,
                     depth)[1]
    plans = [first] if first else []
    if mode == "all" or (mode == "auto" and any(s[4] for s in first)):
        again = fleet_dp(seq, fleet, run, ordering, held, "all" if mode == "all" else "none",
                         depth)[1]
        plans += [again] if again else []
    return plans


def _weigh_slowest(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                   fleet: Fleet, run: RunSpec, weigh: Callable[[FleetPlan | None, str], None],
                   families: dict[str, dict[str, float]], num_stages: int | None = None
                   ) -> None:
    """The "as slowest" candidate (:func:`as_slowest`) under ``run``, and its ``planned_ms``
    (the least over the schedules weighed)."""
    try:
        uniform = as_slowest(problem, arrays, kinds, fleet, run, num_stages)
    except PartitionError:
        return
    # the same devices in file order: never slower than there (each of its stages at its own
    # devices' kinds, memory no smaller, links no slower: the same machines, or each device
    # its own machine and no machine link below inter)
    weigh(score_fleet(problem, arrays, kinds, fleet, run, uniform[0].stage_of,
                      uniform[1].place(uniform[0].replicas), "as-slowest"), "as-slowest")
    # and what the one-kind planner predicted for it there (the baseline's figure)
    family = families.setdefault("as-slowest", {})
    family["planned_ms"] = round(min(family.get("planned_ms", math.inf),
                                     uniform[0].sim.iteration_ms), 6)


def polish_fleet(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                 fleet: Fleet, run: RunSpec, plan: FleetPlan, groups: Sequence[int],
                 budget: int = POLISH_SIMULATIONS) -> FleetPlan:
    """Hill-climb a fleet plan's replica counts on the simulated iteration (as
    :func:`~.planner.polish_replicas` does on one kind): one device added from its group's
    spare ones, taken away, or moved to another stage of the same group; the first faster
    neighbour taken, at most ``budget`` simulations. Stage cuts and groups stay."""
    spent, improved = 0, True
    while improved and spent < budget:
        improved = False
        for replicas in _group_moves(fleet, groups, plan.replicas):
            if spent >= budget:
                break
            spent += 1
            trial = score_fleet(problem, arrays, kinds, fleet, run, plan.stage_of,
                                place_on_groups(fleet, groups, replicas), plan.source)
            if trial is not None and trial.sim.iteration_ms < plan.sim.iteration_ms * (
                    1 - 1e-9):
                plan, improved = trial, True
                break
    return plan


def _group_moves(fleet: Fleet, groups: Sequence[int], replicas: Sequence[int]
                 ) -> list[list[int]]:
    """Replica counts one device away, each stage keeping to its group's devices."""
    spare = {g: fleet.groups[g].devices - sum(r for r, h in zip(replicas, groups) if h == g)
             for g in set(groups)}
    moves = []
    for x, rx in enumerate(replicas):
        if spare[groups[x]] > 0:
            moves.append([r + (k == x) for k, r in enumerate(replicas)])
        if rx > 1:
            moves += [[r - (k == x) + (k == y) for k, r in enumerate(replicas)]
                      for y in range(len(replicas)) if y != x and groups[y] == groups[x]]
            moves.append([r - (k == x) for k, r in enumerate(replicas)])
    return moves
