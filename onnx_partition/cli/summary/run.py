"""What ``run`` prints: the run's shape against the plan's (:func:`shape_line`), the notes
before it runs, measured against predicted (:func:`format_comparison`), the latency
percentiles (:func:`timing_line`) and the check against the whole model (:func:`check_line`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnx_partition.pipeline.predict import RunShape
from onnx_partition.plan import Plan

__all__ = ["TRAIN_PLAN_NOTE", "check_line", "format_comparison", "idle_replicas_note",
           "shape_line", "timing_line"]

#: Said before running a train plan's stage files (priced for torch, run in onnxruntime).
TRAIN_PLAN_NOTE = (
    "note: a train plan is priced for training (its forward and backward as `train` runs "
    "them in torch, the training engine's hops); `run` executes its stage files in "
    "onnxruntime, so measured/predicted compares two executors: for an inference price, "
    "partition with --mode infer (and `profile --plan` the inference plan)")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def shape_line(plan: Plan, shape: RunShape) -> str:
    """The run's stages, replicas and rows per iteration, beside the plan's own."""
    planned = (plan.rows_per_microbatch, plan.microbatches)
    default = "" if "microbatches" in plan.predicted else " by default"
    return (f"{_plural(len(plan.stages), 'stage')} "
            f"({' + '.join(str(s.replicas) for s in plan.stages)} "
            f"replicas), {shape.microbatches} micro-batches x {shape.batch_size} rows = "
            f"{shape.rows} rows per iteration (plan: {planned[1]} micro-batches{default} x "
            f"{planned[0] or '?'} rows)")


def idle_replicas_note(plan: Plan, microbatches: int) -> str | None:
    """One line when fewer micro-batches than a stage's replicas leave some replicas idle
    (replica ``j`` of a stage with ``r`` replicas takes micro-batches ``m = j (mod r)``)."""
    most = max((s.replicas for s in plan.stages), default=1)
    if microbatches >= most:
        return None
    short = [s.index for s in plan.stages if s.replicas > microbatches]
    return (f"note: {microbatches} micro-batches for up to {most} replicas: stage"
            f"{'s' * (len(short) > 1)} {', '.join(map(str, short))} leave"
            f"{'s' * (len(short) == 1)} replicas {microbatches}.. idle (give --microbatches "
            f">= {most})")


def format_comparison(run: Mapping[str, Any]) -> str:
    """Measured against predicted as a small text table (the end of ``run``'s output)."""
    m, p, ratio = run["measured"], run["predicted"], run["ratio"]

    def r(value: float | None) -> str:
        return f"{value:.3g}" if value is not None else "-"

    rows = [("", "measured", "predicted", "measured/predicted"),
            ("samples/s", f"{m['samples_per_s']:.1f}", f"{p['samples_per_s']:.1f}",
             r(ratio["samples_per_s"])),
            ("iteration ms", f"{m['iteration_ms']:.3f}", f"{p['iteration_ms']:.3f}",
             r(ratio["iteration_ms"]))]
    by_stage = {s["index"]: s for s in p["stages"]}
    for s, value, cpu in zip(m["stages"], ratio["stage_busy_ms"],
                             ratio.get("stage_cpu_ms", [])):
        pred = by_stage.get(s["index"], {}).get("busy_ms", 0.0)
        rows.append((f"stage {s['index']} busy ms", f"{s['busy_ms']:.3f}", f"{pred:.3f}",
                     r(value)))
        if "cpu_ms" in s:
            rows.append(("  in CPU time", f"{s['cpu_ms']:.3f}", f"{pred:.3f}", r(cpu)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [row[0].ljust(widths[0]) + "  " + "  ".join(c.rjust(w) for c, w in
                                                         zip(row[1:], widths[1:]))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    note = (f" (simulated at {p['scaled_from_batch_size']} rows per micro-batch, scaled "
            "linearly)" if p.get("scaled_from_batch_size") else "")
    return "\n".join([f"predicted: the plan's forward-only simulation of {p['microbatches']} "
                      f"micro-batches{note}", *lines])


def timing_line(samples_ms: Sequence[float]) -> str:
    """Per-iteration latency as onnxruntime_perf_test reports it: mean, P50, P90, P99 (numpy's
    linear percentiles) over the timed iterations."""
    import numpy as np

    times = np.asarray(samples_ms, dtype=np.float64)
    if times.size == 0:
        return "latency: no timed iterations"
    p50, p90, p99 = np.percentile(times, [50, 90, 99])
    return (f"latency per iteration over {_plural(times.size, 'iteration')}: mean "
            f"{times.mean():.2f} ms, P50 {p50:.2f} ms, P90 {p90:.2f} ms, P99 {p99:.2f} ms")


def check_line(worst: float, verdict: str) -> str:
    """The pipelined outputs against the whole model's: the largest relative error."""
    return f"check against the whole model: max relative error {worst:.2e} ({verdict})"
