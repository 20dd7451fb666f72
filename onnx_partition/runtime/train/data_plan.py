"""What a training run trains on, settled before any process starts and built again in every
rank: :func:`prepare_data` checks ``--data`` and ``--eval-data`` against the plan and the loss
(a :class:`PartitionError` for data it cannot train on) and says what the run takes
(:class:`DataPlan`, which travels to every rank); :func:`plan_job` is what each rank builds from
it (its stages, the loss, the plan, the batches); without data, :func:`synthetic_batch` draws
every step's batch from the seed, row by row, the same in every rank and in the reference."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan
from onnx_partition.runtime.train.comm import Tensors
from onnx_partition.runtime.train.data import (
    ArrayBatches,
    ArraySource,
    FactoryBatches,
    check_data,
)
from onnx_partition.runtime.train.loss import LOSSES
from onnx_partition.runtime.train.loss import LossFn as UserLoss
from onnx_partition.runtime.train.rank_io import Batches, LossFn, StageLike
from onnx_partition.runtime.train.rows import StepRows, synthetic_rows
from onnx_partition.settings.train import DEFAULTS, DataSettings

__all__ = ["EVAL_SEED", "SYNTHETIC", "DataArg", "DataPlan", "plan_job", "prepare_data",
           "synthetic_batch"]

# --data: a .npz or a folder of .npy, a mapping of arrays, or a factory of batches per rank
DataArg = str | os.PathLike[str] | Mapping[str, Any] | Callable[[], Iterable[Any]]
#: What a run without data trains on (``TrainStats.data``).
SYNTHETIC = "synthetic batches"
#: Synthetic validation batches are drawn with ``seed + EVAL_SEED`` (never a training batch's).
EVAL_SEED = 7919


def synthetic_batch(make_batch: Callable[[int, torch.Generator], tuple[Tensors, Tensors]],
                    rows: int, seed: int, step: int) -> tuple[StepRows, StepRows]:
    """Step ``step``'s batch of ``rows`` rows: the same on every rank and in the reference,
    each row drawn from its own generator only when a micro-batch holding it is taken
    (:func:`~onnx_partition.runtime.train.rows.synthetic_rows`)."""
    return synthetic_rows(make_batch, rows, seed, step)


@dataclass(frozen=True)
class DataPlan:
    """What a run trains on (picklable: it travels to every rank): ``batches`` (None:
    synthetic), the loss by name or ``loss_fn``, and ``kind``, the loss resolved."""

    batches: ArrayBatches | FactoryBatches | None = None
    loss: str = DEFAULTS.data.loss
    loss_fn: UserLoss | None = None
    kind: str | None = None
    described: str = SYNTHETIC
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


def prepare_data(plan: Plan, asked: DataSettings, *, per_step: int, steps: int, seed: int,
                 folder: Path | None = None) -> DataPlan:
    """Check the data ``asked`` for (and its ``eval_file``, validation batches by the same
    order contract) against the plan and the loss (before any process starts) and say what the
    run trains on (``per_step`` rows a step, ``steps`` steps): a PartitionError for data it
    cannot train on (:func:`~onnx_partition.runtime.train.data.check_data`; with the plan
    ``folder``, ids too against the embeddings they index,
    :func:`~onnx_partition.runtime.train.vocab.index_ranges`)."""
    from onnx_partition.runtime.train.vocab import index_ranges

    data, eval_data, shuffle = asked.file, asked.eval_file, asked.shuffle
    loss, loss_fn = asked.loss, asked.loss_fn
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
