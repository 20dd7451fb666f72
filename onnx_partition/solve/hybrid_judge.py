"""The exact hybrid judge: a CP-SAT model of the hybrid problem on a sequence, for small ones.

The reference :func:`~onnx_partition.solve.hybrid.plan_hybrid` is checked against (tests, up
to ~12 positions and 4 devices; ``tools/bench_planner.py``, up to 40 positions and 8 devices).
It is written from the model's definition (docs/design.md), not from the DP's code: its own
period, all-reduce, warm-up step and memory formulas (``tests/test_hybrid_judge.py`` perturbs
the DP's and checks the judge then disagrees); contiguous stages over
the sequence, a replica count per stage (every count from 1 to ``min(D, M)``: no replica
without a micro-batch), at most ``D`` devices, and per stage

    period = ceil(M / r) (F [+ B] + comm) / M + allreduce(r) / M
    memory = static(r) + T + held * stash + kept * K

where under 1F1B ``held = ceil(min(W + 1, M) / r)`` and the global warm-up ``W`` of a stage is
``min(W_next + step(r, r_next), M)`` (``step``: the larger count where one divides the other,
else their sum less one),
``W = 0`` for the last stage, ``kept = 0``; in inference ``held = 1`` and ``T = 0``. ``T`` is the
backward's working set, the largest ``working_bytes`` of the stage's positions (under ZB-H1
too: it runs beside the kept gradients). Under ZB-H1
(``config.train_schedule``) a stage holds from its ``F`` to its deferred ``W`` as many as the first
stage's window, ``held = ceil(min(W_0 + 1, M) / r)`` with ``W_0`` the first stage's warm-up, and
keeps between an ``I`` and its ``W`` the output gradients ``K`` (its positions' ``kept_bytes``;
none in the stage starting at 0) of ``kept = min(ceil((1 + W_0 - W) / r), held)`` micro-batches
(docs/design.md, "What ZB-H1 keeps"). ``static(r)`` is the weights, the
gradients and optimizer state of the trainable ones and one gradient receive buffer; with the
optimizer state sharded (ZeRO-1, ``shard`` optimizer) each of ``r`` replicas holds ``1 / r`` of
the state, ``static(r) = W + P + (f - 2) P / r + G``. Minimises the bottleneck period.

Model: slots ``k = 0, 1, ...`` are stages counted from the pipeline's end; ``x[k, i, j]``
chooses stage ``[i, j)`` for slot ``k``, ``y[k, r]`` its replica count; slot 0 ends at ``n``,
slot ``k`` ends where slot ``k - 1`` starts, and exactly one slot starts at 0. The warm-up
recursion and ``held`` are table constraints over small integers; memory is ``x[k, i, j] and
y[k, r] => held_k <= cap(i, j, r)`` with ``cap`` the micro-batches stage ``[i, j)`` may hold on
``r`` replicas (ZB-H1: also ``held_k = h => kept_k <= most(i, j, r, h)``, the most kept
gradients that fit beside ``h`` held micro-batches); the period
``y[k, r] => P >= sum_ij period(i, j, r) x[k, i, j]``. Periods are scaled to integers (rounded
up, the largest to 10^6), so the optimum is exact to 10^-6 of the largest stage period
(:attr:`JudgeResult.tolerance_ms`); the period returned is the chosen plan's, in floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ortools.sat.python import cp_model

from onnx_partition.solve.hybrid_model import HybridConfig, SequenceCosts

__all__ = ["JudgeResult", "judge_hybrid"]

#: the largest stage period in the model's integers (CP-SAT, OR-Tools 9.x, returned wrong
#: "optimal" answers at 10^9 with enforced sums of such coefficients)
_SCALE_TOP = 10**6


@dataclass(frozen=True)
class JudgeResult:
    """The judge's answer: the least bottleneck period (inf: no plan fits; nan: none found
    within the limits), whether CP-SAT proved it, a plan reaching it as ``(start, end,
    replicas)`` per stage, and ``bound_ms``: no plan of the sequence has a smaller period.
    Asked for a plan below a period (``below_ms``), ``period_ms`` is the plan found (never
    ``optimal``), or inf when CP-SAT proved there is none (``bound_ms``: that period)."""

    period_ms: float
    optimal: bool
    stages: tuple[tuple[int, int, int], ...] = ()
    tolerance_ms: float = 0.0  # the integer model's rounding: no plan is faster by more
    bound_ms: float = 0.0


def _stage_numbers(costs: SequenceCosts, config: HybridConfig, i: int, j: int
                   ) -> tuple[float, float, float, float, float, float]:
    """Latency of one micro-batch, parameter bytes, static and stash bytes of ``[i, j)``, the
    bytes with optimizer state (the trainable ones) and the gradient bytes ZB-H1 keeps per
    micro-batch from ``I`` to ``W`` (none in a stage starting at 0: it receives no activation,
    its whole backward runs in ``W``). In training ``static`` holds the backward's working set
    ``T``, the largest of the positions' ``working_bytes`` (under either schedule)."""
    n = len(costs.forward_ms)
    compute = sum(costs.forward_ms[i:j]) + (sum(costs.backward_ms[i:j]) if config.train
                                            else 0.0)

    def send(b: int) -> float:
        if b in (0, n):
            return 0.0
        return costs.cut_bytes[b] / config.link_bytes_per_ms + config.link_latency_ms

    comm = (send(i) + send(j)) * (2.0 if config.train else 1.0)
    params = float(sum(costs.param_bytes[i:j]))  # all-reduced
    received = float(costs.input_bytes if i == 0 else costs.cut_bytes[i])
    sent = float(costs.cut_bytes[j])
    if len(costs.weight_bytes):  # the one count: constants not trained
        held = [(b, t) for b, t, where in costs.shared if any(i <= p < j for p in where)]
        weights = float(sum(costs.weight_bytes[i:j])) + sum(b for b, _ in held)
        trained = float(sum(costs.trainable_bytes[i:j])) + sum(t for _, t in held)
        static = (weights + (config.optimizer_factor - 1.0) * trained + sent if config.train
                  else weights)
    else:
        trained = params
        static = config.optimizer_factor * params + sent if config.train else params
    stash = float(sum(costs.activation_bytes[i:j])) + received
    kept = float(sum(costs.kept_bytes[i:j])) if i > 0 and len(costs.kept_bytes) else 0.0
    if config.train and len(costs.working_bytes):  # the backward's widest op, one at a time
        widest = float(max(costs.working_bytes[i:j]))
        static += widest  # under ZB-H1 too: beside the kept gradients, not inside them
    return compute / config.speed + comm, params, static, stash, trained, kept


