"""The hybrid DP for one bound ``tau`` on the stage period: the fewest devices per suffix and
depth whose every stage's period is at most ``tau`` and within memory.

Two DPs over :class:`~.hybrid_tables.StageTables`: :func:`fewest_devices`, one suffix per
device count (``h[q, i]``; exact where a stage's memory does not depend on the plan), and
:func:`exact_fewest`, the exact one in training under a memory limit, over (position, depth,
first stage's replicas, its 1F1B warm-up) (``h[q, i, c, w]``); under ZB-H1 the exact one once
per stage 0 warm-up ``W_0`` (:class:`WarmupTables`: ``M + 1`` times the work, the same memory),
the one-suffix one with ``W_0 = M`` (:class:`_ZbBound`). :func:`~.hybrid.plan_hybrid` bisects
``tau`` over them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_partition.pipeline.memory import boundary_step, held_in_front, optimizer_state
from onnx_partition.solve.hybrid_model import HybridStage
from onnx_partition.solve.hybrid_tables import COUNT_DTYPE, NO_COUNT, StageTables

__all__ = ["BoundedTables", "ExactTables", "WarmupTables", "exact_fewest", "fewest_devices",
           "zb_kept"]


@dataclass
class BoundedTables:
    """:func:`fewest_devices`'s tables: ``h[q, i, b]``, the fewest devices covering ``[i, n)``
    with ``q`` stages whose plan is kept under label ``b`` (``NO_COUNT`` or more: none), the
    first stage's end ``end``, replicas ``rep`` and 1F1B warm-up ``warm``, and ``after``, the
    label of the suffix it was placed in front of. One label where memory does not depend on
    the plan; else label 0 over every way a stage may run and label 1 the one-suffix DP's own
    choice (:func:`fewest_devices`)."""

    h: np.ndarray
    end: np.ndarray
    rep: np.ndarray
    warm: np.ndarray
    after: np.ndarray
    rebuilt: np.ndarray  # whether the first stage recomputes (``auto``)

    def fewest(self, q: int) -> int:
        return int(self.h[q, 0].min())

    def stages(self, tables: StageTables, q: int) -> list[HybridStage]:
        """The fewest-device plan of depth ``q`` (``h[q, 0]`` finite), by the back-pointers."""
        label, i, stages = int(np.argmin(self.h[q, 0])), 0, []
        for left in range(q, 0, -1):
            j, r = int(self.end[left, i, label]), int(self.rep[left, i, label])
            flag = bool(self.rebuilt[left, i, label]) if tables.mode == "auto" else None
            stages.append(tables.stage(i, j, r, flag))
            label, i = int(self.after[left, i, label]), j
        return stages


#: The bounded DP's stages that could overflow also on about these times the replicas their
#: period needs (fewer micro-batches in flight per replica, more optimizer state shed).
MORE_REPLICAS = (1.5, 2.0, 3.0, 4.0)
#: The way of :func:`fewest_devices` whose stages that could overflow run on the fewest replicas
#: (at least their period's) at which they fit in front of the suffix kept, however many
FIT = np.inf


def fewest_devices(tables: StageTables, tau: float, max_q: int, fits: np.ndarray | None
                   ) -> BoundedTables:
    """h[q, i, b]: fewest devices covering [i, n) with q stages, each of period <= tau and
    within memory (:class:`BoundedTables`). ``fits`` says where a stage is within memory when
    that does not depend on the plan (inference, or no stage could overflow): then one label,
    one suffix per device count, exact. Otherwise (``fits`` None) a stage's 1F1B micro-batches
    in flight depend on its replica count and the suffix's first replica count and warm-up
    (:func:`~onnx_partition.pipeline.memory.held_in_front`): each stage that could overflow
    (``tables.risky``) is checked in front of the suffix kept, its optimizer state shed by its
    replica count, and may also run on about :data:`MORE_REPLICAS` times the replicas its
    period needs (fewer micro-batches in flight each, more state shed) and, under ``auto``,
    recompute (on the fewest replicas its recomputing period needs), and run on the fewest
    replicas at which it fits in front of that suffix (:data:`FIT`, found by bisection over
    the counts: memory binds so that a stage needs many more replicas than its period, the
    405B row's 63 where the period needs 1-16): every plan fits. A
    second label follows the old one-suffix DP (keeping, fewest replicas, one suffix), so
    where that one planned this one does too. It bounds the exact DP (:func:`exact_fewest`)
    from above only. Bands of the suffix's warm-up as further labels (issue 36's proposal)
    found no plan more on tools/hybrid_bounded_misses.py's instances (measured), so none."""
    n = tables.n
    full = fits is None and not tables.exact  # else as before: one label, one way
    labels = 2 if full else 1
    shape = (max_q + 1, n + 1, labels)
    t = BoundedTables(*(np.full(shape, NO_COUNT, dtype=COUNT_DTYPE) if k == 0 else
                        np.zeros(shape, np.int64) for k in range(6)))
    t.h[0, n] = 0
    ways = [_Way(tables, tau, False, fits, full)]
    recompute = tables.mode == "auto" and tables.period_rc is not None
    if full:
        ways += [_Way(tables, tau, rebuilt, None, full, factor)
                 for factor in (1.0, *MORE_REPLICAS, FIT) for rebuilt in (False, True)
                 if (factor, rebuilt) != (1.0, False) and (recompute or not rebuilt)
                 and not (factor == FIT and tables.zb)]
    cand = np.empty((n + 1, n + 1), dtype=COUNT_DTYPE)
    for q in range(1, max_q + 1):
        for lb in (lb for lb in range(labels) if (t.h[q - 1, :, lb] < NO_COUNT).any()):
            next_warm, live = t.warm[q - 1, :, lb], t.h[q - 1, :, lb] < NO_COUNT
            front = None if fits is not None else held_in_front(  # shared by every way
                tables.lookup, t.rep[q - 1, :, lb], next_warm, tables.c.microbatches,
                last=q == 1)
            for way in ways:
                warm = way.mask(cand, front, next_warm, live)
                cand += t.h[q - 1, :, lb][None, :]
                if full and lb == 1 and way is ways[0]:  # the one-suffix DP's: from itself
                    _keep(t, q, lb, cand, warm, way, 1)
                _keep(t, q, lb, cand, warm, way, 0)
    return t


