"""One rank of a training pipeline: it runs the simulator's action list for its device.

**Layout and routing** are the inference runtime's (:func:`onnx_partition.pipeline.layout.
layout`): ranks stage by stage, replicas consecutive; replica ``j`` of a stage with ``r``
replicas takes the micro-batches ``m`` with ``m % r == j`` (counts may differ between stages);
each hop carries every tensor a later stage or the loss still needs, so a skip tensor or a
model input read late travels hop by hop.

**Schedule.** Rank ``(k, j)`` executes ``schedule[(k, j)]`` of the named schedule
(:func:`schedules.build`: 1F1B, GPipe or ZB-H1) with the plan's replica counts, action by
action:

* ``kF m``: take micro-batch ``m``'s tensors (stage 0: slice the batch; else receive them from
  the rank of stage ``k-1`` serving ``m``); the floating tensors an earlier stage made become
  leaves that require grad; run the stage module; send the relay set on (last stage: the loss
  of the model outputs against the targets, times the micro-batch's weight: ``1/M``, or its
  share of the step's counted tokens for cross-entropy; see
  :mod:`onnx_partition.runtime.train.loss`). The
  inputs and outputs stay stashed, with their autograd graph, until ``kB m``.
* ``kB m``: receive the gradients of the floating tensors sent on (last stage: none, the loss
  is the root), ``torch.autograd.backward`` them (a relayed tensor is its own leaf, so its
  gradient passes straight through and adds to this stage's own use of it), and send the
  leaves' gradients back (zeros for a tensor this stage did not use).
* ``kI m`` (ZB-H1): as ``kB m``, but only the leaves' gradients are computed and sent back
  (:func:`passes.input_pass`); the graph stays stashed with the gradients that reached its
  weight branches.
* ``kW m``: the parameters' gradients of micro-batch ``m`` from those
  (:func:`passes.weight_pass`), added to ``.grad``; the stash is freed. A stage whose leaves
  need no gradient (the first) computes nothing in ``I`` and its whole backward in ``W``.

**Recomputation.** A stage with ``recompute`` in the plan runs its forward (and the loss)
without an autograd graph, stashing only its inputs and the RNG state, and builds the graph
again at the start of its ``B`` or ``I`` (:func:`passes.rebuild`; its time counts as backward).

Sends are posted when their action ends (with the next action's receive, in one batch, when it
receives from the same peer: see :mod:`onnx_partition.runtime.train.comm`) and awaited at the
end of the step; receives block: a rank
waits only for what the simulator's action waits for, so an order the simulator runs without
deadlock runs here too.

**Gradient sums.** A micro-batch's loss is its mean times its weight, so summing gradients over
micro-batches and replicas gives the gradient of the mean over the whole batch, as single-
process training with gradient accumulation does. Replicas of a stage then all-reduce (sum)
their gradients in their own group; a tied parameter (``StageModule.tied``) is left out of that
and summed instead over every rank of every stage holding it (Megatron's embedding group),
which counts each rank's contribution exactly once. Then the optimizer steps.

**Hook.** ``TrainConfig.hook`` (:mod:`onnx_partition.runtime.launch.hooks`), when set, is called
after each forward action: the tests kill a rank mid-step through it.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from onnx_partition.errors import one_line
from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.pipeline.microbatch import rows_of
from onnx_partition.pipeline.schedules import Action, Kind
from onnx_partition.plan import Plan
from onnx_partition.progress import echo
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.launch.ranks import RankFailure
from onnx_partition.runtime.train import passes
from onnx_partition.runtime.train.comm import Tensors, TensorWire
from onnx_partition.runtime.train.loss import microbatch_weights
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.modules import eval_module
from onnx_partition.runtime.train.optim import autocast, make_optimizer

__all__ = ["Batches", "LossFn", "RankResult", "SavedCounter", "StageLike", "TrainConfig",
           "microbatch", "step_line", "tied_groups", "train_stages"]

LossFn = Callable[[Tensors, Tensors], torch.Tensor]
# step -> (model inputs, targets), the whole batch of the step
Batches = Callable[[int], tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]


class StageLike(Protocol):
    """What the engine needs of a stage (``onnx_partition.runtime.train.modules.StageModule``)."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tied: dict[str, tuple[int, ...]]

    @property
    def module(self) -> torch.nn.Module: ...  # read only: a stage may build it on first read


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1
    microbatches: int = 4
    schedule: str = "1f1b"
    optimizer: str = "sgd"
    lr: float = 0.01
    check_steps: tuple[int, ...] = ()  # keep the parameters after these steps (1-based)
    keep_state: bool = False  # replica 0 returns its module's state_dict at the end
    verbose: bool = False  # rank 0 prints a line per step
    threads: int = 1  # torch intra-op threads per rank (0: torch's default)
    hook: RankHook | None = None  # called as hook(rank, "forward") after each forward
    seed: int = 0  # torch's RNG (dropout) starts from seed and rank
    # optimisation (make_optimizer; lr_schedule.lr_factor over ``steps`` in all)
    weight_decay: float | None = None  # None: torch.optim's default
    momentum: float = 0.0  # sgd
    betas: tuple[float, float] = (0.9, 0.999)  # adamw
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    clip_grad_norm: float | None = None  # by the whole model's gradient norm
    precision: str = "fp32"  # or "bf16": autocast, fp32 master weights
    # checkpoints (onnx_partition.runtime.train.checkpoint)
    start_step: int = 0  # resumed: steps already done
    resume_from: str | None = None  # the checkpoint folder to load
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_manifest: str = ""  # JSON of the manifest's fixed part (plan, rows per step)
    earlier_evals: tuple[tuple[int, float], ...] = ()  # resumed: the checkpoint's (step, loss)
    # evaluation and logs (rank 0)
    eval_every: int = 0
    eval_batches: int = 1  # batches per evaluation (--eval-data: every whole step of its rows)
    log: str | None = None  # append one JSON object per step
    progress: bool = False  # a progress bar on a terminal
    engine: str = "ours"  # or "torch": torch.distributed.pipelining (train.torch_engine)