def _static_on(config: HybridConfig, static: float, trained: float, r: int) -> float:
    """``static`` bytes as one of ``r`` replicas holds them (docs/design.md, "The shard term"):
    sharded (``shard`` optimizer, training, ``r > 1``), the ``(f - 2) P`` of optimizer state
    becomes ``(f - 2) P / r``; else all of it."""
    if not config.train or config.shard == "none" or r <= 1:
        return static
    state = (config.optimizer_factor - 2.0) * trained
    return static - state + state / r


def _allreduce(config: HybridConfig, params: float, r: int) -> float:
    """The ring all-reduce of ``params`` gradient bytes among ``r`` replicas once per
    iteration (docs/design.md): ``2 (r-1)/r W / bw + 2 (r-1) lat``, 0 for one replica or in
    inference; the group of ``r`` on its own link where the cluster gives one."""
    if not config.train or r <= 1:
        return 0.0
    bw = (config.group_bytes_per_ms[r] if config.group_bytes_per_ms
          else config.link_bytes_per_ms)
    lat = config.group_latency_ms[r] if config.group_latency_ms else config.link_latency_ms
    return 2.0 * (r - 1) / r * params / bw + 2.0 * (r - 1) * lat


def _period(latency: float, r: int, allreduce: float, m: int) -> float:
    """A stage's time per micro-batch (docs/design.md, "The hybrid DP"): the busiest of ``r``
    replicas runs ``ceil(M / r)`` micro-batches of ``latency`` each, then the all-reduce once
    per iteration of ``M``."""
    return math.ceil(m / r) * latency / m + allreduce / m


