"""One rank of a training pipeline: it runs the simulator's action list for its device, step
after step (the actions themselves: :mod:`onnx_partition.runtime.train.actions`).

**Layout and routing** are the inference runtime's (:func:`onnx_partition.pipeline.layout.
layout`): ranks stage by stage, replicas consecutive; replica ``j`` of a stage with ``r``
replicas takes the micro-batches ``m`` with ``m % r == j`` (counts may differ between stages);
each hop carries every tensor a later stage or the loss still needs, so a skip tensor or a
model input read late travels hop by hop.

**Schedule.** Rank ``(k, j)`` executes ``schedule[(k, j)]`` of the named schedule
(:func:`schedules.build`: 1F1B, GPipe or ZB-H1) with the plan's replica counts, action by
action (``kF m``, ``kB m``, ``kI m``, ``kW m``; a recomputing stage rebuilds its forward at
``B`` or ``I``). Sends are posted when their action ends (with the next action's receive, in
one batch, when it receives from the same peer: see :mod:`onnx_partition.runtime.train.comm`)
and awaited at the end of the step; receives block: a rank waits only for what the simulator's
action waits for, so an order the simulator runs without deadlock runs here too.

**The step's end.** The gradients are summed over each stage's replicas and the tied groups
(:mod:`onnx_partition.runtime.train.grads`), the whole model's norm taken (and clipped), the
learning rate set for the step (:func:`~onnx_partition.runtime.train.lr_schedule.lr_factor`) and
the optimizer steps. Rank 0 learns the loss and every rank's times in one small all-reduce and
prints the step line (``verbose``); validation losses, the per-step log and checkpoints follow
the job (:class:`~onnx_partition.runtime.train.rank_io.RankRun`).

**Hook.** ``RankRun.hook`` (:mod:`onnx_partition.runtime.launch.hooks`), when set, is called
after each forward action: the tests kill a rank mid-step through it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.pipeline.schedules import Action, Kind
from onnx_partition.plan import Plan
from onnx_partition.progress import echo
from onnx_partition.runtime.memtrack import host_copies, tracking
from onnx_partition.runtime.train.actions import (
    ACTIONS,
    RankState,
    StepState,
    first_source,
    forward,
)
from onnx_partition.runtime.train.comm import TensorWire
from onnx_partition.runtime.train.grads import (
    clip_gradients,
    owned_for_norm,
    replica_group,
    stage_ranks,
    sum_gradients,
    tied_groups_here,
)
from onnx_partition.runtime.train.loss import microbatch_weights
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.math_mode import apply_math, flags_math, run_math
from onnx_partition.runtime.train.meters import Clock, SavedCounter
from onnx_partition.runtime.train.modules import eval_module
from onnx_partition.runtime.train.optim import make_optimizer
from onnx_partition.runtime.train.overheads import TRACKED_STEPS
from onnx_partition.runtime.train.rank_io import Batches, LossFn, RankResult, RankRun, StageLike
from onnx_partition.runtime.train.restart import write_progress
from onnx_partition.runtime.train.rows import batch_rows, batch_shapes
from onnx_partition.runtime.train.weightless import materialize

__all__ = ["step_line", "train_stages"]


@dataclass
class _Kit:
    """What a rank sets up once: its state (:class:`RankState`), its actions, parameters and
    optimizer, and its process groups (every rank creates every group, in one order)."""

    me: RankState
    replica: int
    actions: list[Action]
    params: dict[str, torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    owned: list[str]  # the parameters this rank counts in the whole model's norm
    stage_group: Any  # this stage's replicas, or None
    tied: list[tuple[Any, list[str]]]  # this stage's tied groups, each with its names

    @property
    def tied_names(self) -> set[str]:
        return {n for _, names in self.tied for n in names}


def train_stages(
    stages: Sequence[StageLike],
    loss_fn: LossFn,
    plan: Plan,
    batches: Batches,
    run: RankRun,
    *,
    rank: int,
    device: torch.device | None = None,
    eval_batches: Batches | None = None,
) -> RankResult:
    """Train this rank's stage (``stages[k]`` for the stage ``k`` that ``rank`` serves) in
    the already initialised default process group; every rank calls it with the same
    ``stages`` list (all stages: the tied groups are read from it), ``plan`` and ``run``.
    ``batches(step)`` gives the whole batch (``microbatches`` x rows per micro-batch) of step
    ``step`` (0-based); only stage 0 (inputs) and the last stage (targets) call it;
    ``eval_batches(i)`` likewise the validation batches (``run.job.data.eval_every``).
    Raises ``RankFailure("compute", ...)`` when the stage module or the loss raises."""
    device = device or torch.device("cpu")
    kit = _set_up(stages, loss_fn, plan, run, rank, device)
    me = kit.me
    held = [*kit.params.values(), *me.module.buffers(), *_optimizer_tensors(kit.optimizer)]
    result = RankResult(rank, me.k, kit.replica, [], 0, [], [], [], [])
    result.math = flags_math(run.precision)
    if 0 in run.check_steps:  # the parameters training starts from
        result.states[0] = host_copies(kit.params.items())
    with tracking(device, held) as memory:  # the peak of live storages, its first steps
        _train_steps(kit, run, batches, result, eval_batches, memory.stop)
        reading = memory()
    result.memory_bytes = reading.peak_bytes
    result.resident_bytes, result.reserved_bytes = reading.resident_bytes, reading.reserved_bytes
    if run.keep_state and kit.replica == 0:
        result.state = {n: v.detach().cpu().clone() for n, v in me.module.state_dict().items()}
    return result


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of ``optimizer``'s state (a resumed run's, loaded before tracking)."""
    return [v for state in optimizer.state.values() if state  # (a shard's others: None)
            for v in state.values() if isinstance(v, torch.Tensor)]


