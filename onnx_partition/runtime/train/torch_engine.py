"""``--engine torch``: a uniform plan trained on ``torch.distributed.pipelining``.

The same stage modules as our engine (:mod:`onnx_partition.runtime.train.modules`), each wrapped
so that it takes the hop it receives and returns the hop it sends, as positional tuples in the
layout's order (:attr:`~onnx_partition.pipeline.layout.Layout.recv_names` /
``send_names``: relayed tensors included; the last stage returns the model outputs), run by a
``PipelineStage`` under ``Schedule1F1B`` or ``ScheduleGPipe``.

**Uniform plans only.** Pipelining maps stage ``i`` of a schedule to rank ``i % group size`` of
one process group, so each replica ``j`` of the plan is one pipeline group (the ranks
``first[k] + j``, one per stage) and every stage needs the same replica count. Replica ``j``
serves the micro-batches ``m`` with ``m % R == j`` (our layout's rule), one schedule step over
them.

**Static shapes.** Run-time metadata inference is not used (on gloo it hung in
``send_object_list``, found in an earlier attempt): rank 0 chains all stages locally on one
micro-batch of step 0 and broadcasts every hop's shapes, dtypes and ``requires_grad``; each rank
gives its ``PipelineStage`` example tensors of them. A hop tensor requires grad on both ends
exactly when our engine sends its gradient back (floating, not a model input): both ends then
derive the same gradient slots, so the sender posts a receive for every gradient the receiver
sends (the earlier deadlock: an integer or a relayed model input on a hop made the receiver send
a gradient the sender never awaited).

**Loss, gradients, optimizer: ours.** The schedule's target is the tensor of global micro-batch
indices, split one per micro-batch; the loss function (``--loss``, the task's) takes that
micro-batch's targets and multiplies the loss by its weight
(:func:`~onnx_partition.runtime.train.loss.microbatch_weights`) with ``scale_grads=False``, as
our engine does. After the schedule's step: the gradient sums over each stage's replicas and the
tied groups, the whole model's norm and clipping, the learning-rate schedule and the optimizer
step are :mod:`onnx_partition.runtime.train.rank`'s own functions.

Not supported here (refused before any process starts): unequal replica counts, fewer
micro-batches than replicas, checkpoints and resume, evaluation, ``--log`` and the fault hook.
``ScheduleInterleavedZeroBubble`` needs several stages per rank (``stage i`` on rank ``i % P``
with ``P`` < stages): our launcher starts one process per stage replica, so it is not offered
(docs/design.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.plan import Plan
from onnx_partition.runtime.train.loss import microbatch_weights
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.rank import (
    Batches,
    LossFn,
    RankResult,
    StageLike,
    TrainConfig,
    _clip,
    _group_for,
    _owned_for_norm,
    _sum_gradients,
    _tied_groups_here,
    microbatch,
    step_line,
)
from onnx_partition.runtime.train.reference import autocast, make_optimizer

__all__ = ["SCHEDULES", "check_torch_engine", "train_stages_torch"]

#: Our schedule names -> torch pipelining's schedule classes.
SCHEDULES: dict[str, Any] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}

# one tensor's static metadata: shape, dtype, requires_grad
Meta = tuple[tuple[int, ...], torch.dtype, bool]


def check_torch_engine(plan: Plan, config: TrainConfig) -> None:
    """A one-line :class:`PartitionError` (before any process) when the run cannot go on
    torch pipelining, saying why."""
    lay = layout(plan)
    counts = sorted(set(lay.replicas))
    if len(counts) > 1:
        raise PartitionError(
            f"--engine torch: torch.distributed.pipelining maps stage i to rank i % (its "
            f"group's size), so every stage needs the same replica count; this plan has "
            f"{lay.replicas} (use --engine ours)")
    if config.schedule not in SCHEDULES:
        raise PartitionError(f"--engine torch: schedule {config.schedule!r} is not torch "
                             f"pipelining's; choose {', '.join(SCHEDULES)}")
    if config.microbatches < counts[0]:
        raise PartitionError(f"--engine torch: each of the {counts[0]} replicas needs a "
                             f"micro-batch; got {config.microbatches} micro-batches")
    unsupported = [flag for flag, on in (
        ("--checkpoint-dir", config.checkpoint_dir is not None),
        ("--resume", config.resume_from is not None),
        ("--eval-every", config.eval_every > 0), ("--log", config.log is not None),
        ("a fault hook", config.hook is not None)) if on]
    if unsupported:
        raise PartitionError(f"--engine torch does not take {', '.join(unsupported)} (our "
                             "engine's; use --engine ours)")


class _Hop(torch.nn.Module):
    """A stage module as pipelining runs it: ``forward(*received hop) -> sent hop``."""

    def __init__(self, stage: StageLike, receives: Sequence[str], sends: Sequence[str],
                 bf16: bool) -> None:
        super().__init__()
        self.stage = stage.module
        self.inputs, self.outputs = tuple(stage.inputs), tuple(stage.outputs)
        self.receives, self.sends, self.bf16 = tuple(receives), tuple(sends), bf16

    def forward(self, *hop: torch.Tensor) -> tuple[torch.Tensor, ...]:
        env = dict(zip(self.receives, hop, strict=True))
        with autocast(hop[0].device if hop else torch.device("cpu"), self.bf16):
            outs = self.stage(*[env[n] for n in self.inputs])
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        if self.bf16:  # hops and the loss in fp32, as our engine
            outs = tuple(o.float() if o.dtype == torch.bfloat16 else o for o in outs)
        env.update(zip(self.outputs, outs, strict=True))
        return tuple(env[n].contiguous() for n in self.sends)


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up its forward and backward compute seconds."""

    seconds: list[float]

    def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return super().forward_one_chunk(*args, **kwargs)
        finally:
            self.seconds[0] += time.perf_counter() - began

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return super().backward_one_chunk(*args, **kwargs)
        finally:
            self.seconds[1] += time.perf_counter() - began


