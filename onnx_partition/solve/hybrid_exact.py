"""The exact hybrid DP for one bound ``tau`` in training under a memory limit: over (position,
depth, first stage's replicas, its 1F1B warm-up) (``h[q, i, c, w]``, :func:`exact_fewest`);
under ZB-H1 once per stage 0 warm-up ``W_0`` (:class:`WarmupTables`). Suffix states on no
plan within the cluster's devices are pruned as they are made (:class:`Prune`).
:func:`~.hybrid.plan_hybrid` bisects ``tau`` over it and :mod:`.hybrid_dp`'s one-suffix DP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnx_partition.pipeline.memory import boundary_step
from onnx_partition.solve.hybrid_dp import zb_kept
from onnx_partition.solve.hybrid_model import HybridStage
from onnx_partition.solve.hybrid_tables import COUNT_DTYPE, NO_COUNT, StageTables

__all__ = ["ExactTables", "Prune", "WarmupTables", "exact_fewest"]

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
    frame = _Frame.of(tables, tau)  # what every run at this tau shares

    def run(first: int) -> ExactTables:
        return _zb_run(tables, tau, max_q, auto, memory, first, frame)

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
            first: int, frame: _Frame | None = None) -> ExactTables:
    """The exact DP at stage 0 warm-up ``first``: a stage on ``r`` replicas holds ``held =
    ceil(min(first + 1, M) / r)`` whatever its place, so its memory ``base + held * stash +
    kept * per_kept`` (:meth:`~.hybrid_tables.StageTables.kept_tables`) is within ``memory``
    iff ``kept`` (:func:`zb_kept`, set by its own warm-up ``w``) is at most a cap per stage
    and count: the 1F1B DP's check with ``kept`` in place of ``held`` (a warm-up over
    ``first`` never fits)."""
    m, choices = tables.c.microbatches, tables.choices
    top = m if first >= m else first + 1  # warm-ups over ``first`` never fit: one state
    warm = np.arange(top + 1)
    held = [np.where(warm <= first, zb_kept(first, warm, r, m), m + 1).tolist()
            for r in choices]
    ways = [tables.mode == "all"] + [True] * auto
    counts = np.asarray(choices)[:, None, None]
    frame = _Frame.of(tables, tau) if frame is None else frame
    caps = []
    for rebuilt in ways:
        base, stash, per_kept = tables.kept_tables(rebuilt)
        room = memory - (base - frame.shed) - (-(-min(first + 1, m) // counts)) * stash
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            cap = np.where(per_kept > 0, room / np.where(per_kept > 0, per_kept, 1.0),
                           np.where(room >= 0, m, -1.0))
        caps.append(np.clip(np.floor(np.where(room < 0, -1.0, cap)), -1, m).astype(np.int32))
    part = _exact_run(tables, tau, max_q, caps[0], caps[1] if auto else None, held, first,
                      frame)
    part.top = first
    return part


def _exact_run(tables: StageTables, tau: float, max_q: int, capi: np.ndarray,
               capi_rc: np.ndarray | None, held: Sequence[Sequence[int]],
               first: int | None = None, frame: _Frame | None = None) -> ExactTables:
    """The exact DP with ``held[c][w]`` the count a stage on ``choices[c]`` replicas at
    warm-up ``w`` must fit (``capi`` / ``capi_rc`` its caps), for warm-ups ``0..len(held[c])
    - 1``, the last standing for every larger one (design.md: no plan needs more); ``first``:
    every plan starts at that warm-up (ZB-H1's ``W_0``). States on no plan within the
    cluster's devices are pruned as they are made (:class:`Prune`), so a run whose every
    plan needs more stops early. ``frame``: what the runs at this ``tau`` share (else made)."""
    n, m = tables.n, len(held[0]) - 1
    choices = tables.choices
    rc, wc = len(choices), m + 1
    h = np.full((max_q + 1, n + 1, rc, wc), _INF, dtype=COUNT_DTYPE)
    end = np.zeros((max_q + 1, n + 1, rc, wc), dtype=np.int32)
    after = np.full((max_q + 1, n + 1, rc, wc), -1, dtype=np.int32)
    frame = _Frame.of(tables, tau) if frame is None else frame
    bands, keeps = _stage_bands(frame, capi, capi_rc)
    gather = _warmup_gather(choices, m)
    held_w = np.asarray(held, dtype=COUNT_DTYPE)  # [c, w]
    flat_h = h.reshape(max_q + 1, n + 1, rc * wc)
    prune = Prune(tables.c.devices, frame.cover, frame.stages,
                   first if first is not None and first < tables.c.microbatches
                   else 2 * int(_INF))
    for q in range(1, max_q + 1):
        g, arg = _suffix_tails(flat_h, q, gather, rc, wc)
        _first_stages(h, end, after, q, g, arg, bands, held_w, choices, prune)
        if not (h[q] < _INF).any():  # no suffix of q stages: none of more (each ends in one)
            break
    return ExactTables(h, end, after, held, keeps)


@dataclass(frozen=True)
class Prune:
    """Suffix states no plan on at most ``D`` devices passes through. The exact DP's answers
    are kept where at most ``D``, the cluster's devices; above, none is needed: every budget
    is at most ``D``, and a least count over ``D`` stays over it. Pruned are a suffix from
    ``i`` whose devices and the fewest that cover ``[0, i)`` within ``tau`` (``cover``)
    exceed ``D``; and, in a run whose pipeline starts at warm-up ``W_0 < M`` (ZB-H1), a
    suffix from ``i > 0`` of warm-up ``w`` on ``r`` replicas with ``w + r + stages - 1 >
    W_0``, ``stages`` the fewest covering ``[0, i)`` within ``tau``: the boundary in front of
    it adds at least ``r`` to the warm-up, each further one at least 1
    (:func:`~onnx_partition.pipeline.memory.boundary_step`). A pruned state lies on no plan
    from ``h[q, 0]`` within ``D`` devices, nor does any state tied with one that does, so
    the plans found and their ties are unchanged (docs/design.md)."""

    devices: int
    cover: np.ndarray  # [i]: fewest devices over [0, i) within tau
    stages: np.ndarray  # [i]: fewest stages over [0, i) within tau
    first: int  # W_0, or more than any warm-up where none is fixed (or W_0 >= M)

    def apply(self, states: np.ndarray, replicas: int) -> None:
        """Set the pruned of ``states[i, w]`` (one count's, ``replicas`` each) to none."""
        over = states + self.cover[:, None] > self.devices
        late = (np.arange(states.shape[1])[None, :] + replicas + self.stages[:, None] - 1
                > self.first)
        late[0] = False
        states[over | late] = _INF


@dataclass(frozen=True)
class _Frame:
    """What every run of the exact DP at one ``tau`` shares: per replica count which stages
    are within ``tau`` keeping (``ok``) and recomputing (``ok_rc``), their bands over (start,
    width) (``ends``; ``inside``: the stage ``[i, i+1+k)`` exists and is within ``tau``), and
    the fewest devices (``cover``) and stages (``stages``) covering ``[0, i)`` within ``tau``
    (:class:`Prune`); and per count the optimizer state a replica sheds (``shed[c, i, j]``,
    :meth:`~.hybrid_tables.StageTables.shed`; ZB-H1's caps)."""

    ok: list[np.ndarray]
    ok_rc: list[np.ndarray] | None
    ends: list[np.ndarray]
    inside: list[np.ndarray]
    cover: np.ndarray
    stages: np.ndarray
    shed: np.ndarray

    @staticmethod
    def of(tables: StageTables, tau: float) -> _Frame:
        n = tables.n
        rows = np.arange(n + 1)
        within = tables.period <= tau  # [c, i, j]; inf (i >= j) never
        ok, ends, inside = list(within), [], []
        for c in range(len(tables.choices)):
            last = np.where(ok[c].any(axis=1),
                            (n - np.argmax(ok[c][:, ::-1], axis=1)) - rows, 0)
            width = max(int(last.max()), 1)
            band = rows[:, None] + 1 + np.arange(width)[None, :]
            ends.append(np.minimum(band, n))
            inside.append(ok[c][rows[:, None], ends[-1]] & (band <= n))
        counts = np.asarray(tables.choices, dtype=np.int64)[:, None, None]
        reps = np.where(within, counts, _INF).min(axis=0)  # [i, j]: fewest replicas
        one = np.where(within.any(axis=0), 1, _INF)
        cover = np.full(n + 1, _INF, dtype=np.int64)
        stages = np.full(n + 1, _INF, dtype=np.int64)
        cover[0] = stages[0] = 0
        for j in range(1, n + 1):
            cover[j] = min(int((cover[:j] + reps[:j, j]).min()), int(_INF))
            stages[j] = min(int((stages[:j] + one[:j, j]).min()), int(_INF))
        ok_rc = None if tables.period_rc is None else list(tables.period_rc <= tau)
        shed = np.stack([np.broadcast_to(tables.shed(r), (n + 1, n + 1))
                         for r in tables.choices])
        return _Frame(ok, ok_rc, ends, inside, cover, stages, shed)


#: A replica count's stages as bands over (start, width): end, within tau, may hold.
_Band = tuple[np.ndarray, np.ndarray, np.ndarray]


def _stage_bands(frame: _Frame, capi: np.ndarray, capi_rc: np.ndarray | None
                 ) -> tuple[list[_Band], list[np.ndarray]]:
    """Each replica count's stages within ``tau``, as bands (:class:`_Frame`): for the stage
    ``[i, i+1+k)`` its end, whether it is within ``tau`` and how many micro-batches it may
    hold (the most of keeping and recomputing, each where within ``tau``); and,
    recomputation chosen per stage, per count what each stage may hold keeping (-1: its keep
    period is over ``tau``)."""
    rows = np.arange(len(frame.cover))[:, None]
    bands = []
    keeps = []
    for c, ok in enumerate(frame.ok):
        cap = capi[c] if capi.ndim == 3 else capi  # per count: its optimizer state sharded
        if capi_rc is not None and frame.ok_rc is not None:
            keeps.append(np.where(ok, cap, -1))  # keep periods are never above recomputing's
            cap = np.maximum(keeps[-1], np.where(
                frame.ok_rc[c], capi_rc[c] if capi_rc.ndim == 3 else capi_rc, -1))
        ends = frame.ends[c]
        bands.append((ends, frame.inside[c], cap[rows, ends]))
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
                  choices: Sequence[int], prune: Prune) -> None:
    """``h[q]``, ``end[q]`` and ``after[q]`` from the suffixes' tails ``g``: per replica count
    c and warm-up w, the first stage ``[i, j)`` on choices[c] replicas within ``tau`` and
    memory (its ``held_w[c, w]`` micro-batches fit) in front of the fewest-device suffix from
    ``j``; then the states on no plan within the devices set to none (``prune``)."""
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
        prune.apply(h[q, :, c], choices[c])
