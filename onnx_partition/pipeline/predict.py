"""Predicted against measured: the shape of a run, the plan's prediction for it, and the JSON
objects ``run --json``, ``simulate --json`` and ``partition --json`` print.

**Batch size.** Every command means the same by ``--batch-size``: *rows per micro-batch* (the
leading dim the stage files were planned at; plan.json ``batch_size``). An iteration (one call of
the pipeline) is ``microbatches`` micro-batches, so its rows are ``batch_size x microbatches``
(:class:`RunShape`). ``run`` defaults to the plan's micro-batch size and count
(:attr:`Plan.rows_per_microbatch` and :attr:`Plan.microbatches`, whose default for plans without
a count is ``partition``'s).

**Prediction for a run** (:func:`predict`): the plan's own simulation
(:func:`~onnx_partition.pipeline.from_plan.simulate_plan`) with the run's micro-batch count and the
forward-only schedule (``run`` executes forward passes, also of training plans). When the run's
micro-batch size differs from the plan's, every simulated duration is scaled by
``run / plan`` rows: all costs scaled alike scale the whole timeline alike (linear in batch,
the assumption ``partition`` makes for costs files).

Field names are plan.json's where they mean the same: ``iteration_ms``, ``throughput_per_s``
(micro-batches per second), ``microbatches``, ``batch_size``, per-stage ``compute_ms``,
``comm_ms``, ``memory_bytes``, ``replicas``; new: ``samples_per_s`` (rows per second),
``rows`` (per iteration), ``busy_ms`` (compute per iteration on one replica), and, for a train
plan whose simulation plays other hops than its ``comm_ms`` (measured ones), ``comm_played_ms``
per stage (:func:`~onnx_partition.pipeline.from_plan.played_comm`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json
from onnx_partition.pipeline.from_plan import default_schedule, played_comm, simulate_plan
from onnx_partition.pipeline.simulate import SimResult
from onnx_partition.plan import Plan
from onnx_partition.plan.contracts import RUN_FORMAT

__all__ = ["RUN_FORMAT", "SHARED", "SHARED_STAGE", "RunShape", "dumps",
           "measured_json", "partition_json", "predict", "ratios",
           "read_run", "rows_scale", "run_json", "run_shape", "simulate_json",
           "simulation_json"]



@dataclass(frozen=True)
class RunShape:
    """How many rows an iteration feeds: ``microbatches`` micro-batches of ``batch_size``."""

    batch_size: int  # rows per micro-batch
    microbatches: int

    @property
    def rows(self) -> int:
        return self.batch_size * self.microbatches


def run_shape(plan: Plan, *, batch_size: int | None = None,
              microbatches: int | None = None) -> RunShape:
    """The run's shape: the given values, else the plan's (see the module docstring)."""
    size = batch_size if batch_size is not None else (plan.rows_per_microbatch or 1)
    count = microbatches if microbatches is not None else plan.microbatches
    if size < 1 or count < 1:
        raise PartitionError(f"--batch-size and --microbatches must be at least 1, got "
                             f"{size} and {count}")
    return RunShape(size, count)


# ------------------------------------------------------------------------- JSON objects


def simulation_json(plan: Plan, result: SimResult, *, schedule: str, microbatches: int,
                    batch_size: int | None, scale: float = 1.0,
                    simulated_at_rows: bool = False) -> dict[str, Any]:
    """A simulation as plain data: the plan's per-stage figures multiplied by ``scale``, and
    the result's durations too unless it was ``simulated_at_rows`` (its costs already
    scaled)."""
    plan_scale = scale
    scale = 1.0 if simulated_at_rows else scale
    iteration = result.iteration_ms * scale
    rows = (batch_size or 0) * microbatches
    devices = [{"stage": dev[0], "replica": dev[1], "busy_ms": round(busy * scale, 6),
                "peak_inflight": result.peak_inflight.get(dev, 0),
                "memory_bytes": int(result.peak_memory_bytes.get(dev, 0.0))}
               for dev, busy in sorted(result.busy_ms.items())]
    stages: list[dict[str, Any]] = []
    forward_only = plan.mode == "train" and schedule == "infer"  # a train plan's forward pass
    played = None if forward_only else played_comm(plan)
    for stage in plan.stages:
        mine = [d for d in devices if d["stage"] == stage.index]
        pred = stage.predicted
        compute = (0.0 if pred is None else pred.forward_ms
                   if forward_only and pred.forward_ms is not None else pred.compute_ms)
        stages.append({
            "index": stage.index, "replicas": stage.replicas,
            "busy_ms": round(sum(d["busy_ms"] for d in mine) / max(1, len(mine)), 6),
            "compute_ms": round(compute * plan_scale, 6),
            "comm_ms": round(pred.comm_ms * plan_scale, 6) if pred else 0.0,
            # the hops the simulation plays, where they are not comm_ms (measured hops)
            **({"comm_played_ms": round(played[len(stages)] * plan_scale, 6)}
               if played is not None else {}),
            "memory_bytes": max((d["memory_bytes"] for d in mine), default=0),
            # as plan.json marks it: a stage rebuilding its forward in backward
            **({"recompute": True} if stage.recompute and plan.mode == "train"
               and not forward_only else {}),
        })
    return {
        "schedule": schedule, "microbatches": microbatches, "batch_size": batch_size,
        "rows": rows, "iteration_ms": round(iteration, 6),
        "throughput_per_s": round(microbatches / iteration * 1000.0, 3) if iteration else 0.0,
        "samples_per_s": round(rows / iteration * 1000.0, 3) if iteration and rows else 0.0,
        "bubble_fraction": round(result.bubble_fraction, 4),
        "stages": stages, "devices": devices,
    }


def predict(plan: Plan, shape: RunShape) -> dict[str, Any]:
    """The plan's prediction for a run of ``shape`` (see the module docstring)."""
    result, _ = simulate_plan(plan, schedule="infer", microbatches=shape.microbatches)
    planned = plan.rows_per_microbatch
    scale = shape.batch_size / planned if planned else 1.0
    body = simulation_json(plan, result, schedule="infer", microbatches=shape.microbatches,
                           batch_size=shape.batch_size, scale=scale)
    body["scaled_from_batch_size"] = planned if scale != 1.0 else None
    return body


