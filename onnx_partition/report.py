"""Human-readable views of a plan: the text table printed by the CLI."""

from __future__ import annotations

from onnx_partition.plan import Plan


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def plan_table(plan: Plan) -> str:
    """One row per stage: operators, predicted compute and communication, memory, cut tensors."""
    header = ("stage", "ops", "consts", "compute ms", "comm ms", "total ms", "memory MB",
              "in", "out", "replicas", "devices")
    rows = [header]
    for stage in plan.stages:
        pred = stage.predicted
        compute = pred.compute_ms if pred else 0.0
        comm = pred.comm_ms if pred else 0.0
        rows.append((
            str(stage.index), str(len(stage.nodes)), str(len(stage.constants)),
            f"{compute:.3f}", f"{comm:.3f}", f"{compute + comm:.3f}",
            _mb(pred.memory_bytes if pred else 0), str(len(stage.inputs)),
            str(len(stage.outputs)), str(stage.replicas), ",".join(stage.devices),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = plan.predicted
    if "iteration_ms" in total:
        lines.append(
            f"{plan.mode}, ordering {plan.ordering}, solver {plan.solver}: "
            f"{total['devices_used']} devices, {total['microbatches']} micro-batches per "
            f"iteration of {total['iteration_ms']:.3f} ms (simulated), bubble "
            f"{total['bubble_fraction'] * 100:.1f}%, {total['throughput_per_s']:.1f} "
            f"micro-batches/s"
        )
    elif total:
        lines.append(
            f"ordering {plan.ordering}, solver {plan.solver}: bottleneck "
            f"{total.get('bottleneck_ms', 0):.3f} ms, predicted "
            f"{total.get('throughput_per_s', 0):.1f} micro-batches/s "
            f"(whole model {total.get('total_compute_ms', 0):.3f} ms)"
        )
    return "\n".join(lines)
