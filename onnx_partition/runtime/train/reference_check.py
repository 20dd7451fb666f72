"""``--check``: every rank's gradients after the first backward, and with SGD its parameters
after each checked step, set against the whole program trained in one process on the same
batches (:mod:`onnx_partition.runtime.train.reference`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from onnx_partition.plan import Plan, read_plan
from onnx_partition.runtime.train.data_plan import DataPlan, synthetic_batch
from onnx_partition.runtime.train.math_mode import apply_math, run_math
from onnx_partition.runtime.train.rank_io import RankResult, RankRun

__all__ = ["compare_with_reference", "differences", "reference_device"]


def differences(where: str, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                truth: Mapping[str, torch.Tensor], math: str) -> list[str]:
    """One line per tensor of ``got`` that differs from ``truth`` (float64) beyond the
    tolerance of ``math`` at its own scale and beyond
    :data:`~onnx_partition.runtime.train.reference.NOISE_FACTOR` times ``want``'s (the
    reference in the run's own precision) distance from it
    (:func:`~onnx_partition.runtime.train.reference.mismatch`)."""
    from onnx_partition.runtime.train.reference import NOISE_FACTOR, mismatch

    lines = []
    for name, value in got.items():
        if name not in want or name not in truth:
            lines.append(f"{where} parameter {name!r} is not in the reference")
            continue
        exact = truth[name].to(torch.float64)
        noise = float((want[name].to(torch.float64) - exact).abs().max()) if exact.numel() else 0.0
        off = mismatch(value, exact, NOISE_FACTOR * noise, math)
        if off is not None:
            lines.append(f"{where} parameter {name!r} differs (max abs "
                         f"{float((value.double() - exact).abs().max()):.3g}, "
                         f"{off:.2g} of its largest element)")
    return lines


def reference_device(plan: Plan) -> torch.device | None:
    """Where ``--check``'s reference runs: the first stage's GPU when this machine has it
    (the numbers of the plan's device), else the CPU (None)."""
    first = plan.stages[0].devices[0] if plan.stages[0].devices else "cpu"
    if first.startswith("cuda") and torch.cuda.is_available():
        index = int(first.partition(":")[2] or 0)
        if index < torch.cuda.device_count():
            return torch.device("cuda", index)
    return None


def compare_with_reference(folder: Path, ranks: Sequence[RankResult], run: RankRun, rows: int,
                           spec: DataPlan) -> list[str]:
    """One line per parameter (stage, replica, name) that differs from single-process training
    beyond rounding: its gradient after the first backward, and with SGD its value after each
    checked step, by :func:`differences`: against the float64 truth (the whole program
    trained in float64 on the same batches) at the tolerance of the run's math (the plan's,
    or the run's autocast precision: :func:`~onnx_partition.runtime.train.math_mode.run_math`)
    and each tensor's own scale, or within the rounding the single-process reference in the
    run's own precision carries (a tensor that is zero in exact arithmetic, as a key bias's
    gradient under softmax, is rounding in both). AdamW's
    parameters are not compared: its first step's ``g / |g|`` turns rounding in a tiny
    gradient into ``±lr``."""
    from onnx_partition.runtime.train.reference import reference_gradients, reference_train
    from onnx_partition.runtime.train.task import task_for

    task = task_for(folder, spec.loss, spec.loss_fn, spec.kind)
    plan = read_plan(folder)
    math, device = run_math(plan.math, run.precision), reference_device(plan)
    apply_math(math)  # the reference in the run's own precision computes as the run does
    problems: list[str] = []

    def compare(what: str, got_by_rank: Sequence[dict[str, torch.Tensor]],
                want: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> None:
        for r, got in zip(ranks, got_by_rank):
            where = f"{what}: stage {r.stage} replica {r.replica} (rank {r.rank})"
            problems.extend(differences(where, got, want, truth, math))

    source = spec.fresh()
    every = [source(s) if source is not None else
             synthetic_batch(task.make_batch, rows, run.job.seed, s)
             for s in range(max(run.check_steps, default=0))]
    if run.check_steps:
        both = [reference_gradients(folder, every[0], microbatches=run.microbatches, task=task,
                                    precision=precision, dtype=dtype, device=device,
                                    weights=run.weights, seed=run.job.seed)
                for precision, dtype in ((run.precision, None), ("fp32", torch.float64))]
        compare("gradient of step 1", [r.grads for r in ranks], *both)
    if run.optimizer != "sgd":
        return problems
    asked = run.job.optimizer
    for step in run.check_steps:
        both = [reference_train(
            folder, every[:step], optimizer=run.optimizer, lr=asked.lr, steps=step,
            microbatches=run.microbatches, task=task, weight_decay=asked.weight_decay,
            momentum=asked.momentum, betas=asked.betas, warmup_steps=asked.warmup_steps,
            lr_schedule=asked.lr_schedule, total_steps=run.job.steps,
            clip_grad_norm=asked.clip_grad_norm, precision=precision, dtype=dtype,
            device=device, weights=run.weights, seed=run.job.seed)
            for precision, dtype in ((run.precision, None), ("fp32", torch.float64))]
        compare(f"after step {step}", [r.states[step] for r in ranks], *both)
    return problems
