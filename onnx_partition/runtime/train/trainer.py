"""Train a plan folder: one process per stage replica (or one rank under ``torchrun``).

:func:`train_plan` checks the request before any process starts (a plan that cannot be trained,
an altered stage file or program, a process count that is not the plan's replicas: a
:class:`PartitionError`; bad ``--data`` too, :func:`prepare_data`), builds the stage modules in
every rank (:func:`onnx_partition.runtime.train.modules.stage_modules`), takes every step's
batch from the data (:mod:`onnx_partition.runtime.train.data`: stage 0 reads the inputs, the
last stage the targets) or draws it from the seed (synthetic, the same in every rank), runs
:func:`onnx_partition.runtime.train.rank.train_stages` in each rank and
returns :class:`TrainStats`: loss and time per step, per-stage forward and backward times
measured, and the simulator's iteration time for the same plan and schedule, both from the
plan's predicted costs and from the measured stage times.

``--check`` compares every rank's parameters after step 1 (and 3) with the whole program
trained in one process on the same batches (``reference_train``). ``--save`` writes replica 0
of every stage back as a servable plan folder (``save_trained``).

Several machines (the plan folder on each): :func:`train_rank` is one rank under ``torchrun``,
started through the entry :func:`onnx_partition.cli.torchrun.train_main`::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST \\
        -m onnx_partition.train.runtime PLAN --steps 10 --microbatches 8 --batch-size 4
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.fileio import atomic_write
from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.from_plan import plan_costs, recompute_line, simulate_plan
from onnx_partition.pipeline.layout import layout
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import Plan, read_plan
from onnx_partition.plan.contracts import STAGE_COSTS_FORMAT, TRAIN_FORMAT
from onnx_partition.plan.folder import is_earlier_plan
from onnx_partition.runtime.infer.sessions import verify_plan_folder
from onnx_partition.runtime.infer.worker import choose_backend
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.launch.ranks import (
    check_placement,
    check_world_size,
    torchrun_env,
)
from onnx_partition.runtime.train.choices import (
    ENGINES,
    OPTIMIZERS,
    PlannedChoiceWarning,
    planned_choices,
)
from onnx_partition.runtime.train.comm import Tensors
from onnx_partition.runtime.train.data import (
    ArrayBatches,
    ArraySource,
    FactoryBatches,
    check_data,
)
from onnx_partition.runtime.train.loss import LOSSES
from onnx_partition.runtime.train.loss import LossFn as UserLoss
from onnx_partition.runtime.train.paths import check_log_path, check_output_path
from onnx_partition.runtime.train.rank import (
    Batches,
    LossFn,
    RankResult,
    StageLike,
    TrainConfig,
    train_stages,
)
from onnx_partition.runtime.train.spawn import launch_training, torchrun_rank

__all__ = ["EVAL_SEED", "StagePrediction", "TrainStats", "comparison", "comparison_table",
           "format_train", "predicted_stages", "train_json", "train_plan", "train_rank",
           "train_stages"]

CHECK_STEPS = (1, 3)
# --data: a .npz or a folder of .npy, a mapping of arrays, or a factory of batches per rank
DataArg = str | os.PathLike[str] | Mapping[str, Any] | Callable[[], Iterable[Any]]
#: Synthetic validation batches are drawn with ``seed + EVAL_SEED`` (never a training batch's).
EVAL_SEED = 7919


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
    optimizer: str = "sgd"  # what stepped: --check compares parameters for SGD only
    saved: Path | None = None
    data: str = "synthetic batches"  # what the run trained on
    loss_kind: str = ""  # the loss (auto resolved)
    start_step: int = 0  # resumed: the checkpoint's step
    eval_loss: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    grad_norm: list[float] = field(default_factory=list)  # per step, before clipping
    lr: list[float] = field(default_factory=list)  # per step
    checkpoint: Path | None = None  # where checkpoints went
    # per stage, measured in the run: bytes saved for backward per micro-batch (the saved-tensor
    # hook over the first step), the device's peak (CUDA: max_memory_allocated; None on CPU)
    activation_bytes: list[int | None] = field(default_factory=list)
    memory_bytes: list[int | None] = field(default_factory=list)
    # per stage on CPU: the ranks' thread CPU time in forward and backward (as forward_ms)
    forward_cpu_ms: list[float] = field(default_factory=list)
    backward_cpu_ms: list[float] = field(default_factory=list)
    # per stage, the plan's prediction for the same quantities (the simulator's costs, at this
    # run's rows per micro-batch: scaled linearly from the plan's when they differ)
    predicted_stages: list[StagePrediction] = field(default_factory=list)
    scaled_from_batch_size: int | None = None  # the plan's rows, when the run's differ
    recompute: list[int] = field(default_factory=list)  # stages rebuilding their forward

    @property
    def measured_ms(self) -> float:
        """Mean step time, the first step (warm-up) left out when there are several."""
        steady = self.step_ms[1:] or self.step_ms
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


def synthetic_batch(make_batch: Callable[[int, torch.Generator], tuple[Tensors, Tensors]],
                    rows: int, seed: int, step: int) -> tuple[Tensors, Tensors]:
    """Step ``step``'s batch: the same on every rank and in the reference."""
    return make_batch(rows, torch.Generator().manual_seed(seed * 1_000_003 + step))


