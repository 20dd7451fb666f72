"""``--engine torch``: the same stage modules on ``torch.distributed.pipelining``, with DDP over
the replicas of each stage (uniform grids only: pipelining maps stage ``i`` to rank ``i`` of one
pipeline group, so every stage needs the same replica count ``R``).

What had to be adapted to the pipelining API:

* **Named tensors and relays.** A ``PipelineStage`` passes one positional tuple from stage
  ``k-1`` to stage ``k``. :class:`Relay` wraps stage ``k``'s module: it takes the tensors of
  our layout's hop into stage ``k`` (``recv_names[k]``, sorted names, model inputs at stage 0)
  as that tuple, runs the module, and returns ``send_names[k]``, so a skip tensor or a late
  model input rides through the stages in between exactly as in our engine.
* **Loss and targets.** The schedule's ``loss_fn(output, target)`` sees the last stage's tuple
  and one target tensor per micro-batch: the task must have one target (a plan whose task has
  several is refused when it starts). Pipelining divides gradients by its micro-batch count.
* **Replicas.** Pipeline ``j`` is ranks ``first[k] + j``; it runs the micro-batches
  ``m % R == j`` (our routing) as its own schedule of ``M / R`` micro-batches, and DDP averages
  over the ``R`` pipelines: the gradient of the mean over all ``M`` micro-batches, as ours.
* **Tied parameters** are summed after the schedule, over the stages of the same pipeline
  holding them (DDP has already averaged each over its replicas).

Times: the forward time per stage is measured around the module; pipelining gives no hook
for its backward, so a rank's backward time is its step minus forwards and the optimizer,
i.e. backward plus waiting: an upper bound.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from onnx_partition.plan import Plan
from onnx_partition.runtime.distributed import _Failure, layout
from onnx_partition.train.comm import Tensors
from onnx_partition.train.rank import (
    Batches,
    LossFn,
    RankResult,
    StageLike,
    TrainConfig,
    make_optimizer,
    microbatch,
)


def torch_engine_refusal(plan: Plan) -> str | None:
    """Why the plan cannot run on torch's pipelining engine, or None."""
    counts = sorted({max(1, s.replicas) for s in plan.stages})
    if len(counts) > 1:
        return (f"torch.distributed.pipelining maps stage i to rank i of one group, so every "
                f"stage needs the same replica count; this plan has {counts} (use --engine ours)")
    return None


