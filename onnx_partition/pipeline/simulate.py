"""A dependency-driven event simulator of pipeline schedules, and closed forms to check it.

:func:`simulate` plays a schedule (:mod:`onnx_partition.pipeline.schedules`) against
:class:`PipelineCosts` (plain numbers, no devices) and returns makespan, throughput, bubble,
per-device busy time, peak in-flight micro-batches and memory, the all-reduce windows, and a
timeline for Gantt charts. :func:`simulate_schedule` gives the same figures, bit for bit, for a
schedule named in the registry, without the timeline and about 10 times faster: the planner
scores every proposal with it. Pure Python, no ONNX.

:func:`backward_factor` is the one rule for a backward time derived from a forward time: the
analytic cost model prices each operator by it (``cost.analytic``, which says which operators
are dense), a costs file's node without ``backward_ms`` and a plan that stores only forward +
backward per stage (:mod:`.from_plan`) take its figure for an operator of unknown class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from onnx_partition.pipeline.layout import replica_of
from onnx_partition.pipeline.memory import device_bytes
from onnx_partition.pipeline.schedules import (
    Action,
    ActionKey,
    Device,
    Kind,
    Schedule,
    ScheduleError,
    action_key,
    build,
    checked_name,
    pipeline_width,
    render,
    stage_orders,
    validate,
)

__all__ = ["PipelineCosts", "SimResult", "StageCosts", "backward_factor", "bubble_closed_form",
           "bubble_closed_form_interleaved", "pipeline_time_closed_form", "simulate",
           "simulate_schedule"]


def backward_factor(dense: bool | None = None) -> float:
    """Backward time over forward time, the one rule: 2 for a dense operator (matrix products,
    convolutions, attention: the gradients of both operands, each as costly as the forward), 1
    for any other (one gradient the size of its output), and 2 where the class is not known (a
    measured node without a backward time, a stage's forward + backward stored whole): the
    dense figure, as dense operators carry most of a model's training time."""
    return 1.0 if dense is False else 2.0


@dataclass(frozen=True)
class StageCosts:
    """Costs of one stage; times are per micro-batch on ONE replica.

    ``backward_input_ms`` and ``backward_weight_ms`` are the two halves of ``backward_ms``
    that zero-bubble schedules run as separate ``I`` and ``W`` actions; where not given the
    backward splits in half (:meth:`split`). ``recompute``: the stage keeps only its
    ``input_bytes`` per micro-batch in flight and runs its forward again at the start of its
    backward (``B`` or ``I``), holding one micro-batch's activations then (until ``W``).
    ``action_ms``: the engine's fixed work per action (receiving headers, copying and posting
    sends, stashing, freeing graphs; :mod:`onnx_partition.cost.engine_price`), added to every action
    of the stage (``F``, ``B``, ``I``, ``W``; inference's ``F`` too where given) and counted as
    busy time: it occupies the device. It does not grow with the rows. ``kept_bytes``: the
    output gradients an ``I`` keeps for its ``W`` (ZB-H1; :mod:`onnx_partition.pipeline.
    memory`), held from the end of the ``I`` to the end of the ``W``."""

    forward_ms: float
    backward_ms: float
    replicas: int = 1
    allreduce_ms: float = 0.0  # gradient all-reduce once per iteration (train), per replica group
    activation_bytes: float = 0.0  # stashed per in-flight micro-batch
    static_bytes: float = 0.0  # parameters + grads + optimizer state, per replica
    backward_input_ms: float | None = None
    backward_weight_ms: float | None = None
    recompute: bool = False
    input_bytes: float = 0.0  # received per micro-batch: what a recomputing stage keeps
    step_ms: float = 0.0  # once per iteration after every device is done: the optimizer step
    # added to a B (W under zero bubble) of every micro-batch but a replica's first: adding its
    # parameters' gradients to those of the earlier micro-batches (the first sets them)
    accumulate_ms: float = 0.0
    # what the engine's split backward adds to a micro-batch's I + W over its B (one more graph
    # walk and one autograd call per weight group, cost.engine_price.split_ms): half to each
    split_ms: float = 0.0
    action_ms: float = 0.0  # the engine's work per action, whatever its kind
    kept_bytes: float = 0.0  # kept from an I to its W, per micro-batch

    def split(self) -> tuple[float, float]:
        """(input-gradient, weight-gradient) ms: as given (one given: the other is the rest
        of ``backward_ms``), else half of ``backward_ms`` each (a dense operator's two
        gradients, :func:`backward_factor`)."""
        i, w = self.backward_input_ms, self.backward_weight_ms
        if i is None and w is None:
            return self.backward_ms / 2.0, self.backward_ms / 2.0
        if i is None:
            return max(self.backward_ms - float(w or 0.0), 0.0), float(w or 0.0)
        if w is None:
            return i, max(self.backward_ms - i, 0.0)
        return i, w

    def duration(self, kind: Kind) -> float:
        """The time of one action of ``kind`` (recomputation adds a forward to B and I), with
        the engine's ``action_ms``."""
        return self._compute(kind) + self.action_ms

    def _compute(self, kind: Kind) -> float:
        if kind is Kind.F:
            return self.forward_ms
        again = self.forward_ms if self.recompute else 0.0
        if kind is Kind.B:
            return self.backward_ms + again
        i, w = self.split()
        return (i + again if kind is Kind.I else w) + self.split_ms / 2.0


@dataclass(frozen=True)
class PipelineCosts:
    """Stage costs plus ``send_ms[b]``: moving one micro-batch across boundary ``b``
    (stage b -> b+1; the gradient going back takes the same time)."""

    stages: Sequence[StageCosts]
    send_ms: Sequence[float]

    def at_rows(self, scale: float) -> PipelineCosts:
        """These costs at ``scale`` times the rows per micro-batch: what grows with the rows
        (compute, activations, received bytes, hops) is multiplied by ``scale``; what does not
        (the per-step ``step_ms``, the gradients' ``accumulate_ms`` and ``allreduce_ms``, the
        parameters' ``static_bytes``, the split's per-call ``split_ms``, the engine's
        per-action ``action_ms``) is kept. Linear in the
        batch, the assumption ``partition`` makes for costs files."""
        if scale == 1.0:
            return self

        def times(x: float | None) -> float | None:
            return None if x is None else x * scale

        return PipelineCosts(
            [replace(s, forward_ms=s.forward_ms * scale, backward_ms=s.backward_ms * scale,
                     backward_input_ms=times(s.backward_input_ms),
                     backward_weight_ms=times(s.backward_weight_ms),
                     activation_bytes=s.activation_bytes * scale,
                     input_bytes=s.input_bytes * scale,
                     kept_bytes=s.kept_bytes * scale) for s in self.stages],
            [x * scale for x in self.send_ms])


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    ``busy_ms`` counts forward/backward compute (with the gradients' accumulation) and the
    engine's work per action (``action_ms``); the all-reduce, the per-step work and waiting
    are idle, so
    ``bubble_fraction = 1 - sum(busy_ms) / (num_devices * iteration_ms)``.
    ``peak_inflight`` is the most micro-batch chunks (a micro-batch on one hosted stage) whose
    forward ran but backward has not (0 for inference). ``peak_memory_bytes`` is the hosted
    stages' ``static`` plus, in training, the peak over time of the stashed chunks'
    ``activation`` (``static + peak_inflight * activation`` for one stage per device, by
    :func:`~onnx_partition.pipeline.memory.device_bytes`); in
    inference, plus the largest hosted stage's ``activation`` (``static`` alone on an idle
    device). ``allreduce`` maps a stage to its all-reduce window ``(start, end)`` (train,
    when ``allreduce_ms > 0``). ``timeline``: every action's ``(device, action, start, end)``,
    empty from :func:`simulate_schedule` (the planner's scorer).
    """

    iteration_ms: float
    throughput_per_s: float
    bubble_fraction: float
    busy_ms: dict[Device, float]
    peak_inflight: dict[Device, int]
    peak_memory_bytes: dict[Device, float]
    timeline: list[tuple[Device, Action, float, float]]
    allreduce: dict[int, tuple[float, float]]
    schedule: str = ""  # the schedule's name, where the caller knows it (from_plan does)

# ----------------------------------------------------------------- simulation


def _dependencies(a: Action, last: int) -> list[tuple[ActionKey, int]]:
    """(action, boundary whose send time applies or -1) that ``a`` waits for: a forward the
    one of the stage above; a backward (``B`` or ``I``) its forward and the input gradient
    of the stage below (its ``B`` or ``I``); a ``W`` its own ``I``."""
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F:
        return [((s - 1, 0, mb), s - 1)] if s else []
    if a.kind is Kind.W:
        return [((s, 1, mb), -1)]
    return [((s, 0, mb), -1), ((s + 1, 1, mb), s)] if s < last else [((s, 0, mb), -1)]


def simulate(schedule: Schedule, costs: PipelineCosts) -> SimResult:
    """Play ``schedule`` against ``costs``.

    Each device runs its actions in list order; an action starts once the device is free
    and its dependencies are done: ``sF m`` (s > 0) needs ``(s-1)F m`` + ``send_ms[s-1]``;
    ``sB m`` (or ``sI m``) needs ``sF m`` and, below the last stage, ``(s+1)B m`` (or
    ``(s+1)I m``) + ``send_ms[s]``; ``sW m`` needs ``sI m``. A micro-batch's activations are
    held from its ``F`` to its ``B`` or ``W``. A ``B`` or ``W`` takes ``accumulate_ms`` more
    for every micro-batch but each replica's first (gradients added to the earlier ones'),
    and every action its stage's ``action_ms`` (the engine's own work around it, busy time).
    Sends overlap compute (pure latency). In training each stage's replicas then all-reduce
    gradients for ``allreduce_ms``, starting when all of the group's devices are free: after
    their last backward and, when a device hosts several stages (interleaved), after the
    all-reduce of its lower stages (one at a time, sharing the device's links). Then every
    device meets every other (the gradient norm's all-reduce) and steps its optimizer: the
    iteration ends ``max(step_ms)`` after the last device is free (a stage's ``step_ms``:
    its optimizer step and the step's barriers, :mod:`onnx_partition.cost.engine_price`).
    The number of micro-batches and train/inference are read from the schedule.
    Raises :class:`ScheduleError` on an invalid schedule or a deadlock (with a grid).
    """
    num_mb, train = _checked_shape(schedule, costs)
    num_stages = len(costs.stages)
    width = pipeline_width(schedule, num_stages)  # devices per replica
    engine = _Engine(schedule, costs, shared=width < num_stages)
    engine.run()
    ran = {dev: {a.stage for a in acts} for dev, acts in schedule.items()} if not train else {}
    memory = _memory(costs, ran, width, train, engine.shared, engine.peak, engine.peak_stashed)
    engine.timeline.sort(key=lambda item: (item[2], item[0]))
    return _outcome(costs, width, num_mb, train, engine.free, engine.busy, engine.peak,
                    memory, engine.timeline)


def _outcome(costs: PipelineCosts, width: int, num_mb: int, train: bool,
             free: dict[Device, float], busy: dict[Device, float], peak: dict[Device, int],
             memory: dict[Device, float], timeline: list[tuple[Device, Action, float, float]]
             ) -> SimResult:
    """The :class:`SimResult` of a played schedule: the all-reduce windows after each device's
    last action (``free`` moves on past them), then the step."""
    finish = max(free.values(), default=0.0)
    allreduce = _allreduce(costs, free, width) if train else {}
    finish = max([finish, *(t1 for _, t1 in allreduce.values())])
    if train:  # the step's closing barrier, then every stage's optimizer step side by side
        finish += max((s.step_ms for s in costs.stages), default=0.0)
    return SimResult(
        iteration_ms=finish,
        throughput_per_s=num_mb / finish * 1000.0 if finish > 0 else float("inf"),
        bubble_fraction=1.0 - sum(busy.values()) / (len(free) * finish) if finish else 0.0,
        busy_ms=busy,
        peak_inflight=peak if train else dict.fromkeys(free, 0),
        peak_memory_bytes=memory,
        timeline=timeline,
        allreduce=allreduce,
    )


def _checked_shape(schedule: Schedule, costs: PipelineCosts) -> tuple[int, bool]:
    """The schedule's micro-batch count and whether it trains, once it and ``costs`` agree."""
    num_stages = len(costs.stages)
    if len(costs.send_ms) != num_stages - 1:
        raise ScheduleError(
            f"send_ms needs {num_stages - 1} entries for {num_stages} stages, "
            f"got {len(costs.send_ms)}"
        )
    all_actions = [a for acts in schedule.values() for a in acts]
    num_mb = max((a.microbatch for a in all_actions), default=-1) + 1
    train = any(a.kind is not Kind.F for a in all_actions)
    validate(schedule, num_stages, num_mb, train, replicas=[s.replicas for s in costs.stages])
    return num_mb, train


class _Engine:
    """The event engine: plays every device's actions and keeps each device's figures."""

    def __init__(self, schedule: Schedule, costs: PipelineCosts, *, shared: bool) -> None:
        self.schedule, self.costs = schedule, costs
        # bytes counted action by action: a device hosting several stages, or recomputation
        self.shared = shared or any(s.recompute or s.kept_bytes for s in costs.stages)
        self.last = len(costs.stages) - 1
        self.end: dict[ActionKey, float] = {}
        self.pos = dict.fromkeys(schedule, 0)
        self.free = dict.fromkeys(schedule, 0.0)
        self.inflight = dict.fromkeys(schedule, 0)
        self.peak = dict.fromkeys(schedule, 0)
        self.stashed = dict.fromkeys(schedule, 0.0)  # activation bytes held (shared devices)
        self.peak_stashed = dict.fromkeys(schedule, 0.0)
        self.busy = dict.fromkeys(schedule, 0.0)
        self.timeline: list[tuple[Device, Action, float, float]] = []

    def run(self) -> None:
        """Run every action once; raise :class:`ScheduleError` on a deadlock.

        Worklist: a device runs its actions until one waits for an action not yet done, then
        waits on that action's key and is woken when it ends. Every action is handled once; an
        action's start depends only on its dependencies and its device, so the order of
        handling does not change the result.
        """
        schedule = self.schedule
        waiting: dict[ActionKey, list[Device]] = {}
        work = list(reversed(schedule))
        while work:
            dev = work.pop()
            actions = schedule[dev]
            while self.pos[dev] < len(actions):
                a = actions[self.pos[dev]]
                deps = _dependencies(a, self.last)
                missing = next((d for d, _ in deps if d not in self.end), None)
                if missing is not None:
                    waiting.setdefault(missing, []).append(dev)
                    break
                key = self._execute(dev, a, deps)
                self.pos[dev] += 1
                work.extend(reversed(waiting.pop(key, [])))
        if len(self.end) < sum(len(acts) for acts in schedule.values()):
            raise ScheduleError(_deadlock_message(schedule, self.pos, self.end, self.last))

    def _execute(self, dev: Device, a: Action, deps: list[tuple[ActionKey, int]]) -> ActionKey:
        """Run ``a`` on ``dev`` once the device is free and ``deps`` (all done) have arrived."""
        ready = max(
            (self.end[d] + (self.costs.send_ms[b] if b >= 0 else 0.0) for d, b in deps),
            default=0.0,
        )
        stage = self.costs.stages[a.stage]
        duration = stage.duration(a.kind)
        if a.kind in (Kind.B, Kind.W) and a.microbatch >= stage.replicas:
            duration += stage.accumulate_ms  # replica j's first micro-batch is j
        start = max(self.free[dev], ready)
        key = action_key(a)
        self.end[key] = self.free[dev] = start + duration
        self.busy[dev] += duration
        self.timeline.append((dev, a, start, start + duration))
        if a.kind is not Kind.I:  # an I keeps the micro-batch's activations for its W
            self.inflight[dev] += 1 if a.kind is Kind.F else -1
        self.peak[dev] = max(self.peak[dev], self.inflight[dev])
        if self.shared:
            held, during = _held_bytes(stage, a.kind)
            self.peak_stashed[dev] = max(self.peak_stashed[dev], self.stashed[dev] + during)
            self.stashed[dev] += held
        return key


def _held_bytes(stage: StageCosts, kind: Kind) -> tuple[float, float]:
    """(change of the bytes a device holds once ``kind`` ends, extra bytes while it runs) for
    one action of ``stage``: a forward stashes the micro-batch (only its inputs when the
    stage recomputes); ``B`` and ``W`` free it; a recomputing stage's ``B`` holds its
    activations again while it runs and its ``I`` holds them until the ``W``; an ``I`` keeps
    the stage's ``kept_bytes`` until the ``W``."""
    full = stage.activation_bytes
    kept = min(stage.input_bytes, full) if stage.recompute else full
    again = full - kept  # rebuilt by recomputation
    if kind is Kind.F:  # the whole forward's activations exist while it runs
        return kept, full
    if kind is Kind.B:
        return -kept, again
    if kind is Kind.I:
        return again + stage.kept_bytes, again + stage.kept_bytes
    return -full - stage.kept_bytes, 0.0


def _allreduce(
    costs: PipelineCosts, free: dict[Device, float], width: int
) -> dict[int, tuple[float, float]]:
    """Each stage's all-reduce window, in stage order, once all of its replicas' devices are
    free; ``free`` moves on past each window."""
    windows: dict[int, tuple[float, float]] = {}
    for s, stage in enumerate(costs.stages):
        if stage.allreduce_ms > 0:
            t0 = max(free[(s % width, r)] for r in range(stage.replicas))
            for r in range(stage.replicas):
                free[(s % width, r)] = t0 + stage.allreduce_ms
            windows[s] = (t0, t0 + stage.allreduce_ms)
    return windows


def _memory(costs: PipelineCosts, ran: dict[Device, set[int]], width: int, train: bool,
            shared: bool, peak: dict[Device, int], peak_stashed: dict[Device, float]
            ) -> dict[Device, float]:
    """Peak bytes per device (see :class:`SimResult`); ``ran``: the stages each device ran
    (read in inference only)."""
    stages = costs.stages
    memory: dict[Device, float] = {}
    for dev in peak:
        hosted = [stages[s] for s in range(dev[0], len(stages), width)]
        static = sum(stage.static_bytes for stage in hosted)
        if not train:  # the micro-batch being computed, of the largest stage it runs
            largest = max((stages[s].activation_bytes for s in ran[dev]), default=0.0)
            memory[dev] = device_bytes(static, largest, 1 if ran[dev] else 0)
        elif shared:
            memory[dev] = device_bytes(static, peak_stashed[dev], 1)
        else:
            memory[dev] = device_bytes(static, hosted[0].activation_bytes, peak[dev])
    return memory


# ------------------------------------------------------------ the planner's scorer

_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)
_PART = (0, 1, 1, 2)  # F, B, I, W -> ActionKey's part (a B and an I deliver the same)
_DELTA = (1, -1, 0, -1)  # micro-batches in flight after each kind (an I keeps its W's)


def simulate_schedule(name: str, replicas: Sequence[int], microbatches: int,
                      costs: PipelineCosts) -> SimResult:
    """``simulate(build(name, replicas, microbatches), costs)`` with an empty timeline: the
    same recurrences (start = max(device free, dependencies' ends + sends)) on the same
    floats in the same order, so every figure is equal bit for bit, played on plain lists
    from the builders' stage orders (:func:`~onnx_partition.pipeline.schedules.stage_orders`):
    no :class:`Action` per action, no validation (the builders' schedules are valid: the
    tests check it), no timeline (the planner keeps every played plan, and none reads one:
    the 70B tournament's timelines were 2.34 GB). The planner's scorer.

    Exact, not a steady state extrapolated: a period of 1F1B's steady state is exact in real
    numbers, but ``t + k * period`` is not the float the simulator's ``k`` additions give, and
    a plan chosen within :data:`~onnx_partition.solve.devices.DEVICE_SLACK` or by a tie could
    change; a lean pass over every action is fast enough (docs/benchmarks.md). Interleaved
    schedules (devices hosting several stages) go to :func:`simulate`."""
    orders = stage_orders(name, replicas, microbatches)
    counts = list(replicas)
    if orders is None:
        return replace(simulate(build(name, counts, microbatches), costs), timeline=[])
    if len(costs.send_ms) != len(costs.stages) - 1 or counts != [
            s.replicas for s in costs.stages]:
        _checked_shape(build(name, counts, microbatches), costs)  # raises its message
    lean = _Lean(orders, counts, costs, microbatches)
    if not lean.run():  # a deadlock: the full engine says where
        simulate(build(name, counts, microbatches), costs)
    train = checked_name(name) != "infer"
    devices = lean.devices
    free = dict(zip(devices, lean.free))
    peak = dict(zip(devices, lean.peak))
    ran = ({} if train else  # inference's memory: the stage a device ran, if any
           {dev: {dev[0]} if lane else set() for dev, lane in zip(devices, lean.lanes)})
    memory = _memory(costs, ran, len(counts), train, lean.shared, peak,
                     dict(zip(devices, lean.top)))
    return _outcome(costs, len(counts), microbatches, train, free,
                    dict(zip(devices, lean.busy)), peak, memory, [])


def _coded(order: list[tuple[Kind, int]]) -> list[tuple[int, int]]:
    """``order`` with each kind as its index in :data:`_KINDS` (by identity: hashing an
    :class:`~enum.Enum` member runs Python code)."""
    f, b, i = Kind.F, Kind.B, Kind.I
    return [(0 if k is f else 1 if k is b else 2 if k is i else 3, mb) for k, mb in order]


class _Lean:
    """:class:`_Engine`'s worklist on lists indexed by device and micro-batch (one stage per
    device): ``ends[part][stage][mb]`` is None until that action is done."""

    def __init__(self, orders: list[list[tuple[Kind, int]]], counts: list[int],
                 costs: PipelineCosts, m: int) -> None:
        stages = costs.stages
        self.devices: list[Device] = [(s, r) for s, d in enumerate(counts) for r in range(d)]
        self.stage = [dev[0] for dev in self.devices]
        self.lanes: list[list[tuple[int, int]]] = []
        for order, d in zip(orders, counts, strict=True):
            coded = _coded(order)
            if d == 1:
                self.lanes.append(coded)
                continue
            lanes: list[list[tuple[int, int]]] = [[] for _ in range(d)]
            for action in coded:
                lanes[replica_of(action[1], d)].append(action)
            self.lanes += lanes
        self.counts, self.m, self.send = counts, m, list(costs.send_ms)
        self.ends: list[list[list[float | None]]] = [
            [[None] * m for _ in stages] for _ in range(3)]
        self.first = [[s.duration(kind) for kind in _KINDS] for s in stages]
        self.later = [[t + s.accumulate_ms if kind in (Kind.B, Kind.W) else t
                       for t, kind in zip(first, _KINDS)]
                      for s, first in zip(stages, self.first)]
        self.held = [[_held_bytes(s, kind) for kind in _KINDS] for s in stages]
        self.shared = any(s.recompute or s.kept_bytes for s in stages)
        n = len(self.devices)
        self.pos, self.peak, self.inflight = [0] * n, [0] * n, [0] * n
        self.free, self.busy = [0.0] * n, [0.0] * n
        self.stashed, self.top = [0.0] * n, [0.0] * n

    def run(self) -> bool:
        """Play every device's lane; False on a deadlock (an action never ready)."""
        waiting: dict[int, list[int]] = {}
        work = list(range(len(self.devices) - 1, -1, -1))
        while work:
            self._advance(work.pop(), waiting, work)
        return sum(self.pos) == sum(len(lane) for lane in self.lanes)

    def _advance(self, d: int, waiting: dict[int, list[int]], work: list[int]) -> None:
        """Run device ``d``'s actions until one waits (filed in ``waiting`` under the key
        ``(part * stages + stage) * M + mb`` of what it waits for); devices waiting for an
        action run go back on ``work``. :meth:`_Engine._execute`'s arithmetic, term by term."""
        s, m, last = self.stage[d], self.m, len(self.counts) - 1
        span = (last + 1) * m
        lane, i = self.lanes[d], self.pos[d]
        fwd, grad, wgt = self.ends[0][s], self.ends[1][s], self.ends[2][s]
        above = self.ends[0][s - 1] if s else None
        below = self.ends[1][s + 1] if s < last else None
        send_in = self.send[s - 1] if s else 0.0
        send_out = self.send[s] if s < last else 0.0
        first, later, held, reps = self.first[s], self.later[s], self.held[s], self.counts[s]
        free, busy, inflight, peak = self.free[d], self.busy[d], self.inflight[d], self.peak[d]
        stashed, top, shared = self.stashed[d], self.top[d], self.shared
        while i < len(lane):
            k, mb = lane[i]
            if k == 0:  # F: the stage above's F, sent
                e = above[mb] if above is not None else 0.0
                if e is None:
                    waiting.setdefault((s - 1) * m + mb, []).append(d)
                    break
                ready, ends = (e + send_in if above is not None else 0.0), fwd
            elif k == 3:  # W: its own I
                e = grad[mb]
                if e is None:
                    waiting.setdefault(span + s * m + mb, []).append(d)
                    break
                ready, ends = e + 0.0, wgt
            else:  # B or I: its F, and the stage below's B or I, sent
                e = fwd[mb]
                if e is None:
                    waiting.setdefault(s * m + mb, []).append(d)
                    break
                ready, ends = e + 0.0, grad
                if below is not None:
                    e = below[mb]
                    if e is None:
                        waiting.setdefault(span + (s + 1) * m + mb, []).append(d)
                        break
                    e += send_out
                    ready = e if e > ready else ready
            duration = later[k] if mb >= reps else first[k]
            start = ready if ready > free else free
            ends[mb] = free = start + duration
            busy += duration
            inflight += _DELTA[k]
            peak = inflight if inflight > peak else peak
            if shared:
                change, during = held[k]
                top = stashed + during if stashed + during > top else top
                stashed += change
            i += 1
            woken = waiting.pop(_PART[k] * span + s * m + mb, None)
            if woken is not None:
                work.extend(reversed(woken))
        self.pos[d], self.free[d], self.busy[d] = i, free, busy
        self.inflight[d], self.peak[d], self.stashed[d], self.top[d] = inflight, peak, stashed, top


def _deadlock_message(
    schedule: Schedule, pos: dict[Device, int], end: dict[ActionKey, float], last: int
) -> str:
    stuck = {dev: i for dev, i in pos.items() if i < len(schedule[dev])}
    waits = []
    for dev, i in sorted(stuck.items()):
        a = schedule[dev][i]
        missing = ", ".join(
            str(Action(d[0], (Kind.F, Kind.B if a.kind is Kind.B else Kind.I, Kind.W)[d[1]],
                       d[2]))
            for d, _ in _dependencies(a, last)
            if d not in end
        )
        waits.append(f"device {dev} is stuck at {a} waiting for {missing}")
    return (
        "schedule deadlocks: no device can start its next action\n  "
        + "\n  ".join(waits)
        + "\nschedule (stuck actions in brackets):\n"
        + render(schedule, stuck)
    )

# --------------------------------------------------------------- closed forms


def bubble_closed_form(p: int, m: int) -> float:
    """Bubble fraction of GPipe and 1F1B with p equal stages and m micro-batches:
    ``(p-1) / (m+p-1)`` (Huang et al. 2019; Narayanan et al. 2021)."""
    return (p - 1) / (m + p - 1)


def bubble_closed_form_interleaved(p: int, m: int, v: int) -> float:
    """Bubble fraction of interleaved 1F1B with p devices of v equal chunks each and m
    micro-batches (``m % p == 0``): ``(p-1) / (v m + p - 1)``. The bubble time is
    ``(p-1)/v`` of a device's full micro-batch forward + backward ``t``, so the iteration takes
    ``(m + (p-1)/v) t`` (Narayanan et al., SC'21, section 2.2.2); ``v = 1`` is 1F1B."""
    return (p - 1) / (v * m + p - 1)


def pipeline_time_closed_form(t_max: float, p: int, m: int) -> float:
    """Makespan ``(m+p-1) * t_max`` of p equal stages, each taking ``t_max`` per
    micro-batch (``forward + backward`` in training), without communication."""
    return (m + p - 1) * t_max
