"""The training losses (``train --loss``) and how a step weights its micro-batches.

* ``cross_entropy``: the model's first output against ``labels`` (or a target named as that
  output), classes in the last dim, ``ignore_index=-100``, the mean over the counted tokens.
* ``mse``: mean squared error of the first output against ``labels`` plus that of every output
  with a target named as it (summed).
* ``output``: the model computes its own loss (a Hugging Face model given ``labels``): its first
  output is the scalar to minimise.
* ``auto``: ``output`` for a scalar first output, ``cross_entropy`` for integer labels, ``mse``
  otherwise (:func:`resolve_loss`).

A Python ``loss_fn(outputs, targets) -> scalar`` (both by name) is taken as a mean over the rows
given. **Weights.** A step over micro-batches equals one over their concatenation: micro-batch
``m``'s loss is weighted by its share of the step's counted tokens (cross-entropy) or of its rows
(every other loss; ``1/M`` for the equal micro-batches of a step) (:func:`microbatch_weights`);
the pipeline's last stage and the single-process reference both use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.microbatch import row_ranges, rows_of
from onnx_partition.runtime.train.choices import LOSSES

__all__ = ["IGNORE_INDEX", "LOSSES", "Loss", "LossFn", "make_loss", "microbatch_weights",
           "resolve_loss", "upcast"]

IGNORE_INDEX = -100
Tensors = dict[str, torch.Tensor]
LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Loss:
    """A loss by name, callable as ``loss(outputs, targets)`` (a mean); ``counted``: the tokens
    its mean is over (cross-entropy), None when the mean is over rows."""

    kind: str  # cross_entropy, mse, output or custom
    fn: LossFn
    counted: Callable[[Mapping[str, torch.Tensor]], float] | None = None

    def __call__(self, outputs: Mapping[str, torch.Tensor],
                 targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.fn(outputs, targets)


def upcast(outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A stage's outputs as the loss and the wire take them: bfloat16 ones cast to float32
    (lossless; the wire has no bfloat16), the rest as they are."""
    return tuple(o.float() if o.dtype == torch.bfloat16 else o for o in outputs)


def resolve_loss(kind: str, first_output_shape: Sequence[object], labels_integer: bool | None
                 ) -> str:
    """The loss ``auto`` stands for (others as given): ``output`` for a scalar first output,
    ``cross_entropy`` for integer labels (``labels_integer``), ``mse`` otherwise."""
    if kind not in LOSSES:
        raise PartitionError(f"unknown loss {kind!r}; choose {', '.join(LOSSES)}")
    if kind != "auto":
        return kind
    if len(first_output_shape) == 0:
        return "output"
    return "cross_entropy" if labels_integer else "mse"


def make_loss(kind: str, outputs: Sequence[str]) -> Loss:
    """The built-in loss ``kind`` (not ``auto``) of a model whose outputs are ``outputs``."""
    first = outputs[0]

    def target(targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "labels" in targets:
            return targets["labels"]
        if first in targets:
            return targets[first]
        raise PartitionError(f"--loss {kind}: no target 'labels' (nor {first!r}) in the data")

    if kind == "cross_entropy":
        def cross_entropy(out: Mapping[str, torch.Tensor],
                          targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
            logits, labels = out[first], target(targets)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                    labels.reshape(-1).long(), ignore_index=IGNORE_INDEX,
                                    reduction="sum")
            # the count as a tensor: no host sync, and it runs on fake and meta tensors
            return total / (labels != IGNORE_INDEX).sum().clamp(min=1)

        def counted(targets: Mapping[str, torch.Tensor]) -> float:
            return float((target(targets) != IGNORE_INDEX).sum())

        return Loss("cross_entropy", cross_entropy, counted)
    if kind == "mse":
        def mse(out: Mapping[str, torch.Tensor],
                targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
            pairs = [(first, "labels")] if "labels" in targets else []
            pairs += [(n, n) for n in outputs if n in targets]
            if not pairs:
                raise PartitionError("--loss mse: no target 'labels' nor one named as an output")
            return sum((F.mse_loss(out[o].float(), targets[t].float()) for o, t in pairs),
                       torch.zeros((), device=out[first].device))

        return Loss("mse", mse)
    if kind == "output":
        def own(out: Mapping[str, torch.Tensor],
                targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
            value = out[first]
            if value.numel() != 1:
                raise PartitionError(f"--loss output: the first output {first!r} has shape "
                                     f"{list(value.shape)}, not a scalar loss")
            return value.reshape(()).float()

        return Loss("output", own)
    raise PartitionError(f"unknown loss {kind!r}; choose {', '.join(LOSSES[1:])}")


def microbatch_weights(loss: object, targets: Mapping[str, torch.Tensor], count: int
                       ) -> list[float]:
    """Each micro-batch's weight in its step: its share of the counted tokens when ``loss``
    counts them (:attr:`Loss.counted`), else of the rows (``1/count`` without targets). The
    tokens are counted one micro-batch at a time (a step's rows taken micro-batch by
    micro-batch, :func:`~onnx_partition.pipeline.microbatch.rows_of`: only its counts kept);
    the rows are read from no tensor's data."""
    counted = getattr(loss, "counted", None)
    if counted is not None and targets:
        per = [counted(rows_of(targets, m, count)) for m in range(count)]
        total = sum(per)
        return [p / total if total else 0.0 for p in per]
    if not targets:
        return [1.0 / count] * count
    rows = getattr(targets, "rows", None)
    if rows is None:
        rows = len(next(iter(targets.values())))
    return [(hi - lo) / rows for lo, hi in row_ranges(rows, count)]
