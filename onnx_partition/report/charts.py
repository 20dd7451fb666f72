"""The HTML report's charts (:mod:`onnx_partition.report`): time and memory per stage, and the
simulated schedule as a Gantt chart."""

from __future__ import annotations

import math

from onnx_partition.pipeline.from_plan import (
    default_schedule,
    hosted_stages,
    interleaving_note,
    over_memory_note,
    played_comm,
    recompute_note,
    schedule_name,
)
from onnx_partition.pipeline.schedules import Device, Kind, pipeline_width
from onnx_partition.pipeline.simulate import PipelineCosts, SimResult
from onnx_partition.plan import Plan
from onnx_partition.plan.contracts import ClusterFields, FleetFields
from onnx_partition.report.svg import (
    ALLREDUCE,
    BACKWARD,
    COMM,
    FORWARD,
    Bar,
    Segment,
    esc,
    fmt_ms,
    gantt,
    hbar_chart,
    stage_colour,
)
from onnx_partition.values import fmt_bytes, sig3

__all__ = ["device_labels", "gantt_chart", "html_note", "memory_chart", "stage_peaks", "time_chart",
           "warning_note", "what_if"]


def html_note(text: str) -> str:
    """A grey explanatory paragraph under a chart."""
    return f'<p class="note">{esc(text)}</p>'


def time_chart(plan: Plan) -> str:
    """Each stage's predicted compute and communication per micro-batch; a train plan whose
    simulation plays other hop times than its ``comm_ms`` (:func:`played_comm`) shows those,
    and says so."""
    labels = [f"stage {s.index}" for s in plan.stages]
    played = played_comm(plan)
    what = "communication (played)" if played is not None else "communication"
    rows, totals = [], []
    for k, s in enumerate(plan.stages):
        c, m = (s.predicted.compute_ms, s.predicted.comm_ms) if s.predicted else (0.0, 0.0)
        m = played[k] if played is not None else m
        rows.append([Segment(c, stage_colour(s.index), f"stage {s.index} compute {fmt_ms(c)}"),
                     Segment(m, COMM, f"stage {s.index} {what} {fmt_ms(m)}")])
        totals.append(f"{sig3(c)} + {sig3(m)} = {fmt_ms(c + m)}")
    return hbar_chart(labels, rows, unit="time per micro-batch (ms)", value_text=totals,
                      legend_items=[("compute (in the stage's colour)", stage_colour(0)),
                                    (what, COMM)],
                      title=f"time per stage: compute + {what} (ms)", row_title="stage")


def what_if(plan: Plan, result: SimResult) -> bool:
    """Whether ``result`` plays another schedule or micro-batch count than the plan was made
    for (``report --schedule`` / ``--microbatches``): its memory is then not plan.json's."""
    played = max((a.microbatch for _, a, _, _ in result.timeline), default=-1) + 1
    return schedule_name(result) != default_schedule(plan) or played != plan.microbatches


def device_labels(plan: Plan, result: SimResult) -> dict[Device, str]:
    """Each simulated device's row label: ``stage s · replica r · device`` (plan.json's device),
    or ``device d · replica r · stages ...`` where it hosts several stages (interleaved)."""
    labels = {}
    for dev, stages in hosted_stages(plan, result).items():
        s, r = dev
        if len(stages) > 1:  # interleaved what-if: plan.json's devices do not apply
            labels[dev] = f"device {s} · replica {r} · stages {', '.join(map(str, stages))}"
        else:
            where = plan.stages[s].devices[r] if r < len(plan.stages[s].devices) else "?"
            labels[dev] = f"stage {s} · replica {r} · {where}"
    return labels


def stage_peaks(plan: Plan, result: SimResult) -> list[float]:
    """Each stage's simulated peak memory: that of its fullest device (a device hosting several
    stages, interleaved, counts whole)."""
    peaks = [0.0] * len(plan.stages)
    for dev, stages in hosted_stages(plan, result).items():
        for s in stages:
            peaks[s] = max(peaks[s], result.peak_memory_bytes.get(dev, 0.0))
    return peaks


