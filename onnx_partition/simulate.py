"""Pipeline schedules as data, and a dependency-driven event simulator.

A schedule maps each device ``(stage, replica)`` to the ordered list of actions it runs;
an action such as ``1F0`` is (stage 1, forward, micro-batch 0). Builders:

* :func:`gpipe` -- all forwards, then all backwards (GPipe, Huang et al. 2019).
* :func:`one_f_one_b` -- PipeDream-Flush / 1F1B (Narayanan et al. 2021): a few warm-up
  forwards, then alternate one forward and one backward, then drain the backwards.
* :func:`interleaved` -- interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): each
  of ``p`` devices holds ``v`` model chunks (stages ``d, d + p, ...``), shrinking the bubble
  by ``v``.
* :func:`inference` -- forwards only.

A stage with ``d`` replicas sends micro-batch ``m`` to replica ``m % d``; each replica runs
the subsequence of the stage's action list that belongs to its micro-batches. A device is
keyed by its first stage: with ``p`` distinct first stages, device ``(d, r)`` runs the
actions of stages ``s`` with ``s % p == d`` (``p`` = number of stages unless interleaved).

:func:`simulate` plays a schedule against :class:`PipelineCosts` (plain numbers, no
devices) and returns makespan, throughput, bubble, per-device busy time, peak in-flight
micro-batches and memory, and a timeline for Gantt charts. Pure Python, no ONNX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from onnx_partition.errors import PartitionError
from onnx_partition.solve.stage_model import device_bytes, one_f_one_b_warmups


class ScheduleError(PartitionError, ValueError):
    """An invalid or deadlocking schedule (also a ``ValueError``)."""


class Kind(Enum):
    F = "F"
    B = "B"


_ACTION_RE = re.compile(r"(\d+)([FB])(\d+)")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``str(Action(1, Kind.F, 0)) == "1F0"``."""

    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1B3") == Action(1, Kind.B, 3)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '1F0')")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


Device = tuple[int, int]  # (first stage hosted, replica)
Schedule = dict[Device, list[Action]]
_Key = tuple[int, bool, int]  # (stage, is_backward, microbatch): a cheaply hashed Action


@dataclass(frozen=True)
class StageCosts:
    """Costs of one stage; times are per micro-batch on ONE replica."""

    forward_ms: float
    backward_ms: float
    replicas: int = 1
    allreduce_ms: float = 0.0  # gradient all-reduce once per iteration (train), per replica group
    activation_bytes: float = 0.0  # stashed per in-flight micro-batch
    static_bytes: float = 0.0  # parameters + grads + optimizer state, per replica


@dataclass(frozen=True)
class PipelineCosts:
    """Stage costs plus ``send_ms[b]``: moving one micro-batch across boundary ``b``
    (stage b -> b+1; the gradient going back takes the same time)."""

    stages: Sequence[StageCosts]
    send_ms: Sequence[float]


@dataclass(frozen=True)
class SimResult:
    """Outcome of :func:`simulate`.

    ``busy_ms`` counts forward/backward compute only; all-reduce and waiting are idle, so
    ``bubble_fraction = 1 - sum(busy_ms) / (num_devices * iteration_ms)``.
    ``peak_inflight`` is the most micro-batch chunks (a micro-batch on one hosted stage) whose
    forward ran but backward has not (0 for inference). ``peak_memory_bytes`` is the hosted
    stages' ``static`` plus, in training, the peak over time of the stashed chunks'
    ``activation`` (``static + peak_inflight * activation`` for one stage per device, by
    :func:`~onnx_partition.solve.stage_model.device_bytes`); in
    inference, plus the largest hosted stage's ``activation`` (``static`` alone on an idle
    device). ``allreduce`` maps a stage to its all-reduce window ``(start, end)`` (train,
    when ``allreduce_ms > 0``).
    """

    iteration_ms: float
    throughput_per_s: float
    bubble_fraction: float
    busy_ms: dict[Device, float]
    peak_inflight: dict[Device, int]
    peak_memory_bytes: dict[Device, float]
    timeline: list[tuple[Device, Action, float, float]]
    allreduce: dict[int, tuple[float, float]]


# ---------------------------------------------------------------------------- builders