def _train_steps(kit: _Kit, run: RankRun, batches: Batches, result: RankResult,
                 eval_batches: Batches | None, untrack: Callable[[], None]) -> None:
    """The run's steps, with validation, the per-step log and checkpoints as they fall due;
    ``untrack`` after the steps memory is measured over where more follow (they are timed
    without the tracker: :func:`~onnx_partition.runtime.train.overheads.timed_from`)."""
    me, rank, device = kit.me, result.rank, kit.me.device
    bar = _progress(run) if rank == 0 else None
    # validation runs the stage as model.eval() would (dropout off, running statistics, no
    # buffer update), on the same parameters: .eval() alone changes nothing in an FX program
    evaluating = bool(run.job.data.eval_every) and eval_batches is not None
    judge = replace(me, module=eval_module(me.module)) if evaluating else me
    for step in range(run.checkpoints.start, run.job.steps):
        began = time.perf_counter()
        st = _run_actions(kit, run, batches, result, step, began)
        _finish_step(kit, run, st, result, step, began)
        done = step + 1
        if done - run.checkpoints.start == TRACKED_STEPS:  # the later steps, if any: timed
            untrack()
        if done in run.check_steps:
            result.states[done] = host_copies(kit.params.items())
        if evaluating and eval_batches is not None and _due(done, run.job.data.eval_every, run):
            _evaluate(judge, eval_batches, run, result, done)
        if rank == 0:
            _log_step(run, result, st, step)
            if run.progress_file is not None:
                write_progress(run.progress_file, done)
            if bar is not None:
                bar(done, result.loss[-1])
        if run.checkpoints.directory and _due(done, run.checkpoints.every, run):
            _checkpoint(run, me.lay, rank, done, me.module, kit.optimizer, device,
                        result.eval_loss)
        del st  # the step's batch dies with it, not at the next step's end (two batches held)


def _due(done: int, every: int, run: RankRun) -> bool:
    """After every ``every`` steps (0: never), and after the last."""
    return bool(every) and (done % every == 0 or done == run.job.steps)