@dataclass
class _Loss:
    """The schedule's loss: the target is micro-batch ``m``'s index; ``loss_fn`` of the model
    outputs against ``m``'s targets, times ``m``'s weight."""

    loss_fn: LossFn
    names: tuple[str, ...]
    count: int
    device: torch.device
    targets: Mapping[str, torch.Tensor]
    weights: list[float]

    def __call__(self, outputs: Any, index: torch.Tensor) -> torch.Tensor:
        outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        m = int(index.reshape(-1)[0])
        want = ({n: v.to(self.device) for n, v in
                 microbatch(self.targets, m, self.count).items()} if self.targets else {})
        return self.loss_fn(dict(zip(self.names, outs, strict=True)), want) * self.weights[m]


def hop_metas(stages: Sequence[StageLike], lay: Layout, inputs: Mapping[str, torch.Tensor],
              model_inputs: set[str], model_outputs: Sequence[str]
              ) -> list[tuple[list[Meta], list[Meta]]]:
    """Per stage, the metadata of what it receives and what it sends (the last stage: the model
    outputs), found by chaining every stage on ``inputs`` (one micro-batch) without autograd."""
    env: dict[str, torch.Tensor] = dict(inputs)
    found = []
    with torch.no_grad():
        for k, stage in enumerate(stages):
            receives = [_meta(n, env[n], model_inputs) for n in lay.recv_names[k]]
            outs = stage.module(*[env[n] for n in stage.inputs])
            env.update(zip(stage.outputs, (outs,) if isinstance(outs, torch.Tensor) else outs,
                           strict=True))
            sends = lay.send_names[k] if k + 1 < lay.stages else list(model_outputs)
            found.append((receives, [_meta(n, env[n], model_inputs) for n in sends]))
    return found


def _meta(name: str, value: torch.Tensor, model_inputs: set[str]) -> Meta:
    """A hop tensor's metadata; it requires grad where our engine sends its gradient back."""
    return (tuple(value.shape), value.dtype,
            value.is_floating_point() and name not in model_inputs)


def _example(meta: Meta, device: torch.device) -> torch.Tensor:
    shape, dtype, grad = meta
    return torch.zeros(shape, dtype=dtype, device=device).requires_grad_(grad)


def _free_others(stages: Sequence[StageLike], k: int) -> None:
    """Drop the modules of the other stages built for :func:`hop_metas` (lazy stages)."""
    for stage in stages:
        if stage.index != k and hasattr(stage, "built"):
            stage.built = None


