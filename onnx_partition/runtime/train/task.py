"""What a plan is trained on: synthetic batches from its input specs and the recipe's loss.

Language models (an integer input with a vocabulary bound ``high`` and an output whose last dim
is that vocabulary) are trained with cross-entropy against random next tokens; every other model
with mean squared error against random normal targets, summed over its outputs. Both losses are
means over the rows given, so a step over micro-batches equals one over their concatenation when
each micro-batch's loss is weighted by its share of the rows
(:mod:`onnx_partition.runtime.train.reference`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from onnx_partition.errors import PartitionError
from onnx_partition.plan import IOSpec, Plan, read_plan

__all__ = ["TrainTask", "task_for"]

Tensors = dict[str, torch.Tensor]


@dataclass
class TrainTask:
    """``loss_fn(outputs by name, targets by name)`` -> scalar loss, mean over the rows given;
    ``make_batch(rows, generator)`` -> (model inputs by name, targets by name), synthetic."""

    loss_fn: Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], torch.Tensor]
    make_batch: Callable[[int, torch.Generator], tuple[Tensors, Tensors]]
    kind: str = "mse"  # "cross_entropy" or "mse"


def task_for(plan_dir: str | Path) -> TrainTask:
    """The plan's loss and synthetic batches (see the module docstring)."""
    plan = read_plan(plan_dir)
    fixed = plan.input_shapes
    vocab = max((s.high for s in plan.inputs if s.high and _is_integer(s.dtype)), default=None)
    logits = [o for o in plan.outputs
              if vocab is not None and len(o.shape) >= 2 and o.shape[-1] == vocab]
    if logits:
        names = [o.name for o in logits]
        assert vocab is not None

        def cross_entropy(outputs: Mapping[str, torch.Tensor],
                          targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return sum((F.cross_entropy(outputs[n].reshape(-1, outputs[n].shape[-1]).float(),
                                        targets[n].reshape(-1)) for n in names),
                       torch.zeros(()))

        def lm_batch(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
            inputs = _inputs(plan, fixed, rows, generator)
            shapes = {o.name: _shape(o, rows, fixed)[:-1] for o in logits}
            return inputs, {n: torch.randint(0, vocab, shapes[n], generator=generator)
                            for n in names}

        return TrainTask(cross_entropy, lm_batch, kind="cross_entropy")

    floats = [o for o in plan.outputs if not _is_integer(o.dtype)]

    def mse(outputs: Mapping[str, torch.Tensor],
            targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return sum((F.mse_loss(outputs[o.name].float(), targets[o.name]) for o in floats),
                   torch.zeros(()))

    def mse_batch(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
        inputs = _inputs(plan, fixed, rows, generator)
        return inputs, {o.name: torch.randn(_shape(o, rows, fixed), generator=generator)
                        for o in floats}

    return TrainTask(mse, mse_batch, kind="mse")


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