def _step(before: int, after: int) -> int:
    """What boundary ``before -> after`` (replica counts) adds to the 1F1B warm-up of every
    stage up to it (docs/design.md, ``1f1b``): the larger count where one divides the other,
    else ``before + after - 1``."""
    if before % after == 0 or after % before == 0:
        return max(before, after)
    return before + after - 1


def judge_hybrid(costs: SequenceCosts, config: HybridConfig, *, time_limit_s: float = 30.0,
                 workers: int = 1, deterministic_s: float | None = None,
                 below_ms: float | None = None) -> JudgeResult:
    """The least bottleneck period over every plan of the sequence that fits (see the module
    docstring), by CP-SAT; ``config.depth`` fixes the number of stages. ``deterministic_s``
    also limits CP-SAT's deterministic time (work counted, not time elapsed: with one worker
    the same answer at any load).

    ``below_ms``: instead, is there a plan whose every stage's period is below ``below_ms``?
    (A proof that a heuristic's period is least: ask below it.) Then only the stages and
    replica counts under it are in the model, with no objective, and each stage's replica
    count is at least the fewest that bring it under: with the contiguity constraints (a
    path in a layered DAG, whose linear relaxation is integral) the relaxation alone already
    counts the fewest devices any plan below ``below_ms`` needs, memory aside."""
    data = _JudgeData.of(costs, config, below_ms)
    model = cp_model.CpModel()
    var = _Variables.of(model, data)
    _add_chain(model, data, var, config)
    binds = _add_warmups(model, data, var, config)
    for k in range(data.slots):
        _add_slot(model, data, var, k, binds, below_ms)
    if below_ms is None:
        model.minimize(var.bottleneck)
    else:
        model.add(sum(data.fewest[p] * xv for k in range(data.slots) for p, xv in var.x[k].items())
                  <= data.devices)
    solver = _solver(workers, time_limit_s, deterministic_s, below_ms)
    status = solver.solve(model)
    return _result(solver, status, data, var, below_ms)


@dataclass
class _JudgeData:
    """The model's data: the stages ``pairs`` (those under ``below_ms`` where asked), each one's
    latency, parameter, static and stash bytes (``numbers``), period per replica count, the
    fewest replicas under ``below_ms``, the micro-batches each may hold (``cap``) and the
    integer scale of the periods; ``cap`` per stage and replica count."""

    n: int
    m: int
    devices: int
    most: int
    reps: range
    slots: int
    pairs: list[tuple[int, int]]
    period: dict[tuple[tuple[int, int], int], float]
    fewest: dict[tuple[int, int], int]
    top: float
    scale: float
    cap: dict[tuple[tuple[int, int], int], int]
    #: ZB-H1 (training): per stage and replica count, for each ``held`` 0..M the most kept
    #: gradients that fit beside it (-1: not even ``held`` alone); empty otherwise
    most_kept: dict[tuple[tuple[int, int], int], list[int]]

    @classmethod
    def of(cls, costs: SequenceCosts, config: HybridConfig, below_ms: float | None
           ) -> _JudgeData:
        n, m, devices = len(costs.forward_ms), config.microbatches, config.devices
        most = min(devices, m)
        reps = range(1, most + 1)
        slots = min(config.max_stages, devices, n)
        if config.depth:
            slots = min(slots, config.depth)
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n + 1)]
        numbers = {p: _stage_numbers(costs, config, *p) for p in pairs}
        period = {(p, r): _period(numbers[p][0], r, _allreduce(config, numbers[p][1], r), m)
                  for p in pairs for r in reps}
        fewest: dict[tuple[int, int], int] = {}  # below_ms: the fewest replicas under it
        if below_ms is not None:
            for p in pairs:
                under = [r for r in reps if period[p, r] < below_ms]
                if under:
                    fewest[p] = under[0]
            pairs = list(fewest)
        top = max(period.values())
        scale = _SCALE_TOP / top if top > 0 else 1.0
        cap: dict[tuple[tuple[int, int], int], int] = {}
        most_kept: dict[tuple[tuple[int, int], int], list[int]] = {}
        zb = config.train and config.train_schedule == "zb-h1"
        for p in pairs:
            _, _, static, stash, trained, kept = numbers[p]
            for r in reps:
                room = config.memory_bytes - _static_on(config, static, trained, r)
                if room < 0:
                    cap[p, r] = -1
                elif stash <= 0 or math.isinf(room):
                    cap[p, r] = m
                else:  # a tiny stash may overflow the quotient to inf: m caps it first
                    cap[p, r] = m if room >= m * stash else math.floor(room / stash)
                if zb:  # memory = static(r) + held * stash + kept * K, counted as written
                    most_kept[p, r] = [
                        max((g for g in range(m + 1)
                             if _static_on(config, static, trained, r) + h * stash + g * kept
                             <= config.memory_bytes), default=-1) for h in range(m + 1)]
        return cls(n, m, devices, most, reps, slots, pairs, period, fewest, top, scale, cap,
                   most_kept)