@dataclass
class RankResult:
    """What one rank did and measured."""

    rank: int
    stage: int
    replica: int
    actions: list[str]  # executed, in order, every step (``str(Action)``)
    peak_inflight: int  # most micro-batches stashed at once
    step_ms: list[float]  # per step: start to optimizer step done
    forward_ms: list[float]  # per step: this rank's forward compute (with the loss)
    backward_ms: list[float]  # per step: this rank's backward compute
    loss: list[float]  # rank 0 only: the whole batch's loss, per step
    table: list[list[float]] = field(default_factory=list)  # rank 0: per step, per rank [fwd, bwd]
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> params
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # check: step 1's, summed
    state: dict[str, torch.Tensor] | None = None  # keep_state: the module's final state_dict
    grad_norm: list[float] = field(default_factory=list)  # per step, the whole model's
    lr: list[float] = field(default_factory=list)  # per step
    eval_loss: list[tuple[int, float]] = field(default_factory=list)  # rank 0: (step, loss)
    # bytes the stage module saved for backward, per micro-batch of the run's first step
    # (the saved-tensor hook: unique storages, parameters and buffers left out)
    activation_bytes: list[int] = field(default_factory=list)
    # CPU: per step, the thread's CPU time in forward and backward compute (one torch thread
    # computes in the calling thread): what a busy machine's other processes do not stretch
    forward_cpu_ms: list[float] = field(default_factory=list)
    backward_cpu_ms: list[float] = field(default_factory=list)
    memory_bytes: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the run
    # per step, where the wall time went (ms; ``spans``: per action, from the step's start,
    # (action, start, end, of which blocked in receives); ``tail``: the step's end, from the
    # last action to the step done: sends awaited, gradient sums and the norm's all-reduce
    # (a barrier over every rank), the optimizer step)
    spans: list[list[tuple[str, float, float, float]]] = field(default_factory=list)
    tail: list[dict[str, float]] = field(default_factory=list)


def microbatch(batch: Mapping[str, torch.Tensor], m: int, count: int) -> Tensors:
    """Micro-batch ``m`` of ``count``: the one split rule
    (:func:`onnx_partition.pipeline.microbatch.rows_of`; a step's ``B x M`` rows give
    micro-batch ``m`` rows ``m B .. (m + 1) B``)."""
    return rows_of(batch, m, count)


def tied_groups(stages: Sequence[StageLike]) -> list[tuple[int, ...]]:
    """The distinct sets of stages sharing a parameter, sorted (one process group each)."""
    return sorted({tuple(sorted(s)) for st in stages for s in st.tied.values() if len(s) > 1})


