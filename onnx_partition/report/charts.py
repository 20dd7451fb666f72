"""The HTML report's charts (:mod:`onnx_partition.report`): time and memory per stage, and the
simulated schedule as a Gantt chart."""

from __future__ import annotations

from onnx_partition.pipeline.from_plan import (
    hosted_stages,
    interleaving_note,
    played_comm,
    recompute_note,
    schedule_name,
)
from onnx_partition.pipeline.schedules import Kind, pipeline_width
from onnx_partition.pipeline.simulate import PipelineCosts, SimResult
from onnx_partition.plan import Plan
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

__all__ = ["gantt_chart", "html_note", "memory_chart", "time_chart"]


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


def memory_chart(plan: Plan) -> str:
    """Each device's predicted peak memory against the cluster's limit."""
    limit_gb = plan.cluster.get("memory_gb")
    limit = float(limit_gb) * 1e9 if isinstance(limit_gb, int | float) else None
    # a mixed fleet: each stage against its own GPU kind's memory (the least of its kinds)
    kinds = {g["gpu"]: float(g["memory_gb"]) * 1e9 for g in plan.cluster.get("groups") or []}
    labels, rows, texts = [], [], []
    for s in plan.stages:
        used = float(s.predicted.memory_bytes) if s.predicted else 0.0
        own = min((kinds[k] for k in (s.gpu or "").split("+") if k in kinds), default=limit)
        for r in range(s.replicas):
            where = s.devices[r] if r < len(s.devices) else "?"
            labels.append(f"stage {s.index} · replica {r} · {where}")
            rows.append([Segment(used, stage_colour(s.index), f"{fmt_bytes(used)}")])
            share = f" ({sig3(used / own * 100)}% of {s.gpu or 'limit'})" if own else ""
            texts.append(fmt_bytes(used) + share)
    peak = max((row[0].value for row in rows), default=0.0)
    drawn = limit if limit is not None and limit <= 4 * max(peak, 1.0) else None
    chart = hbar_chart(labels, rows, unit="predicted peak memory per device (bytes)",
                       value_text=texts, limit=drawn,
                       limit_label=f"device limit {fmt_bytes(limit or 0)}",
                       tick_format=fmt_bytes, title="memory per device (bytes)",
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
            else "weights and the stage's input and output tensors" if "iteration_ms"
            not in plan.predicted else "weights and activations of one micro-batch")
    return chart + html_note(f"Planner's predicted peak per device ({what}). {note}")


def gantt_chart(plan: Plan, result: SimResult, costs: PipelineCosts) -> str:
    """The simulated schedule, one row per device."""
    devices = sorted(result.busy_ms)
    row_of = {dev: i for i, dev in enumerate(devices)}
    hosted = hosted_stages(plan, result)
    width = pipeline_width(devices, len(costs.stages))  # < stages when interleaved
    names = []
    for s, r in devices:
        if len(hosted[(s, r)]) > 1:  # interleaved what-if: plan.json's devices do not apply
            names.append(f"device {s} · replica {r} · stages "
                         f"{', '.join(map(str, hosted[(s, r)]))}")
            continue
        where = plan.stages[s].devices[r] if r < len(plan.stages[s].devices) else "?"
        names.append(f"stage {s} · replica {r} · {where}")
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
