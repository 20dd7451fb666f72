"""Simulate a written plan: rebuild the event simulator's costs from plan.json alone.

plan.json keeps, per stage, ``predicted.compute_ms`` (per micro-batch on one replica: the
forward in inference, forward + backward in training), ``predicted.comm_ms``, ``replicas`` and
``predicted.memory_bytes``; hybrid plans add ``allreduce_ms`` (one per stage). From these:

* **Send times.** A stage's ``comm_ms`` counts both of its boundaries, so each interior
  boundary appears in two stages. Boundary ``b``'s send time ``s[b]`` is the comm it adds to
  *each* neighbour, i.e. ``comm[k] = f * (s[k-1] + s[k])`` (``s[-1] = s[S-1] = 0``), with
  ``f = 2`` for hybrid training plans (the activation forward, the gradient back, as the
  planner writes it) and ``f = 1`` otherwise (plain pipelines: ``(cut bytes) / bandwidth +
  latency`` per boundary, see ``docs/design.md``). :func:`stage_comm` writes this encoding
  (the planner's ``comm_ms``) and :func:`send_times` is its exact inverse: ``s[0] = comm[0] /
  f``, ``s[b] = comm[b] / f - s[b-1]`` (the last stage's ``comm`` is ``f s[S-2]``, implied),
  clipped at 0, so an untouched plan gives back its planner's send times to plan.json's
  rounding (``comm_ms`` has 6 decimals, so a send is off by up to about ``1e-6 S`` ms; the
  least-squares recovery used before spread that error differently, so a plain plan's
  simulated figures can differ from it in their last printed digit);
  ``simulator_costs.send_ms``, where a plan has it, is taken as written.
* **Forward / backward.** Training plans store only ``forward + backward``; the split is
  taken as backward = 2 x forward (:func:`~onnx_partition.pipeline.simulate.backward_factor`
  for a stage, whose operators' classes the plan does not keep; the ``costs.json`` default and
  the rule for dense layers). An inference plan simulated with a training schedule uses the
  same rule.
* **Memory.** ``memory_bytes`` is the planner's per-device peak for the plan's own schedule;
  it is used as the device's static bytes (no separate activation term), so another schedule's
  extra stashed micro-batches are not counted.
* **Interleaved 1F1B** (``schedule="interleaved"``, ``chunks=v``; Narayanan et al., SC'21) is a
  what-if: the plan's ``S`` stages are laid out on ``S / v`` devices per replica, device ``d``
  hosting stages ``d, d + S/v, ...`` (its memory is the sum of theirs). plan.json's device
  list describes the plan's own one-stage-per-device layout, so it is not used for names.

The planner keeps the exact split; a plan may carry it as ``simulator_costs`` (all keys
optional, one entry per stage, ``send_ms`` one per boundary): ``{"forward_ms": [...],
"backward_ms": [...], "send_ms": [...], "activation_bytes": [...], "static_bytes": [...],
"backward_input_ms": [...], "input_bytes": [...], "kept_bytes": [...], "step_ms": [...],
"accumulate_ms": [...], "split_ms": [...], "action_ms": [...], "hop_bytes": [...]}`` (the
input-gradient part of each backward, which zero-bubble schedules run apart, half of it where
absent; the bytes a recomputing stage keeps per micro-batch; the output gradients a ZB-H1 stage
keeps per micro-batch from its ``I`` to its ``W``; each stage's work once per training step, its
optimizer step and the step's barriers, added after the last device is done, and its gradients'
accumulation, added to the backward of every micro-batch but a replica's first, what splitting a
backward into ``I`` and ``W`` adds to them, half to each, and the engine's own work per action,
added to every action of the stage (:mod:`onnx_partition.cost.engine_price`); the bytes crossing
each boundary per micro-batch, which ``send_ms`` prices). A stage whose ``recompute`` is true
recomputes its forward in the simulation.
Given them, the rebuild is the planner's own costs. Without them, a hybrid plan's simulated
iteration equals ``predicted.iteration_ms`` when backward really is 2 x forward in every
stage (or the split does not matter, e.g. one stage); otherwise it differs a little.

Note the two cost models: the plain planner charges communication to the stage's time
(``bottleneck_ms = max(compute + comm)``), while the simulator overlaps sends with compute
(a send delays the receiver, it does not occupy the sender), so a plain pipeline's simulated
throughput can exceed its ``predicted.throughput_per_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.schedules import (
    NAMES,
    Action,
    Device,
    Kind,
    Schedule,
    build,
    checked_name,
    pipeline_width,
)
from onnx_partition.pipeline.simulate import (
    PipelineCosts,
    SimResult,
    StageCosts,
    backward_factor,
    simulate,
)
from onnx_partition.plan import Plan
from onnx_partition.plan.contracts import ClusterFields
from onnx_partition.values import fmt_bytes

__all__ = [
    "MAX_GRID_STEPS",
    "comm_factor",
    "default_schedule",
    "device_name",
    "hosted_stages",
    "interleaving_note",
    "over_memory_note",
    "plan_costs",
    "played_comm",
    "played_comm_note",
    "recompute_line",
    "recompute_note",
    "schedule_name",
    "schedule_of",
    "send_times",
    "simulate_plan",
    "stage_comm",
]

#: The schedule grid is printed up to this many steps on one device.
MAX_GRID_STEPS = 48


def default_schedule(plan: Plan) -> str:
    """The schedule the plan was planned for (plan.json's ``schedule``); without one (older
    plans), ``1f1b`` for training plans, ``infer`` otherwise (what the planner simulated)."""
    named = plan.schedule
    if named is not None and named.lower() in NAMES:
        return named.lower()
    return "1f1b" if plan.mode == "train" else "infer"


def comm_factor(train: bool) -> float:
    """How many times a boundary's send time counts in each neighbour's ``comm_ms``: twice in
    training (the activation forward, the gradient back), once otherwise."""
    return 2.0 if train else 1.0


def stage_comm(send_ms: Sequence[float], factor: float = 1.0) -> list[float]:
    """Each stage's ``comm_ms`` from the per-boundary send times: ``factor * (s[k-1] + s[k])``
    with ``s[-1] = s[S-1] = 0`` (``len(send_ms) + 1`` stages); :func:`send_times` inverts it."""
    k_stages = len(send_ms) + 1
    return [factor * ((send_ms[k - 1] if k > 0 else 0.0)
                      + (send_ms[k] if k < k_stages - 1 else 0.0))
            for k in range(k_stages)]


def send_times(comm_ms: Sequence[float], factor: float = 1.0) -> list[float]:
    """The per-boundary send times of :func:`stage_comm`'s encoding, its exact inverse
    (``len(comm) - 1`` entries): ``s[0] = comm[0] / factor``, ``s[b] = comm[b] / factor -
    s[b-1]``, then clipped at 0 (so plan.json's rounding, or an edit, cannot make a send
    negative)."""
    sends: list[float] = []
    before = 0.0
    for comm in list(comm_ms)[:-1]:
        before = comm / factor - before
        sends.append(before)
    return [max(s, 0.0) for s in sends]


def _given(values: Sequence[float] | None, length: int, name: str) -> list[float] | None:
    """plan.json's ``simulator_costs.<name>`` as floats, if present (of ``length``)."""
    if values is None:
        return None
    if len(values) != length:
        raise PartitionError(f"plan.json simulator_costs.{name} needs {length} numbers")
    return [float(v) for v in values]