@dataclass
class _Stash:
    leaves: Tensors  # received tensors that require grad
    sent: Tensors  # tensors sent on (autograd graph kept), or {"": loss} on the last stage
    run: Callable[..., Tensors] | None = None  # recomputing: the forward, run again at B or I
    rng: passes.RngState | None = None  # recomputing: the RNG state the forward started from
    later: passes.WeightPass | None = None  # after kI m: what kW m needs


@dataclass(frozen=True)
class _Rank:
    """What this rank keeps through training: its stage, its place and its wire."""

    lay: Layout
    k: int  # the stage served
    stage: StageLike
    module: torch.nn.Module
    loss_fn: LossFn
    wire: TensorWire
    device: torch.device
    count: int  # micro-batches per step
    model_inputs: set[str]
    model_outputs: list[str]
    clock: _Clock
    bf16: bool = False  # autocast the stage module to bfloat16
    saved: SavedCounter | None = None  # counts what the first step's forwards save
    recompute: bool = False  # keep only the inputs; run the forward again at B or I
    params: list[torch.nn.Parameter] = field(default_factory=list)  # for the split backward

    @property
    def last(self) -> bool:
        return self.k == self.lay.stages - 1


@dataclass
class _Step:
    """One step's state on this rank: its batch, the stashed micro-batches and the sums."""

    inputs: Mapping[str, torch.Tensor]
    targets: Mapping[str, torch.Tensor]
    stash: dict[int, _Stash] = field(default_factory=dict)
    fwd: float = 0.0  # seconds of forward compute (with the loss), read at the step's end
    bwd: float = 0.0  # seconds of backward compute
    loss_sum: torch.Tensor | float = 0.0  # on the device until the step ends (no host sync)
    weights: list[float] = field(default_factory=list)  # last stage: each micro-batch's share


