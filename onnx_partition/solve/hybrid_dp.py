"""The hybrid DP for one bound ``tau`` on the stage period: the fewest devices per suffix and
depth whose every stage's period is at most ``tau`` and within memory.

Two DPs over :class:`~.hybrid_tables.StageTables`: :func:`fewest_devices`, one suffix per
device count (``h[q, i]``; exact where a stage's memory does not depend on the plan), and
:func:`exact_fewest`, the exact one in training under a memory limit, over (position, depth,
first stage's replicas, its 1F1B warm-up) (``h[q, i, c, w]``). :func:`~.hybrid.plan_hybrid`
bisects ``tau`` over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_partition.pipeline.memory import boundary_step, held_in_front
from onnx_partition.solve.hybrid_model import HybridStage
from onnx_partition.solve.hybrid_tables import COUNT_DTYPE, NO_COUNT, StageTables

__all__ = ["ExactTables", "exact_fewest", "fewest_devices"]


def fewest_devices(
    tables: StageTables, tau: float, max_q: int, fits: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """h[q, i]: fewest devices covering [i, n) with q stages, each of period <= tau and within
    memory (``NO_COUNT`` or more: impossible); with the chosen end and replica count per (q, i).
    ``fits`` says where a stage is within memory when that does not depend on the plan
    (inference, or no stage could overflow): then this is exact. Otherwise (``fits`` None)
    it keeps one suffix per device count, so it only bounds the exact DP
    (:func:`exact_fewest`) from above: each stage's memory is checked in front of the suffix
    chosen:
    its 1F1B micro-batches in flight depend only on its replica count and the suffix's first
    replica count and warm-up (:func:`~onnx_partition.pipeline.memory.held_in_front`), a
    small table looked up for the stages that could overflow at all (``tables.risky``) and
    compared with how many micro-batches each may hold (``tables.risky_cap``).
    Integer tables: the device counts are small whole numbers."""
    n = tables.n
    above = np.zeros((n + 1, n + 1), dtype=COUNT_DTYPE)
    limit = np.float32(tau)
    for needed in tables.needed:
        above += needed > limit
    reps = tables.lookup[above]
    h = np.full((max_q + 1, n + 1), NO_COUNT, dtype=COUNT_DTYPE)
    h[0, n] = 0
    end = np.zeros((max_q + 1, n + 1), dtype=np.int64)
    rep = np.zeros((max_q + 1, n + 1), dtype=np.int64)
    warm = np.zeros((max_q + 1, n + 1), dtype=np.int64)  # 1F1B warm-up of the first stage
    rows = np.arange(n + 1)
    cand = np.empty((n + 1, n + 1), dtype=COUNT_DTYPE)
    flat = cand.reshape(-1)  # a view
    if fits is None:  # only stages that could overflow: held[c, j] is held.flat[at[k]]
        risky = tables.risky
        at = above.reshape(-1)[risky].astype(np.int64) * (n + 1) + risky % (n + 1)
    for q in range(1, max_q + 1):
        np.copyto(cand, reps)
        if fits is None:
            held, steps = held_in_front(tables.lookup, rep[q - 1], warm[q - 1],
                                        tables.c.microbatches, last=q == 1)
            flat[risky[np.take(held, at) > tables.risky_cap]] = NO_COUNT
        else:
            np.copyto(cand, NO_COUNT, where=~fits)
        cand += h[q - 1][None, :]
        end[q] = np.argmin(cand, axis=1)
        h[q] = np.minimum(cand[rows, end[q]], NO_COUNT)
        rep[q] = np.where(h[q] < NO_COUNT, reps[rows, end[q]], 0)
        if fits is None:
            warm[q] = np.minimum(steps[above[rows, end[q]], end[q]] + warm[q - 1][end[q]],
                                 tables.c.microbatches)
    return h, end, rep


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

    def fewest(self, q: int) -> int:
        return int(self.h[q, 0].min())

    def stages(self, tables: StageTables, q: int) -> list[HybridStage]:
        """The fewest-device plan of depth ``q`` (``h[q, 0]`` finite)."""
        w_count = self.h.shape[3]
        state = int(np.argmin(self.h[q, 0]))
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


def exact_fewest(tables: StageTables, tau: float, max_q: int, capi: np.ndarray,
                  capi_rc: np.ndarray | None = None) -> ExactTables:
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
    slower), recovered in :meth:`ExactTables.stages`."""
    n, m = tables.n, tables.c.microbatches
    choices = tables.choices
    rc, wc = len(choices), m + 1
    h = np.full((max_q + 1, n + 1, rc, wc), _INF, dtype=COUNT_DTYPE)
    end = np.zeros((max_q + 1, n + 1, rc, wc), dtype=np.int32)
    after = np.full((max_q + 1, n + 1, rc, wc), -1, dtype=np.int32)
    held = [[-(-min(w + 1, m) // r) if tables.c.train else 1 for w in range(wc)]
            for r in choices]  # inference: the micro-batch being computed
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