@dataclass(frozen=True)
class DataPlan:
    """What a run trains on (picklable: it travels to every rank): ``batches`` (None:
    synthetic), the loss by name or ``loss_fn``, and ``kind``, the loss resolved."""

    batches: ArrayBatches | FactoryBatches | None = None
    loss: str = "auto"
    loss_fn: UserLoss | None = None
    kind: str | None = None
    described: str = "synthetic batches"
    evals: ArrayBatches | None = None  # --eval-data, by the same order contract
    eval_steps: int = 1  # batches of B x M rows per evaluation: every whole one of --eval-data
    eval_described: str = ""  # what the validation loss is taken over

    def eval_batches(self) -> Batches | None:
        """Validation batches from ``--eval-data`` (None: synthetic ones of another seed)."""
        return self.evals

    def fresh(self) -> Batches | None:
        """The batches from step 0 again (for the reference)."""
        if isinstance(self.batches, FactoryBatches):
            return FactoryBatches(self.batches.factory, self.batches.inputs)
        return self.batches


def plan_job(plan_dir: str, rows: int, seed: int, deterministic: bool,
             spec: DataPlan = DataPlan(), evaluate: bool = False
             ) -> tuple[Sequence[StageLike], LossFn, Plan, Batches, Batches | None]:
    """What every rank builds for ``plan_dir``
    (a :data:`~onnx_partition.runtime.train.spawn.Build`); validation batches (``evaluate``)
    come from ``--eval-data`` (``spec.evals``), else are synthetic ones of another seed
    (:data:`EVAL_SEED`)."""
    from onnx_partition.runtime.train.modules import lazy_stages, require_trainable
    from onnx_partition.runtime.train.task import task_for

    plan = require_trainable(plan_dir)
    stages = lazy_stages(plan_dir, deterministic=deterministic)  # a rank builds its own only
    task = task_for(Path(plan_dir), spec.loss, spec.loss_fn, spec.kind)
    batches = spec.fresh() or functools.partial(synthetic_batch, task.make_batch, rows, seed)
    evals = None
    if evaluate:
        evals = spec.eval_batches() or functools.partial(
            synthetic_batch, task.make_batch, rows, seed + EVAL_SEED)
    return stages, task.loss_fn, plan, batches, evals


