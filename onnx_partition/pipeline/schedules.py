"""Pipeline schedules as data: builders, validation and a text grid.

A schedule maps each device ``(stage, replica)`` to the ordered list of actions it runs;
an action such as ``1F0`` is (stage 1, forward, micro-batch 0). Builders:

* :func:`gpipe` -- all forwards, then all backwards (GPipe, Huang et al. 2019).
* :func:`one_f_one_b` -- PipeDream-Flush / 1F1B (Narayanan et al. 2021): a few warm-up
  forwards, then alternate one forward and one backward, then drain the backwards.
* :func:`interleaved` -- interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): each
  of ``p`` devices holds ``v`` model chunks (stages ``d, d + p, ...``), shrinking the bubble
  by ``v``.
* :func:`inference` -- forwards only.

**The registry.** :data:`NAMES` lists every schedule by name and :func:`build` makes one from
its name: the one map from a name to a builder, used by the simulator's callers
(:mod:`.from_plan`), the planner's scorer, the training runtime (:data:`TRAIN_NAMES`, the
ones it runs) and the command line's choices.

A stage with ``d`` replicas sends micro-batch ``m`` to replica ``m % d``; each replica runs
the subsequence of the stage's action list that belongs to its micro-batches. A device is
keyed by its first stage: with ``p`` distinct first stages, device ``(d, r)`` runs the
actions of stages ``s`` with ``s % p == d`` (``p`` = number of stages unless interleaved).
:mod:`onnx_partition.pipeline.simulate` plays them. Pure Python, no ONNX.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.layout import replica_of
from onnx_partition.pipeline.memory import one_f_one_b_warmups

__all__ = [
    "DEFAULT_CHUNKS",
    "NAMES",
    "TRAIN_NAMES",
    "Action",
    "ActionKey",
    "Device",
    "Kind",
    "Schedule",
    "ScheduleError",
    "build",
    "checked_name",
    "gpipe",
    "inference",
    "interleaved",
    "one_f_one_b",
    "pipeline_width",
    "render",
    "validate",
]

#: Every schedule :func:`build` knows, in the order the command line lists them.
NAMES = ("gpipe", "1f1b", "interleaved", "infer")
#: The schedules the training runtime runs (one stage per device).
TRAIN_NAMES = ("1f1b", "gpipe")
#: Model chunks per device of the interleaved schedule unless told.
DEFAULT_CHUNKS = 2


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
ActionKey = tuple[int, bool, int]  # (stage, is_backward, microbatch): a cheaply hashed Action

# ------------------------------------------------------------------- builders


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
            schedule[(stage, r)] = [Action(stage, k, mb) for k, mb in order
                                   if replica_of(mb, d) == r]
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
    else ``d_k + d_k+1 - 1`` (:func:`~onnx_partition.pipeline.memory.one_f_one_b_warmups`,
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


def checked_name(name: str, chunks: int | None = None) -> str:
    """``name`` as :data:`NAMES` spells it (case ignored); :class:`ScheduleError` for an
    unknown name or for ``chunks`` given to a schedule other than ``interleaved``."""
    key = name.lower()
    if key not in NAMES:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")
    if chunks is not None and key != "interleaved":
        raise ScheduleError(f"model chunks per device apply only to the interleaved "
                            f"schedule, not {key}")
    return key


def build(name: str, replicas: Sequence[int], microbatches: int, *,
          chunks: int | None = None) -> Schedule:
    """The schedule called ``name`` (one of :data:`NAMES`) for stages with these replica
    counts and ``microbatches`` micro-batches; ``chunks`` model chunks per device for
    ``interleaved`` only (default :data:`DEFAULT_CHUNKS`). Raises :class:`ScheduleError` for
    an unknown name, chunks given to another schedule, or what the builder refuses."""
    key = checked_name(name, chunks)
    counts = list(replicas)
    if key == "gpipe":
        return gpipe(len(counts), microbatches, counts)
    if key == "1f1b":
        return one_f_one_b(len(counts), microbatches, counts)
    if key == "interleaved":
        return interleaved(len(counts), microbatches,
                           DEFAULT_CHUNKS if chunks is None else chunks, counts)
    return inference(len(counts), microbatches, counts)

# ----------------------------------------------------------------- validation


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
    seen: dict[ActionKey, Device] = {}
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