def _set_up(stages: Sequence[StageLike], loss_fn: LossFn, plan: Plan, run: RankRun, rank: int,
            device: torch.device) -> _Kit:
    """This rank's stage module on its device, its actions, groups, optimizer (the checkpoint's
    state loaded when resuming) and wire, after a first collective."""
    apply_math(run_math(plan.math, run.precision))  # the math the plan was priced in
    if run.job.engine.threads > 0:
        torch.set_num_threads(run.job.engine.threads)
    lay = layout(plan)
    k, replica = lay.place(rank)
    torch.manual_seed(run.job.seed * 1_000_003 + rank)
    module = materialize(stages[k].module, device, plan, run.job.seed).train()
    if run.weights is not None and run.checkpoints.resume_from is None:  # --from-pretrained
        from onnx_partition.runtime.train.pretrained import load_into

        load_into(module, run.weights)
    actions = schedules.build(run.schedule, lay.replicas, run.microbatches)[(k, replica)]
    # Every rank creates every group, in the same order (torch.distributed requires it).
    stage_group = replica_group(lay, list(range(lay.stages)), k)
    tied = tied_groups_here(lay, stages, k)
    params = dict(module.named_parameters())
    chosen = run.job.optimizer
    sharded = plan.stages[k].sharded and stage_group is not None  # ZeRO-1 over the replicas
    optimizer = make_optimizer(run.optimizer, list(params.values()), chosen.lr,
                               weight_decay=chosen.weight_decay, momentum=chosen.momentum,
                               betas=chosen.betas, shard_group=stage_group if sharded else None)
    if run.checkpoints.resume_from is not None:  # a sharded optimizer reads only its share
        _load_checkpoint(run, rank, module, optimizer, device)
    wire = TensorWire(device, lay.name)
    # a collective before the first point-to-point batch (NCCL wants one, on this rank's GPU)
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index or 0])
    else:
        dist.barrier()
    me = RankState(lay, k, stages[k], module, loss_fn, wire, device, run.microbatches,
                   {s.name for s in plan.inputs}, [s.name for s in plan.outputs], Clock(device),
                   run.precision == "bf16", SavedCounter(module), bool(plan.stages[k].recompute),
                   [p for p in params.values() if p.requires_grad])
    return _Kit(me, replica, actions, params, optimizer,
                owned_for_norm(stages, k, replica, params), stage_group, tied)


def _run_actions(kit: _Kit, run: RankRun, batches: Batches, result: RankResult, step: int,
                 began: float) -> StepState:
    """The step's actions, in order: each action's sends leave when it ends (or with the next
    action's receive from their peer), and are all awaited at the end."""
    me, actions = kit.me, kit.actions
    st = StepState(*(batches(step) if me.k == 0 or me.last else ({}, {})))
    if me.last:
        st.weights = microbatch_weights(me.loss_fn, st.targets, run.microbatches)
    kit.optimizer.zero_grad(set_to_none=True)
    spans: list[tuple[str, float, float, float]] = []
    for i, action in enumerate(actions):
        result.actions.append(str(action))
        t0, blocked = time.perf_counter(), me.wire.comm_s
        ACTIONS[action.kind](me, st, action)
        me.wire.flush(first_source(me, actions[i + 1]) if i + 1 < len(actions) else None)
        spans.append((str(action), (t0 - began) * 1000.0,
                      (time.perf_counter() - began) * 1000.0,
                      (me.wire.comm_s - blocked) * 1000.0))
        if action.kind is Kind.F:
            result.peak_inflight = max(result.peak_inflight, len(st.stash))
            if run.hook is not None:
                run.hook(result.rank, "forward")
    result.spans.append(spans)
    return st


