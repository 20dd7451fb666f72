"""``--check``: every rank's gradients after the first backward, and with SGD its parameters
after each checked step, set against the whole program trained in one process on the same
batches (:mod:`onnx_partition.runtime.train.reference`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from onnx_partition.runtime.train.data_plan import DataPlan, synthetic_batch
from onnx_partition.runtime.train.rank_io import RankResult, RankRun

__all__ = ["compare_with_reference"]


def compare_with_reference(folder: Path, ranks: Sequence[RankResult], run: RankRun, rows: int,
                           spec: DataPlan) -> list[str]:
    """One line per parameter (stage, replica, name) that differs from single-process training
    beyond rounding (:func:`~onnx_partition.runtime.train.reference.mismatch`: a tolerance of
    the dtype's precision, relative to the tensor's scale or at least the model's largest
    element): its gradient after the first
    backward, and with SGD its value after each checked step. AdamW's parameters are not
    compared: its first step's ``g / |g|`` turns rounding in a tiny gradient into ``±lr``."""
    from onnx_partition.runtime.train.reference import (
        mismatch,
        reference_gradients,
        reference_train,
    )
    from onnx_partition.runtime.train.task import task_for

    task = task_for(folder, spec.loss, spec.loss_fn, spec.kind)
    problems: list[str] = []
    bf16 = run.precision == "bf16"

    def compare(what: str, got_by_rank: Sequence[dict[str, torch.Tensor]],
                want: dict[str, torch.Tensor]) -> None:
        floor = max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)
        for r, got_all in zip(ranks, got_by_rank):
            for name, got in got_all.items():
                where = f"{what}: stage {r.stage} replica {r.replica} (rank {r.rank})"
                if name not in want:
                    problems.append(f"{where} parameter {name!r} is not in the reference")
                    continue
                ref = want[name]
                # bf16 autocast: the tolerance of the precision the run computed in
                off = (mismatch(got.to(torch.bfloat16), ref.to(torch.bfloat16), floor) if bf16
                       else mismatch(got, ref, floor))
                if off is not None:
                    problems.append(f"{where} parameter {name!r} differs (max abs "
                                    f"{float((got - ref.to(got.dtype)).abs().max()):.3g}, "
                                    f"{off:.2g} of its largest element)")

    source = spec.fresh()
    every = [source(s) if source is not None else
             synthetic_batch(task.make_batch, rows, run.job.seed, s)
             for s in range(max(run.check_steps, default=0))]
    if run.check_steps:
        want = reference_gradients(folder, every[0], microbatches=run.microbatches, task=task,
                                   precision=run.precision, seed=run.job.seed)
        compare("gradient of step 1", [r.grads for r in ranks], want)
    if run.optimizer != "sgd":
        return problems
    asked = run.job.optimizer
    for step in run.check_steps:
        want = reference_train(folder, every[:step], optimizer=run.optimizer, lr=asked.lr,
                               steps=step, microbatches=run.microbatches, task=task,
                               weight_decay=asked.weight_decay, momentum=asked.momentum,
                               betas=asked.betas, warmup_steps=asked.warmup_steps,
                               lr_schedule=asked.lr_schedule, total_steps=run.job.steps,
                               clip_grad_norm=asked.clip_grad_norm, precision=run.precision,
                               seed=run.job.seed)
        compare(f"after step {step}", [r.states[step] for r in ranks], want)
    return problems