def _keep(t: BoundedTables, q: int, source: int, cand: np.ndarray, warm: np.ndarray,
          way: _Way, lb: int) -> None:
    """Per ``i`` the best stage ``[i, j)`` of ``cand``, kept under label ``lb`` if it has fewer
    devices (or as many and a smaller warm-up) than the one kept so far; in front of the
    suffixes of label ``source``."""
    rows = np.arange(cand.shape[0])
    at = np.argmin(cand, axis=1)
    value = np.minimum(cand[rows, at], NO_COUNT)
    new_warm = warm[rows, at]
    kept, kept_warm = t.h[q, :, lb], t.warm[q, :, lb]
    better = (value < kept) | ((value == kept) & (value < NO_COUNT) & (new_warm < kept_warm))
    t.h[q, better, lb] = value[better]
    t.end[q, better, lb] = at[better]
    t.rep[q, better, lb] = way.reps[rows, at][better]
    t.warm[q, better, lb] = new_warm[better]
    t.after[q, better, lb] = source
    t.rebuilt[q, better, lb] = way.rebuilt


class _Way:
    """One way a stage may run in :func:`fewest_devices` (keeping its activations, or
    recomputing them), at a bound ``tau``: each stage on the fewest replicas its period needs
    (``reps``); :meth:`mask` prices the stages in front of one label's suffixes, those that
    could overflow checked against them (a recomputing way has only those: keeping the others
    is never slower)."""

    def __init__(self, tables: StageTables, tau: float, rebuilt: bool,
                 fits: np.ndarray | None, full: bool, factor: float = 1.0) -> None:
        n = tables.n
        periods = tables.needed if not rebuilt else np.minimum.accumulate(
            np.asarray(tables.period_rc), axis=0)
        above = np.zeros((n + 1, n + 1), dtype=COUNT_DTYPE)
        for needed in periods:
            above += needed > np.float32(tau) if not rebuilt else needed > tau
        self.fit = factor == FIT  # the count chosen per suffix, in :meth:`mask`
        if 1.0 < factor < FIT:  # more replicas than the period needs: less memory in flight
            above = _more(tables, above, tau, rebuilt, factor)
        self.reps = tables.lookup[above]
        if rebuilt or factor > 1.0:  # only the stages that could overflow keeping
            only = np.full(self.reps.size, NO_COUNT, dtype=COUNT_DTYPE)
            only[tables.risky] = self.reps.reshape(-1)[tables.risky]
            self.reps = only.reshape(self.reps.shape)
        self.tables, self.above, self.rebuilt, self.fits = tables, above, rebuilt, fits
        self.cols = np.arange(n + 1)[None, :]
        risky = tables.risky
        count = above.reshape(-1)[risky].astype(np.int64)
        self.at = count * (n + 1) + risky % (n + 1)
        self.zb = _ZbBound(tables, above, rebuilt, full) if tables.zb else None
        self.cap = tables.risky_cap  # the exact DP's run: as before, no optimizer state shed
        if self.zb is None and fits is None and full:
            base, stash, _ = tables.kept_tables(rebuilt or tables.mode == "all")
            room = tables.c.memory_bytes - (base.reshape(-1)[risky] - _shed(tables, count))
            stash = stash.reshape(-1)[risky]
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                cap = np.where(stash > 0, room / np.where(stash > 0, stash, 1.0),
                               np.where(room >= 0, tables.c.microbatches, -1.0))
            self.cap = np.clip(np.floor(np.where(room < 0, -1.0, cap)), -1,
                               tables.c.microbatches).astype(np.int64)
            if self.fit:
                self.room = tables.c.memory_bytes - base.reshape(-1)[risky]
                self.stash, self.count, self.ends = stash, count, risky % (n + 1)
                self.state = optimizer_state(tables.stateful.reshape(-1)[risky],
                                             tables.c.optimizer_factor)
                period = tables.period_rc if rebuilt else tables.period
                self.period = np.asarray(period).reshape(len(tables.choices), -1)[:, risky]
                self.tau = tau

    def mask(self, cand: np.ndarray, front: tuple[np.ndarray, np.ndarray] | None,
             next_warm: np.ndarray, live: np.ndarray) -> np.ndarray:
        """``cand`` set to the stages' replicas, those over memory in front of the suffixes
        (``front``: :func:`held_in_front` of their first replicas and warm-ups ``next_warm``;
        ``live``: those that exist) masked out; returns every stage's 1F1B warm-up there."""
        tables, m = self.tables, self.tables.c.microbatches
        np.copyto(cand, self.reps)
        if self.fits is not None:
            np.copyto(cand, NO_COUNT, where=~self.fits)
            return np.zeros(cand.shape, dtype=np.int64)
        assert front is not None
        held, steps = front
        flat = cand.reshape(-1)
        if self.fit:
            return self._fitted(flat, held, steps, next_warm, live)
        if self.zb is None:
            flat[tables.risky[np.take(held, self.at) > self.cap]] = NO_COUNT
        else:
            flat[tables.risky[self.zb.over(steps, next_warm)]] = NO_COUNT
        return np.minimum(steps[self.above, self.cols] + next_warm[None, :], m)


    def _fitted(self, flat: np.ndarray, held: np.ndarray, steps: np.ndarray,
                next_warm: np.ndarray, live: np.ndarray) -> np.ndarray:
        """:meth:`mask` of the :data:`FIT` way: each stage that could overflow, in front of a
        suffix that exists (``live``), on the fewest counts from its period's up at which it
        fits there (a bisection: memory falls as the count grows, about; the count found is
        checked), within ``tau``; ``flat`` (and :attr:`reps`) set to them, warm-ups returned."""
        tables, m, k = self.tables, self.tables.c.microbatches, len(self.tables.choices)
        sel = np.flatnonzero(live[self.ends] & (self.count < k))
        ends, state, stash, room = (self.ends[sel], self.state[sel], self.stash[sel],
                                    self.room[sel])

        def fits(c: np.ndarray) -> np.ndarray:
            r = tables.lookup[c].astype(float)
            shed = np.where(r > 1, state - state / r, 0.0) if tables.c.shard == "optimizer" \
                else 0.0  # optimizer_state's share on the other replicas
            return held[c, ends] * stash <= room + shed

        lo, hi = self.count[sel] - 1, np.full(sel.shape, k - 1)  # lo fails, hi fits
        ok = fits(hi)
        while np.any(ok & (hi - lo > 1)):
            mid = (lo + hi) // 2
            good = fits(mid)
            hi, lo = np.where(ok & good, mid, hi), np.where(ok & ~good, mid, lo)
        count = np.where(ok & fits(hi), hi, k)
        within = self.period[np.minimum(count, k - 1), sel] <= self.tau
        count = np.where(within, count, k)
        flat[:] = NO_COUNT
        flat[tables.risky[sel]] = tables.lookup[count]
        self.reps = flat.reshape(self.reps.shape).copy()
        warm = np.full(flat.shape, m, dtype=np.int64)
        warm[tables.risky[sel]] = np.minimum(steps[count, ends] + next_warm[ends], m)
        return warm.reshape(self.reps.shape)