def _finish_step(kit: _Kit, run: RankRun, st: StepState, result: RankResult, step: int,
                 began: float) -> None:
    """The step's end: sends awaited, gradients summed (step 1's kept for ``--check``), the
    norm taken and clipped, the learning rate set, the optimizer step; then the step's figures
    (:func:`_record_step`). ``result.tail`` gets where that time went."""
    me, params = kit.me, kit.params
    marks = [time.perf_counter()]
    me.wire.wait()  # before any collective: a peer in it may wait for a queued send
    marks.append(time.perf_counter())
    counter = me.saved
    if counter is not None and counter.active:  # only the first step counts (left out of the
        result.activation_bytes, counter.active = list(counter.per_microbatch), False  # timing)
    sum_gradients(params, kit.tied_names, kit.stage_group, kit.tied)
    if step == 0 and run.check_steps:
        result.grads = host_copies((n, p.grad) for n, p in params.items()
                                   if p.grad is not None)
    marks.append(time.perf_counter())
    chosen = run.job.optimizer
    norm = clip_gradients(params, kit.owned, chosen.clip_grad_norm, me.device)
    marks.append(time.perf_counter())
    lr = chosen.lr * lr_factor(chosen.lr_schedule, step, chosen.warmup_steps, run.job.steps)
    for group in kit.optimizer.param_groups:
        group["lr"] = lr
    kit.optimizer.step()
    marks.append(time.perf_counter())
    result.tail.append({name: (b - a) * 1000.0 for name, a, b in zip(
        ("sends_ms", "grad_sum_ms", "norm_ms", "optimizer_ms"), marks, marks[1:])})
    result.grad_norm.append(norm)
    result.lr.append(lr)
    _record_step(me, st, result, step, began, verbose=run.job.logging.verbose)