def train_stages(
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
    """Train this rank's stage (``stages[k]`` for the stage ``k`` that ``rank`` serves) in
    the already initialised default process group; every rank calls it with the same
    ``stages`` list (all stages: the tied groups are read from it), ``plan`` and
    ``config``. ``batches(step)`` gives the whole batch (``microbatches`` x rows per
    micro-batch) of step ``step`` (0-based); only stage 0 (inputs) and the last stage
    (targets) call it; ``eval_batches(i)`` likewise the validation batches (``config.eval_every``).
    Raises ``RankFailure("compute", ...)`` when the stage module or the loss raises."""
    device = device or torch.device("cpu")
    if config.check_steps and device.type == "cuda":  # --check: full float32 (no TF32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    lay = layout(plan)
    k, replica = lay.place(rank)
    torch.manual_seed(config.seed * 1_000_003 + rank)
    module = stages[k].module.to(device).train()
    actions = schedules.build(config.schedule, lay.replicas, config.microbatches)[(k, replica)]

    # Every rank creates every group, in the same order (torch.distributed requires it).
    stage_group = _group_for(lay, [s for s in range(lay.stages)], k)
    my_tied = _tied_groups_here(lay, stages, k)
    tied_names = {n for _, names in my_tied for n in names}
    params = dict(module.named_parameters())
    optimizer = make_optimizer(config.optimizer, list(params.values()), config.lr,
                               weight_decay=config.weight_decay, momentum=config.momentum,
                               betas=config.betas)
    if config.resume_from is not None:
        _load_checkpoint(Path(config.resume_from), rank, module, optimizer, device)
    owned = _owned_for_norm(stages, k, replica, params)
    wire = TensorWire(device, lay.name)
    # a collective before the first point-to-point batch (NCCL wants one, on this rank's GPU)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index or 0])
    else:
        dist.barrier()
    counter = SavedCounter(module)
    me = _Rank(lay, k, stages[k], module, loss_fn, wire, device, config.microbatches,
               {s.name for s in plan.inputs}, [s.name for s in plan.outputs], _Clock(device),
               config.precision == "bf16", counter, bool(plan.stages[k].recompute),
               [p for p in params.values() if p.requires_grad])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = _progress(config) if rank == 0 else None
    # validation runs the stage as model.eval() would (dropout off, running statistics, no
    # buffer update), on the same parameters: .eval() alone changes nothing in an FX program
    judge = (replace(me, module=eval_module(module))
             if config.eval_every and eval_batches is not None else None)

    result = RankResult(rank, k, replica, [], 0, [], [], [], [])
    for step in range(config.start_step, config.steps):
        began = time.perf_counter()
        st = _Step(*(batches(step) if k == 0 or me.last else ({}, {})))
        if me.last:
            st.weights = microbatch_weights(loss_fn, st.targets, config.microbatches)
        optimizer.zero_grad(set_to_none=True)
        spans: list[tuple[str, float, float, float]] = []
        for i, action in enumerate(actions):
            result.actions.append(str(action))
            t0, blocked = time.perf_counter(), wire.comm_s
            _RUN[action.kind](me, st, action)
            # the action's sends leave now, or with the next action's receive from their peer
            wire.flush(_source(me, actions[i + 1]) if i + 1 < len(actions) else None)
            spans.append((str(action), (t0 - began) * 1000.0,
                          (time.perf_counter() - began) * 1000.0,
                          (wire.comm_s - blocked) * 1000.0))
            if action.kind is Kind.F:
                result.peak_inflight = max(result.peak_inflight, len(st.stash))
                if config.hook is not None:
                    config.hook(rank, "forward")
        marks = [time.perf_counter()]
        wire.wait()  # before any collective: a peer in it may wait for a queued send
        marks.append(time.perf_counter())
        if counter.active:  # only the first step counts (it is left out of the timings)
            result.activation_bytes, counter.active = list(counter.per_microbatch), False
        _sum_gradients(params, tied_names, stage_group, my_tied)
        if step == 0 and config.check_steps:
            result.grads = {n: p.grad.detach().cpu().clone() for n, p in params.items()
                            if p.grad is not None}
        marks.append(time.perf_counter())
        norm = _clip(params, owned, config.clip_grad_norm, device)
        marks.append(time.perf_counter())
        lr = config.lr * lr_factor(config.lr_schedule, step, config.warmup_steps, config.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        marks.append(time.perf_counter())
        result.spans.append(spans)
        result.tail.append({name: (b - a) * 1000.0 for name, a, b in zip(
            ("sends_ms", "grad_sum_ms", "norm_ms", "optimizer_ms"), marks, marks[1:])})
        result.grad_norm.append(norm)
        result.lr.append(lr)
        _record_step(me, st, result, step, began, verbose=config.verbose)
        if step + 1 in config.check_steps:
            result.states[step + 1] = {n: p.detach().cpu().clone() for n, p in params.items()}
        if config.eval_every and eval_batches is not None and (
                (step + 1) % config.eval_every == 0 or step + 1 == config.steps):
            _evaluate(judge or me, eval_batches, config, result, step + 1)
        if rank == 0:
            _log_step(config, result, st, step)
            if bar is not None:
                bar(step + 1, result.loss[-1])
        if config.checkpoint_dir and config.checkpoint_every and (
                (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps):
            _checkpoint(config, lay, rank, step + 1, module, optimizer, device,
                        result.eval_loss)
    if device.type == "cuda":
        result.memory_bytes = int(torch.cuda.max_memory_allocated(device))
    if config.keep_state and replica == 0:
        result.state = {n: v.detach().cpu().clone() for n, v in module.state_dict().items()}
    return result


def _owned_for_norm(stages: Sequence[StageLike], k: int, replica: int,
                    params: Mapping[str, torch.nn.Parameter]) -> list[str]:
    """The parameters whose gradient this rank counts in the whole model's norm: replica 0's,
    a tied parameter only on the first stage holding it (after the gradient sums every
    replica and every holder has the same gradient)."""
    if replica != 0:
        return []
    tied = stages[k].tied
    return [n for n in sorted(params) if n not in tied or min(tied[n]) == k]


def _clip(params: Mapping[str, torch.nn.Parameter], owned: Sequence[str], max_norm: float | None,
          device: torch.device) -> float:
    """The whole model's gradient norm (squared norms all-reduced over every rank) and, with
    ``max_norm``, the gradients scaled as ``torch.nn.utils.clip_grad_norm_`` scales them."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for n in owned:
        grad = params[n].grad
        if grad is not None:
            sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def _load_checkpoint(folder: Path, rank: int, module: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """This rank's parameters, optimizer state and RNG state from a checkpoint folder."""
    from onnx_partition.runtime.train.checkpoint import rank_file

    saved = torch.load(rank_file(folder, rank), map_location=device, weights_only=False)
    module.load_state_dict(saved["module"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    if device.type == "cuda" and saved.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)


def _checkpoint(config: TrainConfig, lay: Layout, rank: int, step: int, module: torch.nn.Module,
                optimizer: torch.optim.Optimizer, device: torch.device,
                evals: Sequence[tuple[int, float]] = ()) -> None:
    """Write this rank's share of the checkpoint after ``step`` (rank 0 publishes it, with
    every validation loss of the run so far, the resumed segments' included)."""
    from onnx_partition.runtime.train.checkpoint import CHECKPOINT_FORMAT, write_checkpoint

    def save(path: Path) -> None:
        torch.save({"module": module.state_dict(), "optimizer": optimizer.state_dict(),
                    "rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda"
                    else None}, path)

    manifest = None
    if rank == 0:
        fixed = json.loads(config.checkpoint_manifest or "{}")
        rows = int(fixed.get("rows_per_step", 0))
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "steps": config.steps,
                    "data_position": {"step": step, "rows": step * rows}, **fixed,
                    "eval_loss": [[s, v] for s, v in (*config.earlier_evals, *evals)],
                    "ranks": [{"rank": q, "stage": lay.place(q)[0], "replica": lay.place(q)[1],
                               "file": f"rank-{q:05d}.pt"} for q in range(lay.world_size)]}
    hook = config.hook
    write_checkpoint(Path(config.checkpoint_dir or "."), step, rank, save, dist.barrier, manifest,
                     None if hook is None else lambda: hook(rank, "checkpoint"))


def _evaluate(me: _Rank, batches: Batches, config: TrainConfig, result: RankResult,
              step: int) -> None:
    """A forward-only pass over ``config.eval_batches`` validation batches (``me.module``: the
    stage as :func:`~onnx_partition.runtime.train.modules.eval_module` runs it), each rank
    serving its micro-batches in order; rank 0 learns the mean of the batches' losses (each the
    step loss over its B x M rows) and prints it."""
    lay, k = me.lay, me.k
    me.module.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(config.eval_batches):
                st = _Step(*(batches(i) if k == 0 or me.last else ({}, {})))
                if me.last:
                    st.weights = microbatch_weights(me.loss_fn, st.targets, config.microbatches)
                for m in range(me.count):
                    if lay.rank_of(k, m) == result.rank:
                        _forward(me, st, Action(k, Kind.F, m))
                st.stash.clear()
                total += float(st.loss_sum)
        me.wire.wait()
    finally:
        me.module.train()
    summed = torch.tensor([total], dtype=torch.float64, device=me.device)
    dist.all_reduce(summed)
    loss = float(summed.cpu()[0]) / config.eval_batches
    if result.rank == 0:
        result.eval_loss.append((step, loss))
        if config.verbose:
            echo(f"eval after step {step}: validation loss {loss:.4f}")


def _log_step(config: TrainConfig, result: RankResult, st: _Step, step: int) -> None:
    """Append the step's JSON object to ``config.log`` (rank 0)."""
    if config.log is None:
        return
    ms = result.step_ms[-1]
    rows = next(iter(st.inputs.values())).shape[0] if st.inputs else 0
    body: dict[str, Any] = {"step": step + 1, "loss": result.loss[-1], "lr": result.lr[-1],
                            "grad_norm": result.grad_norm[-1],
                            "samples_per_s": rows / ms * 1000.0 if ms > 0 else 0.0}
    tokens = _tokens(st.inputs)
    if tokens:
        body["tokens_per_s"] = tokens / ms * 1000.0 if ms > 0 else 0.0
    if result.eval_loss and result.eval_loss[-1][0] == step + 1:
        body["eval_loss"] = result.eval_loss[-1][1]
    with open(config.log, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(body) + "\n")


def _tokens(inputs: Mapping[str, torch.Tensor]) -> int:
    """Tokens in a batch of a model with a sequence axis (an integer input of rank >= 2, rows x
    positions), else 0."""
    for value in inputs.values():
        if value.dim() >= 2 and not value.is_floating_point() and value.dtype != torch.bool:
            return math.prod(value.shape[:2])
    return 0


def _progress(config: TrainConfig) -> Callable[[int, float], None] | None:
    """Rank 0's bar (steps done, loss, ETA; on a terminal only)."""
    if not config.progress:
        return None
    from onnx_partition.progress import loss_bar

    return loss_bar("train", config.steps, start=config.start_step)


def _tied_groups_here(lay: Layout, stages: Sequence[StageLike],
                      k: int) -> list[tuple[Any, list[str]]]:
    """Create every tied group (on every rank); those of stage ``k``, each with the names of the
    parameters it sums."""
    mine = []
    for stage_set in tied_groups(stages):
        group = dist.new_group(ranks=[q for s in stage_set for q in _ranks(lay, s)])
        if k in stage_set:
            names = sorted(n for n, s in stages[k].tied.items() if tuple(sorted(s)) == stage_set)
            mine.append((group, names))
    return mine


def _forward(me: _Rank, st: _Step, action: Action) -> None:
    """``kF m``: take micro-batch ``m``'s tensors, run the stage (and on the last stage the
    loss), send the relay set on and stash what the backward needs (a recomputing stage: its
    inputs and RNG state, the graph built again at its ``B`` or ``I``)."""
    lay, k, m, count, device = me.lay, me.k, action.microbatch, me.count, me.device
    if k == 0:  # the micro-batch's own tensors (a slice would keep the whole batch's storage,
        # and autograd's saved inputs would count it)
        env = {n: v.to(device) if device.type != "cpu" else v.clone() for n, v in
               microbatch({n: st.inputs[n] for n in lay.recv_names[0]}, m, count).items()}
    else:
        env = me.wire.recv(lay.rank_of(k - 1, m), m, lay.recv_names[k])
    leaves = {}
    for n in list(env):
        if env[n].is_floating_point() and n not in me.model_inputs:
            env[n] = leaves[n] = env[n].detach().requires_grad_()
    want = ({n: v.to(device) for n, v in microbatch(st.targets, m, count).items()}
            if me.last and st.targets else {})
    weight = st.weights[m] if me.last else 1.0

    def run(saved: SavedCounter | None = None) -> Tensors:
        """The stage on ``env``: what it sends on, or ``{"": loss}`` on the last stage;
        ``saved`` counts what the stage module saves (once per micro-batch: a recomputing
        stage's rebuild, whose activations live one backward at a time)."""
        with autocast(device, me.bf16), _counting(saved):
            outs = me.module(*[env[n] for n in me.stage.inputs])
        if isinstance(outs, torch.Tensor):
            outs = (outs,)
        if me.bf16:  # hops and the loss in fp32 (the wire has no bfloat16; lossless upcast)
            outs = tuple(o.float() if o.dtype == torch.bfloat16 else o for o in outs)
        made = {**env, **dict(zip(me.stage.outputs, outs, strict=True))}
        if me.last:
            return {"": me.loss_fn({n: made[n] for n in me.model_outputs}, want) * weight}
        return {n: made[n] for n in lay.send_names[k]}

    t0 = me.clock.start()
    rng = None
    try:
        if me.recompute:  # its forward saves nothing; the rebuild's activations are counted
            sent, rng = passes.kept_forward(run, device)
        else:
            sent = run(me.saved)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(0, t0)
    if me.last:
        st.loss_sum = st.loss_sum + sent[""].detach()
    else:
        me.wire.send(lay.rank_of(k + 1, m), m, lay.send_names[k], sent)
    st.stash[m] = _Stash(leaves, sent, run if me.recompute else None, rng)


def _roots(me: _Rank, st: _Step, action: Action,
           held: _Stash) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A backward's start: the graph built again on a recomputing stage, the gradients of what
    was sent on received (last stage: none, the loss is the root); the roots that require
    grad and their gradients."""
    lay, k, m = me.lay, me.k, action.microbatch
    if held.run is not None and held.rng is not None:
        run = held.run
        t0 = me.clock.start()
        try:
            held.sent = passes.rebuild(lambda: run(me.saved), me.module, held.rng)
        except Exception as exc:
            raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
        me.clock.stop(1, t0)
        held.run = held.rng = None
    if me.last:
        loss = held.sent[""]
        return ([loss], [None]) if loss.requires_grad else ([], [])
    names = _grad_names(held.sent, lay.send_names[k], me.model_inputs)
    got = me.wire.recv_like(lay.rank_of(k + 1, m), names, held.sent)
    pairs = [(held.sent[n], got[n]) for n in names if held.sent[n].requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _send_back(me: _Rank, action: Action, held: _Stash,
               grads: Mapping[str, torch.Tensor | None]) -> None:
    """Send the leaves' gradients to the stage below (zeros for a tensor this stage did not
    use)."""
    if me.k > 0:
        lay, k, m = me.lay, me.k, action.microbatch
        names = _grad_names(held.leaves, lay.recv_names[k], me.model_inputs)
        back = {n: g if (g := grads.get(n)) is not None else torch.zeros_like(held.leaves[n])
                for n in names}
        me.wire.send(lay.rank_of(k - 1, m), m, names, back, header=False)


def _backward(me: _Rank, st: _Step, action: Action) -> None:
    """``kB m``: receive the gradients of what was sent on, backpropagate them and send the
    leaves' gradients back."""
    held = st.stash.pop(action.microbatch)
    roots, grads = _roots(me, st, action, held)
    t0 = me.clock.start()
    try:
        if roots:
            torch.autograd.backward(roots, grads)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)
    _send_back(me, action, held, {n: t.grad for n, t in held.leaves.items()})


def _input(me: _Rank, st: _Step, action: Action) -> None:
    """``kI m``: receive the gradients of what was sent on, compute the leaves' gradients alone
    (:func:`passes.input_pass`) and send them back; the graph stays stashed for ``kW m``."""
    held = st.stash[action.microbatch]
    roots, grads = _roots(me, st, action, held)
    names = list(held.leaves)
    t0 = me.clock.start()
    try:
        got, held.later = passes.input_pass(roots, grads, [held.leaves[n] for n in names],
                                            me.params)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)
    held.sent = {}  # what only the input gradients needed is freed with the roots
    del roots, grads
    _send_back(me, action, held, dict(zip(names, got, strict=True)))