@dataclass
class _Variables:
    """``x[k][(i, j)]``: slot ``k`` (counted from the pipeline's end) is stage ``[i, j)``;
    ``y[k][r]``: it has ``r`` replicas; ``active[k]``: slot ``k`` holds a stage; ``rep``,
    ``warm``, ``held``, ``kept``: its replicas, 1F1B global warm-up, micro-batches in flight
    per replica and (ZB-H1) those whose gradients it keeps from ``I`` to ``W``;
    ``bottleneck``: the period in integers; ``ending[k][b]`` (``starting``): the choices of
    slot ``k`` that end (start) at boundary ``b``."""

    x: list[dict[tuple[int, int], cp_model.IntVar]]
    y: list[dict[int, cp_model.IntVar]]
    active: list[cp_model.IntVar]
    rep: list[cp_model.IntVar]
    warm: list[cp_model.IntVar]
    held: list[cp_model.IntVar]
    kept: list[cp_model.IntVar]
    bottleneck: cp_model.IntVar
    ending: list[list[list[cp_model.IntVar]]]
    starting: list[list[list[cp_model.IntVar]]]

    @classmethod
    def of(cls, model: cp_model.CpModel, data: _JudgeData) -> _Variables:
        n, m, most, reps, slots, pairs, cap = (data.n, data.m, data.most, data.reps, data.slots,
                                               data.pairs, data.cap)
        top, scale = data.top, data.scale
        # slot 0 ends at n, slot k > 0 before it with room for the k stages after it; the last
        # slot starts at 0 (implied by the constraints below: said here, the relaxation is a path)
        x = [{p: model.new_bool_var(f"x{k}_{p[0]}_{p[1]}") for p in pairs
              if (k == 0) == (p[1] == n) and n - p[1] >= k and (k < slots - 1 or p[0] == 0)
              and max(cap[p, r] for r in reps) >= 1} for k in range(slots)]
        y = [{r: model.new_bool_var(f"y{k}_{r}") for r in reps} for k in range(slots)]
        active = [model.new_bool_var(f"a{k}") for k in range(slots)]
        rep = [model.new_int_var(0, most, f"r{k}") for k in range(slots)]
        warm = [model.new_int_var(0, m, f"w{k}") for k in range(slots)]
        held = [model.new_int_var(0, m, f"h{k}") for k in range(slots)]
        kept = [model.new_int_var(0, m, f"g{k}") for k in range(slots)]
        big = math.ceil(top * scale) + 1
        bottleneck = model.new_int_var(0, big, "period")
        # [k][b]: the choices of slot k that end (start) at boundary b
        ending: list[list[list[cp_model.IntVar]]] = [[[] for _ in range(n + 1)]
                                                     for _ in range(slots)]
        starting: list[list[list[cp_model.IntVar]]] = [[[] for _ in range(n + 1)]
                                                       for _ in range(slots)]
        for k in range(slots):
            for (i, j), v in x[k].items():
                ending[k][j].append(v)
                starting[k][i].append(v)
        return cls(x, y, active, rep, warm, held, kept, bottleneck, ending, starting)