def _record_step(me: RankState, st: StepState, result: RankResult, step: int, began: float, *,
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
            echo(step_line(step, result.loss[-1], ms, table[:, :2].tolist(), lay,
                           rows=batch_rows(st.inputs)))


def step_line(step: int, loss: float, ms: float, times: Sequence[Sequence[float]], lay: Layout,
              *, rows: int) -> str:
    """``step 1: loss 2.3026, 812.3 samples/s (19.70 ms); busy ms per stage: 4.1 5.0``
    (busy = forward + backward, the mean over a stage's replicas)."""
    busy = []
    for s in range(lay.stages):
        mine = [sum(times[q]) for q in stage_ranks(lay, s)]
        busy.append(sum(mine) / len(mine))
    rate = rows / ms * 1000.0 if ms > 0 else 0.0
    return (f"step {step + 1}: loss {loss:.4f}, {rate:.1f} samples/s ({ms:.2f} ms); busy ms per "
            f"stage: {' '.join(f'{b:.2f}' for b in busy)}")


def _evaluate(me: RankState, batches: Batches, run: RankRun, result: RankResult,
              step: int) -> None:
    """A forward-only pass over ``run.eval_batches`` validation batches (``me.module``: the
    stage as :func:`~onnx_partition.runtime.train.modules.eval_module` runs it), each rank
    serving its micro-batches in order; rank 0 learns the mean of the batches' losses (each the
    step loss over its B x M rows) and prints it."""
    lay, k = me.lay, me.k
    me.module.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(run.eval_batches):
                st = StepState(*(batches(i) if k == 0 or me.last else ({}, {})))
                if me.last:
                    st.weights = microbatch_weights(me.loss_fn, st.targets, run.microbatches)
                for m in range(me.count):
                    if lay.rank_of(k, m) == result.rank:
                        forward(me, st, Action(k, Kind.F, m))
                st.stash.clear()
                total += float(st.loss_sum)
        me.wire.wait()
    finally:
        me.module.train()
    summed = torch.tensor([total], dtype=torch.float64, device=me.device)
    dist.all_reduce(summed)
    loss = float(summed.cpu()[0]) / run.eval_batches
    if result.rank == 0:
        result.eval_loss.append((step, loss))
        if run.job.logging.verbose:
            echo(f"eval after step {step}: validation loss {loss:.4f}")


def _log_step(run: RankRun, result: RankResult, st: StepState, step: int) -> None:
    """Append the step's JSON object to ``run.job.logging.file`` (rank 0)."""
    if run.job.logging.file is None:
        return
    ms = result.step_ms[-1]
    rows = batch_rows(st.inputs)
    body: dict[str, Any] = {"step": step + 1, "time": round(time.time(), 3),
                            "loss": result.loss[-1], "lr": result.lr[-1],
                            "grad_norm": result.grad_norm[-1],
                            "samples_per_s": rows / ms * 1000.0 if ms > 0 else 0.0}
    tokens = _tokens(st.inputs)
    if tokens:
        body["tokens_per_s"] = tokens / ms * 1000.0 if ms > 0 else 0.0
    if result.eval_loss and result.eval_loss[-1][0] == step + 1:
        body["eval_loss"] = result.eval_loss[-1][1]
    if step + 1 <= run.replayed_through:  # done before a lost rank, trained again
        body["replayed"] = True
    with open(run.job.logging.file, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(body) + "\n")


def _tokens(inputs: Mapping[str, torch.Tensor]) -> int:
    """Tokens in a batch of a model with a sequence axis (an integer input of rank >= 2, rows x
    positions), else 0; read from the shapes, no row."""
    for shape, dtype in batch_shapes(inputs).values():
        if len(shape) >= 2 and not dtype.is_floating_point and dtype != torch.bool:
            return math.prod(shape[:2])
    return 0


def _progress(run: RankRun) -> Callable[[int, float], None] | None:
    """Rank 0's bar (steps done, loss, ETA; on a terminal only)."""
    if not run.job.logging.progress:
        return None
    from onnx_partition.progress import loss_bar

    return loss_bar("train", run.job.steps, start=run.checkpoints.start)


def _load_checkpoint(run: RankRun, rank: int, module: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """This rank's parameters, optimizer state and RNG state from the checkpoint resumed, read
    as data (:mod:`~onnx_partition.runtime.train.checkpoint_state`)."""
    from onnx_partition.runtime.train.checkpoint import legacy_rank_file
    from onnx_partition.runtime.train.checkpoint_state import load_legacy_rank, load_rank_state

    asked = run.checkpoints
    folder = Path(asked.resume_from or ".")
    if asked.legacy:
        load_legacy_rank(legacy_rank_file(folder, rank), module, optimizer, device)
    else:
        load_rank_state(folder, rank, module, optimizer, device, same_plan=asked.same_plan)


def _checkpoint(run: RankRun, lay: Layout, rank: int, step: int, module: torch.nn.Module,
                optimizer: torch.optim.Optimizer, device: torch.device,
                evals: Sequence[tuple[int, float]] = ()) -> None:
    """Write this rank's share of the checkpoint after ``step`` (rank 0 publishes it, with
    every validation loss of the run so far, the resumed segments' included)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from onnx_partition.runtime.train.checkpoint import CHECKPOINT_FORMAT, write_checkpoint
    from onnx_partition.runtime.train.checkpoint_state import save_rank_state

    state: dict[str, Any] | None = None  # a sharded optimizer's: whole on the first replica
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)  # every replica takes part
        state = optimizer.state_dict() if lay.place(rank)[1] == 0 else None
    else:
        state = optimizer.state_dict()

    def save(path: Path) -> None:
        save_rank_state(path, module, optimizer, device, first_replica=lay.place(rank)[1] == 0,
                        state=state)

    manifest = None
    if rank == 0:
        fixed = json.loads(run.checkpoints.manifest or "{}")
        rows = int(fixed.get("rows_per_step", 0))
        manifest = {"format": CHECKPOINT_FORMAT, "step": step, "steps": run.job.steps,
                    "data_position": {"step": step, "rows": step * rows}, **fixed,
                    "eval_loss": [[s, v] for s, v in (*run.checkpoints.evals, *evals)],
                    "lr_schedule": _schedule(run),
                    "ranks": [{"rank": q, "stage": lay.place(q)[0], "replica": lay.place(q)[1],
                               "file": f"rank-{q:05d}.safetensors"}
                              for q in range(lay.world_size)]}
    hook = run.hook
    write_checkpoint(Path(run.checkpoints.directory or "."), step, rank, save, dist.barrier,
                     manifest, None if hook is None else lambda: hook(rank, "checkpoint"))


def _schedule(run: RankRun) -> dict[str, Any]:
    """The LR schedule a checkpoint records (a function of the step: nothing else to keep)."""
    o = run.job.optimizer
    return {"kind": o.lr_schedule, "lr": o.lr, "warmup_steps": o.warmup_steps,
            "steps": run.job.steps}