class Relay(nn.Module):
    """Stage ``module`` taking and returning our layout's hop tensors as positional tuples."""

    def __init__(self, module: nn.Module, inputs: Sequence[str], outputs: Sequence[str],
                 recv: Sequence[str], send: Sequence[str]) -> None:
        super().__init__()
        self.module = module
        self.inputs, self.outputs = list(inputs), list(outputs)
        self.recv, self.send = list(recv), list(send)
        self.forward_s = 0.0

    def forward(self, *values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        began = time.perf_counter()
        env = dict(zip(self.recv, values, strict=True))
        outs = self.module(*[env[n] for n in self.inputs])
        env.update(zip(self.outputs, (outs,) if isinstance(outs, torch.Tensor) else outs,
                       strict=True))
        self.forward_s += time.perf_counter() - began
        return tuple(env[n] for n in self.send)


def train_stages_torch(
    stages: Sequence[StageLike],
    loss_fn: LossFn,
    plan: Plan,
    batches: Batches,
    config: TrainConfig,
    *,
    rank: int,
    device: torch.device | None = None,
) -> RankResult:
    """:func:`onnx_partition.train.rank.train_stages`, on torch's pipelining engine."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    device = device or torch.device("cpu")
    lay = layout(plan)
    k, j = lay.place(rank)
    reps, count = lay.replicas[0], config.microbatches
    if count % reps:
        raise _Failure("setup", f"--engine torch needs micro-batches in multiples of the "
                                f"replica count {reps}, got {count}")
    last = k == lay.stages - 1
    stage = stages[k]
    # Every rank creates every group in the same order.
    pipes = [dist.new_group([lay.first[s] + q for s in range(lay.stages)]) for q in range(reps)]
    dps = [dist.new_group([lay.first[s] + q for q in range(reps)]) for s in range(lay.stages)]
    tied_sets = sorted({tuple(sorted(v)) for st in stages for v in st.tied.values()})
    mine: list[tuple[Any, list[str]]] = []
    for stage_set in tied_sets:
        for q in range(reps):
            group = dist.new_group([lay.first[s] + q for s in stage_set])
            if k in stage_set and q == j:
                mine.append((group, sorted(n for n, v in stage.tied.items()
                                           if tuple(sorted(v)) == stage_set)))
    relay = Relay(stage.module.to(device).train(), stage.inputs, stage.outputs,
                  lay.recv_names[k], lay.send_names[k])
    module: nn.Module = relay
    if reps > 1:
        module = DistributedDataParallel(relay, process_group=dps[k])
    params = dict(relay.module.named_parameters())
    optimizer = make_optimizer(config.optimizer, list(params.values()), config.lr)
    example_in, example_out = _examples(stages, lay, batches, count, k,
                                        {s.name for s in plan.inputs})
    pipe_stage = PipelineStage(module, k, lay.stages, device, input_args=example_in,
                               output_args=example_out, group=pipes[j])
    outputs = lay.send_names[-1]
    target_name: list[str] = []

    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        got = (output,) if isinstance(output, torch.Tensor) else tuple(output)
        return loss_fn(dict(zip(outputs, got, strict=True)), {target_name[0]: target})

    kind = Schedule1F1B if config.schedule == "1f1b" else ScheduleGPipe
    schedule = kind(pipe_stage, n_microbatches=count // reps, loss_fn=loss if last else None)
    result = RankResult(rank, k, j, [], 0, [], [], [], [])
    for step in range(config.steps):
        began = time.perf_counter()
        relay.forward_s = 0.0
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        try:
            if k == 0 or last:
                inputs, targets = batches(step)
                ours = [m for m in range(count) if m % reps == j]
            if k == 0:
                local = [microbatch({n: inputs[n] for n in lay.recv_names[0]}, m, count)
                         for m in ours]
                args = [torch.cat([mb[n] for mb in local]).to(device) for n in lay.recv_names[0]]
            if last:
                if len(targets) != 1:
                    raise _Failure("setup", f"--engine torch takes one target tensor; the task "
                                            f"has {sorted(targets)}")
                target_name[:] = list(targets)
                target = torch.cat([microbatch(targets, m, count)[target_name[0]]
                                    for m in ours]).to(device)
            if k == 0 and last:
                schedule.step(*args, target=target, losses=losses)
            elif k == 0:
                schedule.step(*args)
            elif last:
                schedule.step(target=target, losses=losses)
            else:
                schedule.step()
        except _Failure:
            raise
        except Exception as exc:
            raise _Failure("compute", f"step {step + 1}: {exc}") from exc
        for group, names in mine:
            flat = torch.cat([_grad(params[n]).reshape(-1) for n in names])
            dist.all_reduce(flat, group=group)
            for n, piece in zip(names, flat.split([params[n].numel() for n in names])):
                params[n].grad = piece.view_as(params[n]).clone()
        t_opt = time.perf_counter()
        optimizer.step()
        opt_s = time.perf_counter() - t_opt
        row = torch.zeros(lay.world_size, 3, dtype=torch.float64)
        step_s = time.perf_counter() - began
        loss_sum = sum(float(v.detach()) for v in losses) / count  # this pipeline's share
        row[rank] = torch.tensor([relay.forward_s * 1000.0,
                                  (step_s - relay.forward_s - opt_s) * 1000.0, loss_sum],
                                 dtype=torch.float64)
        wired = row.to(device)
        dist.all_reduce(wired)
        table = wired.cpu()
        result.step_ms.append((time.perf_counter() - began) * 1000.0)
        result.forward_ms.append(float(row[rank, 0]))
        result.backward_ms.append(float(row[rank, 1]))
        if rank == 0:
            result.loss.append(float(table[:, 2].sum()))
            result.table.append([float(v) for v in table[:, :2].reshape(-1)])
            if config.verbose:
                print(f"step {step + 1}: loss {result.loss[-1]:.4f}, "
                      f"{_rows(inputs) / result.step_ms[-1] * 1000.0:.1f} samples/s "
                      f"({result.step_ms[-1]:.2f} ms)", flush=True)
        if step + 1 in config.check_steps:
            result.states[step + 1] = {n: p.detach().cpu().clone() for n, p in params.items()}
    if config.keep_state and j == 0:
        result.state = {n: v.detach().cpu().clone() for n, v in relay.module.state_dict().items()}
    return result


def _examples(stages: Sequence[StageLike], lay: Any, batches: Batches, count: int, k: int,
              model_inputs: set[str]) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Stage ``k``'s input and output tuples on micro-batch 0, by chaining the stages before
    it here (static metadata: pipelining's run-time inference hung on gloo). ``requires_grad``
    tells pipelining which gradients cross: the floating tensors a stage made, as ours."""
    inputs, _ = batches(0)
    env = dict(microbatch(inputs, 0, count))
    for s in range(k + 1):
        env = {n: t.detach().requires_grad_(t.is_floating_point() and s > 0)
               for n, t in env.items()}
        relay = Relay(stages[s].module, stages[s].inputs, stages[s].outputs,
                      lay.recv_names[s], lay.send_names[s])
        got = relay(*[env[n] for n in lay.recv_names[s]])
        if s < k:
            env = dict(zip(lay.send_names[s], got))
    for stage in stages:
        stage.module.zero_grad(set_to_none=True)
    outs = tuple(t.detach().requires_grad_(t.requires_grad) for t in got)
    return tuple(env[n].detach().requires_grad_(env[n].requires_grad)
                 for n in lay.recv_names[k]), outs


def _rows(inputs: Tensors) -> int:
    return next(iter(inputs.values())).shape[0] if inputs else 0


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
