"""Hybrid-parallel planning over the DAG: sequences -> blocks -> hybrid DP -> simulated choice.

For each ordering the DAG is sequenced, coarsened into at most :data:`MAX_POSITIONS` blocks
(narrow points first, see :mod:`onnx_partition.solve.order.blocks`), and handed to the hybrid DP
(:mod:`.hybrid`), which proposes plans of several pipeline depths, on the whole cluster and on
its first 1, 2, 4, ... machines; balanced pp x dp grids join them. Every proposal, and any
baseline, is scored the same way (:mod:`.scoring`): the event simulator plays its schedule over
``M`` micro-batches on the placed cluster, fill and drain included, best lower bound first and
the hopeless skipped. The fastest plan wins, and its replica counts are then polished; devices
cost, so among the plans within DEVICE_SLACK (2%) of the fastest the one on the fewest devices
is returned, with notes saying what more devices would buy.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from onnx_partition.cost.cluster import Cluster
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import ring_allreduce_ms
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.solve import baselines
from onnx_partition.solve.devices import DEVICE_SLACK, devices_notes, fewest_devices
from onnx_partition.solve.dp import split_sequence
from onnx_partition.solve.hybrid import (
    MAX_DEVICES,
    BoundedNoPlan,
    HybridConfig,
    HybridStage,
    SequenceCosts,
    price_plans,
    replica_choices,
    solve_hybrid,
)
from onnx_partition.solve.order.blocks import Blocks, cluster_blocks
from onnx_partition.solve.order.topo import assign, cut_bytes
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import (
    HybridPlan,
    NodeArrays,
    RunSpec,
    StageTotals,
    lower_bound_ms,
    simulated,
    stage_totals,
    totals_costs,
)
from onnx_partition.solve.search import polish_split, sequence_for

__all__ = ["DEVICE_SLACK", "DOWNSET_GRAPH", "DOWNSET_STATES", "HYBRID_ORDERINGS", "LONG_GRAPH",
           "LONG_POLISH", "MAX_POSITIONS", "POLISH_SIMULATIONS", "SIMULATED", "DpSequence",
           "Proposal", "SolvedSequence", "devices_notes", "downset_candidates", "dp_candidates",
           "dp_sequence", "estimate_ms", "fewest_devices", "grid_candidates",
           "machine_budgets", "plan_cluster", "polish_replicas", "proposals_for",
           "sequence_costs"]

#: The hybrid DP's tables grow with the square of the positions: coarser blocks beyond this.
MAX_POSITIONS = 400
HYBRID_ORDERINGS = ("topo", "dfs", "minlive")
#: Beyond this many operators the hybrid DP sees one ordering (min-live is quadratic in the
#: ready set, and the orderings' blocks differ little), grid cuts are not polished, and only
#: the winner's replica counts are, with LONG_POLISH simulations.
LONG_GRAPH = 2000
#: Graphs up to this many operators also get PipeDream's downset DP as a proposal: its splits
#: need not be contiguous in any sequence the DP cuts, and with at most DOWNSET_STATES downsets
#: it costs milliseconds.
DOWNSET_GRAPH = 32
DOWNSET_STATES = 2000
#: Simulations the replica polish of each starting plan may spend.
POLISH_SIMULATIONS = 24
#: ... and of the winner alone on long graphs: on GPT-2 medium tiled to 5,082 operators (PCIe
#: cluster, 64 devices, training) 4 simulations, 0.13 s, gain all that 24 do (4.1%).
LONG_POLISH = 4
#: Proposals per ordering and machine count handed to the simulator (best closed form first).
SIMULATED = 6


@dataclass(frozen=True)
class Proposal:
    """An unscored plan: node -> stage, replicas per stage, and where it came from."""

    stage_of: list[int]
    replicas: list[int]
    source: str  # "dp:<ordering>", "grid:pp<k>", "<common split>:pp<k>" or "pipedream"
    polish: Callable[[], list[int]] | None = None  # a better split, on demand (costly)
    notes: tuple[str, ...] = ()  # what its DP says of itself (bounded: the gap proven)
    solved: SolvedSequence | None = None  # its DP run, where that ran without recomputation


def _coarse_blocks(order: list[int], problem: DagProblem, devices: int) -> Blocks:
    """Narrow-point blocks of ``order``, merged down to MAX_POSITIONS."""
    blocks = cluster_blocks(problem, order, problem.compute_ms, max(1, min(devices, 16)))
    bounds = blocks.bounds
    if len(bounds) - 1 <= MAX_POSITIONS:
        return blocks
    prefix = np.concatenate([[0.0], np.cumsum([problem.compute_ms[v] for v in order])])
    target = prefix[-1] / MAX_POSITIONS
    kept = [0]
    for b in bounds[1:-1]:
        if prefix[b] - prefix[kept[-1]] >= target:
            kept.append(b)
    kept.append(len(order))
    return Blocks(order, kept)


def estimate_ms(stages: Sequence[HybridStage], run: RunSpec) -> float:
    """Closed-form iteration time of a proposal, to rank proposals before simulating the best:
    one micro-batch through every stage (fill and drain), the rest of the busiest replica's
    ``ceil(M / r)`` micro-batches at the slowest stage, then the slowest all-reduce."""
    m = run.microbatches
    fill = sum(s.latency_ms for s in stages)
    rest = max((-(-m // s.replicas) - 1) * s.latency_ms for s in stages)
    return fill + rest + max(s.allreduce_ms for s in stages)


@dataclass(frozen=True)
class DpSequence:
    """What the hybrid DP plans over for one ordering: the ordering's sequence, its
    narrow-point block bounds, the blocks' costs and the cluster as the DP's numbers."""

    order: list[int]
    bounds: list[int]
    costs: SequenceCosts
    config: HybridConfig


@dataclass(frozen=True)
class SolvedSequence:
    """One ordering's hybrid DP as the planner ran it without recomputation (the model
    :mod:`.hybrid_proof` judges, which reuses it rather than solve it again): its input and
    its plans, best bottleneck period first (none: no plan found, the DP bounded)."""

    ordering: str
    sequence: DpSequence
    plans: list[list[HybridStage]]


def dp_sequence(
    problem: DagProblem, arrays: NodeArrays, run: RunSpec, order: Sequence[int],
    num_stages: int | None = None,
) -> DpSequence:
    """The hybrid DP's input for the sequence ``order``: :func:`_coarse_blocks`' blocks, each
    block's sums, every boundary priced at the intra-machine link and every replica group at
    its own (:meth:`Cluster.link`)."""
    order = list(order)
    blocks = _coarse_blocks(order, problem, run.cluster.devices)
    bounds = list(blocks.bounds)
    cluster = run.cluster
    choices = replica_choices(cluster.devices)
    group_bw = [math.inf] * (cluster.devices + 1)
    group_lat = [0.0] * (cluster.devices + 1)
    for r in choices:
        group_bw[r] = cluster.link(r).bytes_per_ms
        group_lat[r] = cluster.link(r).latency_ms
    config = HybridConfig(
        devices=cluster.devices,
        memory_bytes=cluster.memory_bytes,
        microbatches=run.microbatches,
        train=run.train,
        speed=cluster.speed,
        link_bytes_per_ms=cluster.intra.bytes_per_ms,
        link_latency_ms=cluster.intra.latency_ms,
        group_bytes_per_ms=group_bw,
        group_latency_ms=group_lat,
        optimizer_factor=run.optimizer_factor,
        shard=run.shard,
        train_schedule=run.train_schedule,  # ZB-H1's kept gradients in its memory
        max_stages=num_stages or run.max_stages,
        depth=num_stages,
        budgets=machine_budgets(cluster),
    )
    return DpSequence(order, bounds, sequence_costs(problem, arrays, blocks), config)


def dp_candidates(
    problem: DagProblem, arrays: NodeArrays, run: RunSpec, ordering: str,
    num_stages: int | None = None, order: Sequence[int] | None = None,
) -> list[Proposal]:
    """The hybrid DP's best proposals for one ordering (by the closed form), unscored.

    Also on the first 1, 2, 4, ... machines alone: the DP prices every boundary and replica
    group at its own link, not at where the plan will sit, so a plan that keeps off a slow
    inter-machine network is found by planning without it (PipeDream's "use fewer machines").
    Every proposal is then simulated on the real cluster."""
    sequence = dp_sequence(problem, arrays, run,
                           sequence_for(problem, ordering) if order is None else order,
                           num_stages)
    order, bounds, seq, config = (sequence.order, sequence.bounds, sequence.costs,
                                  sequence.config)
    cluster = run.cluster
    notes: list[str] = []
    plans = _dp_plans(seq, config, run, notes)
    solved = SolvedSequence(ordering, sequence, plans) if _plain(run, config) else None
    proposals = [p for p in plans if num_stages is None or len(p) == num_stages]
    proposals.sort(key=lambda p: estimate_ms(p, run))
    # the closed form prices every link as the DP does: rank within each machine count only
    per_machines: dict[int, int] = {}
    kept = []
    for proposal in proposals:
        machines = -(-sum(s.replicas for s in proposal) // cluster.devices_per_machine)
        per_machines[machines] = per_machines.get(machines, 0) + 1
        if per_machines[machines] <= SIMULATED:
            kept.append(proposal)
    at = np.asarray(order, dtype=np.int64)  # converted once, not per proposal (100k nodes)
    return [Proposal(assign(at, [bounds[s.start] for s in proposal] + [len(order)]),
                     [s.replicas for s in proposal],
                     f"dp{RECOMPUTED if any(s.recompute for s in proposal) else ''}:{ordering}",
                     notes=tuple(notes), solved=solved)
            for proposal in kept]


#: The source tag of the hybrid DP's plans with a stage the DP chose to recompute
#: (``dp+rc:ORDERING``).
RECOMPUTED = "+rc"


def _solved(seq: SequenceCosts, config: HybridConfig, notes: list[str]
            ) -> list[list[HybridStage]]:
    """:func:`solve_hybrid`'s plans; where the DP was bounded (the exact one too large) a
    note with its proven gap joins ``notes``, and no plan found is none proposed."""
    try:
        solution = solve_hybrid(seq, config)
    except BoundedNoPlan as error:
        notes.append(f"hybrid DP ({config.recompute} recomputation): {error}")
        return []
    if not solution.exact:
        notes.append(f"hybrid DP ({config.recompute} recomputation): bounded, the exact DP "
                     f"would need {solution.cells:,} cells; least period found "
                     f"{solution.period_ms:.6g} ms, no plan below {solution.lower_ms:.6g} ms "
                     f"(gap {solution.gap:.2%}, relaxation: one micro-batch in flight)")
    return solution.plans


def _dp_plans(seq: SequenceCosts, config: HybridConfig, run: RunSpec,
              notes: list[str] | None = None) -> list[list[HybridStage]]:
    """The hybrid DP's plans, its stages recomputing as ``run.recompute`` says: ``all``
    every stage, ``auto`` chosen per stage inside the DP where memory binds (a stage
    recomputes exactly where keeping its activations does not fit), ``none`` never. Under
    ``auto`` the plans of the DP with every stage recomputing join as proposals where one of
    their stages must recompute (each stage then keeping where that fits): other cuts at the
    same or a larger bottleneck, which the simulator may find faster (fill, drain). Where
    each proposal's stages really recompute is decided again where memory is checked
    (:func:`~.scoring.totals_costs`), by the same rule. What the DP says of itself (bounded:
    its gap) joins ``notes``."""
    notes = [] if notes is None else notes
    if _plain(run, config):
        return _solved(seq, config, notes)
    auto = replace(config, recompute=run.recompute)
    plans = _solved(seq, auto, notes)
    if run.recompute == "auto":
        try:
            every = _solved(seq, replace(config, recompute="all"), notes)
        except PartitionError:  # fitting only where some stage keeps
            every = []
        seen = {tuple((s.start, s.end, s.replicas) for s in p) for p in plans}
        spans = []  # the DP's order, each plan once
        for p in every:
            key = tuple((s.start, s.end, s.replicas) for s in p)
            if key not in seen:
                seen.add(key)
                spans.append(key)
        plans += [p for p in price_plans(seq, auto, spans) if any(s.recompute for s in p)
                  and max(s.memory_bytes for s in p) <= config.memory_bytes]
    return plans


def _plain(run: RunSpec, config: HybridConfig) -> bool:
    """Whether :func:`_dp_plans` runs the DP without recomputation: in inference, under
    ``--recompute none``, or where memory is unlimited."""
    return not run.train or run.recompute == "none" or not math.isfinite(config.memory_bytes)


def grid_candidates(
    problem: DagProblem, arrays: NodeArrays, run: RunSpec, num_stages: int | None = None,
    order: Sequence[int] | None = None, budgets: Sequence[int] = (),
) -> list[Proposal]:
    """Equal replicas per stage (the pp x dp grids of Megatron-style training), each cut by the
    sequence DP with communication: cheap proposals the hybrid DP's bottleneck objective can
    miss when fill, drain and all-reduce decide (it minimises the period, not the iteration).
    On graphs up to LONG_GRAPH each cut on all the devices is also polished on the DAG, and the
    common splits of :mod:`.baselines` join in, so no baseline grid is ever better. The grids
    of each smaller device count in ``budgets`` are proposed too (see :func:`dp_candidates`).
    """
    grids = [(d, pp) for d in (run.cluster.devices, *budgets)
             for pp in ([num_stages] if num_stages else range(1, run.max_stages + 1))
             if d % pp == 0 and pp <= min(d, problem.num_nodes)
             and d // pp <= run.microbatches]  # a replica beyond the M-th gets no work
    if not grids:
        return []
    # Balance what one micro-batch costs one replica of a stage: forward; in training also
    # backward, the gradients' return trip, and the ring all-reduce of its weights spread over
    # the micro-batches. Cut over narrow-point blocks, found once, so long graphs stay cheap.
    base = list(problem.compute_ms)
    nbytes = list(problem.nbytes)
    if run.train:
        base = [f + b for f, b in zip(problem.compute_ms, arrays.backward_ms)]
        nbytes = [2.0 * b for b in nbytes]
    base = [c / run.cluster.speed for c in base]
    order = list(sequence_for(problem, "dfs") if order is None else order)
    at = np.asarray(order, dtype=np.int64)  # converted once, not per grid (100k nodes)
    cuts = cut_bytes(problem, order, nbytes)
    blocks = cluster_blocks(problem, order, base, max(pp for _, pp in grids))
    plans = []
    common: dict[tuple[str, int], list[int]] = {}
    for devices, pp in grids:
        if pp > len(blocks.bounds) - 1:
            continue
        replicas = devices // pp
        compute = base
        if run.train and replicas > 1:
            group = run.cluster.link(replicas)
            share = ring_allreduce_ms(arrays.columns[1], replicas, group.bytes_per_ms, 0.0)
            compute = list(np.asarray(base) + share / run.microbatches)
        block_compute, block_cuts = blocks.compress(compute, cuts)
        split = split_sequence(block_compute, block_cuts, pp,  # a proposal: 0.0001% will do
                               bandwidth_bytes_per_ms=problem.bandwidth_bytes_per_ms,
                               latency_ms=problem.latency_ms, precision=1e-6)
        stage_of = assign(at, blocks.expand(split.bounds))
        short = problem.num_nodes <= LONG_GRAPH
        polish = None
        if short and devices == run.cluster.devices:  # splits no sequence holds
            polish = partial(polish_split, problem.reweighted(compute, nbytes), stage_of, pp,
                             order)
        plans.append(Proposal(stage_of, [replicas] * pp, f"grid:pp{pp}", polish))
        if short:  # the common splits too: never return worse
            for name, split_fn in _common_splits():
                if (name, pp) not in common:
                    common[name, pp] = split_fn(problem, arrays, pp)
                plans.append(Proposal(common[name, pp], [replicas] * pp, f"{name}:pp{pp}"))
    return plans


def _common_splits() -> list[tuple[str, Callable[[DagProblem, NodeArrays, int], list[int]]]]:
    """Megatron/DeepSpeed "uniform", DeepSpeed "parameters", torchgpipe's time balance."""
    return [
        ("uniform", lambda p, a, s: baselines.uniform(p, s)),
        ("parameters", baselines.parameter_balanced),
        ("time", lambda p, a, s: baselines.time_balanced(p, s)),
    ]


def downset_candidates(problem: DagProblem, arrays: NodeArrays, run: RunSpec,
                       num_stages: int | None = None) -> list[Proposal]:
    """PipeDream's plan (:func:`.baselines.pipedream`, exact for its own cost model over every
    downset split) as one more proposal on small graphs, so that baseline is never better
    either; none when the downsets are too many or its depth is not ``num_stages``."""
    try:
        found = baselines.pipedream(problem, arrays, run, max_states=DOWNSET_STATES,
                                    time_limit_s=1.0)
    except PartitionError:
        return []
    if num_stages is not None and len(found.replicas) != num_stages:
        return []
    return [Proposal(list(found.stage_of), list(found.replicas), "pipedream")]


def machine_budgets(cluster: Cluster) -> list[int]:
    """The devices of the first 1, 2, 4, ... machines, short of the whole cluster."""
    budgets, machines = [], 1
    while machines < cluster.machines:
        budgets.append(machines * cluster.devices_per_machine)
        machines *= 2
    return budgets


def sequence_costs(problem: DagProblem, arrays: NodeArrays, blocks: Blocks) -> SequenceCosts:
    """The hybrid DP's input: ``blocks`` of a sequence as positions, each with its nodes'
    sums, the bytes crossing each allowed boundary (relay model), the one memory count
    (a shared initializer in each block holding it, :meth:`NodeArrays.shared_in`; ZB-H1's
    kept gradients; the largest working set) and each block's first and last operator."""
    order, bounds = blocks.order, blocks.bounds
    labels: list[str] = []
    last_labels: list[str] = []
    if arrays.names:
        for lo, hi in itertools.pairwise(bounds):
            labels.append(arrays.names[order[lo]])
            last_labels.append(arrays.names[order[hi - 1]])
    counted = arrays.counted
    return SequenceCosts(blocks.sums(problem.compute_ms), blocks.sums(arrays.backward_ms),
                         blocks.sums(arrays.param_bytes), blocks.sums(arrays.activation_bytes),
                         cut_bytes(problem, order)[np.asarray(bounds)], labels, last_labels,
                         blocks.sums(arrays.weight_bytes) if counted else [],
                         blocks.sums(arrays.trainable_bytes) if counted else [],
                         arrays.input_bytes, arrays.shared_in(blocks),
                         blocks.sums(arrays.kept_bytes), blocks.maxes(arrays.working_bytes))


def proposals_for(problem: DagProblem, arrays: NodeArrays, run: RunSpec,
                  num_stages: int | None, orderings: Sequence[str]) -> list[Proposal]:
    """Every unscored proposal: each distinct ordering's DP plans, the balanced grids (cut
    depth-first), and on small graphs PipeDream's downset DP."""
    if problem.num_nodes > LONG_GRAPH:  # orderings differ little once blocks are formed:
        orderings = list(orderings)[:1]  # the first for the hybrid DP; grids cut depth-first
    sequences = {o: sequence_for(problem, o) for o in {*orderings, "dfs"}}
    distinct: dict[tuple[int, ...], str] = {}  # an ordering equal to an earlier one adds nothing
    for o in orderings:
        distinct.setdefault(tuple(sequences[o]), o)
    proposals = [p for o in distinct.values()
                 for p in dp_candidates(problem, arrays, run, o, num_stages, sequences[o])]
    proposals += grid_candidates(problem, arrays, run, num_stages, sequences["dfs"],
                                 machine_budgets(run.cluster))
    if problem.num_nodes <= DOWNSET_GRAPH:
        proposals += downset_candidates(problem, arrays, run, num_stages)
    return proposals


@dataclass
class _Tournament:
    """Proposals simulated best lower bound first; the best plan so far, the best per machine
    count, and per family its best ``iteration_ms`` or the ``lower_bound_ms`` that ruled it out."""

    problem: DagProblem
    arrays: NodeArrays
    run: RunSpec
    best: HybridPlan | None = None
    families: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the lower bound of every plan weighed so far, None where it does not fit in memory
    bounds: dict[tuple[tuple[int, ...], tuple[int, ...]], float | None] = field(
        default_factory=dict)
    by_machines: dict[int, HybridPlan] = field(default_factory=dict)
    reporter: Reporter = SILENT  # each proposal weighed
    played: list[HybridPlan] = field(default_factory=list)  # every plan simulated
    #: each cut's per-stage sums, shared by its proposals on other replica counts
    totals: dict[tuple[tuple[int, ...], int], StageTotals] = field(default_factory=dict)

    def play(self, batch: list[Proposal]) -> list[tuple[float, Proposal]]:
        """Simulate a batch's new plans best bound first, skipping what cannot beat
        :attr:`best`; return every proposal of the batch that fits in memory with its bound
        (a plan proposed twice is simulated once, but each proposal keeps its own polish)."""
        run = self.run
        pool = []
        for proposal in batch:
            cut = tuple(proposal.stage_of)
            key = (cut, tuple(proposal.replicas))
            if key in self.bounds:
                continue
            if max(proposal.replicas) > run.microbatches:  # a replica beyond the M-th would
                self.bounds[key] = None  # get no micro-batch: not weighed
                continue
            depth = len(proposal.replicas)
            if (cut, depth) not in self.totals:
                self.totals[cut, depth] = stage_totals(self.problem, self.arrays,
                                                       proposal.stage_of, depth)
            costs, memory = totals_costs(self.totals[cut, depth], proposal.replicas, run)
            self.bounds[key] = None
            if max(memory) <= run.cluster.memory_bytes:
                bound = lower_bound_ms(costs, run.microbatches, run.train,
                                       split=run.schedule == "zb-h1")
                self.bounds[key] = bound
                pool.append((bound, proposal, costs, memory))
        pool.sort(key=lambda e: e[0])
        for played_n, (bound, proposal, costs, memory) in enumerate(pool, 1):
            self.reporter.step("planning: simulating proposals", played_n, len(pool))
            family = (proposal.source.split(":")[1] if proposal.source.startswith("dp")
                      else "grid")
            if self.best is not None and bound >= self._limit(proposal):
                self.families.setdefault(family, {"lower_bound_ms": bound})
                continue
            plan = simulated(proposal.stage_of, proposal.replicas, costs, memory, run,
                             proposal.source)
            self.played.append(plan)
            done = self.families.get(family, {}).get("iteration_ms", math.inf)
            self.families[family] = {"iteration_ms": float(min(done, plan.sim.iteration_ms))}
            machines = -(-sum(plan.replicas) // run.cluster.devices_per_machine)
            if machines not in self.by_machines or (
                    plan.sim.iteration_ms < self.by_machines[machines].sim.iteration_ms):
                self.by_machines[machines] = plan
            if self.best is None or plan.sim.iteration_ms < self.best.sim.iteration_ms:
                self.best = plan
        weighed = [(self.bounds[tuple(p.stage_of), tuple(p.replicas)], p) for p in batch]
        return [(bound, p) for bound, p in weighed if bound is not None]

    def _limit(self, proposal: Proposal) -> float:
        """The iteration a proposal must beat to matter: the best's, or within DEVICE_SLACK
        of it on fewer devices."""
        assert self.best is not None
        best_ms = self.best.sim.iteration_ms
        fewer = sum(proposal.replicas) < sum(self.best.replicas)
        return best_ms * (1 + DEVICE_SLACK) if fewer else best_ms

    def play_polished_grids(self, played: list[tuple[float, Proposal]]) -> None:
        """Re-cut (polish) the grid proposals whose depth and replicas could still win: those
        whose equal shares of the work beat the best plan so far."""
        if self.best is None:
            return
        run = self.run
        work = float(self.problem.compute_array.sum()
                     + (self.arrays.columns[0].sum() if run.train else 0))
        work /= run.cluster.speed
        best_ms = self.best.sim.iteration_ms

        def balanced(p: Proposal) -> float:
            """No cut of ``p``'s depth and replicas beats equal shares of the work."""
            return -(-run.microbatches // p.replicas[0]) * work / len(p.replicas)

        self.play([replace(p, stage_of=p.polish(), polish=None) for _, p in played
                   if p.polish is not None and balanced(p) < best_ms])


def plan_cluster(
    problem: DagProblem, arrays: NodeArrays, run: RunSpec, *, num_stages: int | None = None,
    orderings: Sequence[str] = HYBRID_ORDERINGS, reporter: Reporter = SILENT,
    proposals: Sequence[Proposal] | None = None,
) -> tuple[HybridPlan, dict[str, dict[str, float]]]:
    """The fastest simulated plan over every ordering's DP proposals and the balanced grids,
    and per family either its best simulated ``iteration_ms`` or, when none of its proposals
    could beat the winner, the ``lower_bound_ms`` that ruled them out.

    Proposals are played in the simulator in the order of :func:`lower_bound_ms`, skipping
    any that cannot beat the best so far: the answer is that of simulating them all.
    ``num_stages`` fixes the pipeline depth; otherwise the planner chooses it. Each proposal
    weighed is reported to ``reporter``. ``proposals``: :func:`proposals_for`'s, when the
    caller has them (they do not depend on the training schedule, so planning for several
    schedules makes them once).
    """
    started = time.perf_counter()
    tournament = _Tournament(problem, arrays, run, reporter=reporter)
    if proposals is None:
        proposals = proposals_for(problem, arrays, run, num_stages, orderings)
    played = tournament.play(list(proposals))
    tournament.play_polished_grids(played)
    best = tournament.best
    if best is None:
        depth = f"{num_stages}-stage " if num_stages else ""
        under = f" under {run.schedule}" if run.train and run.schedule != "1f1b" else ""
        raise PartitionError(f"no {depth}plan fits the cluster's memory{under}")
    # Polish the winner and the best plan of every other machine count too: one device at a
    # time cannot climb from a plan on 8 machines to a better one on 2, so more devices could
    # otherwise end in a slower plan than fewer.
    if problem.num_nodes <= LONG_GRAPH:
        starts = [best] + [p for p in tournament.by_machines.values() if p is not best]
        best = min((polish_replicas(problem, arrays, p, run) for p in starts),
                   key=lambda p: p.sim.iteration_ms)
    else:
        best = polish_replicas(problem, arrays, best, run, LONG_POLISH)
    best = fewest_devices(best, tournament.played, run)
    said = dict.fromkeys(note for p in proposals for note in p.notes)
    best = replace(best, notes=[*best.notes, *said])
    # every proposal was checked with the one memory model, which the simulator agrees with
    assert max(best.sim.peak_memory_bytes.values()) <= run.cluster.memory_bytes
    best.planning_s = time.perf_counter() - started
    return best, tournament.families


def _replica_moves(replicas: Sequence[int], devices: int,
                   most: int = MAX_DEVICES) -> Iterator[list[int]]:
    """Replica counts one device away (moved between two stages, added from the spare ones,
    or taken away; none above ``most``), one at a time: a 260-stage plan has 67,000."""
    spare = devices - sum(replicas)
    for x, rx in enumerate(replicas):
        if spare > 0 and rx < most:
            yield [r + (k == x) for k, r in enumerate(replicas)]
        if rx > 1:
            yield [r - (k == x) for k, r in enumerate(replicas)]
            for y in range(len(replicas)):
                if y != x and replicas[y] < most:
                    yield [r - (k == x) + (k == y) for k, r in enumerate(replicas)]


def polish_replicas(problem: DagProblem, arrays: NodeArrays, plan: HybridPlan, run: RunSpec,
                    budget: int = POLISH_SIMULATIONS) -> HybridPlan:
    """Hill-climb the winner's replica counts on the simulated iteration, which the DP only
    approximates (fill, drain, placed links; a grid's counts are equal by construction):
    neighbours one device away within memory (1F1B's in flight depend on the counts), in
    :func:`lower_bound_ms` order, the hopeless skipped, the first faster taken; at most
    ``budget`` simulations; stage cuts stay."""
    totals = stage_totals(problem, arrays, plan.stage_of, plan.num_stages)
    spent, improved = 0, True
    while improved and spent < budget:
        improved = False
        # least bound first, as a stable sort; only those kept (all 67,000 moves' costs of a
        # 16,384-device plan took 11 GB)
        for _, replicas in heapq.nsmallest(budget - spent, _hopeful(totals, plan, run),
                                           key=lambda e: e[0]):
            spent += 1
            costs, memory = totals_costs(totals, replicas, run)
            trial = simulated(plan.stage_of, replicas, costs, memory, run, plan.source)
            if trial.sim.iteration_ms < plan.sim.iteration_ms * (1 - 1e-9):
                plan, improved = trial, True
                break
    return plan


def _hopeful(totals: StageTotals, plan: HybridPlan, run: RunSpec
             ) -> Iterator[tuple[float, list[int]]]:
    """:func:`polish_replicas`'s moves within memory that may beat ``plan``, and bounds."""
    for replicas in _replica_moves(plan.replicas, run.cluster.devices, run.microbatches):
        costs, memory = totals_costs(totals, replicas, run)
        bound = lower_bound_ms(costs, run.microbatches, run.train,
                               split=run.schedule == "zb-h1")
        if bound < plan.sim.iteration_ms and max(memory) <= run.cluster.memory_bytes:
            yield bound, replicas