def _weight(me: _Rank, st: _Step, action: Action) -> None:
    """``kW m``: the parameters' gradients of micro-batch ``m`` (:func:`passes.weight_pass`),
    added to ``.grad``; the micro-batch's graph is freed."""
    held = st.stash.pop(action.microbatch)
    if held.later is None:
        raise RankFailure("compute", f"{action}: no input-gradient pass before it")
    t0 = me.clock.start()
    try:
        passes.weight_pass(held.later)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)


_RUN: dict[Kind, Callable[[_Rank, _Step, Action], None]] = {
    Kind.F: _forward, Kind.B: _backward, Kind.I: _input, Kind.W: _weight}


def _record_step(me: _Rank, st: _Step, result: RankResult, step: int, began: float, *,
                 verbose: bool) -> None:
    """Add the step's figures to ``result``. One small all-reduce per step: rank 0 learns the
    loss and every rank's times (and prints the step line when ``verbose``)."""
    lay, rank = me.lay, result.rank
    st.fwd, st.bwd = me.clock.read()
    if not me.clock.cuda:
        fwd_cpu, bwd_cpu = me.clock.read_cpu()
        result.forward_cpu_ms.append(fwd_cpu * 1000.0)
        result.backward_cpu_ms.append(bwd_cpu * 1000.0)
    row = torch.zeros(lay.world_size, 3, dtype=torch.float64)
    row[rank] = torch.tensor([st.fwd * 1000.0, st.bwd * 1000.0, float(st.loss_sum)],
                             dtype=torch.float64)
    wired = row.to(me.device)
    dist.all_reduce(wired)
    table = wired.cpu()
    ms = (time.perf_counter() - began) * 1000.0
    result.step_ms.append(ms)
    result.forward_ms.append(st.fwd * 1000.0)
    result.backward_ms.append(st.bwd * 1000.0)
    if rank == 0:
        result.loss.append(float(table[:, 2].sum()))
        result.table.append([float(v) for v in table[:, :2].reshape(-1)])
        if verbose:
            rows = next(iter(st.inputs.values())).shape[0] if st.inputs else 0
            echo(step_line(step, result.loss[-1], ms, table[:, :2].tolist(), lay, rows=rows))


