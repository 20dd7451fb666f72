"""Pipeline schedules as data: builders, validation and a text grid.

A schedule maps each device ``(stage, replica)`` to the ordered list of actions it runs;
an action such as ``1F0`` is (stage 1, forward, micro-batch 0). Builders:

* :func:`gpipe` -- all forwards, then all backwards (GPipe, Huang et al. 2019).
* :func:`one_f_one_b` -- PipeDream-Flush / 1F1B (Narayanan et al. 2021): a few warm-up
  forwards, then alternate one forward and one backward, then drain the backwards.
* :func:`interleaved` -- interleaved 1F1B (Narayanan et al., SC'21, section 2.2.2): each
  of ``p`` devices holds ``v`` model chunks (stages ``d, d + p, ...``), shrinking the bubble
  by ``v``.
* :func:`zb_h1` -- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's
  order with each backward split into an input-gradient pass ``I`` (what the stage below
  waits for) and a weight-gradient pass ``W``, stage ``s`` deferring ``s`` of its W passes to
  fill the bubble, so no device holds more micro-batches than 1F1B's first stage.
* :func:`inference` -- forwards only.

**Actions.** ``F`` forward, ``B`` the whole backward, ``I`` its input-gradient half and ``W``
its weight-gradient half (``I`` then ``W`` is ``B``). A micro-batch's backward on a stage is
either one ``B`` or an ``I`` and a ``W``, on the device of its ``F``.

**The registry.** :data:`REGISTRY` maps every schedule name to its :class:`ScheduleSpec`
(builder, the modes it serves, a description); :data:`NAMES` lists them and :func:`build`
makes one from its name: the one map from a name to a builder, used by the simulator's callers
(:mod:`.from_plan`), the planner's scorer, the training runtime (:data:`TRAIN_NAMES`, the
ones it runs) and every verb's ``--schedule`` choices.

A stage with ``d`` replicas sends micro-batch ``m`` to replica ``m % d``; each replica runs
the subsequence of the stage's action list that belongs to its micro-batches. A device is
keyed by its first stage: with ``p`` distinct first stages, device ``(d, r)`` runs the
actions of stages ``s`` with ``s % p == d`` (``p`` = number of stages unless interleaved).
:mod:`onnx_partition.pipeline.simulate` plays them. Pure Python, no ONNX.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.layout import replica_of
from onnx_partition.pipeline.memory import one_f_one_b_warmups

__all__ = [
    "DEFAULT_CHUNKS",
    "NAMES",
    "PLANNED_NAMES",
    "REGISTRY",
    "TRAIN_NAMES",
    "Action",
    "ActionKey",
    "Device",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "action_key",
    "build",
    "checked_name",
    "gpipe",
    "inference",
    "interleaved",
    "one_f_one_b",
    "pipeline_width",
    "render",
    "stage_orders",
    "validate",
    "zb_h1",
]

#: Model chunks per device of the interleaved schedule unless told.
DEFAULT_CHUNKS = 2


class ScheduleError(PartitionError, ValueError):
    """An invalid or deadlocking schedule (also a ``ValueError``)."""


class Kind(Enum):
    """F forward; B whole backward; I input-gradient backward; W weight-gradient backward."""

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the paper's letter)
    W = "W"


_ACTION_RE = re.compile(r"(\d+)([FBIW])(\d+)")


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
        """Inverse of ``str``: ``Action.parse("1I3") == Action(1, Kind.I, 3)``."""
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '1F0', '1B0', '1I0', "
                             "'1W0')")
        return cls(int(match[1]), Kind(match[2]), int(match[3]))


Device = tuple[int, int]  # (first stage hosted, replica)
Schedule = dict[Device, list[Action]]
#: (stage, part, microbatch), a cheaply hashed Action: part 0 forward, 1 the input gradient
#: (``B`` or ``I``: what the stage below waits for), 2 the weight gradient (``W``).
ActionKey = tuple[int, int, int]

_PART = {Kind.F: 0, Kind.B: 1, Kind.I: 1, Kind.W: 2}


def action_key(a: Action) -> ActionKey:
    """``a``'s :data:`ActionKey`: a ``B`` and an ``I`` share one (both deliver the input
    gradient the stage below waits for)."""
    return (a.stage, _PART[a.kind], a.microbatch)

# ------------------------------------------------------------------- builders


def _replica_counts(num_stages: int, replicas: Sequence[int] | None) -> list[int]:
    if num_stages < 1:
        raise ScheduleError(f"need at least one stage, got {num_stages}")
    counts = [1] * num_stages if replicas is None else list(replicas)
    if len(counts) != num_stages or any(d < 1 for d in counts):
        raise ScheduleError(f"replicas must be {num_stages} counts >= 1, got {counts}")
    return counts


def _distribute(stage_orders: list[list[tuple[Kind, int]]], counts: list[int]) -> Schedule:
    """Split each stage's action order over its replicas (micro-batch m -> replica m % d), in
    one pass over the order (not one per replica: 256 replicas of 512 actions each)."""
    schedule: Schedule = {}
    for stage, (order, d) in enumerate(zip(stage_orders, counts, strict=True)):
        lanes: list[list[Action]] = [[] for _ in range(d)]
        for k, mb in order:
            lanes[replica_of(mb, d)].append(Action(stage, k, mb))
        schedule.update(((stage, r), lane) for r, lane in enumerate(lanes))
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
    return _distribute(_gpipe_orders(num_stages, num_microbatches, train), counts)


def _gpipe_orders(num_stages: int, m: int, train: bool) -> list[list[tuple[Kind, int]]]:
    order = [(Kind.F, mb) for mb in range(m)]
    if train:
        order += [(Kind.B, mb) for mb in range(m)]
    return [order] * num_stages


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
    return _distribute(_one_f_one_b_orders(counts, num_microbatches), counts)


def _one_f_one_b_orders(counts: list[int], m: int) -> list[list[tuple[Kind, int]]]:
    orders: list[list[tuple[Kind, int]]] = []
    for warmup in one_f_one_b_warmups(counts, m):
        order = [(Kind.F, mb) for mb in range(warmup)]
        for mb in range(warmup, m):
            order += [(Kind.F, mb), (Kind.B, mb - warmup)]
        order += [(Kind.B, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return orders


def zb_h1(
    num_stages: int, num_microbatches: int, replicas: Sequence[int] | None = None
) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1).

    Each backward is split into ``I`` (the input gradient, sent to the stage below at once)
    and ``W`` (the weight gradient, needed only by the optimizer step). Stage ``s`` runs
    1F1B's order (:func:`one_f_one_b`: ``W_s`` warm-up forwards, then one forward and one
    ``I``, then the remaining ``I``) and runs the ``W`` of a micro-batch once ``D_s = W_0 -
    W_s`` later ``I`` passes are done (``s`` for one replica per stage: 0 on the first stage,
    ``p - 1`` on the last); the deferred ``W`` passes run in the cool-down, where 1F1B's
    stages wait. A stage holds a micro-batch from its ``F`` to its ``W``, so each holds at
    most ``min(W_0 + 1, M)`` micro-batches (spread over its replicas): 1F1B's first stage's
    peak (``min(p, M)`` without replicas). With ``F = I = W`` the bubble is ``(p - 1)(F + I -
    W)`` (the paper's figure 3), a third of 1F1B's.
    """
    counts = _replica_counts(num_stages, replicas)
    _check_microbatches(num_microbatches)
    return _distribute(_zb_h1_orders(counts, num_microbatches), counts)