def measured_json(plan: Plan, shape: RunShape, *, iteration_ms: Sequence[float],
                  busy_ms: Mapping[tuple[int, int], float],
                  cpu_ms: Mapping[tuple[int, int], float] | None = None) -> dict[str, Any]:
    """A measured run as plain data: ``iteration_ms`` per timed iteration, ``busy_ms`` per
    (stage, replica) per iteration (means over the timed iterations), and ``cpu_ms`` the same
    compute in thread CPU time (``busy_ms`` less what other threads and processes took from
    its core: their ratio is the contention a run suffered)."""
    mean = sum(iteration_ms) / len(iteration_ms) if iteration_ms else 0.0
    cpu = cpu_ms or {}
    devices = [{"stage": k, "replica": r, "busy_ms": round(ms, 6),
                **({"cpu_ms": round(cpu[k, r], 6)} if (k, r) in cpu else {})}
               for (k, r), ms in sorted(busy_ms.items())]
    stages = []
    for stage in plan.stages:
        mine = [d for d in devices if d["stage"] == stage.index]
        entry = {"index": stage.index, "replicas": stage.replicas,
                 "busy_ms": round(sum(d["busy_ms"] for d in mine) / max(1, len(mine)), 6)}
        if mine and all("cpu_ms" in d for d in mine):
            entry["cpu_ms"] = round(sum(d["cpu_ms"] for d in mine) / len(mine), 6)
        stages.append(entry)
    return {
        "microbatches": shape.microbatches, "batch_size": shape.batch_size, "rows": shape.rows,
        "iterations": len(iteration_ms), "iteration_ms": round(mean, 6),
        "iteration_ms_each": [round(ms, 6) for ms in iteration_ms],
        "throughput_per_s": round(shape.microbatches / mean * 1000.0, 3) if mean else 0.0,
        "samples_per_s": round(shape.rows / mean * 1000.0, 3) if mean else 0.0,
        "stages": stages, "devices": devices,
    }


def ratios(measured: Mapping[str, Any], predicted: Mapping[str, Any]) -> dict[str, Any]:
    """measured / predicted: throughput, iteration time, and each stage's busy time."""
    def div(a: float, b: float) -> float | None:
        return float(f"{a / b:.4g}") if b else None

    by_stage = {s["index"]: s for s in predicted["stages"]}
    return {
        "samples_per_s": div(measured["samples_per_s"], predicted["samples_per_s"]),
        "iteration_ms": div(measured["iteration_ms"], predicted["iteration_ms"]),
        "stage_busy_ms": [div(s["busy_ms"], by_stage[s["index"]]["busy_ms"])
                          for s in measured["stages"] if s["index"] in by_stage],
        "stage_cpu_ms": [div(s["cpu_ms"], by_stage[s["index"]]["busy_ms"])
                         if "cpu_ms" in s else None
                         for s in measured["stages"] if s["index"] in by_stage],
    }