def step_line(step: int, loss: float, ms: float, times: Sequence[Sequence[float]], lay: Layout,
              *, rows: int) -> str:
    """``step 1: loss 2.3026, 812.3 samples/s (19.70 ms); busy ms per stage: 4.1 5.0``
    (busy = forward + backward, the mean over a stage's replicas)."""
    busy = []
    for s in range(lay.stages):
        mine = [sum(times[q]) for q in _ranks(lay, s)]
        busy.append(sum(mine) / len(mine))
    rate = rows / ms * 1000.0 if ms > 0 else 0.0
    return (f"step {step + 1}: loss {loss:.4f}, {rate:.1f} samples/s ({ms:.2f} ms); busy ms per "
            f"stage: {' '.join(f'{b:.2f}' for b in busy)}")


def _source(me: _Rank, action: Action) -> int | None:
    """The rank ``action`` first receives from (None: it receives nothing)."""
    if action.kind is Kind.F:
        return me.lay.rank_of(me.k - 1, action.microbatch) if me.k > 0 else None
    return None if me.last or action.kind is Kind.W else me.lay.rank_of(me.k + 1, action.microbatch)


def _ranks(lay: Layout, stage: int) -> list[int]:
    return list(range(lay.first[stage], lay.first[stage] + lay.replicas[stage]))


