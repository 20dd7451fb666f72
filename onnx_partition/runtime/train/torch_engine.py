"""``--engine torch``: a uniform plan trained on ``torch.distributed.pipelining``.

The same stage modules as our engine (:mod:`onnx_partition.runtime.train.modules`), each wrapped
so that it takes the hop it receives and returns the hop it sends, as positional tuples in the
layout's order (:attr:`~onnx_partition.pipeline.layout.Layout.recv_names` /
``send_names``: relayed tensors included; the last stage returns the model outputs), run by a
``PipelineStage`` under ``Schedule1F1B``, ``ScheduleGPipe`` or ``ScheduleInterleavedZeroBubble``.

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

**Interleaved zero bubble** (``--schedule interleaved-zb``: ``ScheduleInterleavedZeroBubble``)
holds two stages per rank: a pipeline has ``P = stages / 2`` positions, stage ``i`` on position
``i % P``, so a run takes half the processes (rank ``pos * R + replica``; with one stage per
rank this is our layout's rank). A tied parameter's copies on one rank are added there first,
then all-reduced over the ranks holding it; each rank returns one result per stage it holds.

Not supported here (refused before any process starts): unequal replica counts, fewer
micro-batches than replicas, checkpoints and resume, evaluation, ``--log`` and the fault hook.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
)

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.plan import Plan
from onnx_partition.runtime.train.loss import microbatch_weights
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.optim import autocast, make_optimizer
from onnx_partition.runtime.train.rank import (
    Batches,
    LossFn,
    RankResult,
    StageLike,
    TrainConfig,
    _all_reduce_grads,
    _clip,
    _owned_for_norm,
    microbatch,
    step_line,
    tied_groups,
)

__all__ = ["SCHEDULES", "check_torch_engine", "hop_metas", "train_stages_torch", "world_size"]

#: Our schedule names -> torch pipelining's schedule classes.
SCHEDULES: dict[str, Any] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                             "interleaved-zb": ScheduleInterleavedZeroBubble}

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
    recomputed = [s.index for s in plan.stages if s.recompute]
    if recomputed:
        raise PartitionError(
            f"--engine torch runs every stage without recomputation; this plan's stages "
            f"{recomputed} recompute (its memory assumes it): use --engine ours, or partition "
            "with --recompute none")
    if config.schedule not in SCHEDULES:
        raise PartitionError(f"--engine torch: schedule {config.schedule!r} is not torch "
                             f"pipelining's; choose {', '.join(SCHEDULES)}")
    if config.microbatches < counts[0]:
        raise PartitionError(f"--engine torch: each of the {counts[0]} replicas needs a "
                             f"micro-batch; got {config.microbatches} micro-batches")
    if config.schedule == "interleaved-zb":
        if lay.stages % 2:
            raise PartitionError(f"--schedule interleaved-zb holds two stages per rank (stage "
                                 f"i on rank i % (stages / 2)); this plan has {lay.stages}")
        positions = lay.stages // 2
        for j in range(counts[0]):
            n = len(range(j, config.microbatches, counts[0]))
            rounds = max(1, n // positions)
            if n % rounds:
                raise PartitionError(
                    f"--schedule interleaved-zb: each pipeline's micro-batches ({n}) must be a "
                    f"multiple of its rounds ({rounds}; torch's zero-bubble rule)")
    unsupported = [flag for flag, on in (
        ("--checkpoint-dir", config.checkpoint_dir is not None),
        ("--resume", config.resume_from is not None),
        ("--eval-every", config.eval_every > 0), ("--log", config.log is not None),
        ("a fault hook", config.hook is not None)) if on]
    if unsupported:
        raise PartitionError(f"--engine torch does not take {', '.join(unsupported)} (our "
                             "engine's; use --engine ours)")


class _ContiguousGradient(torch.autograd.Function):
    """The identity, whose backward makes the gradient contiguous: pipelining sends a received
    tensor's gradient as autograd left it (a transposed or expanded view for some cuts), and
    gloo sends only contiguous tensors."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _Hop(torch.nn.Module):
    """A stage module as pipelining runs it: ``forward(*received hop) -> sent hop``."""

    def __init__(self, stage: StageLike, receives: Sequence[str], sends: Sequence[str],
                 bf16: bool) -> None:
        super().__init__()
        self.stage = stage.module
        self.inputs, self.outputs = tuple(stage.inputs), tuple(stage.outputs)
        self.receives, self.sends, self.bf16 = tuple(receives), tuple(sends), bf16

    def forward(self, *hop: torch.Tensor) -> tuple[torch.Tensor, ...]:
        hop = tuple(_ContiguousGradient.apply(h) if h.requires_grad else h for h in hop)
        env = dict(zip(self.receives, hop, strict=True))
        with autocast(hop[0].device if hop else torch.device("cpu"), self.bf16):
            outs = self.stage(*[env[n] for n in self.inputs])
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        if self.bf16:  # hops and the loss in fp32, as our engine
            outs = tuple(o.float() if o.dtype == torch.bfloat16 else o for o in outs)
        env.update(zip(self.outputs, outs, strict=True))
        # pipelining detaches what a stage sends in place (``detach_``), which fails on a view (a
        # reshaped output, a received tensor passed through) and breaks a later backward that
        # saved the tensor (softmax saves its output): a stage sends its own copy
        return tuple(env[n].clone(memory_format=torch.contiguous_format) for n in self.sends)