def plan_costs(plan: Plan, *, train: bool) -> PipelineCosts:
    """The simulator's costs of ``plan`` (see the module docstring for the rules)."""
    p = len(plan.stages)
    if p == 0:
        raise PartitionError("plan.json has no stages")
    preds = [s.predicted for s in plan.stages]
    compute = [pr.compute_ms if pr else 0.0 for pr in preds]
    comm = [pr.comm_ms if pr else 0.0 for pr in preds]
    memory = [float(pr.memory_bytes) if pr else 0.0 for pr in preds]
    hybrid_train = plan.mode == "train"
    sim = plan.simulator_costs
    ratio = backward_factor()  # a stage's class is not known: the rule's figure for that
    stored_fwd = [c / (1.0 + ratio) for c in compute] if hybrid_train else compute
    forward = _given(sim.forward_ms, p, "forward_ms") or stored_fwd
    backward = _given(sim.backward_ms, p, "backward_ms") or [ratio * f for f in forward]
    send = _given(sim.send_ms, p - 1, "send_ms")
    if send is None:
        send = send_times(comm, comm_factor(hybrid_train))
    acts = _given(sim.activation_bytes, p, "activation_bytes") or [0.0] * p
    static = _given(sim.static_bytes, p, "static_bytes") or memory
    raw_allreduce = plan.allreduce_ms
    allreduce = [0.0] * p
    if raw_allreduce is not None and len(raw_allreduce) == p:
        allreduce = [float(x) for x in raw_allreduce]
    grad_in = _given(sim.backward_input_ms, p, "backward_input_ms")
    kept = _given(sim.input_bytes, p, "input_bytes") or [0.0] * p
    grads = _given(sim.kept_bytes, p, "kept_bytes") or [0.0] * p
    step = _given(sim.step_ms, p, "step_ms") or [0.0] * p
    accumulate = _given(sim.accumulate_ms, p, "accumulate_ms") or [0.0] * p
    split_cost = _given(sim.split_ms, p, "split_ms") or [0.0] * p
    per_action = _given(sim.action_ms, p, "action_ms") or [0.0] * p
    stages = [
        StageCosts(forward[k], backward[k] if train else 0.0, max(1, s.replicas),
                   allreduce[k] if train else 0.0, acts[k], static[k],
                   backward_input_ms=grad_in[k] if grad_in is not None else None,
                   recompute=bool(s.recompute) and train, input_bytes=kept[k],
                   step_ms=step[k] if train else 0.0,
                   accumulate_ms=accumulate[k] if train else 0.0,
                   split_ms=split_cost[k] if train else 0.0,
                   action_ms=per_action[k] if train else 0.0,
                   kept_bytes=grads[k] if train else 0.0)
        for k, s in enumerate(plan.stages)
    ]
    return PipelineCosts(stages, send)


