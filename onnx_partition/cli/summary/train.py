"""``train``'s summary at the end of a run: the figures of a
:class:`~onnx_partition.runtime.train.results.TrainStats` (throughput, loss per step, the
iteration measured against the simulator's, ``--check``'s verdict, validation loss, resume,
checkpoints, the saved plan) and the table of measured against predicted
(:func:`comparison_table`). What a run prints while it runs (the data line before the ranks
start, rank 0's line per step and validation loss) is the runtime's: it prints as it goes."""

from __future__ import annotations

from onnx_partition.pipeline.from_plan import recompute_line
from onnx_partition.runtime.train.results import TrainStats, comparison

__all__ = ["comparison_table", "format_train"]


def comparison_table(stats: TrainStats) -> list[str]:
    """:func:`comparison` as text: one line per quantity, measured, predicted and their ratio
    (``-`` where a figure is missing)."""
    body = comparison(stats)
    measured, predicted, ratio = body["measured"], body["predicted"], body["ratio"]

    def cell(value: float | None, unit: str) -> str:
        if value is None:
            return "-"
        if unit == "MB":
            return f"{value / 1e6:.4g}"
        return f"{value:.2f}" if unit == "x" else f"{value:.3f}"

    rows = [("iteration ms", measured["iteration_ms"], predicted["iteration_ms"],
             ratio["iteration_ms"], "ms")]
    names = (("forward_ms", "forward ms", "ms", "forward_ms"),
             ("forward_cpu_ms", "forward CPU ms", "ms", "forward_ms"),
             ("backward_ms", "backward ms", "ms", "backward_ms"),
             ("backward_cpu_ms", "backward CPU ms", "ms", "backward_ms"),
             ("activation_bytes", "activation MB", "MB", "activation_bytes"),
             ("memory_bytes", "peak memory MB", "MB", "memory_bytes"),
             ("resident_bytes", "resident (VmHWM) MB", "MB", ""),
             ("reserved_bytes", "CUDA reserved MB", "MB", ""))
    for m, p, r in zip(measured["stages"], predicted["stages"], ratio["stages"]):
        for key, label, unit, against in names:
            if m[key] is None and key != "activation_bytes":
                continue  # CUDA: no thread CPU time; CPU: no reserve
            rows.append((f"stage {m['stage']} {label}", m[key], p.get(against), r.get(key),
                         unit))
    scaled = predicted["scaled_from_batch_size"]
    note = (f"; predicted per-row terms scaled from the plan's {scaled} rows per micro-batch"
            if scaled else "")
    lines = [f"measured against predicted (stage figures per micro-batch on one replica; CPU ms: "
             f"the rank's thread CPU time, against the predicted wall time; activation: bytes "
             f"saved for backward{note})",
             f"  {'quantity':<26}{'measured':>12}{'predicted':>12}{'ratio':>8}"]
    lines += [f"  {name:<26}{cell(m, unit):>12}{cell(p, unit):>12}{cell(r, 'x'):>8}"
              for name, m, p, r, unit in rows]
    return lines


def format_train(stats: TrainStats) -> str:
    """The end-of-run summary, ending with :func:`comparison_table`."""
    ratio = stats.measured_ms / stats.simulated_ms if stats.simulated_ms > 0 else float("inf")
    cal = stats.measured_ms / stats.calibrated_ms if stats.calibrated_ms > 0 else float("inf")
    priced = "" if stats.ran_math == stats.math else f", priced in {stats.math}"
    lines = [
        f"{len(stats.ranks)} ranks ({stats.engine} engine, {stats.schedule}, {stats.ran_math} "
        f"math{priced}), batch {stats.rows} "
        f"= {stats.microbatches} micro-batches x {stats.rows // stats.microbatches} rows: "
        f"{stats.samples_per_s:.1f} samples/s, {stats.measured_ms:.2f} ms per step",
        f"  trained on {stats.data}; loss {stats.loss_kind}",
        f"  loss per step: {' '.join(f'{v:.4f}' for v in stats.loss)}",
        f"  iteration: measured {stats.measured_ms:.2f} ms; simulated "
        f"{stats.simulated_ms:.2f} ms from the plan's costs (measured/simulated "
        f"{ratio:.2f}); "
        f"{stats.calibrated_ms:.2f} ms from the measured stage times ({cal:.2f})",
    ]
    for at, restart in enumerate(stats.restarts, start=1):  # as said when they happened
        replayed = restart["replayed_steps"]
        lines.insert(at, f"  restarted after a lost rank in step {restart['failed_step']}: "
                        f"resumed from step {restart['resumed_from_step']}, "
                        + (f"step {replayed[0]} replayed" if len(replayed) == 1 else
                           f"steps {replayed[0]}-{replayed[-1]} replayed" if replayed
                           else "no step replayed"))
    note = recompute_line(stats.recompute)
    if note:  # as partition, simulate and report say it
        lines.insert(1, f"  {note}")
    if stats.checked_steps:
        verdict = "OK" if not stats.mismatches else f"MISMATCH ({len(stats.mismatches)})"
        steps = " and ".join(map(str, stats.checked_steps))
        what = (f"after step {steps}" if stats.optimizer == "sgd" else
                f"of the gradients of step 1 ({stats.optimizer}'s parameters are not compared: "
                "its first step turns rounding in a tiny gradient into +-lr)")
        lines.append(f"check against single-process training {what}: {verdict}")
        lines += [f"  {m}" for m in stats.mismatches[:10]]
    if stats.eval_loss:
        best = min(v for _, v in stats.eval_loss)
        lines.append(f"  validation loss: final {stats.eval_loss[-1][1]:.4f} (after step "
                     f"{stats.eval_loss[-1][0]}), best {best:.4f}")
    if stats.start_step:
        lines.append(f"  resumed from the checkpoint after step {stats.start_step}")
    if stats.checkpoint is not None:
        lines.append(f"checkpoints in {stats.checkpoint}")
    if stats.saved is not None:
        lines.append(f"saved the trained plan to {stats.saved}")
    if stats.saved_pretrained is not None:
        lines.append(f"saved the trained weights (safetensors) to {stats.saved_pretrained}")
    return "\n".join(lines + comparison_table(stats))