def _replica_counts(num_stages: int, replicas: Sequence[int] | None) -> list[int]:
    if num_stages < 1:
        raise ScheduleError(f"need at least one stage, got {num_stages}")
    counts = [1] * num_stages if replicas is None else list(replicas)
    if len(counts) != num_stages or any(d < 1 for d in counts):
        raise ScheduleError(f"replicas must be {num_stages} counts >= 1, got {counts}")
    return counts


def _distribute(stage_orders: list[list[tuple[Kind, int]]], counts: list[int]) -> Schedule:
    """Split each stage's action order over its replicas (micro-batch m -> replica m % d)."""
    schedule: Schedule = {}
    for stage, (order, d) in enumerate(zip(stage_orders, counts, strict=True)):
        for r in range(d):
            schedule[(stage, r)] = [Action(stage, k, mb) for k, mb in order if mb % d == r]
    return schedule


def _check_microbatches(num_microbatches: int) -> None:
    if num_microbatches < 1:
        raise ScheduleError(f"need at least one micro-batch, got {num_microbatches}")


def gpipe(
    num_stages: int,
    num_microbatches: int,
    replicas: Sequence[int] | None = None,
    *,
    train: bool = True,
) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all forwards, then all backwards
    (micro-batch order 0..M-1 both ways). Every stage stashes all M micro-batches."""
    counts = _replica_counts(num_stages, replicas)
    _check_microbatches(num_microbatches)
    order = [(Kind.F, mb) for mb in range(num_microbatches)]
    if train:
        order += [(Kind.B, mb) for mb in range(num_microbatches)]
    return _distribute([order] * num_stages, counts)


def inference(
    num_stages: int, num_microbatches: int, replicas: Sequence[int] | None = None
) -> Schedule:
    """Forward-only pipeline: each stage runs micro-batches 0..M-1 in order."""
    return gpipe(num_stages, num_microbatches, replicas, train=False)


def one_f_one_b(
    num_stages: int, num_microbatches: int, replicas: Sequence[int] | None = None
) -> Schedule:
    """PipeDream-Flush / 1F1B (Narayanan et al. 2021).

    Stage s runs ``W_s`` warm-up forwards, then alternates one forward and one backward,
    then drains the remaining backwards; its replicas share the order by round-robin. Without
    replicas ``W_s = p - s - 1`` (the standard schedule; peak in-flight ``min(p - s, M)``).
    With replicas each boundary adds ``max(d_k, d_k+1)`` micro-batches when one count divides
    the other (equal counts: every replica runs Megatron's 1F1B on its own micro-batches),
    else ``d_k + d_k+1 - 1`` (:func:`~onnx_partition.solve.stage_model.one_f_one_b_warmups`,
    whose module gives the peak in-flight per replica in closed form). Warm-ups shrink
    downstream, so it cannot deadlock.
    """
    counts = _replica_counts(num_stages, replicas)
    _check_microbatches(num_microbatches)
    m = num_microbatches
    orders: list[list[tuple[Kind, int]]] = []
    for warmup in one_f_one_b_warmups(counts, m):
        order = [(Kind.F, mb) for mb in range(warmup)]
        for mb in range(warmup, m):
            order += [(Kind.F, mb), (Kind.B, mb - warmup)]
        order += [(Kind.B, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return _distribute(orders, counts)


def interleaved(
    num_stages: int, num_microbatches: int, chunks: int, replicas: Sequence[int] | None = None
) -> Schedule:
    """Interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2), Megatron-LM's order.

    The ``S`` stages run on ``p = S / v`` devices of ``v = chunks`` model chunks each: device
    ``d`` hosts stages ``d, d + p, ..., d + (v-1) p`` and keeps the key ``(d, replica)``.
    Forward step ``k = 0 .. M v - 1`` runs chunk ``(k // p) % v`` on micro-batch
    ``(k // (p v)) p + k % p``; backward step ``k`` runs chunk ``v - 1 - (k // p) % v`` on the
    same micro-batch. Device ``d`` runs ``min(M v, 2 (p - d - 1) + (v - 1) p)`` warm-up
    forward steps, then alternates one forward and one backward step, then drains the
    backwards. Needs ``M % p == 0`` (Megatron's requirement). With ``R`` replicas of every
    stage, replica ``r`` is its own pipeline over micro-batches ``r, r + R, ...`` (the
    simulator's ``m % R`` rule), so ``M % (p R) == 0``. ``chunks == 1`` is :func:`one_f_one_b`
    (any replicas). Each device's bubble is ``(p - 1) / v`` of a micro-batch's full
    forward + backward, ``v`` times less than 1F1B's.
    """
    counts = _replica_counts(num_stages, replicas)
    _check_microbatches(num_microbatches)
    if chunks < 1:
        raise ScheduleError(f"need at least one model chunk per device, got {chunks}")
    if num_stages % chunks:
        raise ScheduleError(
            f"cannot lay out {num_stages} stage(s) as {chunks} model chunks per device: "
            "the chunk count must divide the stage count"
        )
    if chunks == 1:
        return one_f_one_b(num_stages, num_microbatches, counts)
    if len(set(counts)) > 1:
        raise ScheduleError(
            f"the interleaved schedule needs the same replica count in every stage, got {counts}"
        )
    p, v, reps = num_stages // chunks, chunks, counts[0]
    if num_microbatches % (p * reps):
        what = f"{p} device{'s' * (p != 1)}" + (f" x {reps} replicas" if reps > 1 else "")
        raise ScheduleError(
            f"the interleaved schedule needs micro-batches in multiples of {what} = "
            f"{p * reps}, got {num_microbatches}"
        )
    local = num_microbatches // reps  # micro-batches per replica pipeline
    total = local * v  # forward (and backward) steps per device

    def step(k: int, kind: Kind) -> tuple[Kind, int, int]:
        chunk = (k // p) % v
        return kind, (v - 1 - chunk if kind is Kind.B else chunk), (k // (p * v)) * p + k % p

    schedule: Schedule = {}
    for d in range(p):
        warmup = min(total, (p - d - 1) * 2 + (v - 1) * p)
        order = [step(k, Kind.F) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step(warmup + k, Kind.F), step(k, Kind.B)]
        order += [step(k, Kind.B) for k in range(total - warmup, total)]
        for r in range(reps):
            schedule[(d, r)] = [Action(c * p + d, kind, j * reps + r) for kind, c, j in order]
    return schedule


# -------------------------------------------------------------------------- validation


def pipeline_width(devices: Iterable[Device], num_stages: int) -> int:
    """Devices per replica ``p``: the number of distinct first stages when they are
    ``0..p-1`` with ``p < num_stages`` (stages hosted round-robin, device ``d`` running
    stages ``d, d + p, ...``), else ``num_stages``."""
    firsts = sorted({dev[0] for dev in devices})
    p = len(firsts)
    return p if 0 < p < num_stages and firsts == list(range(p)) else num_stages


def validate(
    schedule: Schedule,
    num_stages: int,
    num_microbatches: int,
    train: bool,
    *,
    replicas: Sequence[int] | None = None,
) -> None:
    """Raise :class:`ScheduleError` unless every (stage, kind, micro-batch) appears exactly
    once, on a replica of a device hosting that stage, with a micro-batch's F and B on the same
    device. Device ``(d, r)`` hosts stages ``s`` with ``s % p == d``, where ``p`` is the number
    of distinct first stages (``num_stages`` unless interleaved, see :func:`interleaved`).
    With ``replicas``, the devices must be exactly ``(s % p, 0..replicas[s]-1)``, and the
    stages sharing a device must have equal replica counts."""
    problems: list[str] = []
    p = pipeline_width(schedule, num_stages)
    if replicas is not None:
        counts = _replica_counts(num_stages, replicas)
        want = {(s % p, r) for s, d in enumerate(counts) for r in range(d)}
        if set(schedule) != want:
            problems.append(f"devices {sorted(schedule)} != expected {sorted(want)}")
        for d in range(p):
            shared = counts[d::p]
            if len(set(shared)) > 1:
                problems.append(f"stages {list(range(d, num_stages, p))} share device {d} but "
                                f"have replica counts {shared}")
    seen: dict[_Key, Device] = {}
    for device, actions in schedule.items():
        for a in actions:
            key = (a.stage, a.kind is Kind.B, a.microbatch)
            home = a.stage % p if 0 <= a.stage < num_stages else a.stage  # its device
            if home != device[0]:
                hosts = "stage" if p == num_stages else "first stage"
                problems.append(f"{a} is on device {device} of {hosts} {device[0]}")
            elif a.kind is Kind.B and not train:
                problems.append(f"{a} is a backward in an inference schedule")
            elif not 0 <= a.microbatch < num_microbatches or not 0 <= a.stage < num_stages:
                problems.append(
                    f"{a} is out of range ({num_stages} stages, {num_microbatches} micro-batches)"
                )
            elif key in seen:
                problems.append(f"{a} appears twice (on {seen[key]} and {device})")
            else:
                seen[key] = device
    for s in range(num_stages):
        for mb in range(num_microbatches):
            fwd, bwd = seen.get((s, False, mb)), seen.get((s, True, mb))
            if fwd is None:
                problems.append(f"{s}F{mb} is missing")
            if train and bwd is None:
                problems.append(f"{s}B{mb} is missing")
            if train and fwd is not None and bwd is not None and fwd != bwd:
                problems.append(f"{s}F{mb} on {fwd} but {s}B{mb} on {bwd}")
    if problems:
        more = f" (+{len(problems) - 10} more)" if len(problems) > 10 else ""
        raise ScheduleError("invalid schedule: " + "; ".join(problems[:10]) + more)


def render(schedule: Schedule, marked: dict[Device, int] | None = None) -> str:
    """Step-by-device grid, one row per device; ``marked[dev] = i`` brackets step i."""
    marked = marked or {}
    width = max((len(str(a)) for acts in schedule.values() for a in acts), default=3) + 2
    steps = max((len(acts) for acts in schedule.values()), default=0)
    lines = ["device  " + "".join(f"{i:^{width}}" for i in range(steps)).rstrip()]
    for dev in sorted(schedule):
        cells = [
            f"[{a}]" if marked.get(dev) == i else f" {a} " for i, a in enumerate(schedule[dev])
        ]
        lines.append(f"{dev[0]},{dev[1]:<5} " + "".join(f"{c:^{width}}" for c in cells))
    return "\n".join(line.rstrip() for line in lines)


# --------------------------------------------------------------------------- simulation


def _dependencies(a: Action, last: int) -> list[tuple[_Key, int]]:
    """(action, boundary whose send time applies or -1) that ``a`` waits for."""
    s, mb = a.stage, a.microbatch
    if a.kind is Kind.F:
        return [((s - 1, False, mb), s - 1)] if s else []
    return [((s, False, mb), -1), ((s + 1, True, mb), s)] if s < last else [((s, False, mb), -1)]


def simulate(schedule: Schedule, costs: PipelineCosts) -> SimResult:
    """Play ``schedule`` against ``costs``.

    Each device runs its actions in list order; an action starts once the device is free
    and its dependencies are done: ``sF m`` (s > 0) needs ``(s-1)F m`` + ``send_ms[s-1]``;
    ``sB m`` needs ``sF m`` and, below the last stage, ``(s+1)B m`` + ``send_ms[s]``.
    Sends overlap compute (pure latency). In training each stage's replicas then all-reduce
    gradients for ``allreduce_ms``, starting when all of the group's devices are free: after
    their last backward and, when a device hosts several stages (interleaved), after the
    all-reduce of its lower stages (one at a time, sharing the device's links).
    The number of micro-batches and train/inference are read from the schedule.
    Raises :class:`ScheduleError` on an invalid schedule or a deadlock (with a grid).
    """
    num_stages = len(costs.stages)
    if len(costs.send_ms) != num_stages - 1:
        raise ScheduleError(
            f"send_ms needs {num_stages - 1} entries for {num_stages} stages, "
            f"got {len(costs.send_ms)}"
        )
    all_actions = [a for acts in schedule.values() for a in acts]
    num_mb = max((a.microbatch for a in all_actions), default=-1) + 1
    train = any(a.kind is Kind.B for a in all_actions)
    validate(schedule, num_stages, num_mb, train, replicas=[s.replicas for s in costs.stages])
    width = pipeline_width(schedule, num_stages)  # devices per replica
    shared = width < num_stages  # some device hosts several stages

    last = num_stages - 1
    end: dict[_Key, float] = {}
    pos = dict.fromkeys(schedule, 0)
    free = dict.fromkeys(schedule, 0.0)
    inflight = dict.fromkeys(schedule, 0)
    peak = dict.fromkeys(schedule, 0)
    stashed = dict.fromkeys(schedule, 0.0)  # activation bytes held (several stages per device)
    peak_stashed = dict.fromkeys(schedule, 0.0)
    busy = dict.fromkeys(schedule, 0.0)
    timeline: list[tuple[Device, Action, float, float]] = []
    # Worklist: a device runs its actions until one waits for an action not yet done, then
    # waits on that action's key and is woken when it ends. Every action is handled once; an
    # action's start depends only on its dependencies and its device, so the order of handling
    # does not change the result.
    waiting: dict[_Key, list[Device]] = {}
    work = list(reversed(schedule))
    while work:
        dev = work.pop()
        actions = schedule[dev]
        while pos[dev] < len(actions):
            a = actions[pos[dev]]
            deps = _dependencies(a, last)
            missing = next((d for d, _ in deps if d not in end), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(dev)
                break
            ready = max(
                (end[d] + (costs.send_ms[b] if b >= 0 else 0.0) for d, b in deps), default=0.0
            )
            stage = costs.stages[a.stage]
            forward = a.kind is Kind.F
            duration = stage.forward_ms if forward else stage.backward_ms
            start = max(free[dev], ready)
            key = (a.stage, not forward, a.microbatch)
            end[key] = free[dev] = start + duration
            busy[dev] += duration
            timeline.append((dev, a, start, start + duration))
            inflight[dev] += 1 if forward else -1
            peak[dev] = max(peak[dev], inflight[dev])
            if shared:
                stashed[dev] += stage.activation_bytes if forward else -stage.activation_bytes
                peak_stashed[dev] = max(peak_stashed[dev], stashed[dev])
            pos[dev] += 1
            work.extend(reversed(waiting.pop(key, [])))
    if len(end) < len(all_actions):
        raise ScheduleError(_deadlock_message(schedule, pos, end, last))

    finish = max(free.values(), default=0.0)
    allreduce: dict[int, tuple[float, float]] = {}
    if train:
        for s, stage in enumerate(costs.stages):
            if stage.allreduce_ms > 0:
                t0 = max(free[(s % width, r)] for r in range(stage.replicas))
                for r in range(stage.replicas):
                    free[(s % width, r)] = t0 + stage.allreduce_ms
                allreduce[s] = (t0, t0 + stage.allreduce_ms)
                finish = max(finish, t0 + stage.allreduce_ms)

    memory: dict[Device, float] = {}
    for dev, actions in schedule.items():
        hosted = [costs.stages[s] for s in range(dev[0], num_stages, width)]
        static = sum(stage.static_bytes for stage in hosted)
        if not train:  # the micro-batch being computed, of the largest stage it runs
            ran = {a.stage for a in actions}
            largest = max((costs.stages[s].activation_bytes for s in ran), default=0.0)
            memory[dev] = device_bytes(static, largest, 1 if ran else 0)
        elif shared:
            memory[dev] = device_bytes(static, peak_stashed[dev], 1)
        else:
            memory[dev] = device_bytes(static, hosted[0].activation_bytes, peak[dev])
    if not train:
        peak = dict.fromkeys(schedule, 0)
    timeline.sort(key=lambda item: (item[2], item[0]))
    return SimResult(
        iteration_ms=finish,
        throughput_per_s=num_mb / finish * 1000.0 if finish > 0 else float("inf"),
        bubble_fraction=1.0 - sum(busy.values()) / (len(schedule) * finish) if finish else 0.0,
        busy_ms=busy,
        peak_inflight=peak,
        peak_memory_bytes=memory,
        timeline=timeline,
        allreduce=allreduce,
    )


def _deadlock_message(
    schedule: Schedule, pos: dict[Device, int], end: dict[_Key, float], last: int
) -> str:
    stuck = {dev: i for dev, i in pos.items() if i < len(schedule[dev])}
    waits = []
    for dev, i in sorted(stuck.items()):
        a = schedule[dev][i]
        missing = ", ".join(
            str(Action(d[0], Kind.B if d[1] else Kind.F, d[2]))
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


# ------------------------------------------------------------------------- closed forms


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