def _group_for(lay: Layout, stages: Sequence[int], mine: int) -> Any:
    """One group per stage with replicas (created on every rank); this rank's, or None."""
    own = None
    for s in stages:
        if lay.replicas[s] > 1:
            group = dist.new_group(ranks=_ranks(lay, s))
            if s == mine:
                own = group
    return own


def _grad_names(tensors: Mapping[str, torch.Tensor], names: Sequence[str],
                model_inputs: set[str]) -> list[str]:
    """The names whose gradients cross this hop: floating tensors that a stage made (both
    ends see the same dtypes, so both derive the same list)."""
    return [n for n in names
            if n in tensors and tensors[n].is_floating_point() and n not in model_inputs]


def _sum_gradients(params: Mapping[str, torch.nn.Parameter], tied: set[str], stage_group: Any,
                   tied_groups_here: Sequence[tuple[Any, list[str]]]) -> None:
    """Sum gradients over the stage's replicas (tied parameters left out) and, per tied
    group, over every rank holding the parameter."""
    if stage_group is not None:
        _all_reduce_grads([p for n, p in sorted(params.items()) if n not in tied], stage_group)
    for group, names in tied_groups_here:
        _all_reduce_grads([params[n] for n in names], group)


def _all_reduce_grads(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """One flat all-reduce (sum) of the parameters' gradients (None counts as zeros)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for p, piece in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = piece.view_as(p).clone()


class SavedCounter:
    """Bytes a stage module saves for backward in one forward, as autograd keeps them: every
    tensor packed by ``torch.autograd.graph.saved_tensors_hooks`` counted once per storage
    (``StorageWeakRef``: views of one buffer, or a tensor saved by two ops, count once), the
    module's parameters and buffers left out; the rule of
    :func:`onnx_partition.cost.saved.saved_bytes`, which prices ``activation_bytes``, applied
    to the real run. ``active`` until the first step ends (the hook costs a little time)."""

    def __init__(self, module: torch.nn.Module) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._weights = {StorageWeakRef(t.untyped_storage())
                         for t in [*module.parameters(), *module.buffers()]}
        self.seen: set[Any] = set()  # the forward's storages (StorageWeakRef), weights too
        self.active = True
        self.per_microbatch: list[int] = []

    def start(self) -> None:
        self.seen = set(self._weights)
        self.per_microbatch.append(0)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = self._ref(storage)
        if key not in self.seen:
            self.seen.add(key)
            self.per_microbatch[-1] += int(storage.nbytes())
        return tensor


def _counting(counter: SavedCounter | None) -> Any:
    """The saved-tensor hook around one forward while ``counter`` is active, else nothing."""
    if counter is None or not counter.active:
        return contextlib.nullcontext()
    counter.start()
    return torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t)


class _Clock:
    """Forward (0) and backward (1) compute time of a step. CPU: ``perf_counter`` around each
    action, and the thread's CPU time (``thread_time``) beside it. CUDA: a pair of events per
    action, read once at the step's end (one wait for the last event, not a whole-device
    synchronize around every action)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = [0.0, 0.0]
        self.cpu_seconds = [0.0, 0.0]
        self.events: list[tuple[int, Any, Any]] = []  # (kind, start, end), CUDA

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter(), time.thread_time()

    def stop(self, kind: int, began: Any) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((kind, began, end))
        else:
            self.seconds[kind] += time.perf_counter() - began[0]
            self.cpu_seconds[kind] += time.thread_time() - began[1]

    def read(self) -> tuple[float, float]:
        """The step's (forward, backward) seconds; starts the next step at zero."""
        if self.events:
            self.events[-1][2].synchronize()
            for kind, began, end in self.events:
                self.seconds[kind] += began.elapsed_time(end) / 1000.0
            self.events.clear()
        fwd, bwd = self.seconds
        self.seconds = [0.0, 0.0]
        return fwd, bwd

    def read_cpu(self) -> tuple[float, float]:
        """The step's (forward, backward) CPU seconds of this thread (CPU only)."""
        fwd, bwd = self.cpu_seconds
        self.cpu_seconds = [0.0, 0.0]
        return fwd, bwd