def memory_chart(plan: Plan, result: SimResult | None = None) -> str:
    """Each device's peak memory against the cluster's limit: the planner's predicted peak, or,
    for a ``result`` of another schedule or micro-batch count (:func:`what_if`), that
    schedule's simulated peak (the micro-batches it holds in flight, counted by the simulator
    as :mod:`onnx_partition.pipeline.memory`'s closed forms count them), with
    :func:`over_memory_note`, the warning ``simulate`` prints."""
    cluster = plan.cluster
    limit = (cluster.memory_gb * 1e9 if isinstance(cluster, ClusterFields)
             and not math.isinf(cluster.memory_gb) else None)
    # a mixed fleet: each stage against its own GPU kind's memory (the least of its kinds)
    kinds = {g.gpu: g.memory_gb * 1e9 for g in cluster.groups if g.memory_gb is not None} \
        if isinstance(cluster, FleetFields) else {}

    def own(stages: list[int]) -> float | None:
        return min((kinds[k] for s in stages for k in (plan.stages[s].gpu or "").split("+")
                    if k in kinds), default=limit)

    labels, rows, texts = [], [], []
    if result is None:
        for s in plan.stages:
            used = float(s.predicted.memory_bytes) if s.predicted else 0.0
            for r in range(s.replicas):
                where = s.devices[r] if r < len(s.devices) else "?"
                labels.append(f"stage {s.index} · replica {r} · {where}")
                rows.append([Segment(used, stage_colour(s.index), f"{fmt_bytes(used)}")])
                texts.append(fmt_bytes(used) + _share(used, own([s.index]), s.gpu))
    else:
        names, hosted = device_labels(plan, result), hosted_stages(plan, result)
        for dev in sorted(result.peak_memory_bytes):
            used, stages = result.peak_memory_bytes[dev], hosted[dev]
            held = (f", {result.peak_inflight.get(dev, 0)} in flight"
                    if schedule_name(result) != "infer" else "")
            labels.append(names[dev])
            rows.append([Segment(used, stage_colour(stages[0]), f"{fmt_bytes(used)}")])
            texts.append(fmt_bytes(used) + held
                         + _share(used, own(stages), plan.stages[stages[0]].gpu))
    peak = max((row[0].value for row in rows), default=0.0)
    drawn = limit if limit is not None and limit <= 4 * max(peak, 1.0) else None
    under = f" under {_played(result)}" if result is not None else ""
    chart = hbar_chart(labels, rows,
                       unit=("predicted" if result is None else "simulated")
                       + f" peak memory per device{under} (bytes)",
                       value_text=texts, limit=drawn,
                       limit_label=f"device limit {fmt_bytes(limit or 0)}",
                       tick_format=fmt_bytes, title=f"memory per device{under} (bytes)",
                       row_title="stage · replica · device")
    if kinds:
        note = "Each GPU kind's memory: " + ", ".join(
            f"{k} {fmt_bytes(v)}" for k, v in kinds.items()) + " (the shares on the right)."
    elif limit is None:
        note = "No device memory limit in plan.json (no cluster, or unlimited memory)."
    elif drawn is None:
        note = (f"Device limit {fmt_bytes(limit)} is off the scale: the largest use is "
                f"{sig3(peak / limit * 100)}% of it.")
    else:
        note = f"Dashed line: the device memory limit, {fmt_bytes(limit)}."
    what = ("weights, optimizer state and stashed activations" if plan.mode == "train"
            else "weights and the stage's input and output tensors"
            if plan.predicted.iteration_ms is None
            else "weights and activations of one micro-batch")
    if result is None:
        return chart + html_note(f"Planner's predicted peak per device ({what}). {note}")
    warning = over_memory_note(plan, result)
    held = (", after each figure the micro-batches it holds at once"
            if schedule_name(result) != "infer" else "")
    return (chart + html_note(f"Simulated peak per device{under} ({what}{held}); "
                              f"{_planned(plan)}. {note}")
            + (warning_note(warning) if warning else ""))