def _more(tables: StageTables, above: np.ndarray, tau: float, rebuilt: bool, factor: float
          ) -> np.ndarray:
    """The count index of the fewest choices at least ``factor`` times each stage's
    ``choices[above]``, where its period there is within ``tau`` (else past the choices)."""
    choices = np.asarray(tables.choices, dtype=float)
    k = len(choices)
    wanted = np.ceil(np.append(choices, np.inf)[above] * factor)
    more = np.minimum(np.searchsorted(choices, wanted), k)
    period = np.asarray(tables.period_rc if rebuilt else tables.period)
    at = np.minimum(more, k - 1)
    within = np.take_along_axis(period, at[None], axis=0)[0] <= tau
    return np.where((more < k) & within, more, k).astype(COUNT_DTYPE)


def _shed(tables: StageTables, count: np.ndarray) -> np.ndarray:
    """Optimizer-state bytes each risky stage sheds on ``choices[count]`` replicas (0 where
    ``count`` is past the choices: no count meets the bound)."""
    out = np.zeros(count.shape)
    whole = tables.risky
    for c in np.unique(count):
        if c < len(tables.choices):
            sel = count == c
            shed = np.broadcast_to(np.asarray(tables.shed(int(tables.choices[c])), dtype=float),
                                   (tables.n + 1, tables.n + 1))
            out[sel] = shed.reshape(-1)[whole[sel]]
    return out


