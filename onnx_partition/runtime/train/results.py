"""What a training run measured, set against what the plan predicted: :class:`TrainStats`
(built from every rank's :class:`~onnx_partition.runtime.train.rank_io.RankResult` by
:func:`summarize`, with the simulator's iteration time on the plan's costs and on the measured
stage times), :func:`comparison` (measured, predicted and their ratio, per stage too) and
:func:`train_json` (``train --json``). The summary's text is
:mod:`onnx_partition.cli.summary.train`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.from_plan import plan_costs, simulate_plan
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import Plan
from onnx_partition.plan.contracts import TRAIN_FORMAT
from onnx_partition.runtime.train.data_plan import SYNTHETIC
from onnx_partition.runtime.train.overheads import timed_from
from onnx_partition.runtime.train.rank_io import RankResult, RankRun
from onnx_partition.settings.train import TRAIN_FALLBACKS

__all__ = ["StagePrediction", "TrainStats", "comparison", "predicted_stages", "summarize",
           "train_json"]


@dataclass
class TrainStats:
    """What a training run measured (times in ms; ``*_ms`` per stage are per micro-batch on
    one replica, the simulator's unit)."""

    ranks: list[RankResult]
    rows: int  # samples per step (micro-batch rows x micro-batches)
    microbatches: int
    schedule: str
    engine: str
    loss: list[float]  # per step
    step_ms: list[float]  # per step, rank 0: start of the step to the optimizer step done
    forward_ms: list[float]  # per stage, measured
    backward_ms: list[float]  # per stage, measured
    simulated_ms: float  # the simulator on the plan's predicted costs (at the run's rows: at_rows)
    calibrated_ms: float  # the simulator on the measured stage times (plan's send times)
    mismatches: list[str] = field(default_factory=list)  # --check: "stage k parameter p: ..."
    checked_steps: tuple[int, ...] = ()  # steps whose parameters --check compares (SGD)
    optimizer: str = TRAIN_FALLBACKS["optimizer"]  # what stepped (--check: SGD's compared)
    saved: Path | None = None
    saved_pretrained: Path | None = None  # --save-pretrained's folder
    data: str = SYNTHETIC  # what the run trained on
    loss_kind: str = ""  # the loss (auto resolved)
    start_step: int = 0  # resumed: the checkpoint's step
    eval_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    grad_norm: list[float] = field(default_factory=list)  # per step, before clipping
    lr: list[float] = field(default_factory=list)  # per step
    checkpoint: Path | None = None  # where checkpoints went
    # per stage, measured in the run: bytes saved for backward per micro-batch (the saved-tensor
    # hook over the first step), the peak of live tensor storages (CUDA: max_memory_allocated;
    # CPU: the storage tracker), the process's VmHWM and CUDA's reserve (None where there is
    # none); each the maximum over the stage's replicas
    activation_bytes: list[int | None] = field(default_factory=list)
    memory_bytes: list[int | None] = field(default_factory=list)
    resident_bytes: list[int | None] = field(default_factory=list)
    reserved_bytes: list[int | None] = field(default_factory=list)
    # per stage on CPU: the ranks' thread CPU time in forward and backward (as forward_ms)
    forward_cpu_ms: list[float] = field(default_factory=list)
    math: str = "fp32"  # what the plan was priced in (plan.json ``math``) ...
    ran_math: str = "fp32"  # ... and what the ranks computed in (their TF32 flags)
    # --max-restarts: each restart after a lost rank (failed_step, resumed_from_step,
    # replayed_steps, error), in order
    restarts: list[dict[str, Any]] = field(default_factory=list)
    backward_cpu_ms: list[float] = field(default_factory=list)
    # per stage, the plan's prediction for the same quantities (the simulator's costs, at this
    # run's rows per micro-batch: scaled linearly from the plan's when they differ)
    predicted_stages: list[StagePrediction] = field(default_factory=list)
    scaled_from_batch_size: int | None = None  # the plan's rows, when the run's differ
    recompute: list[int] = field(default_factory=list)  # stages rebuilding their forward

    @property
    def measured_ms(self) -> float:
        """Mean step time over the timed steps (:func:`~onnx_partition.runtime.train.overheads.
        timed_from`: the tracked and warm-up steps left out where others follow)."""
        steady = self.step_ms[timed_from(len(self.step_ms)):]
        return sum(steady) / len(steady)

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.measured_ms * 1000.0 if self.measured_ms > 0 else 0.0


@dataclass(frozen=True)
class StagePrediction:
    """A stage's predicted figures per micro-batch on one replica (None: the plan has none)."""

    forward_ms: float
    backward_ms: float
    activation_bytes: int | None
    memory_bytes: int | None


def predicted_stages(plan: Plan, costs: PipelineCosts, scale: float = 1.0,
                     microbatches: int = 1, split: bool = False) -> list[StagePrediction]:
    """Per stage: the simulator's forward and backward ms (``costs``, rebuilt from plan.json;
    the backward with its share of the gradients' accumulation, which every micro-batch of
    ``microbatches`` but each replica's first pays, and, run ``split`` in ``I`` and ``W``, the
    split's ``split_ms``) and plan.json's ``activation_bytes`` and
    ``memory_bytes``, each scaled by ``scale`` (rows of the run / rows of the plan) where it
    grows with the rows: times, activations and receive buffers; weights, gradients, optimizer
    state and the accumulation do not."""
    out = []
    for stage, cost in zip(plan.stages, costs.stages, strict=True):
        pred = stage.predicted
        acts = None if pred is None or pred.activation_bytes is None else pred.activation_bytes
        memory: int | None = None if pred is None else pred.memory_bytes
        if pred is not None and scale != 1.0:
            fixed = [pred.weights_bytes, pred.grad_bytes, pred.optimizer_bytes]
            if acts is not None and None not in fixed and pred.inflight is not None:
                memory = int(sum(x or 0 for x in fixed) + scale * (
                    pred.inflight * acts + (pred.buffer_bytes or 0)))
            else:
                memory = None  # no parts to scale by: no prediction at this size
        adds = max(microbatches - cost.replicas, 0) / max(microbatches, 1)
        out.append(StagePrediction(cost.forward_ms * scale,
                                   cost.backward_ms * scale + cost.accumulate_ms * adds
                                   + (cost.split_ms if split else 0.0),
                                   None if acts is None else round(acts * scale), memory))
    return out


def _one_math(ranks: Sequence[RankResult]) -> str:
    """The math the ranks computed in (their own reports), or ``mixed: ...`` where they
    differ."""
    maths = sorted({r.math for r in ranks})
    return maths[0] if len(maths) == 1 else "mixed: " + ", ".join(maths)


def summarize(plan: Plan, ranks: Sequence[RankResult], run: RankRun, rows: int,
              engine: str) -> TrainStats:
    """Per-stage times (steady steps, per micro-batch on one replica) and both simulations."""
    steady = slice(timed_from(run.job.steps - run.checkpoints.start), None)
    count = run.microbatches
    stages = len(plan.stages)
    fwd, bwd = [0.0] * stages, [0.0] * stages
    fwd_cpu, bwd_cpu = [0.0] * stages, [0.0] * stages
    on_cpu = all(r.forward_cpu_ms for r in ranks)
    for r in ranks:
        f, b = r.forward_ms[steady], r.backward_ms[steady]
        # a replica's total over its micro-batches; all replicas together ran all ``count``
        fwd[r.stage] += sum(f) / len(f) / count
        bwd[r.stage] += sum(b) / len(b) / count
        if on_cpu:
            fc, bc = r.forward_cpu_ms[steady], r.backward_cpu_ms[steady]
            fwd_cpu[r.stage] += sum(fc) / len(fc) / count
            bwd_cpu[r.stage] += sum(bc) / len(bc) / count
    simulated, costs = simulate_plan(plan, schedule=run.schedule, microbatches=count)
    planned = plan.rows_per_microbatch
    scale = rows / count / planned if planned else 1.0
    base = plan_costs(plan, train=True)
    if scale != 1.0:  # the per-row terms scale, the per-step and per-parameter ones do not
        simulated = simulate(schedules.build(run.schedule, [s.replicas for s in costs.stages],
                                             count), costs.at_rows(scale))
    measured = PipelineCosts(
        [StageCosts(fwd[k], bwd[k], s.replicas, s.allreduce_ms) for k, s in
         enumerate(base.stages)], [x * scale for x in base.send_ms])
    replicas = [s.replicas for s in base.stages]
    calibrated = simulate(schedules.build(run.schedule, replicas, count), measured)
    rank0 = ranks[0]
    acts: list[int | None] = [None] * stages
    for r in ranks:  # a stage's replicas: the largest micro-batch, the highest peak
        if r.activation_bytes:
            acts[r.stage] = max(acts[r.stage] or 0, *r.activation_bytes)
    peaks, resident, reserved = (_stage_max(ranks, stages, key) for key in (
        "memory_bytes", "resident_bytes", "reserved_bytes"))
    return TrainStats(ranks=list(ranks), rows=rows, microbatches=count,
                      schedule=run.schedule, engine=engine, loss=rank0.loss,
                      step_ms=rank0.step_ms, forward_ms=fwd, backward_ms=bwd,
                      simulated_ms=simulated.iteration_ms,
                      calibrated_ms=calibrated.iteration_ms,
                      activation_bytes=acts, memory_bytes=peaks, resident_bytes=resident,
                      reserved_bytes=reserved,
                      forward_cpu_ms=fwd_cpu if on_cpu else [],
                      backward_cpu_ms=bwd_cpu if on_cpu else [],
                      predicted_stages=predicted_stages(plan, costs, scale, count,
                                                        run.schedule == "zb-h1"),
                      scaled_from_batch_size=planned if scale != 1.0 else None,
                      optimizer=run.optimizer,
                      start_step=run.checkpoints.start,
                      eval_loss=[*run.checkpoints.evals, *rank0.eval_loss],
                      grad_norm=rank0.grad_norm, lr=rank0.lr,
                      checkpoint=None if run.checkpoints.directory is None
                      else Path(run.checkpoints.directory),
                      recompute=[s.index for s in plan.stages if s.recompute],
                      math=plan.math or "fp32", ran_math=_one_math(ranks))


def _stage_max(ranks: Sequence[RankResult], stages: int, key: str) -> list[int | None]:
    """Per stage, the largest ``key`` of its replicas' results (None: none has it)."""
    out: list[int | None] = [None] * stages
    for r in ranks:
        value = getattr(r, key)
        if value is not None:
            out[r.stage] = max(out[r.stage] or 0, int(value))
    return out


def _ratio(measured: float | None, predicted: float | None) -> float | None:
    """measured / predicted to 4 significant digits (None: either is missing, or 0)."""
    if measured is None or not predicted:
        return None
    return float(f"{measured / predicted:.4g}")


def comparison(stats: TrainStats) -> dict[str, dict[str, Any]]:
    """``measured``, ``predicted`` and their ``ratio`` (measured / predicted), each with
    ``iteration_ms``, ``samples_per_s`` (``run --json``'s names) and ``stages``: per stage
    ``forward_ms`` and ``backward_ms`` (per micro-batch on one replica), ``activation_bytes``
    (saved for backward per micro-batch: the run's saved-tensor hook against plan.json's) and
    ``memory_bytes`` (the peak of live tensor storages, the maximum over the stage's replicas:
    CUDA's ``max_memory_allocated``, on CPU :mod:`onnx_partition.runtime.memtrack`'s tracker,
    against the memory model's); ``measured`` adds ``resident_bytes`` (the ranks' VmHWM: all
    the process holds, the interpreter and libraries too; None where the OS has none) and
    ``reserved_bytes`` (CUDA's allocator reserve; None elsewhere). On CPU ``measured`` adds
    ``forward_cpu_ms`` and ``backward_cpu_ms`` per stage (the rank's thread CPU time in the same
    compute, which other processes on a busy machine do not stretch; None on CUDA) and
    ``ratio`` sets them against the predicted ``forward_ms`` and ``backward_ms``."""
    def rate(ms: float) -> float:
        return round(stats.rows / ms * 1000.0, 3) if ms > 0 else 0.0

    preds = stats.predicted_stages
    count = len(stats.forward_ms)
    acts = stats.activation_bytes or [None] * count
    peaks = stats.memory_bytes or [None] * count
    resident = stats.resident_bytes or [None] * count
    reserved = stats.reserved_bytes or [None] * count
    fwd_cpu: list[float | None] = [round(v, 6) for v in stats.forward_cpu_ms] or [None] * count
    bwd_cpu: list[float | None] = [round(v, 6) for v in stats.backward_cpu_ms] or [None] * count
    measured: dict[str, Any] = {
        "iteration_ms": round(stats.measured_ms, 6), "samples_per_s": rate(stats.measured_ms),
        "stages": [{"stage": k, "forward_ms": round(stats.forward_ms[k], 6),
                    "backward_ms": round(stats.backward_ms[k], 6),
                    "forward_cpu_ms": fwd_cpu[k], "backward_cpu_ms": bwd_cpu[k],
                    "activation_bytes": acts[k], "memory_bytes": peaks[k],
                    "resident_bytes": resident[k], "reserved_bytes": reserved[k]}
                   for k in range(count)]}
    predicted: dict[str, Any] = {
        "iteration_ms": round(stats.simulated_ms, 6), "samples_per_s": rate(stats.simulated_ms),
        "stages": [{"stage": k, "forward_ms": round(p.forward_ms, 6),
                    "backward_ms": round(p.backward_ms, 6),
                    "activation_bytes": p.activation_bytes, "memory_bytes": p.memory_bytes}
                   for k, p in enumerate(preds)],
        "scaled_from_batch_size": stats.scaled_from_batch_size}
    keys = ("forward_ms", "backward_ms", "activation_bytes", "memory_bytes")
    ratio: dict[str, Any] = {
        "iteration_ms": _ratio(measured["iteration_ms"], predicted["iteration_ms"]),
        "samples_per_s": _ratio(measured["samples_per_s"], predicted["samples_per_s"]),
        "stages": [{"stage": m["stage"], **{key: _ratio(m[key], p[key]) for key in keys},
                    "forward_cpu_ms": _ratio(m["forward_cpu_ms"], p["forward_ms"]),
                    "backward_cpu_ms": _ratio(m["backward_cpu_ms"], p["backward_ms"])}
                   for m, p in zip(measured["stages"], predicted["stages"])]}
    return {"measured": measured, "predicted": predicted, "ratio": ratio}


def train_json(stats: TrainStats) -> dict[str, Any]:
    """What ``train --json`` prints: :func:`comparison`'s ``measured``, ``predicted`` (the
    simulator on the plan's costs, plan.json's memory) and ``ratio``, the loss per step and
    the final and best validation loss."""
    evals = [v for _, v in stats.eval_loss]
    return {"format": TRAIN_FORMAT, "engine": stats.engine, "schedule": stats.schedule,
            "recompute": stats.recompute, "math": {"priced": stats.math, "ran": stats.ran_math},
            "ranks": len(stats.ranks), "microbatches": stats.microbatches, "rows": stats.rows,
            "start_step": stats.start_step, "steps": stats.start_step + len(stats.loss),
            "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
            "final_eval_loss": evals[-1] if evals else None,
            "best_eval_loss": min(evals) if evals else None,
            **comparison(stats),
            "check": None if not stats.checked_steps else not stats.mismatches,
            "saved": None if stats.saved is None else str(stats.saved),
            "saved_pretrained": (None if stats.saved_pretrained is None
                                 else str(stats.saved_pretrained)),
            "checkpoint": None if stats.checkpoint is None else str(stats.checkpoint),
            "restarts": stats.restarts}
