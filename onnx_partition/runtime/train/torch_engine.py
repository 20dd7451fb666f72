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
step are our engine's own functions (:mod:`onnx_partition.runtime.train.grads`).

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
from collections.abc import Callable, Mapping, Sequence
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
from onnx_partition.runtime.memtrack import host_copies, tracking
from onnx_partition.runtime.train.grads import (
    all_reduce_grads,
    clip_gradients,
    owned_for_norm,
    tied_groups,
)
from onnx_partition.runtime.train.loss import microbatch_weights, upcast
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.math_mode import apply_math, flags_math, run_math
from onnx_partition.runtime.train.optim import autocast, make_optimizer
from onnx_partition.runtime.train.overheads import TRACKED_STEPS
from onnx_partition.runtime.train.rank import step_line
from onnx_partition.runtime.train.rank_io import (
    Batches,
    LossFn,
    RankResult,
    RankRun,
    StageLike,
    microbatch,
)

__all__ = ["SCHEDULES", "check_torch_engine", "hop_metas", "train_stages_torch", "world_size"]

#: Our schedule names -> torch pipelining's schedule classes.
SCHEDULES: dict[str, Any] = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe,
                             "interleaved-zb": ScheduleInterleavedZeroBubble}

# one tensor's static metadata: shape, dtype, requires_grad
Meta = tuple[tuple[int, ...], torch.dtype, bool]
# a step's batch: model inputs, targets
_Batch = tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]