def played_comm(plan: Plan) -> list[float] | None:
    """Each stage's hops per micro-batch as a train plan's simulation plays them: both of its
    boundaries at the simulator's ``send_ms`` (plan.json ``simulator_costs.send_ms``, else
    decoded from ``comm_ms``), each crossed twice (the activation forward, the gradient back),
    :func:`stage_comm`'s encoding with ``f = 2``. None for an inference plan, or where that is
    plan.json's ``predicted.comm_ms`` already (to its 6 decimals): it differs where the plan's
    hops are priced apart from the link model that balanced the cut (measured, ``engine_costs
    .send_ms``), or where a plain pipeline's planner counted each boundary once."""
    if plan.mode != "train":
        return None
    played = stage_comm(plan_costs(plan, train=True).send_ms, comm_factor(True))
    stated = [s.predicted.comm_ms if s.predicted else 0.0 for s in plan.stages]
    if all(abs(p - c) <= 1e-5 * max(1.0, abs(c)) for p, c in zip(played, stated, strict=True)):
        return None
    return played


def played_comm_note(plan: Plan) -> str | None:
    """What tells the two communication figures apart, where :func:`played_comm` differs: the
    one wording of ``partition``'s table and ``report``'s; None where they agree."""
    if played_comm(plan) is None:
        return None
    said = plan.engine_costs.send_ms or ""
    source = said.split(":", 1)[0] if said else "the link model"
    return ("comm: the link model the cut was balanced on (plan.json predicted.comm_ms; total "
            "and bottleneck count it); comm (played): the same boundaries as the simulated "
            "iteration plays them, each hop twice per micro-batch (activation forward, gradient "
            f"back) at plan.json simulator_costs.send_ms ({source})")


def simulate_plan(
    plan: Plan, *, schedule: str | None = None, microbatches: int | None = None,
    chunks: int | None = None, rows_scale: float = 1.0,
) -> tuple[SimResult, PipelineCosts]:
    """Simulate ``plan`` from plan.json alone: ``schedule`` one of
    :data:`~onnx_partition.pipeline.schedules.NAMES` (default: 1F1B for training plans,
    forward streaming otherwise), ``microbatches`` per iteration
    (default: :attr:`Plan.microbatches`), ``chunks`` model chunks per
    device for ``interleaved`` only (default 2); the schedule is
    :func:`~onnx_partition.pipeline.schedules.build`'s. Returns the result and the rebuilt costs.
    Raises :class:`PartitionError` for an unknown schedule, a bad count, or an interleaving
    the plan does not allow (chunks not dividing the stage count, micro-batches not a multiple
    of devices x replicas, unequal replicas). ``rows_scale``: the run's rows per micro-batch
    over the plan's, the costs taken at those rows (:meth:`PipelineCosts.at_rows`: what grows
    with the rows scaled, the per-step and per-parameter terms kept)."""
    name = checked_name(schedule or default_schedule(plan), chunks)
    m = microbatches if microbatches is not None else plan.microbatches
    if m < 1:
        raise PartitionError(f"need at least one micro-batch, got {m}")
    costs = plan_costs(plan, train=name != "infer").at_rows(rows_scale)
    sched = build(name, [s.replicas for s in costs.stages], m, chunks=chunks)
    return dataclasses.replace(simulate(sched, costs), schedule=name), costs