def prepare_data(plan: Plan, data: DataArg | None, *, per_step: int, steps: int,
                 shuffle: int | None, loss: str, loss_fn: UserLoss | None, seed: int,
                 eval_data: str | os.PathLike[str] | None = None,
                 folder: Path | None = None) -> DataPlan:
    """Check the data (and ``eval_data``, validation batches by the same order contract)
    against the plan and the loss (before any process starts) and say what the run trains
    on: a PartitionError for data it cannot train on
    (:func:`~onnx_partition.runtime.train.data.check_data`; with the plan ``folder``, ids too
    against the embeddings they index, :func:`~onnx_partition.runtime.train.vocab.index_ranges`)."""
    from onnx_partition.runtime.train.vocab import index_ranges

    files = data is not None and (isinstance(data, Mapping) or not callable(data))
    ranges = (index_ranges(folder, plan) if folder is not None and (files or eval_data)
              else None)
    spec = _training_data(plan, data, per_step=per_step, steps=steps, shuffle=shuffle,
                          loss=loss, loss_fn=loss_fn, seed=seed, ranges=ranges)
    if eval_data is None:
        return spec
    source = ArraySource(eval_data, "--eval-data")
    # every whole step of rows is evaluated (and scanned); the rows past the last are left out
    shape = source.headers().get(plan.inputs[0].name, ((), None))[0] if plan.inputs else ()
    batches = max((shape[0] if shape else 0) // per_step, 1)
    info = check_data(plan, source, per_step=per_step, steps=batches, shuffle=None,
                      loss=spec.kind or loss, custom=loss_fn is not None, flag="--eval-data",
                      ranges=ranges)
    evals = ArrayBatches(source, [s.name for s in plan.inputs], info.targets, info.rows,
                         per_step, None)
    left = info.rows - batches * per_step
    described = (f"{source.describe()} ({batches} x {per_step} rows"
                 f"{f'; the last {left} left out' if left else ''})")
    return replace(spec, evals=evals, eval_steps=batches, eval_described=described)


def _training_data(plan: Plan, data: DataArg | None, *, per_step: int, steps: int,
                   shuffle: int | None, loss: str, loss_fn: UserLoss | None, seed: int,
                   ranges: Mapping[str, tuple[int, str]] | None = None) -> DataPlan:
    from onnx_partition.runtime.train.loss import resolve_loss
    from onnx_partition.runtime.train.task import synthetic_kind

    if loss not in LOSSES:
        raise PartitionError(f"unknown loss {loss!r}; choose {', '.join(LOSSES)}")
    if shuffle is not None and data is None:
        raise PartitionError("--shuffle orders the rows of --data; there is no --data")
    inputs = [s.name for s in plan.inputs]
    if data is None:
        kind = "custom" if loss_fn else synthetic_kind(plan) if loss == "auto" else loss
        return DataPlan(None, loss, loss_fn, kind, f"synthetic batches (seed {seed})")
    if callable(data) and not isinstance(data, Mapping):
        factory = FactoryBatches(data, inputs)
        kind = "custom" if loss_fn else loss
        if loss == "auto" and not loss_fn:  # the first batch's labels decide
            _, targets = FactoryBatches(data, inputs)(0)
            labels = targets.get("labels", targets.get(plan.outputs[0].name))
            integer = None if labels is None else not labels.is_floating_point()
            kind = resolve_loss("auto", plan.outputs[0].shape, integer)
        return DataPlan(factory, loss, loss_fn, kind, "batches from the data factory")
    source = ArraySource(data)
    info = check_data(plan, source, per_step=per_step, steps=steps, shuffle=shuffle, loss=loss,
                      custom=loss_fn is not None, ranges=ranges)
    batches = ArrayBatches(source, inputs, info.targets, info.rows, per_step, shuffle)
    order = "in order" if shuffle is None else f"shuffled with seed {shuffle}"
    return DataPlan(batches, loss, loss_fn, info.loss,
                    f"{source.describe()} ({info.rows} rows, {order})")


def check_options(*, optimizer: str, weight_decay: float | None, momentum: float,
                  betas: tuple[float, float], warmup_steps: int, lr_schedule: str,
                  clip_grad_norm: float | None, precision: str, checkpoint_every: int,
                  eval_every: int) -> None:
    """The optimisation, checkpoint and evaluation options, or a one-line PartitionError."""
    from onnx_partition.runtime.train.choices import PRECISIONS
    from onnx_partition.runtime.train.lr_schedule import LR_SCHEDULES

    if weight_decay is not None and not weight_decay >= 0:
        raise PartitionError(f"--weight-decay must be >= 0, got {weight_decay}")
    if momentum != 0.0 and optimizer != "sgd":
        raise PartitionError("--momentum is SGD's; AdamW takes --betas")
    if not 0.0 <= momentum < 1.0:
        raise PartitionError(f"--momentum must be in [0, 1), got {momentum}")
    if betas != (0.9, 0.999) and optimizer != "adamw":
        raise PartitionError("--betas are AdamW's; SGD takes --momentum")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise PartitionError(f"--betas must be two numbers in [0, 1), got {list(betas)}")
    if warmup_steps < 0:
        raise PartitionError(f"--warmup-steps must be >= 0, got {warmup_steps}")
    if lr_schedule not in LR_SCHEDULES:
        raise PartitionError(f"unknown --lr-schedule {lr_schedule!r}; choose "
                             f"{', '.join(LR_SCHEDULES)}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise PartitionError(f"--clip-grad-norm must be positive, got {clip_grad_norm}")
    if precision == "fp16":  # a plan priced for fp16 (partition --precision fp16)
        raise PartitionError("--precision fp16 is not run by train: fp16 needs loss scaling "
                             "(its gradients underflow), which train does not do; give "
                             "--precision bf16 (same memory and speed on GPUs with bf16) or fp32")
    if precision not in PRECISIONS:
        raise PartitionError(f"unknown --precision {precision!r}; choose {', '.join(PRECISIONS)}")
    for name, value in (("--checkpoint-every", checkpoint_every), ("--eval-every", eval_every)):
        if value < 0:
            raise PartitionError(f"{name} must be >= 0, got {value}")


def check_request(plan_dir: Path, *, nproc: int | None, steps: int, microbatches: int,
                  batch_size: int, schedule: str, optimizer: str, lr: float, engine: str
                  ) -> Plan:
    """The plan, if the request is sound; else a PartitionError (before any process)."""
    from onnx_partition.runtime.train.modules import require_trainable

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


RECORD_FORMAT = STAGE_COSTS_FORMAT  # declared in plan.schema.StageCostsSchema


def check_record(path: Path) -> None:
    """``--record FILE`` may replace only an earlier record."""
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("format") == RECORD_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise PartitionError(f"--record {path}: the file exists and is not an earlier "
                                 f"record ({RECORD_FORMAT}); choose another name")


def write_record(path: Path, stats: TrainStats, rows: int, device: str) -> None:
    """The measured per-stage times (per micro-batch of ``rows`` rows on one replica) in the
    ``simulator_costs`` form that plan.json accepts (``onnx_partition.pipeline.from_plan``), written
    atomically; the body is checked against its schema
    (:class:`~onnx_partition.plan.schema.StageCostsSchema`) first."""
    from onnx_partition.plan.schema import validate_stage_costs

    body = {"format": RECORD_FORMAT, "unit": "ms", "device": device,
            "rows_per_microbatch": rows, "microbatches": stats.microbatches,
            "schedule": stats.schedule, "measured_iteration_ms": stats.measured_ms,
            "simulator_costs": {"forward_ms": stats.forward_ms,
                                "backward_ms": stats.backward_ms}}
    validate_stage_costs(body, f"--record {path}")
    atomic_write(path, json.dumps(body, indent=1) + "\n")


def train_plan(
    plan_dir: str | os.PathLike[str],
    *,
    nproc: int | None = None,
    steps: int = 10,
    microbatches: int | None = None,
    batch_size: int | None = None,
    schedule: str | None = None,
    optimizer: str | None = None,
    lr: float = 0.01,
    check: bool = False,
    save: str | os.PathLike[str] | None = None,
    record: str | os.PathLike[str] | None = None,
    engine: str = "ours",
    seed: int = 0,
    verbose: bool = False,
    backend: str | None = None,
    timeout_s: float = 120.0,
    data: DataArg | None = None,
    shuffle: int | None = None,
    loss: str = "auto",
    loss_fn: UserLoss | None = None,
    weight_decay: float | None = None,
    momentum: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int = 0,
    lr_schedule: str = "constant",
    clip_grad_norm: float | None = None,
    precision: str | None = None,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    checkpoint_every: int = 0,
    resume: str | os.PathLike[str] | None = None,
    eval_every: int = 0,
    eval_data: str | os.PathLike[str] | None = None,
    log: str | os.PathLike[str] | None = None,
    progress: bool = False,
    hook: RankHook | None = None,
) -> TrainStats:
    """Train the plan in ``plan_dir`` with one local process per stage replica.

    ``batch_size`` is rows per micro-batch (default: :attr:`Plan.rows_per_microbatch`); a
    step takes ``microbatches`` of them (default: :attr:`Plan.microbatches`, the plan's own
    count). ``check``: dropout off, and the parameters after step 1 (and 3) compared with
    single-process training
    (:attr:`TrainStats.mismatches`). ``save``: a new plan folder with the trained weights.
    ``data``: a ``.npz`` or a folder of ``.npy``, a mapping of arrays, or a factory called in
    each rank that reads data returning an iterable of whole-step batches (every such rank must
    yield the same batches; :mod:`onnx_partition.runtime.train.data`); None: synthetic batches
    from ``seed``. ``shuffle``: permute the rows once per epoch from this seed. ``loss``: one
    of ``auto``, ``cross_entropy``, ``mse``, ``output``, or ``loss_fn(outputs, targets) ->
    scalar`` (a mean over the rows given, picklable; :mod:`onnx_partition.runtime.train.loss`).
    ``seed`` also seeds dropout. ``schedule``, ``optimizer`` and ``precision`` default (None)
    to what the plan was priced for (plan.json), else sgd, fp32, 1F1B, as ``train`` does
    (:func:`~onnx_partition.runtime.train.choices.planned_choices`); one that differs from
    the plan's is warned about (:class:`PlannedChoiceWarning`: its predicted time and memory do not
    hold).
    Optimisation (``weight_decay`` ... ``precision``), checkpoints (``checkpoint_dir`` every
    ``checkpoint_every`` steps; ``resume`` from a checkpoint folder's latest complete
    checkpoint up to ``steps`` in all, writing on there), evaluation (``eval_every`` on
    ``eval_data``, else synthetic batches of another seed) and the per-step JSON ``log`` are
    the command line's options; ``hook`` the ranks' fault seam.
    Raises PartitionError for a bad request (before any process starts) and
    :class:`StageFailed` naming the stage, replica and rank that raised or died.
    """
    folder = Path(plan_dir).resolve()
    schedule, optimizer, precision = planned_defaults(
        folder, schedule=schedule, optimizer=optimizer, precision=precision, engine=engine)
    plan, count, rows = _request(folder, nproc=nproc, steps=steps, microbatches=microbatches,
                                 batch_size=batch_size, schedule=schedule, optimizer=optimizer,
                                 lr=lr, engine=engine)
    if save is not None:
        check_save(folder, Path(save), plan)
    if record is not None:
        check_record(Path(record))
    spec = prepare_data(plan, data, per_step=rows * count, steps=steps, shuffle=shuffle,
                        loss=loss, loss_fn=loss_fn, seed=seed, eval_data=eval_data,
                        folder=folder)
    config = train_config(folder, plan, steps=steps, microbatches=count, rows=rows * count,
                          schedule=schedule, optimizer=optimizer, lr=lr, check=check,
                          keep_state=save is not None, verbose=verbose, hook=hook, seed=seed,
                          weight_decay=weight_decay, momentum=momentum, betas=betas,
                          warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                          clip_grad_norm=clip_grad_norm, precision=precision,
                          checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                          resume=resume, eval_every=eval_every, log=log, progress=progress)
    if engine == "torch":  # torch.distributed.pipelining: uniform plans, our loss and optimizer
        from onnx_partition.runtime.train.torch_engine import check_torch_engine

        config = replace(config, engine=engine)
        check_torch_engine(plan, config)
    config = replace(config, eval_batches=spec.eval_steps)
    if verbose:
        print(f"training on {spec.described}; loss {spec.kind}"
              f"{' (auto)' if loss == 'auto' and loss_fn is None else ''}"
              f"{f'; validation on {spec.eval_described}' if spec.eval_described else ''}",
              flush=True)
    build = functools.partial(plan_job, str(folder), rows * count, seed, check, spec,
                              eval_every > 0)
    ranks = launch_training(plan, build, config, backend=backend, timeout_s=timeout_s)
    # the simulator has no interleaved schedule: 1F1B's iteration stands in for it
    simulated = (config if config.schedule in schedules.TRAIN_NAMES
                 else replace(config, schedule="1f1b"))
    stats = summarize(plan, ranks, simulated, rows * count, engine)
    stats.schedule = config.schedule
    stats.data, stats.loss_kind = spec.described, spec.kind or ""
    if config.check_steps:
        stats.mismatches = compare_with_reference(folder, ranks, config, rows * count, seed,
                                                  spec)
        stats.checked_steps = config.check_steps
    if record is not None:
        write_record(Path(record), stats, rows, "cuda" if torch.cuda.is_available() and
                     any(d.startswith("cuda") for s in plan.stages for d in s.devices) else "cpu")
    if save is not None:
        from onnx_partition.runtime.train.save import save_trained

        states = [next(r.state for r in ranks if r.stage == k and r.state is not None)
                  for k in range(len(plan.stages))]
        stats.saved = save_trained(folder, states, Path(save))
    return stats


def planned_defaults(folder: Path, *, schedule: str | None, optimizer: str | None,
                     precision: str | None, engine: str) -> tuple[str, str, str]:
    """``schedule``, ``optimizer`` and ``precision`` where None as the plan in ``folder`` was
    priced for (:func:`~onnx_partition.runtime.train.choices.planned_choices`, the rule of
    ``train``), warning once (:class:`PlannedChoiceWarning`) when a given one differs from it."""
    given = {"schedule": schedule, "optimizer": optimizer, "precision": precision}
    recorded = read_plan(folder).extra if (folder / "plan.json").is_file() else {}
    chosen, warning = planned_choices(recorded, given, engine=engine,
                                      spelled="{key}={value!r}")
    if warning:
        warnings.warn(warning, PlannedChoiceWarning, stacklevel=3)
    return chosen["schedule"], chosen["optimizer"], chosen["precision"]


def _request(folder: Path, *, nproc: int | None, steps: int, microbatches: int | None,
             batch_size: int | None, schedule: str, optimizer: str, lr: float, engine: str
             ) -> tuple[Plan, int, int]:
    """The plan checked for this request (:func:`check_request`), its micro-batches per step
    and rows per micro-batch (the plan's own unless given): what :func:`train_plan` and
    :func:`train_rank` both start from."""
    from onnx_partition.runtime.train.modules import require_trainable

    plan0 = require_trainable(folder)
    count = microbatches or plan0.microbatches
    rows = batch_size or plan0.rows_per_microbatch or 1
    plan = check_request(folder, nproc=nproc, steps=steps, microbatches=count, batch_size=rows,
                         schedule=schedule, optimizer=optimizer, lr=lr, engine=engine)
    return plan, count, rows


def train_config(folder: Path, plan: Plan, *, steps: int, microbatches: int, rows: int,
                 schedule: str, optimizer: str, lr: float, check: bool, keep_state: bool,
                 verbose: bool, hook: RankHook | None = None, seed: int = 0,
                 weight_decay: float | None = None,
                 momentum: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 warmup_steps: int = 0, lr_schedule: str = "constant",
                 clip_grad_norm: float | None = None, precision: str = "fp32",
                 checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int = 0,
                 resume: str | os.PathLike[str] | None = None, eval_every: int = 0,
                 log: str | os.PathLike[str] | None = None, progress: bool = False
                 ) -> TrainConfig:
    """Every rank's :class:`TrainConfig` for the options of :func:`train_plan` (``rows``: per
    step), checked before any process starts (a PartitionError)."""
    check_options(optimizer=optimizer, weight_decay=weight_decay, momentum=momentum,
                  betas=betas, warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                  clip_grad_norm=clip_grad_norm, precision=precision,
                  checkpoint_every=checkpoint_every, eval_every=eval_every)
    from onnx_partition.runtime.train.checkpoint import optimizer_record

    ckpt = resume_request(folder, plan, rows=rows, steps=steps, resume=resume,
                          checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                          optimizer=optimizer_record(optimizer, weight_decay, momentum, betas))
    if log is not None:
        check_log_path(folder, plan, Path(log))
    checks = tuple(s for s in CHECK_STEPS if s <= steps) if check and not ckpt.start else ()
    return TrainConfig(steps=steps, microbatches=microbatches, schedule=schedule,
                       optimizer=optimizer, lr=lr, check_steps=checks, keep_state=keep_state,
                       verbose=verbose, hook=hook, seed=seed, weight_decay=weight_decay,
                       momentum=momentum, betas=(float(betas[0]), float(betas[1])),
                       warmup_steps=warmup_steps, lr_schedule=lr_schedule,
                       clip_grad_norm=clip_grad_norm, precision=precision,
                       start_step=ckpt.start, resume_from=ckpt.resume_from,
                       checkpoint_dir=ckpt.directory, checkpoint_every=ckpt.every,
                       checkpoint_manifest=ckpt.manifest, earlier_evals=ckpt.evals,
                       eval_every=eval_every,
                       log=None if log is None else str(Path(log).resolve()),
                       progress=progress)


def summarize(plan: Plan, ranks: Sequence[RankResult], config: TrainConfig, rows: int,
              engine: str) -> TrainStats:
    """Per-stage times (steady steps, per micro-batch on one replica) and both simulations."""
    steady = slice(1, None) if config.steps - config.start_step > 1 else slice(None)
    count = config.microbatches
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
    simulated, costs = simulate_plan(plan, schedule=config.schedule, microbatches=count)
    planned = plan.rows_per_microbatch
    scale = rows / count / planned if planned else 1.0
    base = plan_costs(plan, train=True)
    if scale != 1.0:  # the per-row terms scale, the per-step and per-parameter ones do not
        simulated = simulate(schedules.build(config.schedule, [s.replicas for s in costs.stages],
                                             count), costs.at_rows(scale))
    measured = PipelineCosts(
        [StageCosts(fwd[k], bwd[k], s.replicas, s.allreduce_ms) for k, s in
         enumerate(base.stages)], [x * scale for x in base.send_ms])
    replicas = [s.replicas for s in base.stages]
    calibrated = simulate(schedules.build(config.schedule, replicas, count), measured)
    rank0 = ranks[0]
    acts: list[int | None] = [None] * stages
    peaks: list[int | None] = [None] * stages
    for r in ranks:  # a stage's replicas: the largest micro-batch, the highest peak
        if r.activation_bytes:
            acts[r.stage] = max(acts[r.stage] or 0, *r.activation_bytes)
        if r.memory_bytes is not None:
            peaks[r.stage] = max(peaks[r.stage] or 0, r.memory_bytes)
    return TrainStats(ranks=list(ranks), rows=rows, microbatches=count,
                      schedule=config.schedule, engine=engine, loss=rank0.loss,
                      step_ms=rank0.step_ms, forward_ms=fwd, backward_ms=bwd,
                      simulated_ms=simulated.iteration_ms,
                      calibrated_ms=calibrated.iteration_ms,
                      activation_bytes=acts, memory_bytes=peaks,
                      forward_cpu_ms=fwd_cpu if on_cpu else [],
                      backward_cpu_ms=bwd_cpu if on_cpu else [],
                      predicted_stages=predicted_stages(plan, costs, scale, count,
                                                        config.schedule == "zb-h1"),
                      scaled_from_batch_size=planned if scale != 1.0 else None,
                      optimizer=config.optimizer,
                      start_step=config.start_step,
                      eval_loss=[*config.earlier_evals, *rank0.eval_loss],
                      grad_norm=rank0.grad_norm, lr=rank0.lr,
                      checkpoint=None if config.checkpoint_dir is None
                      else Path(config.checkpoint_dir),
                      recompute=[s.index for s in plan.stages if s.recompute])


def compare_with_reference(folder: Path, ranks: Sequence[RankResult], config: TrainConfig,
                           rows: int, seed: int, spec: DataPlan = DataPlan()) -> list[str]:
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
    bf16 = config.precision == "bf16"

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
             synthetic_batch(task.make_batch, rows, seed, s)
             for s in range(max(config.check_steps, default=0))]
    if config.check_steps:
        want = reference_gradients(folder, every[0], microbatches=config.microbatches, task=task,
                                   precision=config.precision)
        compare("gradient of step 1", [r.grads for r in ranks], want)
    if config.optimizer != "sgd":
        return problems
    for step in config.check_steps:
        want = reference_train(folder, every[:step], optimizer=config.optimizer, lr=config.lr,
                               steps=step, microbatches=config.microbatches, task=task,
                               weight_decay=config.weight_decay, momentum=config.momentum,
                               betas=config.betas, warmup_steps=config.warmup_steps,
                               lr_schedule=config.lr_schedule, total_steps=config.steps,
                               clip_grad_norm=config.clip_grad_norm,
                               precision=config.precision)
        compare(f"after step {step}", [r.states[step] for r in ranks], want)
    return problems


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
    ``memory_bytes`` (the device's peak: CUDA's ``max_memory_allocated`` against the memory
    model's; None on CPU, where no allocator keeps a peak). On CPU ``measured`` adds
    ``forward_cpu_ms`` and ``backward_cpu_ms`` per stage (the rank's thread CPU time in the same
    compute, which other processes on a busy machine do not stretch; None on CUDA) and
    ``ratio`` sets them against the predicted ``forward_ms`` and ``backward_ms``."""
    def rate(ms: float) -> float:
        return round(stats.rows / ms * 1000.0, 3) if ms > 0 else 0.0

    preds = stats.predicted_stages
    count = len(stats.forward_ms)
    acts = stats.activation_bytes or [None] * count
    peaks = stats.memory_bytes or [None] * count
    fwd_cpu: list[float | None] = [round(v, 6) for v in stats.forward_cpu_ms] or [None] * count
    bwd_cpu: list[float | None] = [round(v, 6) for v in stats.backward_cpu_ms] or [None] * count
    measured: dict[str, Any] = {
        "iteration_ms": round(stats.measured_ms, 6), "samples_per_s": rate(stats.measured_ms),
        "stages": [{"stage": k, "forward_ms": round(stats.forward_ms[k], 6),
                    "backward_ms": round(stats.backward_ms[k], 6),
                    "forward_cpu_ms": fwd_cpu[k], "backward_cpu_ms": bwd_cpu[k],
                    "activation_bytes": acts[k], "memory_bytes": peaks[k]}
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
             ("memory_bytes", "peak memory MB", "MB", "memory_bytes"))
    for m, p, r in zip(measured["stages"], predicted["stages"], ratio["stages"]):
        for key, label, unit, against in names:
            if m[key] is None and key != "activation_bytes":
                continue  # CPU: no peak kept; CUDA: no thread CPU time
            rows.append((f"stage {m['stage']} {label}", m[key], p[against], r[key], unit))
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
    lines = [
        f"{len(stats.ranks)} ranks ({stats.engine} engine, {stats.schedule}), batch {stats.rows} "
        f"= {stats.microbatches} micro-batches x {stats.rows // stats.microbatches} rows: "
        f"{stats.samples_per_s:.1f} samples/s, {stats.measured_ms:.2f} ms per step",
        f"  trained on {stats.data}; loss {stats.loss_kind}",
        f"  loss per step: {' '.join(f'{v:.4f}' for v in stats.loss)}",
        f"  iteration: measured {stats.measured_ms:.2f} ms; simulated "
        f"{stats.simulated_ms:.2f} ms from the plan's costs (measured/simulated "
        f"{ratio:.2f}); "
        f"{stats.calibrated_ms:.2f} ms from the measured stage times ({cal:.2f})",
    ]
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
    return "\n".join(lines + comparison_table(stats))


def train_json(stats: TrainStats) -> dict[str, Any]:
    """What ``train --json`` prints: :func:`comparison`'s ``measured``, ``predicted`` (the
    simulator on the plan's costs, plan.json's memory) and ``ratio``, the loss per step and
    the final and best validation loss."""
    evals = [v for _, v in stats.eval_loss]
    return {"format": TRAIN_FORMAT, "engine": stats.engine, "schedule": stats.schedule,
            "recompute": stats.recompute,
            "ranks": len(stats.ranks), "microbatches": stats.microbatches, "rows": stats.rows,
            "start_step": stats.start_step, "steps": stats.start_step + len(stats.loss),
            "loss": stats.loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
            "final_eval_loss": evals[-1] if evals else None,
            "best_eval_loss": min(evals) if evals else None,
            **comparison(stats),
            "check": None if not stats.checked_steps else not stats.mismatches,
            "saved": None if stats.saved is None else str(stats.saved),
            "checkpoint": None if stats.checkpoint is None else str(stats.checkpoint)}



@dataclass(frozen=True)
class CheckpointRequest:
    """Where checkpoints go and what a resumed run starts from."""

    directory: str | None = None
    every: int = 0
    start: int = 0  # steps already done
    resume_from: str | None = None  # the checkpoint folder to load
    manifest: str = ""  # JSON: the manifest's fixed part
    evals: tuple[tuple[int, float], ...] = ()  # the checkpoint's validation losses (step, loss)


def resume_request(folder: Path, plan: Plan, *, rows: int, steps: int,
                   resume: str | os.PathLike[str] | None,
                   checkpoint_dir: str | os.PathLike[str] | None,
                   checkpoint_every: int, optimizer: Mapping[str, Any] | None = None
                   ) -> CheckpointRequest:
    """Check ``--checkpoint-dir/--checkpoint-every/--resume`` against the plan (a checkpoint of
    another plan, of another batch, or of another ``optimizer``, as
    :func:`~onnx_partition.runtime.train.checkpoint.optimizer_record` describes it, is
    refused) before any process starts."""
    from onnx_partition.runtime.train.checkpoint import (
        check_checkpoint_dir,
        check_optimizer,
        latest_checkpoint,
        plan_fingerprint,
    )

    start, resume_from, every = 0, None, checkpoint_every
    evals: tuple[tuple[int, float], ...] = ()
    target = None if checkpoint_dir is None else Path(checkpoint_dir)
    if resume is not None:
        found, manifest = latest_checkpoint(Path(resume), plan)
        start, resume_from = int(manifest["step"]), str(found.resolve())
        evals = tuple((int(s), float(v)) for s, v in manifest.get("eval_loss", ()))
        if manifest.get("rows_per_step") != rows:
            raise PartitionError(f"--resume {found}: written with {manifest.get('rows_per_step')}"
                                 f" rows per step, this run takes {rows}")
        if optimizer is not None:
            check_optimizer(found, manifest, optimizer)
        if start >= steps:
            raise PartitionError(f"--resume {found}: already at step {start}; --steps {steps} "
                                 "(steps in all) leaves nothing to train")
        target = target or Path(resume)
        every = every or int(manifest.get("checkpoint_every", 0))
    if target is not None:
        check_checkpoint_dir(target, folder, (folder / plan.model) if plan.model else None)
        if not every:
            raise PartitionError("--checkpoint-dir needs --checkpoint-every K")
    elif checkpoint_every:
        raise PartitionError("--checkpoint-every needs --checkpoint-dir DIR")
    fixed = {"plan": plan_fingerprint(plan), "plan_dir": str(folder), "rows_per_step": rows,
             "checkpoint_every": every, **({} if optimizer is None else {"optimizer": optimizer})}
    return CheckpointRequest(None if target is None else str(target.resolve()), every, start,
                             resume_from, json.dumps(fixed), evals)


# ---------------------------------------------------------------- one rank under torchrun


def train_rank(
    plan_dir: str | os.PathLike[str],
    *,
    steps: int = 10,
    microbatches: int | None = None,
    batch_size: int | None = None,
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    lr: float = 0.01,
    check: bool = False,
    seed: int = 0,
    backend: str | None = None,
    data: DataArg | None = None,
    shuffle: int | None = None,
    loss: str = "auto",
    loss_fn: UserLoss | None = None,
    **options: Any,
) -> TrainStats | None:
    """This process's rank of a training run started by ``torchrun`` (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT from the environment, read by
    :func:`~onnx_partition.runtime.launch.ranks.torchrun_env`; the entry is
    :func:`onnx_partition.cli.torchrun.train_main`). The request is checked as
    :func:`train_plan` checks it (a :class:`PartitionError`); rank 0 returns the figures (and
    ``check``'s comparison), the other ranks None. ``data``, ``shuffle``, ``loss`` and
    ``loss_fn`` as :func:`train_plan` (every rank checks the data); ``options`` are
    :func:`train_plan`'s optimisation, checkpoint, evaluation and log keywords
    (:func:`train_config`). Raises
    :class:`StageFailed` naming this rank's stage and replica when it fails."""
    env = torchrun_env()
    folder = Path(plan_dir).resolve()
    plan, count, rows = _request(folder, nproc=env.world_size, steps=steps,
                                 microbatches=microbatches, batch_size=batch_size,
                                 schedule=schedule, optimizer=optimizer, lr=lr, engine="ours")
    lay = layout(plan)
    check_placement(env, [d for stage in lay.devices for d in stage], lay.name)
    eval_data = options.pop("eval_data", None)
    spec = prepare_data(plan, data, per_step=rows * count, steps=steps, shuffle=shuffle,
                        loss=loss, loss_fn=loss_fn, seed=seed, eval_data=eval_data,
                        folder=folder)
    config = train_config(folder, plan, steps=steps, microbatches=count, rows=rows * count,
                          schedule=schedule, optimizer=optimizer, lr=lr, check=check,
                          keep_state=False, verbose=True, seed=seed, **options)
    config = replace(config, eval_batches=spec.eval_steps)
    checks = config.check_steps
    build = functools.partial(plan_job, str(folder), rows * count, seed, check, spec,
                              config.eval_every > 0)
    try:
        ranks = torchrun_rank(build, config, backend=choose_backend(lay, backend), env=env)
    except PartitionError:
        raise
    except Exception as exc:  # this rank's failure: name it (the entry exits 1)
        raise StageFailed(f"{lay.name(env.rank)} failed: {one_line(exc)}") from exc
    if ranks is None:
        return None
    stats = summarize(plan, ranks, config, rows * count, "ours")
    stats.data, stats.loss_kind = spec.described, spec.kind or ""
    if checks:
        stats.mismatches = compare_with_reference(folder, ranks, config, rows * count, seed,
                                                  spec)
        stats.checked_steps = checks
    return stats