def train_stages_torch(
    stages: Sequence[StageLike],
    loss_fn: LossFn,
    plan: Plan,
    batches: Batches,
    config: TrainConfig,
    *,
    rank: int,
    device: torch.device | None = None,
    eval_batches: Batches | None = None,
) -> RankResult:
    """:func:`~onnx_partition.runtime.train.rank.train_stages` on torch pipelining (the module
    docstring): the same arguments and result (no per-action list, no evaluation)."""
    del eval_batches  # refused by check_torch_engine
    device = device or torch.device("cpu")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    lay = layout(plan)
    k, replica = lay.place(rank)
    last = k == lay.stages - 1
    count = config.microbatches
    mine = [m for m in range(count) if lay.rank_of(k, m) == rank]
    model_inputs = {s.name for s in plan.inputs}
    model_outputs = tuple(s.name for s in plan.outputs)
    first_batch = batches(0) if k == 0 or last else None
    # rank 0 chains every stage once (before the seed: its dropout draws are not the run's)
    shared: list[Any] = [None]
    if rank == 0:
        assert first_batch is not None
        example = {n: v.to(device) for n, v in microbatch(first_batch[0], 0, count).items()}
        shared[0] = hop_metas(stages, lay, example, model_inputs, model_outputs)
        _free_others(stages, k)
    dist.broadcast_object_list(shared, src=0)
    receives, sends = shared[0][k]
    torch.manual_seed(config.seed * 1_000_003 + rank)

    # every rank creates every group in the same order: pipelines, stage replicas, tied sets
    pipe_group = None
    for j in range(lay.replicas[0]):
        group = dist.new_group(ranks=[lay.first[s] + j for s in range(lay.stages)])
        if j == replica:
            pipe_group = group
    stage_group = _group_for(lay, range(lay.stages), k)
    my_tied = _tied_groups_here(lay, stages, k)
    tied_names = {n for _, names in my_tied for n in names}

    hop = _Hop(stages[k], lay.recv_names[k], lay.send_names[k] if not last else model_outputs,
               config.precision == "bf16").to(device).train()
    module = hop.stage
    params = dict(module.named_parameters())
    optimizer = make_optimizer(config.optimizer, list(params.values()), config.lr,
                               weight_decay=config.weight_decay, momentum=config.momentum,
                               betas=config.betas)
    owned = _owned_for_norm(stages, k, replica, params)
    stage = _TimedStage(hop, k, lay.stages, device,
                        input_args=tuple(_example(m, device) for m in receives),
                        output_args=tuple(_example(m, device) for m in sends),
                        group=pipe_group)
    stage.seconds = [0.0, 0.0]
    loss = _Loss(loss_fn, model_outputs, count, device, {}, [])
    schedule = SCHEDULES[config.schedule](stage, n_microbatches=len(mine), loss_fn=loss,
                                          scale_grads=False)
    index = torch.tensor(mine)
    dist.barrier()

    result = RankResult(rank, k, replica, [], 0, [], [], [], [])
    for step in range(config.start_step, config.steps):
        began = time.perf_counter()
        if k == 0 or last:
            inputs, targets = first_batch if step == 0 and first_batch else batches(step)
        else:
            inputs, targets = {}, {}
        if last:
            loss.targets = targets
            loss.weights = microbatch_weights(loss_fn, targets, count)
        args = (tuple(torch.cat([microbatch({n: inputs[n]}, m, count)[n] for m in mine]).to(device)
                      for n in lay.recv_names[0]) if k == 0 else ())
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=index if last else None, losses=losses if last else None,
                      return_outputs=False)
        total = sum((float(v.detach()) for v in losses), 0.0)
        _sum_gradients(params, tied_names, stage_group, my_tied)
        if step == 0 and config.check_steps:
            result.grads = {n: p.grad.detach().cpu().clone() for n, p in params.items()
                            if p.grad is not None}
        norm = _clip(params, owned, config.clip_grad_norm, device)
        lr = config.lr * lr_factor(config.lr_schedule, step, config.warmup_steps, config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        result.grad_norm.append(norm)
        result.lr.append(lr)
        rows = count * (len(args[0]) // len(mine)) if args else 0
        _record(lay, result, stage.seconds, total, began, step, rows, config.verbose, device)
        stage.seconds[:] = [0.0, 0.0]
        if step + 1 in config.check_steps:
            result.states[step + 1] = {n: p.detach().cpu().clone() for n, p in params.items()}
    if config.keep_state and replica == 0:
        result.state = {n: v.detach().cpu().clone() for n, v in module.state_dict().items()}
    return result


def _record(lay: Layout, result: RankResult, seconds: Sequence[float], loss: float,
            began: float, step: int, rows: int, verbose: bool, device: torch.device) -> None:
    """The step's figures (one small all-reduce: rank 0 learns the loss and every rank's
    forward and backward ms), as our engine records them."""
    rank = result.rank
    row = torch.zeros(lay.world_size, 3, dtype=torch.float64)
    row[rank] = torch.tensor([seconds[0] * 1000.0, seconds[1] * 1000.0, loss],
                             dtype=torch.float64)
    wired = row.to(device)
    dist.all_reduce(wired)
    table = wired.cpu()
    ms = (time.perf_counter() - began) * 1000.0
    result.step_ms.append(ms)
    result.forward_ms.append(seconds[0] * 1000.0)
    result.backward_ms.append(seconds[1] * 1000.0)
    if rank == 0:
        result.loss.append(float(table[:, 2].sum()))
        result.table.append([float(v) for v in table[:, :2].reshape(-1)])
        if verbose:
            print(step_line(step, result.loss[-1], ms, table[:, :2].tolist(), lay, rows=rows),
                  flush=True)