def _add_chain(model: cp_model.CpModel, data: _JudgeData, var: _Variables,
               config: HybridConfig) -> None:
    """The slots chain into one pipeline: each active slot one stage and one replica count,
    slot 0 active, slot ``k`` ending where slot ``k - 1`` starts, exactly one stage starting
    at 0 (``config.depth`` of them active where fixed), at most ``D`` devices."""
    n, slots, devices = data.n, data.slots, data.devices
    x, y, active, rep = var.x, var.y, var.active, var.rep
    ending, starting = var.ending, var.starting
    for k in range(slots):
        model.add(sum(x[k].values()) == active[k])
        model.add(sum(y[k].values()) == active[k])
        model.add(rep[k] == sum(r * v for r, v in y[k].items()))
        if k > 0:  # slot k ends where slot k - 1 starts; none after the first stage
            for b in range(1, n):
                model.add(sum(ending[k][b]) == sum(starting[k - 1][b]))
            model.add(active[k] + sum(starting[k - 1][0]) <= 1)
    model.add(active[0] == 1)
    model.add(sum(v for k in range(slots) for v in starting[k][0]) == 1)
    if config.depth:
        model.add(sum(active) == config.depth)
    model.add(sum(rep) <= devices)


def _add_warmups(model: cp_model.CpModel, data: _JudgeData, var: _Variables,
                 config: HybridConfig) -> bool:
    """The 1F1B warm-ups from the end, ``W_k = min(W_{k-1} + step(r_k, r_{k-1}), M)``, and
    whether memory binds at all (they are counted only then)."""
    m, most, reps, slots, cap = data.m, data.most, data.reps, data.slots, data.cap
    rep, warm = var.rep, var.warm
    # 1F1B: warm-ups from the end, micro-batches in flight per replica (where memory binds:
    # a stage that fits with every micro-batch in flight needs no count)
    binds = config.train and (any(c < m for c in cap.values()) or any(
        g < m for most in data.most_kept.values() for g in most[1:]))
    model.add(warm[0] == 0)
    steps = [(a, b, _step(a, b)) for a in reps for b in reps]
    for k in range(1, slots if binds else 0):
        step = model.new_int_var(0, 2 * most, f"s{k}")
        model.add_allowed_assignments(
            [rep[k], rep[k - 1], step],
            steps + [(0, b, 0) for b in range(0, most + 1)])
        raw = model.new_int_var(0, m + 2 * most, f"raw{k}")
        model.add(raw == warm[k - 1] + step)
        model.add_min_equality(warm[k], [raw, m])
    return binds