def _zb_h1_orders(counts: list[int], m: int) -> list[list[tuple[Kind, int]]]:
    warmups = one_f_one_b_warmups(counts, m)
    orders: list[list[tuple[Kind, int]]] = []
    for warmup in warmups:
        defer = warmups[0] - warmup
        order = [(Kind.F, mb) for mb in range(warmup)]
        pending: deque[int] = deque()

        def grad(mb: int, order: list[tuple[Kind, int]] = order,
                 pending: deque[int] = pending, defer: int = defer) -> None:
            order.append((Kind.I, mb))
            pending.append(mb)
            if len(pending) > defer:
                order.append((Kind.W, pending.popleft()))

        for mb in range(warmup, m):
            order.append((Kind.F, mb))
            grad(mb - warmup)
        for mb in range(m - warmup, m):
            grad(mb)
        order += [(Kind.W, mb) for mb in pending]
        orders.append(order)
    return orders


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


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule of the registry: ``builder(replicas, microbatches, chunks)``, the modes
    it serves (``train``, ``infer``), whether the planner considers it (``partition
    --schedule auto``), whether the training runtime runs it, and a one-line description."""

    builder: Callable[[Sequence[int], int, int | None], Schedule]
    modes: tuple[str, ...]
    description: str
    planned: bool = False
    runtime: bool = False


REGISTRY: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(
        lambda r, m, c: gpipe(len(r), m, r), ("train",),
        "GPipe: all forwards, then all backwards (every micro-batch stashed)",
        planned=False, runtime=True),
    "1f1b": ScheduleSpec(
        lambda r, m, c: one_f_one_b(len(r), m, r), ("train",),
        "1F1B (PipeDream-Flush): warm-up forwards, then one forward one backward",
        planned=True, runtime=True),
    "zb-h1": ScheduleSpec(
        lambda r, m, c: zb_h1(len(r), m, r), ("train",),
        "ZB-H1 zero bubble: 1F1B with backward split into input and weight gradients, "
        "weight gradients deferred into the bubble, at 1F1B's peak memory",
        planned=True, runtime=True),
    "interleaved": ScheduleSpec(
        lambda r, m, c: interleaved(len(r), m, DEFAULT_CHUNKS if c is None else c, r),
        ("train",), "interleaved 1F1B: the stages as --chunks model chunks per device "
        "(a what-if layout)"),
    "infer": ScheduleSpec(
        lambda r, m, c: inference(len(r), m, r), ("infer",),
        "forwards only, micro-batches streamed in order", planned=True),
}

#: Every schedule :func:`build` knows, in the order the command line lists them.
NAMES = tuple(REGISTRY)
#: The schedules the training runtime runs (one stage per device).
TRAIN_NAMES = tuple(n for n, spec in REGISTRY.items() if spec.runtime)
#: The train schedules ``partition --schedule auto`` chooses among.
PLANNED_NAMES = tuple(n for n, spec in REGISTRY.items() if spec.planned and "train" in spec.modes)


def checked_name(name: str, chunks: int | None = None) -> str:
    """``name`` as :data:`NAMES` spells it (case ignored); :class:`ScheduleError` for an
    unknown name or for ``chunks`` given to a schedule other than ``interleaved``."""
    key = name.lower()
    if key not in REGISTRY:
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
    return REGISTRY[key].builder(list(replicas), microbatches, chunks)


def stage_orders(name: str, replicas: Sequence[int], microbatches: int
                 ) -> list[list[tuple[Kind, int]]] | None:
    """Each stage's action order ``(kind, micro-batch)`` of the schedule :func:`build` makes
    for ``name`` (its replicas share it round-robin, micro-batch ``m`` on replica ``m % d``),
    before it is split into actions per device; None for ``interleaved``, whose devices host
    several stages. The same refusals as :func:`build`."""
    key = checked_name(name)
    counts = _replica_counts(len(replicas), replicas)
    _check_microbatches(microbatches)
    if key in ("gpipe", "infer"):
        return _gpipe_orders(len(counts), microbatches, train=key == "gpipe")
    if key == "1f1b":
        return _one_f_one_b_orders(counts, microbatches)
    return _zb_h1_orders(counts, microbatches) if key == "zb-h1" else None

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
    once, on a replica of a device hosting that stage, with a micro-batch's backward (one B,
    or one I and one W) on the device of its F. Device ``(d, r)`` hosts stages ``s`` with
    ``s % p == d``, where ``p`` is the number of distinct first stages (``num_stages``
    unless interleaved, see :func:`interleaved`). With ``replicas``, the devices must be
    exactly ``(s % p, 0..replicas[s]-1)``, and the stages sharing a device must have equal
    replica counts."""
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
    seen: dict[tuple[int, Kind, int], Device] = {}
    for device, actions in schedule.items():
        for a in actions:
            key = (a.stage, a.kind, a.microbatch)
            home = a.stage % p if 0 <= a.stage < num_stages else a.stage  # its device
            if home != device[0]:
                hosts = "stage" if p == num_stages else "first stage"
                problems.append(f"{a} is on device {device} of {hosts} {device[0]}")
            elif a.kind is not Kind.F and not train:
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
            fwd = seen.get((s, Kind.F, mb))
            if fwd is None:
                problems.append(f"{s}F{mb} is missing")
            if not train:
                continue
            parts = {k: seen[(s, k, mb)] for k in (Kind.B, Kind.I, Kind.W) if (s, k, mb) in seen}
            if Kind.B in parts and len(parts) > 1:
                halves = "/".join(f"{s}{k.value}{mb}" for k in parts if k is not Kind.B)
                problems.append(f"{s}B{mb} and {halves} both given (a backward is one B, or "
                                "an I and a W)")
            elif not parts:
                problems.append(f"{s}B{mb} is missing (or {s}I{mb} and {s}W{mb})")
            elif Kind.B not in parts and len(parts) == 1:
                have = next(iter(parts))
                lacks = Kind.W if have is Kind.I else Kind.I
                problems.append(f"{s}{have.value}{mb} without {s}{lacks.value}{mb}")
            for k, dev in parts.items():
                if fwd is not None and dev != fwd:
                    problems.append(f"{s}F{mb} on {fwd} but {s}{k.value}{mb} on {dev}")
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