def check_torch_engine(plan: Plan, run: RankRun) -> None:
    """A one-line :class:`PartitionError` (before any process) when the run cannot go on
    torch pipelining, saying why."""
    lay = layout(plan)
    sharded = [s.index for s in plan.stages if s.sharded]
    if sharded:
        raise PartitionError(
            f"--engine torch does not shard optimizer state: stages {sharded} of this plan "
            "do (its memory assumes it); use --engine ours, or partition without "
            "--shard-optimizer")
    counts = sorted(set(lay.replicas))
    if len(counts) > 1:
        raise PartitionError(
            f"--engine torch: torch.distributed.pipelining maps stage i to rank i % (its "
            f"group's size), so every stage needs the same replica count; this plan has "
            f"{lay.replicas} (use --engine ours)")
    if plan.weights == "none":
        raise PartitionError(
            "--engine torch probes every stage's shapes in one process, which a weightless "
            "plan (--no-weights) has no weights for: use --engine ours, which makes each "
            "stage's weights on its own rank")
    recomputed = [s.index for s in plan.stages if s.recompute]
    if recomputed:
        raise PartitionError(
            f"--engine torch runs every stage without recomputation; this plan's stages "
            f"{recomputed} recompute (its memory assumes it): use --engine ours, or partition "
            "with --recompute none")
    if run.schedule not in SCHEDULES:
        raise PartitionError(f"--engine torch: schedule {run.schedule!r} is not torch "
                             f"pipelining's; choose {', '.join(SCHEDULES)}")
    if run.microbatches < counts[0]:
        raise PartitionError(f"--engine torch: each of the {counts[0]} replicas needs a "
                             f"micro-batch; got {run.microbatches} micro-batches")
    if run.schedule == "interleaved-zb":
        if lay.stages % 2:
            raise PartitionError(f"--schedule interleaved-zb holds two stages per rank (stage "
                                 f"i on rank i % (stages / 2)); this plan has {lay.stages}")
        positions = lay.stages // 2
        for j in range(counts[0]):
            n = len(range(j, run.microbatches, counts[0]))
            rounds = max(1, n // positions)
            if n % rounds:
                raise PartitionError(
                    f"--schedule interleaved-zb: each pipeline's micro-batches ({n}) must be a "
                    f"multiple of its rounds ({rounds}; torch's zero-bubble rule)")
    unsupported = [flag for flag, on in (
        ("--checkpoint-dir", run.checkpoints.directory is not None),
        ("--resume", run.checkpoints.resume_from is not None),
        ("--from-pretrained", run.weights is not None),
        ("--eval-every", run.job.data.eval_every > 0), ("--log", run.job.logging.file is not None),
        ("a fault hook", run.hook is not None)) if on]
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
            outs = upcast(outs)
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


@dataclass
class _Kit:
    """What a rank of torch pipelining sets up once: where it sits, the micro-batches its
    pipeline serves, its stages' parameters and optimizer, its groups, the timed
    ``PipelineStage`` of each stage it holds and the schedule running them."""

    at: _Place
    mine: list[int]  # the micro-batches of this rank's pipeline (replica)
    params: dict[int, dict[str, torch.nn.Parameter]]  # per local stage
    optimizer: torch.optim.Optimizer
    owned: list[str]  # "stage/name" of the parameters this rank counts in the norm
    stage_groups: dict[int, Any]  # per local stage with replicas: its replicas' group
    tied: list[tuple[Any, list[tuple[int, str]]]]
    hops: dict[int, _Hop]  # the local stages' modules, as pipelining runs them
    timed: dict[int, _TimedStage]
    loss: _Loss
    schedule: Any

    @property
    def flat(self) -> dict[str, torch.nn.Parameter]:
        return {f"{k}/{n}": p for k, named in self.params.items() for n, p in named.items()}


def train_stages_torch(
    stages: Sequence[StageLike],
    loss_fn: LossFn,
    plan: Plan,
    batches: Batches,
    run: RankRun,
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
    if run.job.engine.threads > 0:
        torch.set_num_threads(run.job.engine.threads)
    lay = layout(plan)
    replicas = lay.replicas[0]
    at = _Place(rank // replicas, rank % replicas, lay.stages // _local_count(run.schedule),
                replicas, lay.stages)
    first, last = at.local[0] == 0, at.local[-1] == lay.stages - 1
    first_batch = batches(0) if first or last else None
    metas = _shared_metas(stages, plan, lay, at, first_batch, run.microbatches, rank, device)
    torch.manual_seed(run.job.seed * 1_000_003 + rank)
    kit = _set_up(stages, loss_fn, plan, lay, at, metas, run, device)
    dist.barrier()
    results = {k: RankResult(rank, k, at.replica, [], 0, [], [], [], []) for k in at.local}
    for result in results.values():
        result.math = flags_math(run.precision)
    held = [t for k in at.local for t in (*kit.params[k].values(),
                                          *kit.hops[k].stage.buffers())]
    with tracking(device, held) as memory:  # the rank's, for every stage it holds
        _steps(kit, stages, lay, at, run, results, batches, first_batch, device, memory.stop)
        reading = memory()
    for k in at.local:
        results[k].memory_bytes = reading.peak_bytes
        results[k].resident_bytes = reading.resident_bytes
        results[k].reserved_bytes = reading.reserved_bytes
    if run.keep_state and at.replica == 0:
        for k in at.local:
            results[k].state = {n: v.detach().cpu().clone()
                                for n, v in kit.hops[k].stage.state_dict().items()}
    return [results[k] for k in at.local]


def _steps(kit: _Kit, stages: Sequence[StageLike], lay: Layout, at: _Place, run: RankRun,
           results: Mapping[int, RankResult], batches: Batches, first_batch: _Batch | None,
           device: torch.device, untrack: Callable[[], None]) -> None:
    """The run's steps (step 0's batch already read, for the hops' metadata); ``untrack``
    after the steps memory is measured over where more follow, as our engine's ranks do
    (:data:`~onnx_partition.runtime.train.overheads.TRACKED_STEPS`)."""
    first, last = at.local[0] == 0, at.local[-1] == lay.stages - 1
    for step in range(run.checkpoints.start, run.job.steps):
        began = time.perf_counter()
        if step == 0 and first_batch is not None:
            batch = first_batch
        else:
            batch = batches(step) if first or last else ({}, {})
        total, rows = _run_schedule(kit, lay, batch, first, last, run.microbatches, device)
        norm, lr = _step_end(kit, stages, run, results, step, device)
        _record(lay, at, results, {k: kit.timed[k].seconds for k in at.local}, total, began,
                step, rows, run.job.logging.verbose, device)
        for k in at.local:
            results[k].grad_norm.append(norm)
            results[k].lr.append(lr)
            kit.timed[k].seconds[:] = [0.0, 0.0]
            if step + 1 in run.check_steps:
                results[k].states[step + 1] = host_copies(kit.params[k].items())
        if step + 1 - run.checkpoints.start == TRACKED_STEPS:  # the later steps: untracked
            untrack()


def _shared_metas(stages: Sequence[StageLike], plan: Plan, lay: Layout, at: _Place,
                  first_batch: _Batch | None, count: int, rank: int,
                  device: torch.device) -> list[tuple[list[Meta], list[Meta]]]:
    """Every hop's metadata, found by rank 0 chaining every stage once on micro-batch 0 of
    step 0 (before the seed: its dropout draws are not the run's) and broadcast."""
    shared: list[Any] = [None]
    if rank == 0:
        assert first_batch is not None
        example = {n: v.to(device) for n, v in microbatch(first_batch[0], 0, count).items()}
        shared[0] = hop_metas(stages, lay, example, {s.name for s in plan.inputs},
                              tuple(s.name for s in plan.outputs))
        _free_others(stages, at.local)
    dist.broadcast_object_list(shared, src=0)
    return list(shared[0])


def _set_up(stages: Sequence[StageLike], loss_fn: LossFn, plan: Plan, lay: Layout, at: _Place,
            metas: Sequence[tuple[list[Meta], list[Meta]]], run: RankRun,
            device: torch.device) -> _Kit:
    """The groups (every rank creates every group in the same order: pipelines, stage
    replicas, tied sets), the local stages wrapped, timed and scheduled, and the optimizer."""
    apply_math(run_math(plan.math, run.precision))  # the math the plan was priced in
    replicas = at.replicas
    pipe_group = None
    for j in range(replicas):
        group = dist.new_group(ranks=[p * replicas + j for p in range(at.positions)])
        if j == at.replica:
            pipe_group = group
    stage_groups: dict[int, Any] = {}
    for k in range(lay.stages):
        if replicas > 1:
            group = dist.new_group(ranks=[at.rank_of(k, j) for j in range(replicas)])
            if k in at.local:
                stage_groups[k] = group
    tied = _tied_here(stages, at)
    model_outputs = tuple(s.name for s in plan.outputs)
    hops = {k: _Hop(stages[k], lay.recv_names[k],
                    lay.send_names[k] if k < lay.stages - 1 else model_outputs,
                    run.precision == "bf16").to(device).train() for k in at.local}
    timed = {}
    for k in at.local:
        receives, sends = metas[k]
        timed[k] = _TimedStage(hops[k], k, lay.stages, device,
                               input_args=tuple(_example(m, device) for m in receives),
                               output_args=tuple(_example(m, device) for m in sends),
                               group=pipe_group)
        timed[k].seconds = [0.0, 0.0]
    params = {k: dict(hops[k].stage.named_parameters()) for k in at.local}
    chosen = run.job.optimizer
    optimizer = make_optimizer(run.optimizer, [p for k in at.local for p in params[k].values()],
                               chosen.lr, weight_decay=chosen.weight_decay,
                               momentum=chosen.momentum, betas=chosen.betas)
    owned = [f"{k}/{n}" for k in at.local for n in owned_for_norm(stages, k, at.replica, params[k])]
    mine = [m for m in range(run.microbatches) if m % replicas == at.replica]
    loss = _Loss(loss_fn, model_outputs, run.microbatches, device, {}, [])
    held = [timed[k] for k in at.local]
    schedule = SCHEDULES[run.schedule](held if len(held) > 1 else held[0],
                                       n_microbatches=len(mine), loss_fn=loss,
                                       scale_grads=False)
    return _Kit(at, mine, params, optimizer, owned, stage_groups, tied, hops, timed, loss,
                schedule)


def _run_schedule(kit: _Kit, lay: Layout, batch: _Batch, first: bool,
                  last: bool, count: int, device: torch.device) -> tuple[float, int]:
    """One step of the schedule on ``batch`` (the first stage feeds its pipeline's
    micro-batches, the last takes their targets): the loss summed over this rank's
    micro-batches, and the step's rows (0 off the first stage)."""
    inputs, targets = batch
    if last:
        kit.loss.targets = targets
        kit.loss.weights = microbatch_weights(kit.loss.loss_fn, targets, count)
    args = (tuple(torch.cat([microbatch({n: inputs[n]}, m, count)[n] for m in kit.mine])
                  .to(device) for n in lay.recv_names[0]) if first else ())
    kit.optimizer.zero_grad(set_to_none=True)
    losses: list[torch.Tensor] = []
    kit.schedule.step(*args, target=torch.tensor(kit.mine) if last else None,
                      losses=losses if last else None, return_outputs=False)
    rows = count * (len(args[0]) // len(kit.mine)) if args else 0
    return sum((float(v.detach()) for v in losses), 0.0), rows


def _step_end(kit: _Kit, stages: Sequence[StageLike], run: RankRun,
              results: Mapping[int, RankResult], step: int,
              device: torch.device) -> tuple[float, float]:
    """Our engine's step end after the schedule's: the gradient sums over each stage's
    replicas and the tied sets (step 1's kept for ``--check``), the whole model's norm and
    clipping, the learning rate and the optimizer step; the norm and the rate."""
    for k, group in kit.stage_groups.items():
        all_reduce_grads([p for n, p in sorted(kit.params[k].items())
                          if n not in stages[k].tied], group)
    _sum_tied(kit.params, kit.tied)
    if step == 0 and run.check_steps:
        for k, named in kit.params.items():
            results[k].grads = host_copies((n, p.grad) for n, p in named.items()
                                           if p.grad is not None)
    chosen = run.job.optimizer
    norm = clip_gradients(kit.flat, kit.owned, chosen.clip_grad_norm, device)
    lr = chosen.lr * lr_factor(chosen.lr_schedule, step, chosen.warmup_steps, run.job.steps)
    for group in kit.optimizer.param_groups:
        group["lr"] = lr
    kit.optimizer.step()
    return norm, lr


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
