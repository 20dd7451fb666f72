"""What ``simulate`` prints: the simulated iteration, each device's busy time and peak memory,
the schedule grid when small enough to read (:func:`format_simulation`), and the samples per
second of the iteration (:func:`samples_line`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onnx_partition.pipeline.from_plan import (
    MAX_GRID_STEPS,
    device_name,
    hosted_stages,
    interleaving_note,
    over_memory_note,
    recompute_note,
    schedule_name,
    schedule_of,
)
from onnx_partition.pipeline.schedules import render
from onnx_partition.pipeline.simulate import SimResult
from onnx_partition.plan import Plan
from onnx_partition.values import fmt_bytes

__all__ = ["format_simulation", "samples_line"]


def format_simulation(plan: Plan, result: SimResult) -> str:
    """Iteration time, throughput, bubble, per-device busy time and peak memory, and the
    schedule grid when it is small enough to read."""
    num_mb = max((a.microbatch for _, a, _, _ in result.timeline), default=-1) + 1
    lines = [
        f"simulated {schedule_name(result)} iteration of {num_mb} micro-batches: "
        f"{result.iteration_ms:.3f} ms, {result.throughput_per_s:.1f} micro-batches/s, "
        f"bubble {result.bubble_fraction * 100:.1f}%",
    ]
    note = interleaving_note(plan, result)
    if note:
        lines.append(note)
    note = recompute_note(plan)
    if note:
        lines.append(note)
    hosted = hosted_stages(plan, result)
    if plan.predicted.iteration_ms is not None:
        lines.append(f"planner predicted: iteration {plan.predicted.iteration_ms:.3f} ms")
    elif plan.predicted.bottleneck_ms is not None:
        lines.append(f"planner predicted: bottleneck {plan.predicted.bottleneck_ms:.3f} ms "
                     "per micro-batch (communication charged to the stages)")
    rows = [("device", "busy ms", "busy %", "peak in-flight", "peak memory")]
    for dev in sorted(result.busy_ms):
        busy = result.busy_ms[dev]
        share = busy / result.iteration_ms * 100 if result.iteration_ms > 0 else 0.0
        rows.append((device_name(plan, dev, hosted[dev]), f"{busy:.3f}", f"{share:.1f}",
                     str(result.peak_inflight.get(dev, 0)),
                     fmt_bytes(result.peak_memory_bytes.get(dev, 0.0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = [rows[0][0].ljust(widths[0]) + "  " + "  ".join(
        c.rjust(w) for c, w in zip(rows[0][1:], widths[1:]))]
    table.append("  ".join("-" * w for w in widths))
    table += [r[0].ljust(widths[0]) + "  " + "  ".join(c.rjust(w) for c, w in
                                                         zip(r[1:], widths[1:])) for r in rows[1:]]
    lines += ["", *table]
    note = over_memory_note(plan, result)
    if note:
        lines.append(note)
    for stage, (t0, t1) in sorted(result.allreduce.items()):
        lines.append(f"stage {stage} all-reduce: {t0:.3f} -> {t1:.3f} ms")
    sched = schedule_of(result)
    steps = max((len(a) for a in sched.values()), default=0)
    if steps <= MAX_GRID_STEPS and len(sched) <= 32:
        lines += ["", render(sched)]
    else:
        lines += ["", f"(schedule grid left out: {len(sched)} devices x {steps} steps)"]
    return "\n".join(lines)


def samples_line(body: Mapping[str, Any]) -> str | None:
    """Samples per second of the simulated iteration (``simulate --json``'s ``body``), with
    the scaling from the plan's rows where asked; None when it has none."""
    if not body["samples_per_s"]:
        return None
    scaled = (f", costs scaled from the plan's {body['scaled_from_batch_size']} rows "
              "(compute, activations and hops with the rows; per-step work as planned)"
              if body.get("scaled_from_batch_size") else "")
    return (f"{body['samples_per_s']:.1f} samples/s ({body['microbatches']} micro-batches x "
            f"{body['batch_size']} rows per iteration of {body['iteration_ms']:.3f} ms"
            f"{scaled})")
