"""Time a plan's run in either runtime and describe it as ``measured.measured_json`` data.

Both adapters feed ``warmup`` untimed then ``iterations`` timed iterations of the same feeds
and report per (stage, replica) the mean compute per timed iteration, in wall-clock and in
thread CPU time.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline import microbatch
from onnx_partition.pipeline.predict import RunShape, measured_json
from onnx_partition.plan import Plan

__all__ = ["MEMORY_SOURCE", "Result", "measure_distributed", "measure_threads", "shape_of_feeds"]

Result = tuple[str, dict[str, Any], dict[str, np.ndarray]]  # runtime, measured, outputs


def shape_of_feeds(shape: RunShape, feeds: dict[str, np.ndarray],
                   axes: dict[str, int | None] | None = None) -> RunShape:
    """The run's shape as the (possibly user-given) feeds make it: their rows in
    ``shape.microbatches`` equal micro-batches (fewer when there are fewer rows); ``axes``:
    where the batch lies in feeds that do not have it on axis 0 (``microbatch.batch_axes``)."""
    try:
        rows = microbatch.batch_size(feeds, axes)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if rows == shape.rows:
        return shape
    count = min(shape.microbatches, rows)
    if rows % count:
        raise PartitionError(f"the inputs have {rows} rows, which {count} micro-batches do "
                             "not divide; give --microbatches")
    return RunShape(rows // count, count)


def measure_threads(
    plan_dir: str | os.PathLike[str], plan: Plan, feeds: dict[str, np.ndarray],
    shape: RunShape, *, warmup: int, iterations: int, threads_per_stage: int = 1,
    providers: list[str] | None = None, show_progress: bool = False,
) -> Result:
    """Run in a :class:`~onnx_partition.runtime.PipelineSession` (a thread per replica);
    ``providers`` overrides the plan's devices (``["CPUExecutionProvider"]``: a GPU plan on CPU),
    ``show_progress`` draws a bar over the timed iterations on a terminal."""
    from onnx_partition.progress import iterate
    from onnx_partition.runtime.infer.pipeline import PipelineSession

    with PipelineSession(plan_dir, microbatches=shape.microbatches,
                         threads_per_stage=threads_per_stage, providers=providers) as session:
        for _ in range(warmup):
            session.run(None, feeds)
        walls: list[float] = []
        busy: dict[tuple[int, int], float] = {}
        cpu: dict[tuple[int, int], float] = {}
        outputs: list[np.ndarray] = []
        for _ in iterate(range(iterations), "run", total=iterations, enabled=show_progress):
            began = time.perf_counter()
            outputs = session.run(None, feeds)
            walls.append((time.perf_counter() - began) * 1000.0)
            stats = session.last_stats
            for key, ms in stats.busy_ms.items():
                busy[key] = busy.get(key, 0.0) + ms / iterations
                cpu[key] = cpu.get(key, 0.0) + stats.cpu_ms.get(key, 0.0) / iterations
        names = [o.name for o in session.get_outputs()]
    measured = measured_json(plan, shape, iteration_ms=walls, busy_ms=busy, cpu_ms=cpu)
    return "threads", measured, dict(zip(names, outputs))


def measure_distributed(
    plan_dir: str | os.PathLike[str], plan: Plan, feeds: dict[str, np.ndarray],
    shape: RunShape, *, nproc: int | None, warmup: int, iterations: int,
    threads_per_stage: int = 1, device: str | None = None, timeout_s: float = 60.0,
    show_progress: bool = False,
) -> Result:
    """Run with a process per replica (:func:`~onnx_partition.runtime.distributed.
    run_distributed`); the first ``warmup`` iterations are left out of the figures.
    ``show_progress``: rank 0 draws a bar over every rank's iterations on a terminal."""
    from onnx_partition.runtime.infer.processes import run_distributed
    from onnx_partition.runtime.infer.worker import RankBar

    outputs, stats = run_distributed(
        plan_dir, feeds, nproc=nproc, microbatches=shape.microbatches,
        iterations=warmup + iterations, threads_per_stage=threads_per_stage, device=device,
        timeout_s=timeout_s, progress=RankBar() if show_progress else None,
    )
    busy, cpu = {}, {}
    for rank, (k, r, _) in enumerate(stats.placement):
        each = stats.busy_each_ms.get(rank, [])[warmup:]
        busy[k, r] = sum(each) / len(each) if each else 0.0
        each = stats.cpu_each_ms.get(rank, [])[warmup:]
        cpu[k, r] = sum(each) / len(each) if each else 0.0
    measured = measured_json(plan, shape, iteration_ms=stats.iteration_ms[warmup:],
                             busy_ms=busy, cpu_ms=cpu)
    _memory_fields(measured, stats)
    measured["setup_ms"] = round(stats.setup_ms, 3)
    measured["comm_ms"] = {str(rank): round(ms / len(stats.iteration_ms), 6)
                           for rank, ms in stats.comm_ms.items()}
    named = dict(zip([o.name for o in plan.outputs], outputs, strict=True))
    return f"distributed:{stats.backend}", measured, named


#: What an inference rank's ``memory_bytes`` and ``resident_bytes`` are (``run --json``).
MEMORY_SOURCE = ("memory_bytes: the rank's peak resident set less its resident set before "
                 "its stage's onnxruntime session was built (weights, arena, activations, "
                 "wire buffers; onnxruntime's allocations are not torch storages); "
                 "resident_bytes: its peak resident set (VmHWM, reset at the rank's start); "
                 "a stage's: the largest of its replicas'")


def _memory_fields(measured: dict[str, Any], stats: Any) -> None:
    """Each rank's measured memory on its ``devices`` entry and each stage's (the largest of
    its replicas') on its ``stages`` entry, in place (None where a rank could not read it)."""
    rank_of = {(k, r): rank for rank, (k, r, _) in enumerate(stats.placement)}
    fields = (("memory_bytes", stats.memory_bytes), ("resident_bytes", stats.resident_bytes))
    for device in measured["devices"]:
        rank = rank_of.get((device["stage"], device["replica"]))
        for name, values in fields:
            device[name] = values.get(rank)
    for stage in measured["stages"]:
        mine = [d for d in measured["devices"] if d["stage"] == stage["index"]]
        for name, _ in fields:
            known = [d[name] for d in mine if d[name] is not None]
            stage[name] = max(known) if mine and len(known) == len(mine) else None
    measured["memory_source"] = MEMORY_SOURCE
