"""Planning on a mixed fleet: stages and replicas on groups of different GPUs.

A :class:`~onnx_partition.cost.cluster.Fleet` holds groups of one GPU kind each. A plan puts
every stage's replicas on one group, and each group hosts one contiguous run of stages (the
pipeline visits the groups in some *ordering*, possibly skipping some): the device-group
assignment of HetPipe (Park et al., ATC'20: one virtual worker per group of like GPUs) and the
stage-to-device-type search of Metis (Um et al., ATC'24: "Metis: Fast Automatic Distributed
Training on Heterogeneous GPUs", which orders device groups along the pipeline and balances
stages by each type's speed and memory). Each stage is priced by its own group's costs (its
GPU's roofline, or the costs file measured on that kind), so a fast kind gets longer stages.

**The DP** (:func:`fleet_dp`), per ordering ``o`` of the groups, over a sequence of ``n``
positions (narrow-point blocks) with per-group costs, minimises the bottleneck period (the
hybrid DP's objective, :mod:`.hybrid`, PipeDream's replicated-stage model)::

    A[t, i, u] = min over j > i, r (u + r <= D_t) of
                   max(P_t(i, j, r, in(u), intra), A[t, j, u + r])   next stage on group o_t
                   max(P_t(i, j, r, in(u), inter), N[t + 1, j])      next stage on a later group
    N[t, j]    = min over t' >= t of A[t', j, 0]                     (groups may be skipped)

``A[t, i, u]``: the least bottleneck of the suffix ``[i, n)`` whose first stage is on group
``o_t`` with ``u`` of its ``D_t`` devices taken by earlier stages; ``A[t, n, u] = 0``. A stage's
period ``P = (F_t + B_t + comm) / r + allreduce_t(r) / M`` with ``F_t``, ``B_t`` its group's
times, ``comm`` its boundaries' transfers at their links (the inter-machine link where the
pipeline enters or leaves a group, ``in(0)``; the group's own link inside it) and the ring
all-reduce on the group's link; a stage whose memory per device (the one memory model with
``held`` micro-batches in flight: 1 in inference; in training ``ceil(M / r)``, GPipe's bound,
never below 1F1B's, or 1 for an optimistic pass checked afterwards) exceeds its group's memory
is out. In training a stage may instead recompute (``--recompute``: keep only its inputs per
micro-batch in flight and one micro-batch's activations, ``F_t`` once more); under ``auto`` it
does exactly where keeping does not fit, as the one-kind DP chooses it per stage (AdaPipe, Sun
et al., ASPLOS'24): ``held`` depends on ``r`` alone, so ``P_t`` is the keep period where that
fits, else the recompute period where that fits, else infinite, a pointwise choice per ``(t,
i, j, r)`` (keeping is never slower) and the recurrence is unchanged. Exact for that objective
over every split of the sequence, replica counts from :func:`~.hybrid.replica_choices`, group
assignment along the ordering and (``auto``) each stage's keep-or-recompute
(``tests/test_fleet.py`` checks it against brute force); ``O(|orders| n^2 D R)`` with the ``j``
loop in numpy. A fixed depth ``S`` (``partition --stages``) adds the stages left to place to
every table, ``A[t, i, u, q]`` (a stage at ``q`` leads to the suffix at ``q - 1``; only ``q =
0`` is 0 at ``n``): ``S`` times the work.

**The choice** (:func:`plan_fleet`): every ordering's DP plan (the best one's replica counts
then hill-climbed, :func:`polish_fleet`), each group alone planned by the one-kind planner
(:func:`~.planner.plan_cluster`, so "only the fastest group" is among the candidates), and
the one-kind plan of every device as the slowest kind (:func:`as_slowest`) are simulated on
the fleet (:func:`fleet_costs`: each stage's times on its kind, each transfer and all-reduce
on the link it crosses once placed) and the fastest wins; the last makes it never slower than
that baseline (the same schedule, no action longer, no link slower). A train candidate is
scored under each schedule asked, with each stage's engine work (step, accumulation, work per
action and per hop: :class:`~onnx_partition.cost.engine_price.FleetEngine`) on its own kind, the
figure ``partition`` then prints.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.cost.engine_price import EngineTerms, FleetEngine
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.layout import replica_of
from onnx_partition.pipeline.memory import (
    StageBytes,
    check_recompute,
    memory_per_device,
    recompute_choice,
    ring_allreduce_ms,
    stash_bytes,
    static_bytes,
)
from onnx_partition.pipeline.schedules import build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.solve.hybrid_model import replica_choices, shared_spans
from onnx_partition.solve.order.blocks import Blocks, cluster_blocks
from onnx_partition.solve.order.topo import assign, cut_bytes
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import HybridPlan, NodeArrays, RunSpec
from onnx_partition.solve.search import sequence_for

__all__ = ["FLEET_POSITIONS", "FleetPlan", "FleetSequence", "KindCosts", "as_slowest",
           "fastest_alone", "fleet_costs", "fleet_dp", "group_orderings", "kind_problem",
           "place_on_groups", "plan_fleet", "polish_fleet", "score_fleet", "slowest_cluster",
           "slowest_costs", "stage_period"]

#: The fleet DP's positions: the sequence's narrow-point blocks merged down to this many.
FLEET_POSITIONS = 96
#: Simulations the replica polish of the best DP plan may spend.
POLISH_SIMULATIONS = 24
#: Every ordering of up to this many groups is tried; more: file order, fastest and slowest
#: first.
ALL_ORDERINGS = 4


@dataclass(frozen=True)
class KindCosts:
    """Per node (the solvers' nodes), one GPU kind's forward and backward times; in training
    also its engine's work (:func:`~onnx_partition.cost.engine_price.engine_terms` on that kind:
    the step, accumulation, work per action and per hop that ``partition`` prices the plan
    with after; None: not priced) and the input-gradient part of each backward (ZB-H1's;
    empty: half)."""

    forward_ms: Sequence[float]
    backward_ms: Sequence[float]
    engine: EngineTerms | None = None
    backward_input_ms: Sequence[float] = ()


@dataclass
class FleetPlan(HybridPlan):
    """A scored fleet plan: a :class:`~.scoring.HybridPlan` whose stage ``k`` runs on GPU kind
    ``gpus[k]`` (``a+b``: replicas on two kinds, only in the "as slowest" baseline's plan)."""

    gpus: list[str] = field(default_factory=list)
    schedule: str = "1f1b"  # the schedule it was scored under (RunSpec.schedule)


@dataclass(frozen=True)
class FleetSequence:
    """A sequence of ``n`` positions with per-group times (plain arrays): the DP's input."""

    forward_ms: Sequence[Sequence[float]]  # [group][position]
    backward_ms: Sequence[Sequence[float]]
    param_bytes: Sequence[float]
    activation_bytes: Sequence[float]
    cut_bytes: Sequence[float]  # n + 1 boundaries, ends 0
    #: memory only, the one count (as :class:`~onnx_partition.solve.hybrid.SequenceCosts`):
    #: empty ``weight_bytes``: ``param_bytes``, all trained
    weight_bytes: Sequence[float] = ()
    trainable_bytes: Sequence[float] = ()
    input_bytes: float = 0.0
    shared: Sequence[tuple[float, float, Sequence[int]]] = ()

    @property
    def n(self) -> int:
        return len(self.param_bytes)

    def weights(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Weight and trainable bytes of every stage ``[i, j)`` ((n + 1) x (n + 1); None:
        all trained), shared initializers once in each stage holding one."""
        if not len(self.weight_bytes):
            return _span(self.param_bytes), None
        weights, trained = _span(self.weight_bytes), _span(self.trainable_bytes)
        if self.shared:
            held, held_trained = shared_spans(self.shared, self.n)
            weights, trained = weights + held, trained + held_trained
        return weights, trained

    def received(self) -> np.ndarray:
        """Bytes stage ``[i, ...)`` receives per micro-batch: stage 0 the graph inputs."""
        cut = np.asarray(self.cut_bytes, dtype=float).copy()
        cut[0] = self.input_bytes
        return cut


#: A stage of :func:`fleet_dp`'s plan: ``(start, end, group, replicas, recomputes)``.
FleetStage = tuple[int, int, int, int, bool]


def _send_ms(nbytes: float, link: Link | None) -> float:
    return 0.0 if link is None or nbytes == 0 else nbytes / link.bytes_per_ms + link.latency_ms


def stage_period(seq: FleetSequence, fleet: Fleet, run: RunSpec, group: int, i: int, j: int,
                 r: int, link_in: Link | None, link_out: Link | None,
                 held: Callable[[int], int] | None = None, recompute: str = "none") -> float:
    """The DP's period of stage ``[i, j)`` on ``r`` replicas of ``group``, entering over
    ``link_in`` and leaving over ``link_out`` (None at the pipeline's ends); infinite when its
    memory per device (``held(r)`` micro-batches in flight) exceeds the group's. In training a
    recomputing stage keeps only its inputs per micro-batch in flight and one micro-batch's
    activations, and runs its forward twice (the one-kind DP's :func:`~.hybrid.recompute_stage`):
    ``recompute`` ``none`` never, ``all`` always, ``auto`` exactly where keeping does not fit
    (keeping is never slower: the least feasible of the two). The scalar statement of what
    :func:`fleet_dp` computes in bulk (the brute-force tests use it)."""
    flags = {"none": [False], "all": [True], "auto": [False, True]}[check_recompute(recompute)]
    g = fleet.groups[group]
    forward = float(sum(seq.forward_ms[group][i:j]))
    comm = _send_ms(seq.cut_bytes[i], link_in) + _send_ms(seq.cut_bytes[j], link_out)
    compute = forward
    if run.train:
        compute += float(sum(seq.backward_ms[group][i:j]))
        comm *= 2.0
    params = float(sum(seq.param_bytes[i:j]))
    link = g.cluster(fleet.inter).link(r)
    allreduce = (ring_allreduce_ms(params, r, link.bytes_per_ms, link.latency_ms)
                 if run.train else 0.0)
    weights, trained = params, None
    if len(seq.weight_bytes):  # the one count: each shared initializer held in [i, j) once
        tied = [(b, t) for b, t, where in seq.shared if any(i <= p < j for p in where)]
        weights = float(sum(seq.weight_bytes[i:j])) + sum(b for b, _ in tied)
        trained = float(sum(seq.trainable_bytes[i:j])) + sum(t for _, t in tied)
    size = StageBytes(weights, float(sum(seq.activation_bytes[i:j])),
                      float(seq.input_bytes if i == 0 else seq.cut_bytes[i]),
                      float(seq.cut_bytes[j]) if run.train else 0.0, trained)
    count = held(r) if held is not None else _held_safe(run)(r)
    static = static_bytes(size, train=run.train, optimizer_factor=run.optimizer_factor)
    for flag in flags:
        rebuilt = flag and run.train
        memory = (static + count * stash_bytes(size, rebuilt)
                  + (size.activations if rebuilt else 0.0))
        if memory <= g.memory * 1e9:
            return ((compute + (forward if rebuilt else 0.0) + comm) / r
                    + allreduce / run.microbatches)
    return math.inf


def _held_safe(run: RunSpec) -> Callable[[int], int]:
    """Micro-batches in flight per device that no schedule exceeds: 1 in inference,
    ``ceil(M / r)`` (GPipe's) in training."""
    m = run.microbatches
    return (lambda r: -(-m // r)) if run.train else (lambda r: 1)


def _span(values: Sequence[float]) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
    return np.asarray(prefix[None, :] - prefix[:, None])  # [i, j] = sum over [i, j)


def fleet_dp(seq: FleetSequence, fleet: Fleet, run: RunSpec, ordering: Sequence[int],
             held: Callable[[int], int] | None = None, recompute: str = "none",
             depth: int | None = None) -> tuple[float, list[FleetStage]]:
    """The least bottleneck period over the splits of ``seq`` into stages on the groups, visited
    in ``ordering`` (each group one contiguous run of stages, or skipped), and its stages
    ``(start, end, group, replicas, recomputes)``; ``(inf, [])`` when nothing fits in memory.
    See the module docstring for the recurrence; each stage keeps or recomputes per
    ``recompute`` as :func:`stage_period` prices it (``auto``: recomputes exactly where
    keeping does not fit its memory; held depends on ``r`` only, so that is a pointwise
    choice per ``(group, i, j, r)`` and the DP stays exact). ``depth``: exactly that many
    stages (each table gains a dimension, the stages left to place)."""
    mode = check_recompute(recompute)
    mode = mode if run.train else "none"
    n, m = seq.n, run.microbatches
    held = held or _held_safe(run)
    cut = np.asarray(seq.cut_bytes, dtype=float)
    params, acts = _span(seq.param_bytes), _span(seq.activation_bytes)
    weights, trained = seq.weights()
    received = seq.received()
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    factor = 2.0 if run.train else 1.0

    def side(link: Link) -> np.ndarray:  # cost of a boundary at this link, ends free
        ms = np.where(cut > 0, cut / link.bytes_per_ms + link.latency_ms, 0.0)
        ms[0] = ms[n] = 0.0
        return np.asarray(ms)

    k = len(ordering)
    inf = math.inf
    # slot q of each table: any depth (one slot, q = 0), or exactly q stages from i on; slot
    # ``slots`` stays inf (what q = 0 leads to before the end); prev[q]: the slot of the
    # suffix after a stage placed at slot q
    slots = 1 if depth is None else depth + 1
    prev = [0] if depth is None else [slots, *range(slots - 1)]
    # A[t][q, i, u]; the choice reaching it: next boundary j, replicas r, next stage on
    # group t, whether the stage recomputes
    A = [np.full((slots + 1, n + 1, fleet.groups[g].devices + 1), inf) for g in ordering]
    ch_j = [np.zeros(a.shape, dtype=np.int64) for a in A]
    ch_r = [np.zeros_like(c) for c in ch_j]
    ch_same = [np.zeros(c.shape, dtype=bool) for c in ch_j]
    ch_rc = [np.zeros(c.shape, dtype=bool) for c in ch_j]
    N = np.full((slots + 1, k + 1, n + 1), inf)
    N[0, :, n] = 0.0
    for t in range(k):
        A[t][0, n, :] = 0.0
    forwards = {g: _span(seq.forward_ms[g]) for g in set(ordering)}
    spans = {g: forwards[g] + (_span(seq.backward_ms[g]) if run.train else 0.0)
             for g in set(ordering)}
    for i in range(n - 1, -1, -1):
        for t in range(k - 1, -1, -1):
            g = ordering[t]
            group = fleet.groups[g]
            own = group.cluster(fleet.inter)
            compute = spans[g][i]
            sides = {"intra": side(group.intra), "inter": side(fleet.inter)}
            stash = acts[i] + received[i]  # the one memory model: static + held * stash
            if trained is None:
                static = run.optimizer_factor * params[i] + cut if run.train else params[i]
            else:
                static = (weights[i] + (run.optimizer_factor - 1.0) * trained[i] + cut
                          if run.train else weights[i])
            limit = group.memory * 1e9
            d = group.devices
            best = np.full((slots, d), inf)  # per q and u in 0..d-1, vectorised over u and j
            for r in replica_choices(d):
                us = np.arange(d - r + 1)  # devices already used, u + r <= d
                # keeping, else (modes auto, all) recomputing: inputs per micro-batch in
                # flight and one micro-batch's activations, its forward once more
                keeps = (valid[i] & (static + held(r) * stash <= limit) if mode != "all"
                         else np.zeros(n + 1, dtype=bool))
                rebuilt = (~keeps & valid[i] & (static + acts[i] + held(r) * received[i]
                                                <= limit) if mode != "none"
                           else np.zeros(n + 1, dtype=bool))
                stage = compute + np.where(rebuilt, forwards[g][i], 0.0)
                link = own.link(r)
                allreduce = np.reshape(ring_allreduce_ms(params[i], r, link.bytes_per_ms,
                                                         link.latency_ms) / m if run.train
                                       else np.zeros(n + 1), (n + 1, 1))
                fits = (keeps | rebuilt)[:, None]
                for same in (True, False):
                    leave = sides["intra" if same else "inter"]
                    enter = np.where(us == 0, sides["inter"][i], sides["intra"][i])
                    period = (stage[:, None] + factor * (enter[None, :] + leave[:, None])) / r
                    own_period = np.where(fits, period + allreduce, inf)
                    for q in range(slots):
                        rest = (A[t][prev[q]][:, us + r] if same
                                else N[prev[q], t + 1][:, None])
                        value = np.maximum(own_period, rest)
                        if same:  # the last stage is taken once, on the "later group" branch
                            value[n, :] = inf
                        j = np.argmin(value, axis=0)
                        reach = value[j, np.arange(len(us))]
                        better = reach < best[q, us]
                        at = us[better]
                        best[q, at] = reach[better]
                        ch_j[t][q, i, at], ch_r[t][q, i, at] = j[better], r
                        ch_same[t][q, i, at], ch_rc[t][q, i, at] = same, rebuilt[j[better]]
            A[t][:slots, i, :d] = best
            N[:slots, t, i] = np.minimum(A[t][:slots, i, 0], N[:slots, t + 1, i])
    q = slots - 1  # any depth, or all ``depth`` stages left
    if not math.isfinite(N[q, 0, 0]):
        return inf, []
    stages: list[FleetStage] = []
    i, t, u = 0, 0, 0
    while i < n:
        if u == 0:  # a fresh group: the first of t, t+1, ... that reaches N[t, i]
            while A[t][q, i, 0] > N[q, t, i]:
                t += 1
        at = (q, i, u)
        j, r, same = int(ch_j[t][at]), int(ch_r[t][at]), bool(ch_same[t][at])
        stages.append((i, j, ordering[t], r, bool(ch_rc[t][at])))
        i, u, q = j, u + r, prev[q]
        if not same:
            t, u = t + 1, 0
    return float(N[slots - 1, 0, 0]), stages


def group_orderings(fleet: Fleet, speed: Sequence[float]) -> list[tuple[int, ...]]:
    """The orderings of the groups along the pipeline to try: all of them up to
    :data:`ALL_ORDERINGS` groups; beyond, file order and by ``speed`` (work per ms) both
    ways."""
    groups = range(len(fleet.groups))
    if len(fleet.groups) <= ALL_ORDERINGS:
        return list(itertools.permutations(groups))
    fast = tuple(sorted(groups, key=lambda g: -speed[g]))
    return list(dict.fromkeys([tuple(groups), fast, fast[::-1]]))


# --------------------------------------------------------------------------- scoring


def _starts(fleet: Fleet) -> list[int]:
    """The fleet index of each group's first device (devices numbered in file order)."""
    return list(itertools.accumulate((g.devices for g in fleet.groups), initial=0))


def place_on_groups(fleet: Fleet, groups: Sequence[int], replicas: Sequence[int]
                    ) -> list[list[int]]:
    """Fleet device indices (file order) of every stage, stage ``k`` on group ``groups[k]``:
    each group's stages placed in pipeline order by :meth:`Cluster.place`."""
    starts = _starts(fleet)
    placed: list[list[int]] = [[] for _ in replicas]
    for g, cluster in enumerate(fleet.clusters):
        ks = [k for k, h in enumerate(groups) if h == g]
        if ks:
            for k, where in zip(ks, cluster.place([replicas[k] for k in ks])):
                placed[k] = [starts[g] + d for d in where]
    return placed


def fleet_costs(per_kind_fwd: Mapping[str, Sequence[float]],
                per_kind_bwd: Mapping[str, Sequence[float]], sizes: Sequence[StageBytes],
                cross_bytes: Sequence[float], fleet: Fleet, placed: Sequence[Sequence[int]],
                run: RunSpec, allreduce_bytes: Sequence[float] | None = None
                ) -> tuple[PipelineCosts, list[float], list[list[str]], list[str], list[float]]:
    """Simulator costs of stages with these per-kind times and sizes placed on fleet devices
    ``placed`` (file order): a stage runs at its slowest replica's kind (replicas take
    micro-batches in turn); each all-reduce on its group's link when one machine holds the
    stage, else on ``inter``; each transfer (micro-batch ``m`` from replica ``m % r_k`` to
    ``m % r_(k+1)``) on the group's link when it stays on one machine, else on ``inter``.
    Also each stage's memory per device, device ids, GPU kinds (``a+b`` for a stage on two)
    and memory limit in bytes. ``allreduce_bytes``: each stage's gradient bytes all-reduced
    (None: its ``params``)."""
    starts = _starts(fleet)

    def group(d: int) -> int:
        return max(g for g in range(len(fleet.groups)) if starts[g] <= d)

    def machine(d: int) -> int:
        g = group(d)
        return fleet.machine_offset[g] + (d - starts[g]) // fleet.groups[g].devices_per_machine

    stage_groups = [sorted({group(d) for d in where}) for where in placed]
    kinds = [list(dict.fromkeys(fleet.groups[g].gpu for g in gs)) for gs in stage_groups]
    replicas = [len(where) for where in placed]
    send = []
    for k, b in enumerate(cross_bytes):
        here, there = placed[k], placed[k + 1]
        crosses = any(machine(here[replica_of(mb, len(here))])
                      != machine(there[replica_of(mb, len(there))])
                      for mb in range(min(run.microbatches, math.lcm(len(here), len(there)))))
        link = fleet.inter if crosses else fleet.groups[group(here[0])].intra
        send.append(b / link.bytes_per_ms + link.latency_ms)
    limits = [min(fleet.groups[g].memory for g in gs) * 1e9 for gs in stage_groups]
    flags = _recomputed(sizes, replicas, limits, run)
    stages = []
    for k, where in enumerate(placed):
        one = len({machine(d) for d in where}) == 1
        link = fleet.groups[stage_groups[k][0]].intra if one else fleet.inter
        grads = sizes[k].params if allreduce_bytes is None else allreduce_bytes[k]
        allreduce = (ring_allreduce_ms(grads, len(where), link.bytes_per_ms,
                                       link.latency_ms) if run.train else 0.0)
        stages.append(StageCosts(
            max(float(per_kind_fwd[g][k]) for g in kinds[k]),
            max(float(per_kind_bwd[g][k]) for g in kinds[k]) if run.train else 0.0,
            len(where), allreduce, stash_bytes(sizes[k]),
            static_bytes(sizes[k], train=run.train, optimizer_factor=run.optimizer_factor),
            recompute=flags[k], input_bytes=sizes[k].received))
    memory = memory_per_device(sizes, replicas, run.microbatches, schedule=run.schedule,
                               optimizer_factor=run.optimizer_factor, recompute=flags)
    devices = [[fleet.device_name(group(d), d - starts[group(d)]) for d in where]
               for where in placed]
    return PipelineCosts(stages, send), memory, devices, ["+".join(k) for k in kinds], limits


def _recomputed(sizes: Sequence[StageBytes], replicas: Sequence[int],
                limits: Sequence[float], run: RunSpec) -> list[bool]:
    """Which stages recompute under ``run.recompute``
    (:func:`~onnx_partition.pipeline.memory.recompute_choice`), each against its own kind's
    memory ``limits[k]``."""
    chosen = {limit: recompute_choice(sizes, replicas, run.microbatches, schedule=run.schedule,
                                      memory_bytes=limit, mode=run.recompute,
                                      optimizer_factor=run.optimizer_factor)
              for limit in set(limits)}
    return [chosen[limit][k] for k, limit in enumerate(limits)]


def score_fleet(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                fleet: Fleet, run: RunSpec, stage_of: Sequence[int],
                placed: Sequence[Sequence[int]], source: str) -> FleetPlan | None:
    """Simulate an assignment whose stage ``k`` runs on fleet devices ``placed[k]`` (None when
    a stage overflows its devices' memory): the one yardstick of every candidate and
    baseline."""
    s = len(placed)
    at = np.asarray(stage_of, dtype=np.int64)

    def per_stage(values: Sequence[float]) -> np.ndarray:
        return np.bincount(at, np.asarray(values, dtype=float), minlength=s)

    fwd = {gpu: per_stage(c.forward_ms).tolist() for gpu, c in kinds.items()}
    bwd = {gpu: per_stage(c.backward_ms).tolist() for gpu, c in kinds.items()}
    params, acts = per_stage(arrays.columns[1]), per_stage(arrays.columns[2])
    cross = problem.cross_bytes(stage_of, s) if s > 1 else []
    edge = [arrays.input_bytes, *cross, 0.0]  # stage 0 receives the graph inputs
    weights, trained = (arrays.stage_weights(stage_of, s) if arrays.counted
                        else (params, None))  # the one count (NodeArrays.stage_weights)
    sizes = [StageBytes(float(weights[k]), float(acts[k]), edge[k],
                        edge[k + 1] if run.train else 0.0,
                        None if trained is None else float(trained[k])) for k in range(s)]
    costs, memory, devices, gpus, limits = fleet_costs(fwd, bwd, sizes, cross, fleet, placed,
                                                       run, [float(p) for p in params])
    if any(mem > limit for mem, limit in zip(memory, limits)):
        return None
    replicas = [len(where) for where in placed]
    played = costs
    if run.train:
        costs, played = _with_engine(costs, kinds, gpus, arrays, stage_of, sizes,
                                     run.schedule, lambda values: per_stage(values).tolist())
    sim = simulate(build(run.schedule, replicas, run.microbatches), played)
    return FleetPlan(list(stage_of), replicas, devices, sim, costs, memory, source, gpus=gpus,
                     schedule=run.schedule)


def _with_engine(costs: PipelineCosts, kinds: Mapping[str, KindCosts], gpus: Sequence[str],
                 arrays: NodeArrays, stage_of: Sequence[int], sizes: Sequence[StageBytes],
                 schedule: str, per_stage: Callable[[Sequence[float]], list[float]]
                 ) -> tuple[PipelineCosts, PipelineCosts]:
    """A train plan's costs with each stage's input-gradient time (its kinds' larger, where
    every kind has them) and its engine's work on its own kinds
    (:class:`~onnx_partition.cost.engine_price.FleetEngine`, where every kind has
    :attr:`KindCosts.engine`), and the costs as simulated: each send plus its boundary's work
    per hop (plan.json's sends are the links', as price_engine adds that after)."""
    on = [gpu.split("+") for gpu in gpus]
    stages = list(costs.stages)
    if all(len(kinds[k].backward_input_ms) for ks in on for k in ks):
        grad = {k: per_stage(kinds[k].backward_input_ms) for ks in on for k in ks}
        stages = [replace(c, backward_input_ms=max(grad[k][i] for k in ks))
                  for i, (c, ks) in enumerate(zip(stages, on))]
    terms = [[kinds[k].engine for k in ks] for ks in on]
    if not all(t is not None for ts in terms for t in ts):
        priced = replace(costs, stages=stages)
        return priced, priced
    s = len(stages)
    tied, tensors = (arrays.stage_engine(stage_of, s) if arrays.counted  # as totals_costs
                     else (None, None))
    work = FleetEngine.of(terms, [size.params for size in sizes],  # type: ignore[arg-type]
                          tied=None if tied is None else tied.tolist(),
                          tensors=None if tensors is None or not len(arrays.trainable_tensors)
                          else [int(n) for n in tensors], split=schedule == "zb-h1")
    stages = [replace(c, step_ms=work.step_ms[i], accumulate_ms=work.accumulate_ms[i],
                      split_ms=work.split_ms[i], action_ms=work.action_ms[i])
              for i, c in enumerate(stages)]
    priced = replace(costs, stages=stages)
    return priced, replace(priced, send_ms=[x + h for x, h in zip(costs.send_ms,
                                                                  work.hop_ms)])


# --------------------------------------------------------------------------- the planner


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
                        *_counted(arrays, blocks))
    return seq, blocks


def _counted(arrays: NodeArrays, blocks: Blocks
             ) -> tuple[list[float], list[float], float, list[tuple[float, float, list[int]]]]:
    """The one count's arrays over ``blocks`` (empty where ``arrays`` do not carry it)."""
    if not arrays.counted:
        return [], [], 0.0, []
    return (blocks.sums(arrays.weight_bytes), blocks.sums(arrays.trainable_bytes),
            arrays.input_bytes, arrays.shared_in(blocks))


def kind_problem(problem: DagProblem, arrays: NodeArrays, costs: KindCosts
                 ) -> tuple[DagProblem, NodeArrays]:
    """The problem and node arrays priced on one kind (for the one-kind planner)."""
    return (problem.reweighted(costs.forward_ms, problem.nbytes),
            replace(arrays, backward_ms=list(costs.backward_ms),
                    backward_input_ms=list(costs.backward_input_ms)))


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
    from onnx_partition.solve.planner import plan_cluster

    runs = [replace(run, train_schedule=name) for name in (schedules or [run.train_schedule])
            ] if run.train else [run]
    work = {gpu: float(sum(c.forward_ms) + (sum(c.backward_ms) if run.train else 0.0))
            for gpu, c in kinds.items()}
    speed = [1.0 / max(work[g.gpu], 1e-12) for g in fleet.groups]
    candidates: list[FleetPlan] = []
    families: dict[str, dict[str, float]] = {}

    def weigh(plan: FleetPlan | None, family: str) -> None:
        if plan is not None:
            candidates.append(plan)
            done = families.get(family, {}).get("iteration_ms", math.inf)
            families[family] = {"iteration_ms": round(min(done, plan.sim.iteration_ms), 6)}

    helds = [None, (lambda r: 1)] if run.train else [None]
    dp_plans: list[tuple[FleetPlan, list[int], RunSpec]] = []  # with each stage's group
    sequences: dict[tuple[int, ...], str] = {}  # an ordering equal to an earlier one adds nothing
    for name in orderings:
        sequences.setdefault(tuple(sequence_for(problem, name)), name)
    for order, name in sequences.items():
        seq, blocks = _sequence(problem, arrays, kinds, fleet, order)
        for ordering in group_orderings(fleet, speed):
            for stages in (s for held in helds for s in _dp_plans(seq, fleet, run, ordering,
                                                                  held, num_stages)):
                stage_of = assign(order, blocks.expand([s[0] for s in stages] + [seq.n]))
                groups = [s[2] for s in stages]
                placed = place_on_groups(fleet, groups, [s[3] for s in stages])
                for each in runs:
                    scored = score_fleet(problem, arrays, kinds, fleet, each, stage_of, placed,
                                         f"fleet:{name}")
                    weigh(scored, f"fleet:{name}")
                    if scored is not None:
                        dp_plans.append((scored, groups, each))
    # the best DP plan's replica counts, hill-climbed on the simulated iteration itself
    if dp_plans:
        plan, groups, each = min(dp_plans, key=lambda e: e[0].sim.iteration_ms)
        weigh(polish_fleet(problem, arrays, kinds, fleet, each, plan, groups), plan.source)
    for each in runs:
        if alone:
            for g, group in enumerate(fleet.groups):
                sub_problem, sub_arrays = kind_problem(problem, arrays, kinds[group.gpu])
                sub_run = replace(each, cluster=group.cluster(fleet.inter),
                                  engine=kinds[group.gpu].engine)
                try:
                    alone_plan, _ = plan_cluster(sub_problem, sub_arrays, sub_run,
                                                 num_stages=num_stages)
                except PartitionError:
                    continue
                placed = place_on_groups(fleet, [g] * alone_plan.num_stages,
                                         alone_plan.replicas)
                weigh(score_fleet(problem, arrays, kinds, fleet, each, alone_plan.stage_of,
                                  placed, f"alone:{group.gpu}"), f"alone:{group.gpu}")
        if slowest:
            _weigh_slowest(problem, arrays, kinds, fleet, each, weigh, families, num_stages)
    if not candidates:
        under = f" under {' or '.join(r.schedule for r in runs)}" if run.train else ""
        if num_stages is not None:
            raise PartitionError(f"no {num_stages}-stage plan fits the fleet{under}: too few "
                                 "positions or devices, or a stage over its group's memory")
        raise PartitionError(f"no plan fits the fleet's memory{under}: no stage of the model "
                             "fits any group's devices")
    best = min(candidates, key=lambda p: p.sim.iteration_ms)
    return best, families


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


# --------------------------------------------------------------------------- baselines


def slowest_costs(kinds: Mapping[str, KindCosts]) -> KindCosts:
    """Every node at its slowest kind's times (node by node: the slowest GPU where one GPU is
    slower at everything, as a V100 beside an A100), with the engine of the kind of most
    work."""
    table = list(kinds.values())
    slowest = max(table, key=lambda c: float(sum(c.forward_ms) + sum(c.backward_ms)))
    return KindCosts([max(c.forward_ms[v] for c in table) for v in
                      range(len(table[0].forward_ms))],
                     [max(c.backward_ms[v] for c in table) for v in
                      range(len(table[0].backward_ms))],
                     slowest.engine,  # the engine of the kind of most work
                     [max(c.backward_input_ms[v] for c in table) for v in
                      range(len(table[0].backward_input_ms))]
                     if all(len(c.backward_input_ms) for c in table) else [])


def slowest_cluster(fleet: Fleet) -> Cluster:
    """Every device of ``fleet`` as the slowest kind in one cluster: the least memory, the
    slowest machine link, the fleet's ``inter`` link, and the fleet's machines when every group
    has as many devices per machine (else each device a machine of its own: what cluster@1
    can state without claiming a link the fleet lacks)."""
    per = {g.devices_per_machine for g in fleet.groups}
    slow = min((g.intra for g in fleet.groups),
               key=lambda link: (link.bytes_per_ms, -link.latency_ms))
    worst = Link(slow.bandwidth_gbps, max(g.intra.latency_ms for g in fleet.groups))
    shape = ((sum(g.machines for g in fleet.groups), per.pop()) if len(per) == 1
             else (fleet.devices, 1))
    return Cluster(machines=shape[0], devices_per_machine=shape[1],
                   memory_gb=min(g.memory for g in fleet.groups), kind="cuda",
                   intra=worst, inter=fleet.inter)


def as_slowest(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
               fleet: Fleet, run: RunSpec, num_stages: int | None = None
               ) -> tuple[HybridPlan, Cluster]:
    """Baseline: the one-kind planner's plan with every device treated as the slowest kind
    (:func:`slowest_costs` on :func:`slowest_cluster`), as a cluster@1 of the slowest GPU
    would be planned (``num_stages`` deep where given); its ``sim`` is that plan's time
    there."""
    from onnx_partition.solve.planner import plan_cluster

    cluster = slowest_cluster(fleet)
    sub_problem, sub_arrays = kind_problem(problem, arrays, slowest_costs(kinds))
    plan, _ = plan_cluster(sub_problem, sub_arrays, replace(run, cluster=cluster,
                                                            engine=slowest_costs(kinds).engine),
                           num_stages=num_stages)
    return plan, cluster


def fastest_alone(problem: DagProblem, arrays: NodeArrays, kinds: Mapping[str, KindCosts],
                  fleet: Fleet, run: RunSpec) -> HybridPlan:
    """Baseline: the one-kind planner on the fastest group alone (least work per device
    times its devices, i.e. the group of most compute)."""
    from onnx_partition.solve.planner import plan_cluster

    def work(g: int) -> float:
        c = kinds[fleet.groups[g].gpu]
        total = sum(c.forward_ms) + (sum(c.backward_ms) if run.train else 0.0)
        return float(total) / fleet.groups[g].devices

    g = min(range(len(fleet.groups)), key=work)
    gpu = fleet.groups[g].gpu
    sub_problem, sub_arrays = kind_problem(problem, arrays, kinds[gpu])
    plan, _ = plan_cluster(sub_problem, sub_arrays, replace(
        run, cluster=fleet.groups[g].cluster(fleet.inter), engine=kinds[gpu].engine))
    return plan