def schedule_of(result: SimResult) -> Schedule:
    """The schedule a result played, rebuilt from its timeline (actions in start order)."""
    sched: dict[Device, list[Action]] = {}
    for dev, action, _, _ in sorted(result.timeline, key=lambda item: (item[0], item[2])):
        sched.setdefault(dev, []).append(action)
    return sched


def hosted_stages(plan: Plan, result: SimResult) -> dict[Device, list[int]]:
    """The plan's stages each simulated device runs: one each, or several (interleaved)."""
    num_stages = len(plan.stages)
    width = pipeline_width(result.busy_ms, num_stages)
    return {dev: list(range(dev[0], num_stages, width)) for dev in result.busy_ms}


def interleaving_note(plan: Plan, result: SimResult) -> str | None:
    """One line saying the result is an interleaved what-if layout, or None if it is not."""
    num_stages = len(plan.stages)
    width = pipeline_width(result.busy_ms, num_stages)
    if width >= num_stages:
        return None
    devices = f"{width} device{'s' * (width != 1)}"
    return (f"interleaved what-if: {num_stages} stages on {devices} per replica, "
            f"{num_stages // width} model chunks each (device d runs stages d, d + {width}, "
            "...); plan.json's device list is for one stage per device")


def recompute_note(plan: Plan) -> str | None:
    """One line naming the stages that recompute their forward in backward, or None."""
    if plan.mode != "train":
        return None
    return recompute_line([s.index for s in plan.stages if s.recompute])


def recompute_line(recomputing: Sequence[int]) -> str | None:
    """:func:`recompute_note`'s line for the stages ``recomputing`` (None for none): the one
    wording of every verb (partition, simulate, report, train)."""
    if not recomputing:
        return None
    named = ", ".join(map(str, recomputing))
    if len(recomputing) == 1:
        return (f"stage {named} recomputes its forward in backward (keeping only its inputs "
                "per micro-batch in flight)")
    return (f"stages {named} recompute their forward in backward (keeping only their inputs "
            "per micro-batch in flight)")


def over_memory_note(plan: Plan, result: SimResult) -> str | None:
    """A warning naming the devices whose simulated peak is over the device memory of the
    plan's cluster (one kind; None within it or without a limit): a what-if schedule that
    holds more than the one planned for (GPipe; ZB-H1 where the planner kept 1F1B)."""
    if not isinstance(plan.cluster, ClusterFields) or math.isinf(plan.cluster.memory_gb):
        return None
    limit = plan.cluster.memory_gb * 1e9
    over = [(dev, peak) for dev, peak in sorted(result.peak_memory_bytes.items())
            if peak > limit * (1.0 + 1e-9)]
    if not over:
        return None
    named = ", ".join(f"{device_name(plan, dev)} {fmt_bytes(peak)}" for dev, peak in over)
    planned = default_schedule(plan)
    why = (f"; the plan was made for {planned}" if schedule_name(result) != planned else "")
    return (f"warning: over the device memory of {fmt_bytes(limit)} under "
            f"{schedule_name(result)}: {named}{why}")


def device_name(plan: Plan, dev: Device, stages: Sequence[int] | None = None) -> str:
    """``stage s replica r`` plus the device id from plan.json when it names one; with
    several hosted ``stages`` (interleaved) ``device d replica r (stages ...)``."""
    if stages is not None and len(stages) > 1:
        return f"device {dev[0]} replica {dev[1]} (stages {', '.join(map(str, stages))})"
    stage, replica = dev
    devices = plan.stages[stage].devices if stage < len(plan.stages) else []
    where = f" ({devices[replica]})" if replica < len(devices) else ""
    gpu = plan.stages[stage].gpu if stage < len(plan.stages) else None
    if gpu:  # a mixed fleet's plan: the kind running the stage
        where = f" ({devices[replica]}, {gpu})" if replica < len(devices) else f" ({gpu})"
    return f"stage {stage} replica {replica}{where}"


def schedule_name(result: SimResult) -> str:
    """The result's schedule by name where known (:func:`simulate_plan` records it), else
    ``infer`` for a forward-only result, ``train`` otherwise (the timeline tells)."""
    if result.schedule:
        return result.schedule
    return "train" if any(a.kind is not Kind.F for _, a, _, _ in result.timeline) else "infer"