class _ZbBound:
    """ZB-H1's memory of the stages that could overflow, for the one-suffix DP, which does not
    know stage 0's warm-up ``W_0``: taken as ``M``, its most (memory grows with it), so the
    plans it finds fit: ``held = ceil(M / r)``, ``kept = min(ceil((1 + M - W) / r), held)``
    with ``W`` the stage's own warm-up in front of the suffix chosen."""

    def __init__(self, tables: StageTables, above: np.ndarray, rebuilt: bool = False,
                 shed: bool = False) -> None:
        n, m = tables.n, tables.c.microbatches
        risky = tables.risky
        base, stash, per_kept = tables.kept_tables(rebuilt or tables.mode == "all")
        count = above.reshape(-1)[risky].astype(np.int64)
        self.base = base.reshape(-1)[risky] - (_shed(tables, count) if shed else 0.0)
        self.stash = stash.reshape(-1)[risky]
        self.per_kept = per_kept.reshape(-1)[risky]
        self.count = above.reshape(-1)[risky].astype(np.int64)  # index into lookup
        self.ends = risky % (n + 1)
        self.r = np.asarray(tables.lookup, dtype=np.int64)[self.count]
        self.m, self.memory = m, tables.c.memory_bytes

    def over(self, steps: np.ndarray, next_warmup: np.ndarray) -> np.ndarray:
        """Which of the stages are over memory in front of the suffixes now chosen."""
        m, r = self.m, self.r
        warmup = np.minimum(steps[self.count, self.ends] + next_warmup[self.ends], m)
        held = -(-m // r)
        kept = np.minimum(zb_kept(m, warmup, r, m), held)
        return np.asarray(self.base + held * self.stash + kept * self.per_kept > self.memory)


def zb_kept(first_warmup: int | np.ndarray, warmup: int | np.ndarray, replicas: int | np.ndarray,
            microbatches: int) -> np.ndarray:
    """Micro-batches whose gradients the fullest replica of a stage keeps from ``I`` to ``W``
    under ZB-H1 (:func:`~onnx_partition.pipeline.memory.kept_held`): ``min(ceil((1 + W_0 - W)
    / r), ceil(min(W_0 + 1, M) / r))``, ``W_0`` stage 0's global warm-up, ``W`` its own."""
    w0, w, r = (np.asarray(v, dtype=np.int64) for v in (first_warmup, warmup, replicas))
    held = -(-np.minimum(w0 + 1, microbatches) // r)
    return np.asarray(np.minimum(-(-(1 + w0 - w) // r), held))


_INF = COUNT_DTYPE(NO_COUNT)  # "no plan" in the exact DP's tables (device counts stay below)


@dataclass
class ExactTables:
    """The exact DP's tables for one bound ``tau`` (training under a memory limit).

    ``h[q, i, c, w]``: fewest devices covering ``[i, n)`` with ``q`` stages, each of period
    ``<= tau`` and within memory, whose first stage has ``choices[c]`` replicas and 1F1B
    global warm-up ``w`` (``_INF``: none). ``end[q, i, c, w]`` is that first stage's end and
    ``after[q, i, c, w]`` the state ``c' * (M + 1) + w'`` of the suffix from that end it was
    placed in front of (-1: none, the stage is last). With recomputation chosen per stage
    (``keeps``, the micro-batches each stage may hold keeping its activations where its keep
    period is within ``tau``, else -1), a stage recomputes exactly where keeping does not
    fit: where its ``held[c][w]`` micro-batches exceed ``keeps``."""

    h: np.ndarray
    end: np.ndarray
    after: np.ndarray
    held: Sequence[Sequence[int]] = ()
    keeps: Sequence[np.ndarray] = ()  # per replica choice c: (n + 1) x (n + 1)
    #: ZB-H1: the whole pipeline's first stage has exactly this warm-up (the DP's ``W_0``)
    top: int | None = None

    def _first(self, q: int) -> np.ndarray:
        """``h[q, 0]``, only the states a pipeline may start in."""
        first = self.h[q, 0]
        if self.top is None:
            return first
        out = np.full(first.shape, _INF, dtype=first.dtype)
        out[:, self.top] = first[:, self.top]
        return out

    def fewest(self, q: int) -> int:
        return int(self._first(q).min())

    def stages(self, tables: StageTables, q: int) -> list[HybridStage]:
        """The fewest-device plan of depth ``q`` (``h[q, 0]`` finite)."""
        w_count = self.h.shape[3]
        state = int(np.argmin(self._first(q)))
        c, w = divmod(state, w_count)
        stages, i = [], 0
        for left in range(q, 0, -1):
            j = int(self.end[left, i, c, w])
            flag = bool(self.keeps[c][i, j] < self.held[c][w]) if len(self.keeps) else None
            stages.append(tables.stage(i, j, tables.choices[c], flag))
            if left > 1:
                c, w = divmod(int(self.after[left, i, c, w]), w_count)
            i = j
        return stages


@dataclass
class WarmupTables(ExactTables):
    """The exact DP under ZB-H1: one run of :func:`exact_fewest`'s DP per stage 0 warm-up
    ``W_0`` (``0..M``), each with every stage's memory at that ``W_0``; per depth the fewest
    devices over them (``fewest_at``) and the ``W_0`` reaching it (``first_at``). A plan is
    rebuilt by running its ``W_0``'s DP again (``run``; the tables are not all kept)."""

    fewest_at: Sequence[int] = ()
    first_at: Sequence[int] = ()
    run: Callable[[int], ExactTables] | None = None
    built: dict[int, ExactTables] = field(default_factory=dict)

    def fewest(self, q: int) -> int:
        return int(self.fewest_at[q])

    def stages(self, tables: StageTables, q: int) -> list[HybridStage]:
        first = int(self.first_at[q])
        if first not in self.built:
            assert self.run is not None
            self.built = {first: self.run(first)}
        return self.built[first].stages(tables, q)


def exact_fewest(tables: StageTables, tau: float, max_q: int, capi: np.ndarray,
                  capi_rc: np.ndarray | None = None, memory: float | None = None
                  ) -> ExactTables:
    """The exact DP over (position, depth, first stage's replicas, its warm-up).

    Under 1F1B a stage's memory depends on its own replica count and warm-up, and its warm-up
    on the replica count and warm-up of the stage after it
    (:func:`~onnx_partition.pipeline.memory.one_f_one_b_warmups`); so a suffix is summed up
    by ``(c, w)`` and the DP keeps, per suffix and depth, the fewest devices for each of them
    (a Pareto set: more replicas in front of a suffix can lower the stage's micro-batches in
    flight, so every allowed count at or above the smallest meeting ``tau`` is tried)::

        h[q, i, c, w] = r_c + min over j, (c', w') with min(step(r_c, r_c') + w', M) = w
                        of h[q-1, j, c', w'],   stage [i, j) on r_c within tau and memory

    ``capi[i, j]`` is how many micro-batches stage ``[i, j)`` may hold within memory. Exact:
    every split of the sequence and every replica count of ``tables.choices``.

    Recomputation per stage (``capi_rc``: the same recomputing, priced by
    ``tables.period_rc``; AdaPipe, Sun et al. ASPLOS 2024, and Mist, Zhu et al. EuroSys 2025,
    choose it inside the search): a stage's micro-batches in flight depend on replica counts
    and warm-ups only, not on what it keeps, so the states are unchanged and a stage fits at
    ``(c, w)`` iff it keeps within ``tau`` and memory or recomputes within both: per
    ``(c, i, j)`` the most it may hold either way within ``tau`` is compared once with
    ``held[c][w]``; it recomputes exactly where keeping does not fit (keeping is never
    slower), recovered in :meth:`ExactTables.stages`.

    Under ZB-H1 (``tables.zb``) every stage holds ``ceil(min(W_0 + 1, M) / r)`` micro-batches
    and keeps the gradients of :func:`zb_kept` of them, ``W_0`` the first stage's warm-up: one
    DP per ``W_0`` (:func:`_zb_run`, within ``memory``, default the config's), a plan counted
    only where its first stage's warm-up is that ``W_0`` (:class:`WarmupTables`)."""
    if tables.zb:
        limit = tables.c.memory_bytes if memory is None else memory
        return _zb_fewest(tables, tau, max_q, capi_rc is not None, limit)
    m = tables.c.microbatches
    top = min(m, 2 * tables.c.devices)  # a warm-up of 2 D or more: over D devices behind it
    held = [[-(-min(w + 1, m) // r) if tables.c.train else 1 for w in range(top + 1)]
            for r in tables.choices]  # inference: the micro-batch being computed
    return _exact_run(tables, tau, max_q, capi, capi_rc, held)


def _zb_fewest(tables: StageTables, tau: float, max_q: int, auto: bool, memory: float
               ) -> WarmupTables:
    """:func:`exact_fewest` under ZB-H1: the DP once per ``W_0``, the best per depth kept."""
    m = tables.c.microbatches

    def run(first: int) -> ExactTables:
        return _zb_run(tables, tau, max_q, auto, memory, first)

    fewest = [int(_INF)] * (max_q + 1)
    first_at = [0] * (max_q + 1)
    for first in range(min(m, 2 * tables.c.devices) + 1):  # none above 2 D (design.md)
        part = run(first)
        for q in range(1, max_q + 1):
            got = part.fewest(q)
            if got < fewest[q]:
                fewest[q], first_at[q] = got, first
    return WarmupTables(np.zeros((1, 1, 1, 1), dtype=COUNT_DTYPE), np.zeros(0), np.zeros(0),
                        fewest_at=fewest, first_at=first_at, run=run)


def _zb_run(tables: StageTables, tau: float, max_q: int, auto: bool, memory: float,
            first: int) -> ExactTables:
    """The exact DP at stage 0 warm-up ``first``: a stage on ``r`` replicas holds ``held =
    ceil(min(first + 1, M) / r)`` whatever its place, so its memory ``base + held * stash +
    kept * per_kept`` (:meth:`~.hybrid_tables.StageTables.kept_tables`) is within ``memory``
    iff ``kept`` (:func:`zb_kept`, set by its own warm-up ``w``) is at most a cap per stage
    and count: the 1F1B DP's check with ``kept`` in place of ``held`` (a warm-up over
    ``first`` never fits)."""
    m, choices = tables.c.microbatches, tables.choices
    top = m if first >= m else first + 1  # warm-ups over ``first`` never fit: one state
    held = [[int(zb_kept(first, w, r, m)) if w <= first else m + 1 for w in range(top + 1)]
            for r in choices]
    ways = [tables.mode == "all"] + [True] * auto
    caps = []
    for rebuilt in ways:
        base, stash, per_kept = tables.kept_tables(rebuilt)
        per_count = []
        for r in choices:
            room = memory - (base - tables.shed(r)) - (-(-min(first + 1, m) // r)) * stash
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                cap = np.where(per_kept > 0, room / np.where(per_kept > 0, per_kept, 1.0),
                               np.where(room >= 0, m, -1.0))
            per_count.append(np.clip(np.floor(np.where(room < 0, -1.0, cap)), -1, m
                                     ).astype(np.int32))
        caps.append(np.stack(per_count))
    part = _exact_run(tables, tau, max_q, caps[0], caps[1] if auto else None, held)
    part.top = first
    return part


def _exact_run(tables: StageTables, tau: float, max_q: int, capi: np.ndarray,
               capi_rc: np.ndarray | None, held: Sequence[Sequence[int]]) -> ExactTables:
    """The exact DP with ``held[c][w]`` the count a stage on ``choices[c]`` replicas at
    warm-up ``w`` must fit (``capi`` / ``capi_rc`` its caps), for warm-ups ``0..len(held[c])
    - 1``, the last standing for every larger one (design.md: no plan needs more)."""
    n, m = tables.n, len(held[0]) - 1
    choices = tables.choices
    rc, wc = len(choices), m + 1
    h = np.full((max_q + 1, n + 1, rc, wc), _INF, dtype=COUNT_DTYPE)
    end = np.zeros((max_q + 1, n + 1, rc, wc), dtype=np.int32)
    after = np.full((max_q + 1, n + 1, rc, wc), -1, dtype=np.int32)
    bands, keeps = _stage_bands(tables, tau, capi, capi_rc)
    gather = _warmup_gather(choices, m)
    held_w = np.asarray(held, dtype=COUNT_DTYPE)  # [c, w]
    flat_h = h.reshape(max_q + 1, n + 1, rc * wc)
    for q in range(1, max_q + 1):
        g, arg = _suffix_tails(flat_h, q, gather, rc, wc)
        _first_stages(h, end, after, q, g, arg, bands, held_w, choices)
    return ExactTables(h, end, after, held, keeps)


#: A replica count's stages as bands over (start, width): end, within tau, may hold.
_Band = tuple[np.ndarray, np.ndarray, np.ndarray]


def _stage_bands(tables: StageTables, tau: float, capi: np.ndarray, capi_rc: np.ndarray | None
                 ) -> tuple[list[_Band], list[np.ndarray]]:
    """Each replica count's stages within ``tau``, as bands: for the stage ``[i, i+1+k)`` its
    end, whether it is within ``tau`` and how many micro-batches it may hold (the most of
    keeping and recomputing, each where within ``tau``); and, recomputation chosen per stage,
    per count what each stage may hold keeping (-1: its keep period is over ``tau``)."""
    n, rc = tables.n, len(tables.choices)
    rows = np.arange(n + 1)
    # Each replica count's stages within tau, as bands: ok[c][i, k] for the stage [i, i+1+k)
    bands = []
    keeps = []
    for c in range(rc):
        ok = tables.period[c] <= tau  # inf (i >= j) never
        cap = capi[c] if capi.ndim == 3 else capi  # per count: its optimizer state sharded
        if capi_rc is not None and tables.period_rc is not None:
            ok_rc = tables.period_rc[c] <= tau  # keep periods are never above these
            keeps.append(np.where(ok, cap, -1))
            cap = np.maximum(keeps[-1], np.where(
                ok_rc, capi_rc[c] if capi_rc.ndim == 3 else capi_rc, -1))
        last = np.where(ok.any(axis=1), (n - np.argmax(ok[:, ::-1], axis=1)) - rows, 0)
        width = max(int(last.max()), 1)
        ends = rows[:, None] + 1 + np.arange(width)[None, :]
        inside = ends <= n
        ends = np.minimum(ends, n)
        bands.append((ends, ok[rows[:, None], ends] & inside, cap[rows[:, None], ends]))
    return bands, keeps


def _warmup_gather(choices: Sequence[int], m: int) -> np.ndarray:
    """The warm-up transfer as one gather over rows of ``ext`` (:func:`_suffix_tails`): the
    suffix states (c', w'), then per c' the best state of warm-up at least t (a stage in front
    of w' >= M - step saturates at M), then a row of no plan. Row of target (c, w): (c', w -
    step) for w < M, (c', >= M - step) for w = M, for every c' (padded with the no-plan
    row)."""
    rc, wc = len(choices), m + 1
    steps = [[boundary_step(a, b) for b in choices] for a in choices]
    states = rc * wc
    gather = np.full((states, rc), 2 * states, dtype=np.int64)
    for c in range(rc):
        for c2 in range(rc):
            step = steps[c][c2]
            for w in range(step, m):
                gather[c * wc + w, c2] = c2 * wc + w - step
            gather[c * wc + m, c2] = states + c2 * wc + max(m - step, 0)
    return gather


def _suffix_tails(flat_h: np.ndarray, q: int, gather: np.ndarray, rc: int, wc: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """g[c * wc + w, j]: fewest devices of a suffix from j (``q - 1`` stages) that a stage of
    choices[c] replicas in front of it gets warm-up w from; arg: that suffix's state
    c' * wc + w'."""
    n, states = flat_h.shape[1] - 1, rc * wc
    if q == 1:
        g = np.full((states, n + 1), _INF, dtype=COUNT_DTYPE)
        g[np.arange(rc) * wc, n] = 0
        arg = np.full((states, n + 1), -1, dtype=np.int64)
    else:
        now = flat_h[q - 1].T.reshape(rc, wc, n + 1)
        sat = now.copy()
        sat_arg = np.broadcast_to(np.arange(states).reshape(rc, wc, 1),
                                  now.shape).copy()
        for w in range(wc - 2, -1, -1):  # best of warm-up >= w
            take = sat[:, w + 1] < sat[:, w]
            sat[:, w] = np.where(take, sat[:, w + 1], sat[:, w])
            sat_arg[:, w] = np.where(take, sat_arg[:, w + 1], sat_arg[:, w])
        ext = np.concatenate([now.reshape(states, n + 1), sat.reshape(states, n + 1),
                              np.full((1, n + 1), _INF, dtype=COUNT_DTYPE)])
        ext_arg = np.concatenate([np.broadcast_to(np.arange(states)[:, None],
                                                  (states, n + 1)),
                                  sat_arg.reshape(states, n + 1),
                                  np.full((1, n + 1), -1)])
        pool = ext[gather]  # [target, c', j]
        pick = np.argmin(pool, axis=1)
        g = np.take_along_axis(pool, pick[:, None, :], axis=1)[:, 0, :]
        arg = ext_arg[np.take_along_axis(gather, pick, axis=1), np.arange(n + 1)[None, :]]
    return g, arg


def _first_stages(h: np.ndarray, end: np.ndarray, after: np.ndarray, q: int, g: np.ndarray,
                  arg: np.ndarray, bands: Sequence[_Band], held_w: np.ndarray,
                  choices: Sequence[int]) -> None:
    """``h[q]``, ``end[q]`` and ``after[q]`` from the suffixes' tails ``g``: per replica count
    c and warm-up w, the first stage ``[i, j)`` on choices[c] replicas within ``tau`` and
    memory (its ``held_w[c, w]`` micro-batches fit) in front of the fewest-device suffix from
    ``j``."""
    rc, wc, n = len(choices), held_w.shape[1], h.shape[1] - 1
    rows = np.arange(n + 1)
    tails = g.reshape(rc, wc, n + 1)  # [c, w, j]
    tail_arg = arg.reshape(rc, wc, n + 1)
    for c in range(rc):
        ends, okb, capb = bands[c]
        live = np.flatnonzero(tails[c].min(axis=1) < _INF)
        if not live.size:
            continue
        fits = okb[None] & (capb[None] >= held_w[c, live][:, None, None])
        cand = np.where(fits, tails[c, live][:, ends], _INF)  # [w, i, k]
        best = np.argmin(cand, axis=2)
        value = np.take_along_axis(cand, best[:, :, None], axis=2)[:, :, 0]
        at = ends[rows[None, :], best]  # [w, i]
        total = np.minimum(value.astype(np.int32) + choices[c], NO_COUNT)  # no overflow
        h[q, :, c, live] = np.where(value < _INF, total, _INF)
        end[q, :, c, live] = at
        after[q, :, c, live] = np.take_along_axis(tail_arg[c, live], at, axis=1)