def warning_note(text: str) -> str:
    """A warning paragraph (:func:`over_memory_note`'s), in red."""
    return f'<p class="note" style="color:#b00020"><b>{esc(text)}</b></p>'


def _share(used: float, own: float | None, gpu: str | None) -> str:
    return f" ({sig3(used / own * 100)}% of {gpu or 'limit'})" if own else ""


def _played(result: SimResult) -> str:
    """``gpipe, 8 micro-batches``: the schedule and micro-batch count a result played."""
    played = max((a.microbatch for _, a, _, _ in result.timeline), default=-1) + 1
    return f"{schedule_name(result)}, {played} micro-batch{'es' * (played != 1)}"


def _planned(plan: Plan) -> str:
    """What plan.json's memory figures are for, and where the simulated ones come from."""
    said = ("" if plan.simulator_costs.activation_bytes is not None else
            "; plan.json has no stashed bytes per micro-batch (simulator_costs.activation_bytes), "
            "so these are its figures whatever the schedule holds")
    return (f"plan.json's predicted memory is for {default_schedule(plan)}, "
            f"{plan.microbatches} micro-batch{'es' * (plan.microbatches != 1)}{said}")


def gantt_chart(plan: Plan, result: SimResult, costs: PipelineCosts) -> str:
    """The simulated schedule, one row per device."""
    devices = sorted(result.busy_ms)
    row_of = {dev: i for i, dev in enumerate(devices)}
    width = pipeline_width(devices, len(costs.stages))  # < stages when interleaved
    labels = device_labels(plan, result)
    names = [labels[dev] for dev in devices]
    bars = []
    for dev, action, t0, t1 in result.timeline:
        forward = action.kind is Kind.F
        what = {Kind.F: "forward", Kind.B: "backward", Kind.I: "input-gradient backward",
                Kind.W: "weight-gradient backward"}[action.kind]
        bars.append(Bar(row_of[dev], t0, t1, stage_colour(action.stage),
                        str(action.microbatch),
                        f"{action}: stage {action.stage} {what} of micro-batch "
                        f"{action.microbatch}, {sig3(t0)}–{fmt_ms(t1)}", hatched=not forward))
    for stage, (t0, t1) in sorted(result.allreduce.items()):
        for r in range(costs.stages[stage].replicas):
            bars.append(Bar(row_of[(stage % width, r)], t0, t1, ALLREDUCE, "all-reduce",
                            f"stage {stage} gradient all-reduce, {sig3(t0)}–{fmt_ms(t1)}",
                            faint=True))
    items = [("forward: solid, in the stage's colour", FORWARD)]
    if any(a.kind is not Kind.F for _, a, _, _ in result.timeline):
        items.append(("backward: hatched", f"hatch:{BACKWARD}"))
    if result.allreduce:
        items.append(("gradient all-reduce", "outline"))
    chart = gantt(names, bars, total=result.iteration_ms, legend_items=items,
                  row_title="stage · replica · device",
                  title="schedule Gantt chart: simulated time (ms) per device")
    sends = ", ".join(sig3(s) for s in costs.send_ms) or "none"
    what_if = interleaving_note(plan, result)
    extra = f" {esc(what_if[0].upper() + what_if[1:])}." if what_if else ""
    recomputing = recompute_note(plan)
    extra += f" {esc(recomputing[0].upper() + recomputing[1:])}." if recomputing else ""
    return (chart + f'<p class="note">{esc(schedule_name(result))} schedule rebuilt from '
            f"plan.json; numbers on bars are micro-batches. Send time per boundary (ms): "
            f"{esc(sends)}. Bubble {result.bubble_fraction * 100:.1f}%.{extra}</p>")