class _TimedStage(PipelineStage):
    """A ``PipelineStage`` that adds up its forward and backward (input and weight) compute
    seconds."""

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

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()  # zero bubble: the weights' half of the backward
        try:
            return super().backward_weight_one_chunk(*args, **kwargs)
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


def _free_others(stages: Sequence[StageLike], keep: Sequence[int]) -> None:
    """Drop the modules of the other stages built for :func:`hop_metas` (lazy stages)."""
    for stage in stages:
        if stage.index not in keep and hasattr(stage, "built"):
            stage.built = None


def world_size(lay: Layout, schedule: str) -> int:
    """Processes of a run: one per stage replica, or one per two (``interleaved-zb``)."""
    return lay.world_size // _local_count(schedule)


def _local_count(schedule: str) -> int:
    """Stages per rank: 2 for the interleaved schedule, else 1."""
    return 2 if schedule == "interleaved-zb" else 1


@dataclass
class _Place:
    """Where a rank sits: pipeline position ``pos`` of replica ``replica``, ``P`` positions per
    pipeline, ``R`` replicas; it holds stages ``pos``, ``pos + P``, ... (``stage i`` on
    position ``i % P``, pipelining's rule) and rank ``pos * R + replica`` (for one stage per
    rank: our layout's rank)."""

    pos: int
    replica: int
    positions: int
    replicas: int
    stages: int

    @property
    def local(self) -> list[int]:
        return list(range(self.pos, self.stages, self.positions))

    def rank_of(self, stage: int, replica: int) -> int:
        return (stage % self.positions) * self.replicas + replica


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
) -> list[RankResult]:
    """:func:`~onnx_partition.runtime.train.rank.train_stages` on torch pipelining (the module
    docstring): the same arguments; one result per stage this rank holds (no per-action list,
    no evaluation)."""
    del eval_batches  # refused by check_torch_engine
    device = device or torch.device("cpu")
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    lay = layout(plan)
    replicas = lay.replicas[0]
    per_rank = _local_count(config.schedule)
    at = _Place(rank // replicas, rank % replicas, lay.stages // per_rank, replicas, lay.stages)
    local = at.local
    first, last = local[0] == 0, local[-1] == lay.stages - 1
    count = config.microbatches
    mine = [m for m in range(count) if m % replicas == at.replica]
    model_inputs = {s.name for s in plan.inputs}
    model_outputs = tuple(s.name for s in plan.outputs)
    first_batch = batches(0) if first or last else None
    # rank 0 chains every stage once (before the seed: its dropout draws are not the run's)
    shared: list[Any] = [None]
    if rank == 0:
        assert first_batch is not None
        example = {n: v.to(device) for n, v in microbatch(first_batch[0], 0, count).items()}
        shared[0] = hop_metas(stages, lay, example, model_inputs, model_outputs)
        _free_others(stages, local)
    dist.broadcast_object_list(shared, src=0)
    torch.manual_seed(config.seed * 1_000_003 + rank)

    # every rank creates every group in the same order: pipelines, stage replicas, tied sets
    pipe_group = None
    for j in range(replicas):
        group = dist.new_group(ranks=[p * replicas + j for p in range(at.positions)])
        if j == at.replica:
            pipe_group = group
    stage_groups: dict[int, Any] = {}
    for k in range(lay.stages):
        if replicas > 1:
            group = dist.new_group(ranks=[at.rank_of(k, j) for j in range(replicas)])
            if k in local:
                stage_groups[k] = group
    tied = _tied_here(stages, at)

    bf16 = config.precision == "bf16"
    hops = {k: _Hop(stages[k], lay.recv_names[k],
                    lay.send_names[k] if k < lay.stages - 1 else model_outputs,
                    bf16).to(device).train() for k in local}
    params = {k: dict(hops[k].stage.named_parameters()) for k in local}
    flat = {f"{k}/{n}": p for k in local for n, p in params[k].items()}
    optimizer = make_optimizer(config.optimizer, list(flat.values()), config.lr,
                               weight_decay=config.weight_decay, momentum=config.momentum,
                               betas=config.betas)
    owned = [f"{k}/{n}" for k in local for n in _owned_for_norm(stages, k, at.replica, params[k])]
    timed = {}
    for k in local:
        receives, sends = shared[0][k]
        timed[k] = _TimedStage(hops[k], k, lay.stages, device,
                               input_args=tuple(_example(m, device) for m in receives),
                               output_args=tuple(_example(m, device) for m in sends),
                               group=pipe_group)
        timed[k].seconds = [0.0, 0.0]
    loss = _Loss(loss_fn, model_outputs, count, device, {}, [])
    kind = SCHEDULES[config.schedule]
    held = [timed[k] for k in local]
    schedule = kind(held if per_rank > 1 else held[0], n_microbatches=len(mine),
                    loss_fn=loss, scale_grads=False)
    index = torch.tensor(mine)
    dist.barrier()

    results = {k: RankResult(rank, k, at.replica, [], 0, [], [], [], []) for k in local}
    for step in range(config.start_step, config.steps):
        began = time.perf_counter()
        inputs: Mapping[str, torch.Tensor] = {}
        if first or last:
            inputs, targets = first_batch if step == 0 and first_batch else batches(step)
        if last:
            loss.targets = targets
            loss.weights = microbatch_weights(loss_fn, targets, count)
        args = (tuple(torch.cat([microbatch({n: inputs[n]}, m, count)[n] for m in mine]).to(device)
                      for n in lay.recv_names[0]) if first else ())
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=index if last else None, losses=losses if last else None,
                      return_outputs=False)
        total = sum((float(v.detach()) for v in losses), 0.0)
        for k in local:
            if k in stage_groups:
                _all_reduce_grads([p for n, p in sorted(params[k].items())
                                   if n not in stages[k].tied], stage_groups[k])
        _sum_tied(params, tied)
        if step == 0 and config.check_steps:
            for k in local:
                results[k].grads = {n: p.grad.detach().cpu().clone()
                                    for n, p in params[k].items() if p.grad is not None}
        norm = _clip(flat, owned, config.clip_grad_norm, device)
        lr = config.lr * lr_factor(config.lr_schedule, step, config.warmup_steps, config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        rows = count * (len(args[0]) // len(mine)) if args else 0
        _record(lay, at, results, {k: timed[k].seconds for k in local}, total, began, step,
                rows, config.verbose, device)
        for k in local:
            results[k].grad_norm.append(norm)
            results[k].lr.append(lr)
            timed[k].seconds[:] = [0.0, 0.0]
            if step + 1 in config.check_steps:
                results[k].states[step + 1] = {n: p.detach().cpu().clone()
                                               for n, p in params[k].items()}
    if config.keep_state and at.replica == 0:
        for k in local:
            results[k].state = {n: v.detach().cpu().clone()
                                for n, v in hops[k].stage.state_dict().items()}
    return [results[k] for k in local]


def _tied_here(stages: Sequence[StageLike], at: _Place) -> list[tuple[Any, list[tuple[int, str]]]]:
    """Create every tied set's group (on every rank, in one order; none when one rank holds
    all of it); those this rank takes part in, each with its (local stage, parameter) copies."""
    mine = []
    for stage_set in tied_groups(stages):
        ranks = sorted({at.rank_of(s, j) for s in stage_set for j in range(at.replicas)})
        group = dist.new_group(ranks=ranks) if len(ranks) > 1 else None
        here = [k for k in stage_set if k in at.local]
        if here:
            copies = sorted((k, n) for k in here for n, s in stages[k].tied.items()
                            if tuple(sorted(s)) == stage_set)
            mine.append((group, copies))
    return mine


def _sum_tied(params: Mapping[int, Mapping[str, torch.nn.Parameter]],
              tied: Sequence[tuple[Any, list[tuple[int, str]]]]) -> None:
    """Every copy of a tied parameter gets the sum over all its copies: this rank's copies
    added first, then one flat all-reduce over the ranks holding it (each rank counted once)."""
    for group, copies in tied:
        names = sorted({n for _, n in copies})
        local = []
        for name in names:
            grads = [params[k][n].grad for k, n in copies if n == name]
            base = params[next(k for k, n in copies if n == name)][name]
            total = torch.zeros_like(base)
            for g in grads:
                if g is not None:
                    total = total + g
            local.append(total)
        flat = torch.cat([g.reshape(-1) for g in local])
        if group is not None:
            dist.all_reduce(flat, group=group)
        for name, piece in zip(names, flat.split([g.numel() for g in local]), strict=True):
            for k, n in copies:
                if n == name:
                    params[k][n].grad = piece.view_as(params[k][n]).clone()


def _record(lay: Layout, at: _Place, results: Mapping[int, RankResult],
            seconds: Mapping[int, Sequence[float]], loss: float, began: float, step: int,
            rows: int, verbose: bool, device: torch.device) -> None:
    """The step's figures (one small all-reduce: rank 0 learns the loss and every stage
    replica's forward and backward ms, in our layout's rank order), as our engine records
    them."""
    row = torch.zeros(lay.world_size, 3, dtype=torch.float64)
    for k, (fwd, bwd) in seconds.items():
        row[lay.first[k] + at.replica] = torch.tensor([fwd * 1000.0, bwd * 1000.0, 0.0],
                                                      dtype=torch.float64)
    row[lay.first[at.local[-1]] + at.replica, 2] = loss
    wired = row.to(device)
    dist.all_reduce(wired)
    table = wired.cpu()
    ms = (time.perf_counter() - began) * 1000.0
    for k, result in results.items():
        result.step_ms.append(ms)
        result.forward_ms.append(seconds[k][0] * 1000.0)
        result.backward_ms.append(seconds[k][1] * 1000.0)
    if results and next(iter(results.values())).rank == 0:
        result = results[0]
        result.loss.append(float(table[:, 2].sum()))
        result.table.append([float(v) for v in table[:, :2].reshape(-1)])
        if verbose:
            print(step_line(step, result.loss[-1], ms, table[:, :2].tolist(), lay, rows=rows),
                  flush=True)
