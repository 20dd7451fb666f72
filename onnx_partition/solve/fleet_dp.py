"""The fleet DP: the least bottleneck period over the splits of a sequence into stages on groups
of different GPUs, visited in one ordering (:mod:`.fleet` chooses among the plans).

Per ordering ``o`` of the groups, over a sequence of ``n`` positions (narrow-point blocks) with
per-group costs, :func:`fleet_dp` minimises the bottleneck period (the hybrid DP's objective,
:mod:`.hybrid`, PipeDream's replicated-stage model)::

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
never below 1F1B's, or 1 for an optimistic pass checked afterwards; under ZB-H1 also the
gradients kept from ``I`` to ``W`` of as many, ``+ held * K``, a bound as ``held`` is:
ZB-H1 keeps at most the micro-batches it holds, ``pipeline.memory.kept_held``) exceeds its
group's memory is out. In training a stage may instead recompute (``--recompute``: keep only
its inputs per micro-batch in flight and one micro-batch's activations, under ZB-H1 those of
each micro-batch whose gradients it keeps, ``F_t`` once more); under ``auto`` it
does exactly where keeping does not fit, as the one-kind DP chooses it per stage (AdaPipe, Sun
et al., ASPLOS'24): ``held`` depends on ``r`` alone, so ``P_t`` is the keep period where that
fits, else the recompute period where that fits, else infinite, a pointwise choice per ``(t,
i, j, r)`` (keeping is never slower) and the recurrence is unchanged. Exact for that objective
over every split of the sequence, every replica count ``1..min(D_t, M)`` on group ``t``, group
assignment along the ordering and (``auto``) each stage's keep-or-recompute
(``tests/test_fleet.py`` checks it against brute force); ``O(|orders| n^2 D R)`` with the ``j``
loop in numpy. A fixed depth ``S`` (``partition --stages``) adds the stages left to place to
every table, ``A[t, i, u, q]`` (a stage at ``q`` leads to the suffix at ``q - 1``; only ``q =
0`` is 0 at ``n``): ``S`` times the work.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_partition.cost.cluster import Fleet, Link
from onnx_partition.pipeline.memory import (
    StageBytes,
    check_recompute,
    optimizer_state,
    ring_allreduce_ms,
    stage_working,
    stash_bytes,
    static_bytes,
    working_term,
)
from onnx_partition.solve.hybrid_model import replica_choices, shared_spans
from onnx_partition.solve.hybrid_tables import working_table
from onnx_partition.solve.scoring import RunSpec

__all__ = ["ALL_ORDERINGS", "FleetSequence", "FleetStage", "fleet_dp", "group_orderings",
           "stage_period", "zb_memory"]

#: Every ordering of up to this many groups is tried; more: file order, fastest and slowest
#: first.
ALL_ORDERINGS = 4


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
    #: ZB-H1's output-gradient bytes kept per micro-batch from ``I`` to ``W`` (empty: none)
    kept_bytes: Sequence[float] = ()
    #: the most gradient bytes live in one op's backward per position (empty: none)
    working_bytes: Sequence[float] = ()

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

    def kept(self) -> np.ndarray:
        """ZB-H1's kept bytes of every stage ``[i, j)`` per micro-batch: none in a stage
        starting at 0 (it receives no activation: its whole backward runs in ``W``)."""
        table = _span(self.kept_bytes) if len(self.kept_bytes) else np.zeros((self.n + 1,
                                                                              self.n + 1))
        table[0, :] = 0.0
        return table

    def working(self, schedule: str) -> np.ndarray:
        """The backward's working set every stage ``[i, j)`` adds to its static bytes under
        ``schedule``: the largest of its positions' (a range maximum), 0 in inference
        (:func:`~onnx_partition.pipeline.memory.working_term`)."""
        widest = working_table(self.working_bytes if schedule != "infer" else (), self.n)
        return np.asarray(working_term(widest, schedule))

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
    memory per device (``held(r)`` micro-batches in flight; under ZB-H1, ``run.schedule``,
    the gradients of as many kept: :func:`zb_memory`; in training the backward's working set,
    its positions' largest) exceeds the group's. In training a
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
    kept = float(sum(seq.kept_bytes[i:j])) if i > 0 and len(seq.kept_bytes) else 0.0
    widest = float(max(seq.working_bytes[i:j])) if run.train and len(seq.working_bytes) else 0.0
    size = StageBytes(weights, float(sum(seq.activation_bytes[i:j])),
                      float(seq.input_bytes if i == 0 else seq.cut_bytes[i]),
                      float(seq.cut_bytes[j]) if run.train else 0.0, trained, kept, widest)
    count = held(r) if held is not None else _held_safe(run)(r)
    static = static_bytes(size, train=run.train, optimizer_factor=run.optimizer_factor,
                          replicas=r, shard=run.shard) + stage_working(size, run.schedule)
    zb = run.train and run.schedule == "zb-h1"
    for flag in flags:
        rebuilt = flag and run.train
        memory = zb_memory(static, stash_bytes(size, rebuilt), size.activations, kept, count,
                           rebuilt=rebuilt, zb=zb)
        if memory <= g.memory * 1e9:
            return ((compute + (forward if rebuilt else 0.0) + comm) / r
                    + allreduce / run.microbatches)
    return math.inf


def zb_memory(static: Any, stash: Any, activations: Any, kept: Any, held: int, *,
              rebuilt: Any, zb: bool) -> Any:
    """A stage's memory per device with ``held`` micro-batches in flight (``stash``: what each
    holds, only the inputs where ``rebuilt``): the one memory model's ``static + held * stash``,
    a recomputing stage also holding one micro-batch's ``activations`` rebuilt; under ZB-H1
    (``zb``) it keeps the gradients of ``held`` micro-batches (``kept`` bytes each, the bound
    of ``pipeline.memory.kept_held``, at most ``held``) and a recomputing one holds as many
    rebuilt. Arrays or numbers (``rebuilt`` a mask)."""
    rebuilt_count = held if zb else 1
    return (static + held * stash + np.where(rebuilt, rebuilt_count * activations, 0.0)
            + (held * kept if zb else 0.0))


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
    tables = _FleetTables(seq, fleet, run, ordering, held or _held_safe(run), mode, depth)
    for i in range(seq.n - 1, -1, -1):
        for t in range(len(ordering) - 1, -1, -1):
            tables.place(i, t)
    return tables.backtrack()


class _FleetTables:
    """The DP's tables over one ordering, filled from the sequence's end (:meth:`place`) and
    read back from its start (:meth:`backtrack`).

    ``A[t][q, i, u]`` (per position ``t`` of the ordering, group ``ordering[t]``): the least
    bottleneck of the suffix ``[i, n)`` whose first stage is on that group with ``u`` of its
    devices taken by earlier stages, at slot ``q``: any depth (one slot, ``q = 0``), or
    exactly ``q`` stages from ``i`` on; slot ``slots`` stays inf (what ``q = 0`` leads to
    before the end); ``prev[q]``: the slot of the suffix after a stage placed at slot ``q``.
    ``N[q, t, j]``: the best of ``A[t'][q, j, 0]`` over ``t' >= t`` (groups may be skipped).
    The choice reaching ``A[t][q, i, u]``: next boundary ``ch_j``, replicas ``ch_r``, whether
    the next stage is on group ``t`` (``ch_same``), whether the stage recomputes (``ch_rc``).
    """

    def __init__(self, seq: FleetSequence, fleet: Fleet, run: RunSpec, ordering: Sequence[int],
                 held: Callable[[int], int], mode: str, depth: int | None) -> None:
        self.fleet, self.run, self.ordering = fleet, run, ordering
        self.held, self.mode = held, mode
        n, m = seq.n, run.microbatches
        self.n, self.m = n, m
        self.cut = np.asarray(seq.cut_bytes, dtype=float)
        self.params, self.acts = _span(seq.param_bytes), _span(seq.activation_bytes)
        self.weights, self.trained = seq.weights()
        self.received = seq.received()
        self.kept = seq.kept()
        self.work = seq.working(run.schedule)  # the backward's working set, static's ``T``
        self.zb = run.train and run.schedule == "zb-h1"
        self.valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        self.factor = 2.0 if run.train else 1.0
        k = len(ordering)
        inf = math.inf
        # slot q of each table: any depth (one slot, q = 0), or exactly q stages from i on; slot
        # ``slots`` stays inf (what q = 0 leads to before the end); prev[q]: the slot of the
        # suffix after a stage placed at slot q
        self.slots = slots = 1 if depth is None else depth + 1
        self.prev = [0] if depth is None else [slots, *range(slots - 1)]
        # A[t][q, i, u]; the choice reaching it: next boundary j, replicas r, next stage on
        # group t, whether the stage recomputes
        self.A = A = [np.full((slots + 1, n + 1, fleet.groups[g].devices + 1), inf)
                      for g in ordering]
        self.ch_j = ch_j = [np.zeros(a.shape, dtype=np.int64) for a in A]
        self.ch_r = [np.zeros_like(c) for c in ch_j]
        self.ch_same = [np.zeros(c.shape, dtype=bool) for c in ch_j]
        self.ch_rc = [np.zeros(c.shape, dtype=bool) for c in ch_j]
        self.N = np.full((slots + 1, k + 1, n + 1), inf)
        self.N[0, :, n] = 0.0
        for t in range(k):
            A[t][0, n, :] = 0.0
        self.forwards = {g: _span(seq.forward_ms[g]) for g in set(ordering)}
        self.spans = {g: self.forwards[g] + (_span(seq.backward_ms[g]) if run.train else 0.0)
                      for g in set(ordering)}

    def side(self, link: Link) -> np.ndarray:
        """Cost of a boundary at this link, ends free."""
        cut, n = self.cut, self.n
        ms = np.where(cut > 0, cut / link.bytes_per_ms + link.latency_ms, 0.0)
        ms[0] = ms[n] = 0.0
        return np.asarray(ms)

    def place(self, i: int, t: int) -> None:
        """``A[t][:, i, :]`` and ``N[:, t, i]``: the best first stage ``[i, j)`` on group
        ``ordering[t]`` for each slot and each count of its devices already used, over every
        end ``j`` and replica count ``r``, the next stage on the same group or a later one
        (vectorised over ``j`` and ``u``)."""
        n, m, run, fleet, ordering = self.n, self.m, self.run, self.fleet, self.ordering
        cut, params, acts, received = self.cut, self.params, self.acts, self.received
        weights, trained, valid, factor = self.weights, self.trained, self.valid, self.factor
        held, mode, forwards, spans = self.held, self.mode, self.forwards, self.spans
        slots, prev, A, N, inf = self.slots, self.prev, self.A, self.N, math.inf
        ch_j, ch_r, ch_same, ch_rc = self.ch_j, self.ch_r, self.ch_same, self.ch_rc
        side = self.side
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
        static = static + self.work[i]
        limit = group.memory * 1e9
        state = params[i] if trained is None else trained[i]  # what has optimizer state
        full = optimizer_state(state, run.optimizer_factor)
        d = group.devices
        best = np.full((slots, d), inf)  # per q and u in 0..d-1, vectorised over u and j
        for r in replica_choices(min(d, max(m, 1))):  # no replica without a micro-batch
            us = np.arange(d - r + 1)  # devices already used, u + r <= d
            own_static = (static - full + optimizer_state(  # its own shard (ZeRO-1)
                state, run.optimizer_factor, r, run.shard) if run.train else static)
            # keeping, else (modes auto, all) recomputing: inputs per micro-batch in
            # flight and one micro-batch's activations, its forward once more
            keeps = (valid[i] & (zb_memory(own_static, stash, acts[i], self.kept[i], held(r),
                                           rebuilt=False, zb=self.zb) <= limit)
                     if mode != "all" else np.zeros(n + 1, dtype=bool))
            rebuilt = (~keeps & valid[i] & (zb_memory(own_static, received[i], acts[i],
                                                      self.kept[i], held(r), rebuilt=True,
                                                      zb=self.zb) <= limit)
                       if mode != "none" else np.zeros(n + 1, dtype=bool))
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

    def backtrack(self) -> tuple[float, list[FleetStage]]:
        """The least bottleneck and its stages ``(start, end, group, replicas, recomputes)``,
        read from the start; ``(inf, [])`` when nothing fits."""
        n, ordering, slots, prev, A, N = (self.n, self.ordering, self.slots, self.prev, self.A,
                                          self.N)
        ch_j, ch_r, ch_same, ch_rc = self.ch_j, self.ch_r, self.ch_same, self.ch_rc
        q = slots - 1  # any depth, or all ``depth`` stages left
        if not math.isfinite(N[q, 0, 0]):
            return math.inf, []
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