def _add_slot(model: cp_model.CpModel, data: _JudgeData, var: _Variables, k: int, binds: bool,
              below_ms: float | None) -> None:
    """Slot ``k``'s micro-batches in flight within its stage's memory (where memory binds), and
    its period: the bottleneck at least it, or (``below_ms``) no stage and replica count over
    ``below_ms`` and at least the fewest replicas under it."""
    m, reps, period, fewest, scale, cap = (data.m, data.reps, data.period, data.fewest,
                                           data.scale, data.cap)
    x, y, rep, warm, held, bottleneck = var.x, var.y, var.rep, var.warm, var.held, var.bottleneck
    if binds:
        # 1F1B: the stage's own window; ZB-H1: the first stage's (the last slot's warm-up:
        # inactive slots repeat the warm-up of the slot before them)
        window = warm[data.slots - 1] if data.most_kept else warm[k]
        table = [(w, r, -(-min(w + 1, m) // r)) for w in range(m + 1) for r in reps]
        model.add_allowed_assignments([window, rep[k], held[k]],
                                      table + [(w, 0, 0) for w in range(m + 1)])
        for p, v in x[k].items():
            for r, yv in y[k].items():
                if cap[p, r] < m:
                    model.add(held[k] <= cap[p, r]).only_enforce_if([v, yv])
        if data.most_kept:
            _add_kept(model, data, var, k, window)
    if below_ms is not None:  # a stage and a replica count over below_ms exclude
        for r, v in y[k].items():  # each other; the fewest replicas under it, a cut
            over = [xv for p, xv in x[k].items() if period[p, r] >= below_ms]
            if over:
                model.add(sum(over) + v <= 1)
        model.add(rep[k] >= sum(fewest[p] * xv for p, xv in x[k].items()))
        return
    for r, v in y[k].items():
        model.add(bottleneck >= sum(math.ceil(period[p, r] * scale) * xv
                                    for p, xv in x[k].items())).only_enforce_if(v)


def _add_kept(model: cp_model.CpModel, data: _JudgeData, var: _Variables, k: int,
              first: cp_model.IntVar) -> None:
    """ZB-H1: slot ``k`` keeps the gradients of ``kept = min(ceil((1 + W_0 - W) / r), held)``
    micro-batches (``first``: ``W_0``), and with ``held = h`` at most ``most_kept[h]`` of them
    fit its stage."""
    m, reps = data.m, data.reps
    rep, warm, held, kept = var.rep, var.warm, var.held, var.kept
    table = [(w0, w, r, min(-(-(1 + w0 - w) // r), -(-min(w0 + 1, m) // r)))
             for w0 in range(m + 1) for w in range(w0 + 1) for r in reps]
    model.add_allowed_assignments([first, warm[k], rep[k], kept[k]],
                                  table + [(w0, w, 0, 0) for w0 in range(m + 1)
                                           for w in range(m + 1)])
    is_held = []
    for h in range(m + 1):
        b = model.new_bool_var(f"held{k}_{h}")
        model.add(held[k] == h).only_enforce_if(b)
        model.add(held[k] != h).only_enforce_if(~b)
        is_held.append(b)
    for p, v in var.x[k].items():
        for r, yv in var.y[k].items():
            for h, most in enumerate(data.most_kept[p, r]):
                if most < m:
                    model.add(kept[k] <= most).only_enforce_if([v, yv, is_held[h]])


def _solver(workers: int, time_limit_s: float, deterministic_s: float | None,
            below_ms: float | None) -> cp_model.CpSolver:
    """CP-SAT with the limits asked; under ``below_ms`` the relaxation decides."""
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = workers
    solver.parameters.max_time_in_seconds = time_limit_s
    if deterministic_s is not None:
        solver.parameters.max_deterministic_time = deterministic_s
    if below_ms is not None:  # the relaxation decides: the whole of it at the root, not
        solver.parameters.linearization_level = 2  # probing first (it took the budget)
        solver.parameters.add_lp_constraints_lazily = False
        solver.parameters.cp_model_probing_level = 0
    return solver


def _result(solver: cp_model.CpSolver, status: cp_model.CpSolverStatus, data: _JudgeData,
            var: _Variables, below_ms: float | None) -> JudgeResult:
    """The judge's answer from CP-SAT's: the plan found, its period in floats, and the bound
    CP-SAT proved."""
    slots, period, scale, x, rep = data.slots, data.period, data.scale, var.x, var.rep
    if status == cp_model.INFEASIBLE:
        return JudgeResult(math.inf, True, bound_ms=math.inf if below_ms is None else below_ms)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return JudgeResult(math.nan, False)
    stages = []
    for k in reversed(range(slots)):
        for p, v in x[k].items():
            if solver.value(v):
                stages.append((p[0], p[1], solver.value(rep[k])))
    best = max(period[(s, e), r] for s, e, r in stages)
    if below_ms is not None:
        return JudgeResult(best, False, tuple(stages))
    # every plan's integer period is at least CP-SAT's bound: its float one, less one unit
    bound = min(best, max(0.0, (solver.best_objective_bound - 1) / scale))
    return JudgeResult(best, status == cp_model.OPTIMAL, tuple(stages), 1.0 / scale, bound)
