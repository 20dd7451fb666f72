"""What a plan is trained on without ``--data``: synthetic batches from its input specs, and the
loss (:mod:`onnx_partition.runtime.train.loss`).

``--loss auto`` without data: ``output`` for a scalar first output; cross-entropy for a language
model (an integer input with a vocabulary bound ``high`` and a first output whose last dim is that
vocabulary), against random next tokens; every other model mean squared error against random
normal targets, summed over its floating outputs. Every loss is a mean over the rows (tokens)
given, and a step weights its micro-batches so that it equals one over their concatenation
(:func:`onnx_partition.runtime.train.loss.microbatch_weights`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from onnx_partition.errors import PartitionError
from onnx_partition.plan import IOSpec, Plan, read_plan
from onnx_partition.runtime.train.loss import Loss, LossFn, make_loss, resolve_loss
from onnx_partition.settings.train import DEFAULTS

__all__ = ["TrainTask", "auto_kind", "synthetic_kind", "task_for"]

Tensors = dict[str, torch.Tensor]


@dataclass
class TrainTask:
    """``loss_fn(outputs by name, targets by name)`` -> scalar loss, mean over the rows given;
    ``make_batch(rows, generator)`` -> (model inputs by name, targets by name), synthetic."""

    loss_fn: Loss
    make_batch: Callable[[int, torch.Generator], tuple[Tensors, Tensors]]
    kind: str = "mse"  # cross_entropy, mse, output or custom


def synthetic_kind(plan: Plan) -> str:
    """What ``--loss auto`` means without data (see the module docstring)."""
    return auto_kind(plan.inputs, plan.outputs)


def auto_kind(inputs: Sequence[IOSpec], outputs: Sequence[IOSpec]) -> str:
    """:func:`synthetic_kind` of a model with these inputs and outputs (a plan's, or a graph's
    before it is planned: what a train plan counts its loss as)."""
    first = outputs[0]
    if len(first.shape) == 0:
        return "output"
    vocab = max((s.high for s in inputs if s.high and _is_integer(s.dtype)), default=None)
    if vocab is not None and len(first.shape) >= 2 and first.shape[-1] == vocab:
        return "cross_entropy"
    return "mse"


def task_for(plan_dir: str | Path, loss: str = DEFAULTS.data.loss, loss_fn: LossFn | None = None,
             kind: str | None = None) -> TrainTask:
    """The plan's loss (``loss``: a name of :data:`~onnx_partition.runtime.train.loss.LOSSES`,
    or ``loss_fn``; ``kind``: the loss already resolved against the data) and its synthetic
    batches."""
    plan = read_plan(plan_dir)
    fixed = plan.input_shapes
    names = [o.name for o in plan.outputs]
    chosen = kind or (synthetic_kind(plan) if loss == "auto" else resolve_loss(loss, [0], None))
    task_loss = Loss("custom", loss_fn) if loss_fn is not None else make_loss(chosen, names)
    first = plan.outputs[0]

    if chosen == "cross_entropy":
        classes = _shape(first, 1, fixed)[-1]

        def lm_batch(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
            inputs = _inputs(plan, fixed, rows, generator)
            shape = _shape(first, rows, fixed)[:-1]
            return inputs, {first.name: torch.randint(0, classes, shape, generator=generator)}

        return TrainTask(task_loss, lm_batch, kind=task_loss.kind)

    floats = [] if chosen == "output" else [o for o in plan.outputs if not _is_integer(o.dtype)]

    def mse_batch(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
        inputs = _inputs(plan, fixed, rows, generator)
        return inputs, {o.name: torch.randn(_shape(o, rows, fixed), generator=generator)
                        for o in floats}

    return TrainTask(task_loss, mse_batch, kind=task_loss.kind)


def _is_integer(dtype: str) -> bool:
    try:
        return bool(np.issubdtype(np.dtype(dtype), np.integer))
    except TypeError:
        return False


def _shape(spec: IOSpec, rows: int, fixed: Mapping[str, list[int]]) -> list[int]:
    """The spec's shape (inputs: as fixed at partition time) with ``rows`` for dim 0."""
    shape = list(fixed.get(spec.name, spec.shape))
    if shape:
        shape[0] = rows
    if not all(isinstance(d, int) for d in shape):
        raise PartitionError(f"tensor {spec.name!r} has symbolic dims {spec.shape} besides the "
                             "batch; export the model with fixed sizes for them")
    return [int(d) for d in shape]


def _inputs(plan: Plan, fixed: Mapping[str, list[int]], rows: int,
            generator: torch.Generator) -> Tensors:
    """Model inputs of the plan's dtypes and shapes; integers below their bound (2 if none),
    as runtime/check.py's random_feeds draws them."""
    feeds: Tensors = {}
    for spec in plan.inputs:
        shape = _shape(spec, rows, fixed)
        dtype = np.dtype(spec.dtype) if spec.dtype != "unknown" else np.dtype("float32")
        if dtype == np.bool_:
            feeds[spec.name] = torch.rand(shape, generator=generator) < 0.5
        elif np.issubdtype(dtype, np.integer):
            feeds[spec.name] = torch.randint(0, spec.high or 2, shape, generator=generator,
                                             dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
        else:
            feeds[spec.name] = torch.randn(shape, generator=generator).to(
                torch.from_numpy(np.zeros(0, dtype)).dtype)
    return feeds
