"""The hybrid DP for one bound ``tau`` on the stage period: the fewest devices per suffix and
depth whose every stage's period is at most ``tau`` and within memory.

Two DPs over :class:`~.hybrid_tables.StageTables`: :func:`fewest_devices` here, one suffix per
device count (``h[q, i]``; exact where a stage's memory does not depend on the plan; under
ZB-H1 with ``W_0 = M``, :class:`_ZbBound`), and :func:`~.hybrid_exact.exact_fewest`, the exact
one in training under a memory limit. :func:`~.hybrid.plan_hybrid` bisects ``tau`` over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnx_partition.pipeline.memory import held_in_front, optimizer_state
from onnx_partition.solve.hybrid_model import HybridStage
from onnx_partition.solve.hybrid_tables import COUNT_DTYPE, NO_COUNT, StageTables

__all__ = ["BoundedTables", "fewest_devices", "zb_kept"]


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
    where that one planned this one does too. It bounds the exact DP
    (:func:`~.hybrid_exact.exact_fewest`) from above only. Bands of the suffix's warm-up as
    further labels (issue 36's proposal) found no plan more on tools/hybrid_bounded_misses.py's
    instances (measured), so none."""
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
