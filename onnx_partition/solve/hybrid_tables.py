"""Every stage of the hybrid DP priced at once: (start, end) matrices over the sequence.

:class:`StageTables` holds, for every stage ``[i, j)`` of the sequence (``(n + 1) x (n + 1)``
matrices, invalid pairs infinite), its compute and transfer times, its memory as ``static +
held * stash`` (the one memory model, :mod:`onnx_partition.pipeline.memory`; under ZB-H1 ``+ kept *
per_kept``, :meth:`StageTables.kept_tables`), and its period on
each replica count the DP tries (``period[c, i, j]``: every one up to ``min(D, M)`` where memory
binds, else :func:`~.hybrid_model.dominant_counts`), keeping or
recomputing; :func:`held_caps` the micro-batches each stage may hold within a memory. The DPs
over them: :mod:`.hybrid_dp`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from onnx_partition.pipeline.memory import (
    StageBytes,
    check_recompute,
    device_bytes,
    memory_per_device,
    optimizer_state,
    recompute_choice,
    ring_allreduce_ms,
    working_term,
)
from onnx_partition.solve.hybrid_model import (
    DP_SCHEDULES,
    HybridConfig,
    HybridStage,
    SequenceCosts,
    dominant_counts,
    recompute_stage,
    replica_choices,
    shared_spans,
    stage_period,
)

__all__ = ["COUNT_DTYPE", "EXACT_CELLS", "MAX_DEVICES", "NO_COUNT", "StageTables", "exact_cells",
           "held_caps", "kept_table", "working_table"]

COUNT_DTYPE = np.int32  # device counts in the DP's tables (int16 stopped at 15,999 devices)
NO_COUNT = 1 << 20  # "no replica count meets the period": more than any device count; twice fits
MAX_DEVICES = NO_COUNT - 1
#: The exact DP (:func:`~.hybrid_dp.exact_fewest`) runs where its largest table, states (replica
#: counts x warm-ups ``0..M``) x positions x (depths or counts), has at most this many cells
#: (int32: 64 MB); beyond, the DP is bounded (:attr:`StageTables.exact` False): its plans fit,
#: and a relaxation bounds how far from the least period they may be.
EXACT_CELLS = 1 << 24


def exact_cells(n: int, config: HybridConfig) -> int:
    """Cells of the exact DP's largest table on ``n`` positions: ``h`` (depths x positions x
    states) or the warm-up gather (states x counts x positions), every count ``1..min(D, M)``
    and warm-up ``0..M``."""
    m = max(config.microbatches, 1)
    counts = min(config.devices, m)
    depths = min(config.depth or config.max_stages, config.devices, n) + 1
    return counts * (m + 1) * (n + 1) * max(depths, counts)


def _span(values: Sequence[float]) -> np.ndarray:
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float))])
    return prefix[None, :] - prefix[:, None]  # [i, j] = sum over [i, j)


def working_table(working_bytes: Sequence[float], n: int) -> np.ndarray:
    """``T[i, j]``: the backward's working set of stage ``[i, j)``
    (:attr:`~onnx_partition.pipeline.memory.StageBytes.working`): the largest of its
    positions' ``working_bytes`` (a range maximum, one running maximum per start), 0 where
    none are given or the stage is empty."""
    table = np.zeros((n + 1, n + 1))
    if not len(working_bytes):
        return table
    values = np.asarray(working_bytes, dtype=float)
    for i in range(n):
        table[i, i + 1:] = np.maximum.accumulate(values[i:])
    return table


def kept_table(kept_bytes: Sequence[float], n: int) -> np.ndarray:
    """``K[i, j]``: the output-gradient bytes stage ``[i, j)`` keeps per micro-batch from ``I``
    to ``W`` under ZB-H1 (:attr:`~onnx_partition.pipeline.memory.StageBytes.kept`): the sum of
    its positions' ``kept_bytes``, 0 for a stage starting at 0 (it receives no activation and
    runs its whole backward in ``W``) and where none are given."""
    if not len(kept_bytes):
        return np.zeros((n + 1, n + 1))
    table = _span(kept_bytes)
    table[0, :] = 0.0
    return table


class StageTables:
    """Every stage's costs as (n + 1) x (n + 1) matrices over (start, end); invalid pairs inf."""

    def __init__(self, costs: SequenceCosts, config: HybridConfig) -> None:
        n = len(costs.forward_ms)
        self.n, self.c = n, config
        if config.train and config.train_schedule not in DP_SCHEDULES:
            raise ValueError(f"the hybrid DP counts the memory of {', '.join(DP_SCHEDULES)}, "
                             f"not {config.train_schedule!r}")
        #: ZB-H1's memory (training): held from stage 0's window, the kept gradients too
        self.zb = config.train and config.train_schedule == "zb-h1"
        self._price_times(costs, config)
        self._price_memory(costs, config)
        check_recompute(config.recompute)
        self._price_recomputing(costs, config)
        #: memory does not depend on the plan: inference, or no stage could overflow even with
        #: every micro-batch in flight (then the one-suffix DP is exact, over dominant counts)
        held_most = config.microbatches if config.train else 1
        base, stash, per_kept = self.kept_tables(self.mode == "all")
        self.memory_free = not config.train or bool(  # kept <= held <= M
            np.all(base + held_most * (stash + per_kept) <= config.memory_bytes))
        self._find_risky(config)
        self._price_periods(config)

    def _price_times(self, costs: SequenceCosts, config: HybridConfig) -> None:
        """``compute`` and ``comm`` of every stage: forward (and backward) at the device's
        speed, the transfers at both of its boundaries (twice in training)."""
        n = self.n
        cut = np.asarray(costs.cut_bytes, dtype=float) / config.link_bytes_per_ms
        cut = cut + config.link_latency_ms
        cut[0] = cut[n] = 0.0
        self.compute = _span(costs.forward_ms) / config.speed
        self.comm = cut[:, None] + cut[None, :]
        if config.train:
            self.compute = self.compute + _span(costs.backward_ms) / config.speed
            self.comm = 2.0 * self.comm

    def _price_memory(self, costs: SequenceCosts, config: HybridConfig) -> None:
        """Every stage's bytes: ``static`` (weights, and in training gradients, optimizer state
        and the outgoing boundary) and ``stash`` (activations and received inputs per
        micro-batch in flight)."""
        n = self.n
        self.params = _span(costs.param_bytes)  # all-reduced
        self.acts = _span(costs.activation_bytes)
        raw_cut = np.asarray(costs.cut_bytes, dtype=float)
        received = raw_cut.copy()
        received[0] = costs.input_bytes  # stage 0 holds the graph inputs
        self.received = np.broadcast_to(received[:, None], (n + 1, n + 1))  # at boundary i
        self.sent = np.broadcast_to(raw_cut[None, :], (n + 1, n + 1))  # at boundary j
        # memory = static + held * stash (pipeline.memory), as (start, end) matrices
        self.weights: np.ndarray | None = None
        self.trained: np.ndarray | None = None
        if len(costs.weight_bytes):
            self.weights, self.trained = _span(costs.weight_bytes), _span(costs.trainable_bytes)
            if costs.shared:
                held, held_trained = shared_spans(costs.shared, n)
                self.weights, self.trained = self.weights + held, self.trained + held_trained
            self.static = (self.weights + (config.optimizer_factor - 1.0) * self.trained
                           + self.sent if config.train else self.weights)
        else:
            self.static = (config.optimizer_factor * self.params + self.sent if config.train
                           else self.params)
        self.stash = self.acts + self.received
        self.kept = kept_table(costs.kept_bytes, n)  # ZB-H1's, per micro-batch kept
        #: the backward's working set, in training (static's ``T``, ZB-H1's beyond ``K``)
        self.working = working_table(costs.working_bytes if config.train else (), n)
        self.static = self.static + working_term(self.working, self.schedule)
        #: the bytes with optimizer state (its ``1 / r`` on each of ``r`` replicas under
        #: ``shard`` optimizer: :meth:`shed`)
        self.stateful = self.params if self.trained is None else self.trained

    def _price_recomputing(self, costs: SequenceCosts, config: HybridConfig) -> None:
        """The same stages recomputing (``rebuilt``, training); under ``all`` they replace the
        keeping ones."""
        #: the stages' own tables keeping their activations, and recomputing (training)
        self.keep = (self.compute, self.static, self.stash)
        self.forward = _span(costs.forward_ms) / config.speed
        self.rebuilt = recompute_stage(self.compute, self.forward, self.static, self.acts,
                                       self.received) if config.train else self.keep
        self.mode = config.recompute if config.train else "none"
        if self.mode == "all":
            self.compute, self.static, self.stash = self.rebuilt

    def kept_tables(self, rebuilt: bool = False) -> tuple[Any, Any, Any]:
        """``(base, stash, per_kept)`` of every stage: its memory is ``base + held * stash +
        kept * per_kept`` (:func:`~onnx_partition.pipeline.memory.memory_per_device`). Under
        ZB-H1 a keeping stage adds the gradients it keeps, ``K``; a recomputing one holds the
        ``kept`` micro-batches between an ``I`` and its ``W`` rebuilt, ``A + K`` each, and only
        its inputs per micro-batch held (``base`` its static bytes without the one ``A`` of
        1F1B's rebuilt table). Under 1F1B ``kept`` is 0 and these are the tables' own."""
        keep_static, keep_stash = self.keep[1], self.keep[2]
        if not self.zb:
            tables = self.rebuilt if rebuilt else self.keep
            return tables[1], tables[2], np.zeros_like(self.kept)
        if rebuilt:
            return keep_static, np.asarray(self.received, dtype=float), self.acts + self.kept
        return keep_static, keep_stash, self.kept

    def _find_risky(self, config: HybridConfig) -> None:
        """The stages that could overflow at all, flat indices (``risky``), and how many
        micro-batches each may hold (``risky_cap``)."""
        n = self.n
        # cap[i, j]: the most micro-batches in flight stage [i, j) may hold within memory
        # (ZB-H1: as many kept, a bound: kept <= held)
        base, stash, per_kept = self.kept_tables(self.mode == "all")
        stash = stash + per_kept
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            room = config.memory_bytes - base
            cap = np.where(stash > 0, room / stash,
                           np.where(room >= 0, np.inf, -np.inf))
        # float32 rounded down: the DP never counts a stage as fitting that does not
        # the stages that could overflow at all (all M micro-batches in flight), flat indices
        valid_ij = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        held_most = config.microbatches if config.train else 1
        self.risky = np.flatnonzero(valid_ij & (cap < held_most))
        # held <= cap iff held <= floor(cap) (held is whole): small integers stream faster
        self.risky_cap = np.clip(np.floor(cap.reshape(-1)[self.risky]), -1,
                                 held_most).astype(COUNT_DTYPE)

    def _price_periods(self, config: HybridConfig) -> None:
        """Every stage's latency, and its period on each replica count (keeping, and under
        ``auto`` recomputing), with the period each count reaches at most (``needed``)."""
        n = self.n
        valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
        self.latency = np.where(valid, self.compute + self.comm, np.inf)
        # every count up to min(D, M) where memory binds (more replicas in front of a suffix
        # can lower a stage's micro-batches in flight) and the exact DP is small enough; else
        # the dominant ones (exact where memory is free; the bounded DP's, else)
        #: whether the exact DP runs (memory free, or its tables within EXACT_CELLS)
        self.exact = self.memory_free or exact_cells(n, config) <= EXACT_CELLS
        self.choices = (dominant_counts(config) if self.memory_free or not self.exact else
                        replica_choices(min(config.devices, max(config.microbatches, 1))))
        # period[c, i, j]: stage [i, j) on choices[c] replicas
        self.period = np.stack([stage_period(self.latency, r, self.allreduce(r),
                                             config.microbatches) for r in self.choices])
        # needed[c, i, j]: the period [i, j) reaches on at most choices[c] replicas; it falls
        # with c, so the replicas a period tau needs are choices[#{c : needed[c] > tau}].
        # Held in float32 rounded down (never says a period is out of reach when it is not)
        # and device counts in int32 (int16 was no faster, measured, and stopped at 15,999).
        needed = np.minimum.accumulate(self.period, axis=0)
        narrow = needed.astype(np.float32)
        self.needed = np.where(narrow > needed, np.nextafter(narrow, np.float32(-np.inf)),
                               narrow)
        self.lookup = np.asarray([*self.choices, NO_COUNT], dtype=COUNT_DTYPE)
        # auto: period_rc[c, i, j], the same stage recomputing (one more forward)
        self.period_rc: np.ndarray | None = None
        if self.mode == "auto":
            latency_rc = np.where(valid, self.rebuilt[0] + self.comm, np.inf)
            self.period_rc = np.stack([stage_period(latency_rc, r, self.allreduce(r),
                                                    config.microbatches)
                                       for r in self.choices])

    def relaxed_fits(self) -> np.ndarray:
        """fits[i, j]: stage ``[i, j)`` fits holding one micro-batch on ``min(D, M)`` replicas
        (the most optimizer state shed), keeping or (``auto``) recomputing. Every stage of a
        plan within memory passes (it holds at least one, on at most that many replicas): a
        relaxation whose memory does not depend on the plan, so over the dominant counts its
        one-suffix DP bounds the fewest devices of every plan from below."""
        c = self.c
        shed = self.shed(min(c.devices, max(c.microbatches, 1)))
        ways = [self.mode == "all"] + [True] * (self.mode == "auto")
        fits = np.zeros(self.static.shape, dtype=bool)
        for rebuilt in ways:  # ZB-H1 keeps one micro-batch's gradients at least (kept >= 1)
            base, stash, per_kept = self.kept_tables(rebuilt)
            fits |= np.asarray(base - shed + stash + self.zb * per_kept <= c.memory_bytes)
        return fits

    def allreduce(self, r: int, params: Any = None) -> Any:
        """Ring all-reduce time of every stage's gradients (or of ``params`` bytes) among
        ``r`` replicas, once per iteration (training only)."""
        c = self.c
        params = self.params if params is None else params
        if not c.train:
            return params * 0.0
        bw = c.group_bytes_per_ms[r] if c.group_bytes_per_ms else c.link_bytes_per_ms
        lat = c.group_latency_ms[r] if c.group_latency_ms else c.link_latency_ms
        return ring_allreduce_ms(params, r, bw, lat)

    def shed(self, r: int) -> np.ndarray | float:
        """Bytes of ``static`` a replica of ``r`` does not hold: the other replicas' shards of
        the optimizer state (``shard`` optimizer; 0 otherwise), every stage at once."""
        c = self.c
        if not c.train or c.shard == "none" or r <= 1:
            return 0.0
        return (optimizer_state(self.stateful, c.optimizer_factor)
                - optimizer_state(self.stateful, c.optimizer_factor, r, c.shard))

    def memory(self, q: int) -> np.ndarray:
        """Bytes per device of every stage placed ``q``-th from the end of a pipeline of single
        replicas (1F1B holds ``min(q, M)`` micro-batches there): the least-memory report."""
        held = min(q, self.c.microbatches) if self.c.train else 1
        return device_bytes(self.static, self.stash, held)

    def stage(self, i: int, j: int, r: int, recompute: bool | None = None) -> HybridStage:
        """Stage ``[i, j)`` on ``r`` replicas, recomputing or not (None: as the mode says,
        ``all`` or not); its memory is set by :meth:`with_memory`."""
        c = self.c
        flag = self.mode == "all" if recompute is None else recompute and self.mode != "none"
        allreduce = float(self.allreduce(r, float(self.params[i, j])))
        compute = float((self.rebuilt if flag else self.keep)[0][i, j])
        comm = float(self.comm[i, j])
        latency = compute + comm if i < j else math.inf
        return HybridStage(i, j, r, latency, compute, comm, allreduce, math.nan,
                           stage_period(latency, r, allreduce, c.microbatches), flag)

    @property
    def schedule(self) -> str:
        """The schedule whose memory the tables count: ``config.train_schedule`` in training."""
        return self.c.train_schedule if self.c.train else "infer"

    def with_memory(self, stages: list[HybridStage]) -> list[HybridStage]:
        """The stages with their exact memory per device (:func:`memory_per_device`), each
        recomputing as its flag says."""
        memory = memory_per_device(self.sizes(stages), [s.replicas for s in stages],
                                   self.c.microbatches,
                                   schedule=self.schedule,
                                   optimizer_factor=self.c.optimizer_factor,
                                   recompute=[s.recompute for s in stages], shard=self.c.shard)
        return [replace(s, memory_bytes=m) for s, m in zip(stages, memory, strict=True)]

    def sizes(self, stages: Sequence[HybridStage]) -> list[StageBytes]:
        """The stages' bytes for :mod:`~onnx_partition.pipeline.memory`."""
        weights = self.params if self.weights is None else self.weights
        return [StageBytes(float(weights[s.start, s.end]), float(self.acts[s.start, s.end]),
                           float(self.received[s.start, s.end]), float(self.sent[s.start, s.end]),
                           None if self.trained is None else float(self.trained[s.start, s.end]),
                           float(self.kept[s.start, s.end]), float(self.working[s.start, s.end]))
                for s in stages]

    def widen(self, stages: list[HybridStage], devices: int) -> list[HybridStage]:
        """Give devices the DP left unused to the slowest stages, while that helps."""
        stages = list(stages)
        spare = devices - sum(s.replicas for s in stages)
        while spare > 0:
            k = max(range(len(stages)), key=lambda x: stages[x].period_ms)
            slow = stages[k]
            more = [r for r in self.choices if slow.replicas < r <= slow.replicas + spare]
            if not more:
                break
            wider = self.stage(slow.start, slow.end, more[-1], slow.recompute)
            if wider.period_ms >= slow.period_ms:
                break
            spare -= wider.replicas - slow.replicas
            stages[k] = wider
        return self.decide(stages)  # the warm-ups moved

    def decide(self, stages: list[HybridStage]) -> list[HybridStage]:
        """The stages with their memory, each (``auto``) recomputing exactly where it is over
        the memory keeping and within it recomputing
        (:func:`~onnx_partition.pipeline.memory.recompute_choice`)."""
        if self.mode == "auto":
            flags = recompute_choice(self.sizes(stages), [s.replicas for s in stages],
                                     self.c.microbatches, schedule=self.schedule,
                                     memory_bytes=self.c.memory_bytes,
                                     optimizer_factor=self.c.optimizer_factor,
                                     shard=self.c.shard)
            stages = [s if s.recompute == f else self.stage(s.start, s.end, s.replicas, f)
                      for s, f in zip(stages, flags, strict=True)]
        return self.with_memory(stages)


def held_caps(tables: StageTables, memory: float, rebuilt: bool = False) -> np.ndarray:
    """capi[i, j]: the most micro-batches stage ``[i, j)`` may hold within ``memory`` per
    device (-1: not even its weights fit), at most ``M``; ``rebuilt``: recomputing. With the
    optimizer state sharded a stage's static bytes fall with its replicas: then
    ``capi[c, i, j]``, on ``choices[c]`` replicas."""
    _, static, stash = tables.rebuilt if rebuilt else (None, tables.static, tables.stash)
    if tables.c.train and tables.c.shard != "none":
        return np.stack([_caps(tables, memory, static - tables.shed(r), stash)
                         for r in tables.choices])
    return _caps(tables, memory, static, stash)


def _caps(tables: StageTables, memory: float, static: np.ndarray, stash: np.ndarray
          ) -> np.ndarray:
    """:func:`held_caps` of one table of static bytes."""
    m = tables.c.microbatches
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        room = memory - static
        cap = np.where(stash > 0, room / np.where(stash > 0, stash, 1.0),
                       np.where(room >= 0, m, -1.0))
    cap = np.where(room < 0, -1.0, cap)
    return np.clip(np.floor(cap), -1, m).astype(np.int32)