def run_json(plan: Plan, shape: RunShape, runtime: str, measured: dict[str, Any],
             **extra: Any) -> dict[str, Any]:
    """What ``run --json`` prints: the run's shape, measured, predicted and their ratio."""
    predicted = predict(plan, shape)
    return {"format": RUN_FORMAT, "runtime": runtime, "stages": len(plan.stages),
            "replicas": [s.replicas for s in plan.stages],
            "microbatches": shape.microbatches, "batch_size": shape.batch_size,
            "rows": shape.rows, **extra, "measured": measured, "predicted": predicted,
            "ratio": ratios(measured, predicted)}


#: The figures of a simulation every ``--json`` output states at its top level.
SHARED = ("schedule", "microbatches", "batch_size", "rows", "iteration_ms", "throughput_per_s",
          "samples_per_s", "bubble_fraction")
#: ... and per stage.
SHARED_STAGE = ("index", "replicas", "busy_ms", "compute_ms", "comm_ms", "memory_bytes")


def partition_json(plan: Plan, plan_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``partition --json`` prints: plan.json without node lists, plus where it went, and
    at the top level (and per stage) the figures of the plan's own simulation as ``simulate
    --json`` states them (:data:`SHARED`, :data:`SHARED_STAGE`): one value per quantity."""
    body = plan.to_json()
    result, _ = simulate_plan(plan)
    figures = simulate_json(plan, result, schedule=None, microbatches=None)
    for stage, sim in zip(body["stages"], figures["stages"]):
        stage["nodes"] = len(stage["nodes"])
        stage["constants"] = len(stage.get("constants", []))
        stage.update({k: sim[k] for k in (*SHARED_STAGE, "comm_played_ms") if k in sim})
    body["plan_dir"] = str(plan_dir)
    body.update({k: figures[k] for k in SHARED})
    return body


def rows_scale(plan: Plan, batch_size: int | None) -> float:
    """``batch_size`` rows per micro-batch over the plan's (1 when either is unknown)."""
    if batch_size is not None and batch_size < 1:
        raise PartitionError(f"--batch-size must be at least 1, got {batch_size}")
    planned = plan.rows_per_microbatch
    return batch_size / planned if batch_size and planned else 1.0


def simulate_json(plan: Plan, result: SimResult, *, schedule: str | None,
                  microbatches: int | None, batch_size: int | None = None) -> dict[str, Any]:
    """What ``simulate --json`` prints: at the plan's micro-batch size, or at ``batch_size``
    rows per micro-batch, ``result`` then being simulated at those rows
    (:func:`~onnx_partition.pipeline.from_plan.simulate_plan` with :func:`rows_scale`: a train
    plan's per-step work does not grow with the rows) and the plan's per-stage figures scaled
    linearly."""
    count = microbatches if microbatches is not None else plan.microbatches
    planned = plan.rows_per_microbatch
    scale = rows_scale(plan, batch_size)
    size = batch_size if batch_size is not None else planned
    body = simulation_json(plan, result, schedule=schedule or default_schedule(plan),
                           microbatches=count, batch_size=size, scale=scale,
                           simulated_at_rows=True)
    body["scaled_from_batch_size"] = planned if scale != 1.0 else None
    return body


def read_run(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``run --json`` file, checked against its schema
    (:class:`~onnx_partition.plan.contracts.RunBody`: a misspelled key is named)."""
    body = read_json(path, "run")
    if not isinstance(body, dict) or body.get("format") != RUN_FORMAT:
        raise PartitionError(f"{path} is not a `run --json` file (format {RUN_FORMAT})")
    from onnx_partition.plan.schema import validate_run  # pydantic: loaded when first needed

    validate_run(body, str(path))
    return body


# ------------------------------------------------------------------------- text


def dumps(body: Mapping[str, Any]) -> str:
    """One JSON object on one line (``--json`` output); strict JSON, so an infinite or NaN
    figure (a plan with no compute) is written as null."""
    return json.dumps(_finite(body), separators=(",", ":"), default=_default, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")
