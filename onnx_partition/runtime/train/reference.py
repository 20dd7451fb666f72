"""The reference: the whole program trained in one process, micro-batch by micro-batch.

A step over ``microbatches`` micro-batches of a batch of B rows accumulates the gradient of
``loss_m * w_m`` over the micro-batches (``loss_m`` a mean over micro-batch m's rows, ``w_m`` its
share of the rows, or of the counted tokens for cross-entropy), so it equals one step on the mean
loss over all B rows, while batch norm sees each micro-batch
alone, exactly as the pipeline does. Micro-batches are split as the runtime splits feeds
(:func:`split_rows`: near-equal, numpy ``linspace`` edges).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.microbatch import row_ranges
from onnx_partition.plan import Plan, read_plan
from onnx_partition.runtime.train.loss import microbatch_weights, upcast
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.optim import autocast, make_optimizer
from onnx_partition.runtime.train.pretrained import PretrainedWeights, load_into
from onnx_partition.runtime.train.task import TrainTask, task_for
from onnx_partition.runtime.train.weightless import materialize
from onnx_partition.settings.train import DEFAULTS, TRAIN_FALLBACKS

__all__ = ["NOISE_FACTOR", "ORDER_ULPS", "ROUNDING_ULPS", "check_tolerance", "mismatch",
           "reference_gradients", "reference_train", "split_rows"]

#: ``--check``'s tolerance, relative to a tensor's largest element: :data:`ROUNDING_ULPS` ulps of
#: the tensor's dtype (its final rounding) plus :data:`ORDER_ULPS` ulps of the accumulator
#: (float32, float64 for float64 tensors: summation order over micro-batches, replicas, stages
#: and kernels), and under TF32 math :data:`ROUNDING_ULPS` ulps of TF32's 10-bit mantissa (the
#: products' inputs are rounded to it). A wrong gradient (a lost micro-batch, a wrong route) is
#: off by a large fraction.
ROUNDING_ULPS = 8
ORDER_ULPS = 64
#: A tensor whose true value is (near) zero carries only the rounding of the sums it came from:
#: it may differ from the float64 truth by up to this many times what the single-process float32
#: reference differs by (:func:`mismatch`'s ``allowance``; no model-wide floor).
NOISE_FACTOR = 16
#: The unit roundoff of TF32's matrix-product inputs (10 explicit mantissa bits).
TF32_EPS = 2.0 ** -10

Batch = tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]


def check_tolerance(dtype: torch.dtype, math: str = "fp32") -> float:
    """Relative tolerance of ``--check`` for tensors of ``dtype`` computed in ``math`` (float32:
    8.6e-6, at TF32 7.8e-3; bfloat16: 0.063, float16: 0.0078, float64: 1.6e-14)."""
    accumulator = torch.float64 if dtype == torch.float64 else torch.float32
    tol = ROUNDING_ULPS * torch.finfo(dtype).eps + ORDER_ULPS * torch.finfo(accumulator).eps
    return tol + (ROUNDING_ULPS * TF32_EPS if math == "tf32" and dtype == torch.float32 else 0.0)


def mismatch(got: torch.Tensor, want: torch.Tensor, allowance: float = 0.0,
             math: str = "fp32") -> float | None:
    """The largest difference of ``got`` from ``want`` relative to ``want``'s largest element,
    when it exceeds both :func:`check_tolerance` of ``got``'s dtype and ``math`` times that
    scale and the absolute ``allowance`` (the rounding a near-zero tensor may carry: a key
    bias's gradient under softmax is zero in exact arithmetic and rounding as computed); None
    when within them. Relative to the tensor's own scale, not elementwise: a near-zero element
    carries the rounding of the sums it came from."""
    ref = want.to(torch.float64)
    diff = float((got.to(torch.float64) - ref).abs().max()) if got.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    tol = check_tolerance(got.dtype if got.is_floating_point() else torch.float64, math)
    if diff <= max(tol * scale, allowance) or diff == 0.0:
        return None
    return diff / scale if scale > 0 else float("inf")


def split_rows(rows: int, chunks: int) -> list[tuple[int, int]]:
    """Row ranges of ``chunks`` near-equal micro-batches (fewer when rows < chunks): the one
    split rule, :func:`onnx_partition.pipeline.microbatch.row_ranges`."""
    if chunks < 1:
        raise PartitionError(f"need at least one micro-batch, got {chunks}")
    return row_ranges(rows, chunks)


def reference_train(
    plan_dir: str | Path,
    batches: Sequence[Batch],
    *,
    microbatches: int,
    optimizer: str = TRAIN_FALLBACKS["optimizer"],
    lr: float = DEFAULTS.optimizer.lr,
    steps: int | None = None,
    task: TrainTask | None = None,
    deterministic: bool = True,
    losses: list[float] | None = None,
    weight_decay: float | None = None,
    momentum: float = DEFAULTS.optimizer.momentum,
    betas: tuple[float, float] = DEFAULTS.optimizer.betas,
    warmup_steps: int = DEFAULTS.optimizer.warmup_steps,
    lr_schedule: str = DEFAULTS.optimizer.lr_schedule,
    total_steps: int | None = None,
    clip_grad_norm: float | None = None,
    precision: str = TRAIN_FALLBACKS["precision"],
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    weights: PretrainedWeights | None = None,
    seed: int = DEFAULTS.seed,
) -> dict[str, torch.Tensor]:
    """Train :func:`whole_module` for ``steps`` steps (default: one per batch), step ``i`` on
    ``batches[i % len(batches)]`` (model inputs, targets by name; all rows of the step) split
    into ``microbatches``; return the parameters after training by name (the stage modules'
    names). ``task`` defaults to :func:`task_for`'s loss; micro-batches are weighted as the
    pipeline weights them (:func:`~onnx_partition.runtime.train.loss.microbatch_weights`).
    ``losses``, when given, gets each step's loss (over the whole batch) appended. The
    optimisation options are a training run's (:mod:`onnx_partition.settings.train`; the
    schedule spans ``total_steps``, default ``steps``; clipping by
    ``torch.nn.utils.clip_grad_norm_``); ``weights``: start from ``--from-pretrained``'s.
    ``dtype`` (float64: the truth ``--check`` measures rounding against) casts the module and
    the float inputs, ``device`` runs it there (default the CPU); the parameters come back on
    the CPU."""
    if not batches:
        raise PartitionError("reference_train needs at least one batch")
    plan = read_plan(plan_dir)
    module = _placed(_start(plan_dir, plan, deterministic, weights, seed), dtype, device)
    task = task or task_for(plan_dir)
    opt = make_optimizer(optimizer, module.parameters(), lr, weight_decay=weight_decay,
                         momentum=momentum, betas=betas)
    count = len(batches) if steps is None else steps
    span = total_steps or count  # steps the lr schedule spans
    for step in range(count):
        opt.zero_grad()
        total = _accumulate(module, plan, task, _cast(batches[step % len(batches)], dtype, device),
                            microbatches, precision)
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip_grad_norm)
        for group in opt.param_groups:
            group["lr"] = lr * lr_factor(lr_schedule, step, warmup_steps, span)
        opt.step()
        if losses is not None:
            losses.append(total)
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


def reference_gradients(plan_dir: str | Path, batch: Batch, *, microbatches: int,
                        task: TrainTask | None = None,
                        precision: str = TRAIN_FALLBACKS["precision"],
                        dtype: torch.dtype | None = None, device: torch.device | None = None,
                        weights: PretrainedWeights | None = None, seed: int = DEFAULTS.seed
                        ) -> dict[str, torch.Tensor]:
    """The gradients of :func:`reference_train`'s first step (before clipping and the
    optimizer), by name (None-gradient parameters left out): what ``--check`` compares first;
    ``dtype`` and ``device`` as there."""
    plan = read_plan(plan_dir)
    module = _placed(_start(plan_dir, plan, True, weights, seed), dtype, device)
    _accumulate(module, plan, task or task_for(plan_dir), _cast(batch, dtype, device),
                microbatches, precision)
    return {name: p.grad.detach().cpu().clone() for name, p in module.named_parameters()
            if p.grad is not None}


def _start(plan_dir: str | Path, plan: Plan, deterministic: bool,
           weights: PretrainedWeights | None, seed: int) -> torch.nn.Module:
    """The whole module training starts from: the program's weights (a weightless plan's made
    as each rank makes its own: same seed, same names), or ``weights``."""
    module = materialize(whole_module(plan_dir, deterministic=deterministic),
                         torch.device("cpu"), plan, seed)
    if weights is not None:
        load_into(module, weights)
    return module


def _placed(module: torch.nn.Module, dtype: torch.dtype | None,
            device: torch.device | None) -> torch.nn.Module:
    """``module`` on ``device`` with its floating tensors in ``dtype`` (each when given)."""
    if device is not None:
        module = module.to(device)
    return module.to(dtype) if dtype is not None else module


def _cast(batch: Batch, dtype: torch.dtype | None, device: torch.device | None) -> Batch:
    """The batch's tensors on ``device``, floating ones in ``dtype`` (each when given)."""
    def one(value: torch.Tensor) -> torch.Tensor:
        value = value.to(device) if device is not None else value
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    inputs, targets = batch
    return ({k: one(v) for k, v in inputs.items()}, {k: one(v) for k, v in targets.items()})


def _accumulate(module: torch.nn.Module, plan: Plan, task: TrainTask, batch: Batch,
                microbatches: int, precision: str) -> float:
    """One step's gradient, accumulated micro-batch by micro-batch, each weighted as the
    pipeline weights it (:func:`~onnx_partition.runtime.train.loss.microbatch_weights`); the
    step's loss."""
    inputs, targets = batch
    names = [o.name for o in plan.outputs]
    rows = int(next(iter(inputs.values())).shape[0])
    weights = microbatch_weights(task.loss_fn, targets, microbatches)
    where = next(iter(inputs.values())).device
    total = 0.0
    for (lo, hi), weight in zip(split_rows(rows, microbatches), weights, strict=True):
        with autocast(where, precision == "bf16"):
            outputs = module(*[inputs[s.name][lo:hi] for s in plan.inputs])
        outputs = upcast(outputs)
        loss = task.loss_fn(dict(zip(names, outputs)),
                            {k: v[lo:hi] for k, v in targets.items()}) * weight
        loss.backward()
        total += float(loss.detach())
    return total
