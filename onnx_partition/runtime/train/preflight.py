"""A training request checked before any process starts (a one-line
:class:`~onnx_partition.errors.PartitionError` each): the plan trainable and unaltered, the
process count its stage replicas, the schedule, optimizer and engine known, the optimisation,
checkpoint and evaluation options in range (:func:`check_options`), and a ``--save`` folder
that the trained plan may be written to (:func:`check_save`)."""

from __future__ import annotations

from pathlib import Path

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.layout import layout
from onnx_partition.plan import Plan
from onnx_partition.plan.folder import is_earlier_plan
from onnx_partition.runtime.infer.sessions import verify_plan_folder
from onnx_partition.runtime.launch.ranks import check_world_size
from onnx_partition.runtime.train.choices import ENGINES, OPTIMIZERS
from onnx_partition.runtime.train.paths import check_output_path
from onnx_partition.settings.train import DEFAULTS, TrainJob

__all__ = ["check_options", "check_request", "check_save"]


def check_options(job: TrainJob) -> None:
    """The optimisation, checkpoint and evaluation options of ``job`` (resolved), or a
    one-line PartitionError."""
    from onnx_partition.runtime.train.choices import PRECISIONS
    from onnx_partition.runtime.train.lr_schedule import LR_SCHEDULES

    asked = job.optimizer
    optimizer, weight_decay, momentum, betas = (asked.name, asked.weight_decay, asked.momentum,
                                                asked.betas)
    precision = job.engine.precision
    if weight_decay is not None and not weight_decay >= 0:
        raise PartitionError(f"--weight-decay must be >= 0, got {weight_decay}")
    if momentum != 0.0 and optimizer != "sgd":
        raise PartitionError("--momentum is SGD's; AdamW takes --betas")
    if not 0.0 <= momentum < 1.0:
        raise PartitionError(f"--momentum must be in [0, 1), got {momentum}")
    if betas != DEFAULTS.optimizer.betas and optimizer != "adamw":
        raise PartitionError("--betas are AdamW's; SGD takes --momentum")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise PartitionError(f"--betas must be two numbers in [0, 1), got {list(betas)}")
    if asked.warmup_steps < 0:
        raise PartitionError(f"--warmup-steps must be >= 0, got {asked.warmup_steps}")
    if asked.lr_schedule not in LR_SCHEDULES:
        raise PartitionError(f"unknown --lr-schedule {asked.lr_schedule!r}; choose "
                             f"{', '.join(LR_SCHEDULES)}")
    clip = asked.clip_grad_norm
    if clip is not None and not clip > 0:
        raise PartitionError(f"--clip-grad-norm must be positive, got {clip}")
    if precision == "fp16":  # a plan priced for fp16 (partition --precision fp16)
        raise PartitionError("--precision fp16 is not run by train: fp16 needs loss scaling "
                             "(its gradients underflow), which train does not do; give "
                             "--precision bf16 (same memory and speed on GPUs with bf16) or fp32")
    if precision not in PRECISIONS:
        raise PartitionError(f"unknown --precision {precision!r}; choose {', '.join(PRECISIONS)}")
    for name, value in (("--checkpoint-every", job.checkpoint.every),
                        ("--eval-every", job.data.eval_every),
                        ("--max-restarts", job.checkpoint.max_restarts)):
        if value < 0:
            raise PartitionError(f"{name} must be >= 0, got {value}")
    if job.checkpoint.max_restarts and job.checkpoint.dir is None:
        raise PartitionError("--max-restarts needs --checkpoint-dir DIR (a restart resumes "
                             "from its newest complete checkpoint)")


def check_request(plan_dir: Path, job: TrainJob, *, nproc: int | None) -> Plan:
    """The plan, if ``job`` (resolved) asks for something it can train on ``nproc``
    processes (None: one per stage replica); else a PartitionError (before any process)."""
    from onnx_partition.runtime.train.modules import require_trainable

    steps, lr, engine = job.steps, job.optimizer.lr, job.engine.name
    schedule, optimizer = job.schedule.name, job.optimizer.name
    microbatches, batch_size = job.schedule.microbatches or 0, job.schedule.batch_size or 0
    plan = require_trainable(plan_dir)
    verify_plan_folder(plan_dir, plan)
    lay = layout(plan)
    if nproc is not None and schedule == "interleaved-zb" and engine == "torch":
        if nproc * 2 != lay.world_size:  # two stages per process
            raise PartitionError(f"--schedule interleaved-zb holds two stages per process: the "
                                 f"plan's {lay.world_size} stage replicas need "
                                 f"{lay.world_size / 2:g} processes; got {nproc}")
    elif nproc is not None:
        check_world_size(lay.replicas, nproc)
    for what, value in (("step", steps), ("micro-batch", microbatches),
                        ("row per micro-batch", batch_size)):
        if value < 1:
            raise PartitionError(f"need at least one {what}, got {value}")
    from onnx_partition.runtime.train.choices import TORCH_SCHEDULES

    if schedule in TORCH_SCHEDULES and engine != "torch":
        raise PartitionError(f"schedule {schedule!r} is torch pipelining's: add --engine torch")
    if schedule not in (*schedules.TRAIN_NAMES, *TORCH_SCHEDULES):
        raise PartitionError(f"unknown schedule {schedule!r}; choose "
                             f"{', '.join(schedules.TRAIN_NAMES)}")
    if optimizer not in OPTIMIZERS:
        raise PartitionError(f"unknown optimizer {optimizer!r}; choose {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise PartitionError(f"the learning rate must be positive, got {lr}")
    if engine not in ENGINES:
        raise PartitionError(f"unknown engine {engine!r}; choose {', '.join(ENGINES)}")
    return plan


def check_save(plan_dir: Path, out: Path, plan: Plan | None = None) -> None:
    """Refuse before training what ``save_trained`` would refuse after it (the rules of
    :func:`onnx_partition.graph.emit.write_plan_folder`), and a folder inside the plan's or
    over its model (:func:`~onnx_partition.runtime.train.paths.check_output_path`)."""
    if out.resolve() == plan_dir.resolve():
        raise PartitionError(f"--save writes a new plan folder, not over {plan_dir}")
    if plan is not None:
        check_output_path(plan_dir, plan, out, "--save")
    if out.exists() and not out.is_dir():
        raise PartitionError(f"--save {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not is_earlier_plan(out):
        raise PartitionError(f"--save {out}: the folder exists and is not an earlier plan")
