"""``profile --plan`` of a train plan: each stage module's forward and backward, alone and all
stages side by side in processes (one per stage, with the torch threads each training rank
uses), as :mod:`onnx_partition.calibrate.recut` does for inference stage files.

Each stage's inputs come from one pass of random model inputs through the stage modules
(:func:`onnx_partition.runtime.train.modules.stage_modules`); inputs made by an earlier stage
need gradients, as in the pipeline. A step is the stage's forward, then its backward from a
gradient of ones on every output that needs one (the loss stage's included; a ZB-H1 plan's as
the engine's input-gradient pass, then its weight pass), gradients of its weights cleared
after. Alone: in this process, one stage after another. Side by side: one
spawned process per stage (a rank's own process: its own torch thread pool), all released at
once by a barrier, each stepping until every one has made ``warmup + repeats`` steps; medians
of each process's steps after its warmup, the last left out.

In the engine (:func:`measure_train_run`): the plan itself trained by ``train``'s engine
(:func:`~onnx_partition.runtime.train.trainer.train_plan`: synthetic batches, the schedule,
optimizer and micro-batches plan.json records, one process per stage replica, one torch thread
each) for a few steps, the first two left out (the memory tracker's), read by
:func:`~onnx_partition.runtime.train.overheads.run_costs`: each stage's compute per micro-batch
there, its work per action, its tail (optimizer step, gradient sums, sends awaited) and the
barriers, and the measured step.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from statistics import median
from typing import TYPE_CHECKING, Any

from onnx_partition.errors import PartitionError

if TYPE_CHECKING:
    from onnx_partition.runtime.train.overheads import RunCosts

__all__ = ["RUN_STEPS", "TrainTimes", "measure_train_engine", "measure_train_plan",
           "measure_train_run"]

#: Steps of the engine run (:func:`measure_train_run`), the first two left out: 6 timed steps, as
#: the mean of 3 moved by up to 17% between two runs of one plan minutes apart on the 2-core VM
#: (hf-gpt2: 71.0 against 58.9 ms, docs/benchmarks.md); a step of a small model is tens of ms.
RUN_STEPS = 8

TrainTimes = dict[str, list[float]]  # alone/together forward_ms and backward_ms per stage


def _device(plan: Any, k: int) -> str:
    devices = plan.stages[k].devices or ["cpu"]
    return str(devices[0])


def _stage_inputs(folder: str, plan: Any, env: dict[str, Any] | None = None
                  ) -> list[list[Any]]:
    """Each stage's inputs from one pass of random model inputs (``env``, where given,
    collects every tensor of the pass by name)."""
    import torch

    from onnx_partition.runtime.infer.check import random_feeds
    from onnx_partition.runtime.train.modules import stage_modules

    env = {} if env is None else env
    env.update({k: torch.from_numpy(v) for k, v in
                random_feeds(plan, batch_size=plan.rows_per_microbatch).items()})
    inputs = []
    with torch.no_grad():
        for stage in stage_modules(folder):
            inputs.append([env[name] for name in stage.inputs])
            env.update(zip(stage.outputs, stage.module(*inputs[-1]), strict=True))
    return inputs


def measure_train_engine(folder: str | os.PathLike[str], *, threads: int = 1,
                         repeats: int = 10) -> dict[str, Any]:
    """The engine's own work for the train plan in ``folder``, measured
    (:mod:`onnx_partition.cost.engine_price`): per stage the plan's optimizer stepping the stage
    module's parameters, plus the step's barriers between two processes, plus, where the stage
    holds parameters tied to another stage's, one hop of their bytes for their all-reduce
    (``step_ms``); its
    gradients' in-place accumulation (``accumulate_ms``); per
    boundary a header and the hop's bytes (what stage k sends on, at the plan's micro-batch)
    there and back between two processes over gloo, one way (``send_ms``)."""
    import torch

    from onnx_partition.cost.engine_price import BARRIERS_PER_STEP
    from onnx_partition.cost.profile.engine import measure_hops, time_accumulate, time_optimizer
    from onnx_partition.pipeline.layout import layout
    from onnx_partition.runtime.train.modules import require_trainable, stage_modules

    folder = os.fspath(folder)
    plan = require_trainable(folder)
    optimizer = plan.optimizer or "adamw"
    optimizer = optimizer if optimizer in ("sgd", "adamw") else "adamw"
    env: dict[str, Any] = {}
    _stage_inputs(folder, plan, env)
    sends = layout(plan).send_names[:-1]
    hop_bytes = [int(sum(env[n].numel() * env[n].element_size() for n in names if n in env))
                 for names in sends]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    modules = stage_modules(folder)
    params = [dict(s.module.named_parameters()) for s in modules]
    # parameters tied across stages (GPT-2's embedding and head): all-reduced every step
    tied_bytes = [int(sum(ps[n].numel() * ps[n].element_size() for n in s.tied if n in ps))
                  for s, ps in zip(modules, params, strict=True)]
    try:
        trained = [[p for p in ps.values() if p.requires_grad] for ps in params]
        steps = [time_optimizer(params, optimizer, repeats=repeats) for params in trained]
        accumulate = [time_accumulate(params, repeats=repeats) for params in trained]
    finally:
        torch.set_num_threads(before)
    tied = sorted({b for b in tied_bytes if b})
    one_way, barrier = measure_hops([*(hop_bytes or [4096]), *tied], repeats=repeats,
                                    threads=threads)
    tied_ms = dict(zip(tied, one_way[len(hop_bytes or [4096]):], strict=True))
    return {"optimizer": optimizer, "optimizer_ms": steps, "barrier_ms": barrier,
            "tied_ms": [tied_ms.get(b, 0.0) for b in tied_bytes],
            "step_ms": [t + BARRIERS_PER_STEP * barrier + tied_ms.get(b, 0.0)
                        for t, b in zip(steps, tied_bytes, strict=True)],
            "accumulate_ms": accumulate,
            "hop_bytes": hop_bytes, "send_ms": one_way[:len(hop_bytes)]}


def measure_train_run(folder: str | os.PathLike[str], *, steps: int = RUN_STEPS,
                      timeout_s: float = 300.0
                      ) -> tuple[RunCosts, str, int, tuple[list[int | None], list[int | None]]]:
    """The train plan in ``folder`` run in the engine for ``steps`` steps (module docstring):
    (its :class:`~onnx_partition.runtime.train.overheads.RunCosts`, the schedule, the
    micro-batches per step, and per stage the bytes saved per micro-batch and the peak of live
    tensor storages measured there)."""
    from onnx_partition.runtime.train.overheads import run_costs
    from onnx_partition.runtime.train.trainer import train_plan

    if steps < 2:
        raise PartitionError(f"the engine run needs at least 2 steps (the first is left out), "
                             f"got {steps}")
    stats = train_plan(folder, steps=steps, timeout_s=timeout_s)
    run = run_costs(stats.ranks, stats.microbatches, split=stats.schedule == "zb-h1")
    return run, stats.schedule, stats.microbatches, (list(stats.activation_bytes),
                                                     list(stats.memory_bytes))


def _stepper(module: Any, inputs: Sequence[Any], device: str, split: bool = False) -> Any:
    """A callable making one step; returns (forward ms, backward ms, input-gradient ms). With
    ``split`` (a ZB-H1 plan) the backward runs as the engine's two passes, the input gradient
    then the weights' (:mod:`onnx_partition.runtime.train.passes`), as its ``I`` and ``W``; else
    in one (the input-gradient ms 0)."""
    import torch
    from torch.utils._pytree import tree_flatten

    from onnx_partition.runtime.train import passes

    target = torch.device(device)
    module.to(target)
    module.train()
    sync = (lambda: torch.cuda.synchronize(target)) if target.type == "cuda" else (lambda: None)

    def leaves() -> list[Any]:
        out = []
        for value in inputs:
            if isinstance(value, torch.Tensor):
                value = value.detach().to(target)
                if value.is_floating_point():
                    value.requires_grad_(True)
            out.append(value)
        return out

    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> tuple[float, float, float]:
        args = leaves()
        sync()
        began = time.perf_counter()
        outputs = module(*args)
        sync()
        middle = time.perf_counter()
        flat = [t for t in tree_flatten(outputs)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
        seeds = [torch.ones_like(t) for t in flat]
        between = middle
        if flat and split:
            grads_of = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            _, later = passes.input_pass(flat, seeds, grads_of, params)
            sync()
            between = time.perf_counter()
            passes.weight_pass(later)
        elif flat:
            torch.autograd.backward(flat, seeds)
        sync()
        ended = time.perf_counter()
        for p in module.parameters():
            p.grad = None
        return (middle - began) * 1e3, (ended - middle) * 1e3, (between - middle) * 1e3

    return step


def _worker(folder: str, k: int, inputs: list[Any], device: str, threads: int, want: int,
            barrier: Any, counts: Any, stop: Any, results: Any, split: bool = False) -> None:
    try:
        import torch

        from onnx_partition.runtime.train.modules import stage_modules

        torch.set_num_threads(threads)
        step = _stepper(stage_modules(folder, only=[k])[0].module, inputs, device, split)
        step()  # built and touched before the clock starts
        barrier.wait()
        times = []
        while not stop.is_set():
            times.append(step())
            with counts.get_lock():
                counts[k] += 1
                if all(c >= want for c in counts):
                    stop.set()
        results.put((k, times, None))
    except BaseException as exc:  # reported by the parent
        stop.set()
        barrier.abort()
        results.put((k, [], f"{type(exc).__name__}: {exc}"))


def _medians(times: Sequence[tuple[float, ...]], warmup: int) -> tuple[float, ...]:
    kept = list(times[warmup:-1]) if len(times) > warmup + 1 else list(times[-1:])
    return tuple(median(t[i] for t in kept) for i in range(len(kept[0])))


def measure_train_plan(folder: str | os.PathLike[str], *, threads: int = 1, repeats: int = 10,
                       warmup: int = 2, timeout_s: float = 600.0) -> TrainTimes:
    """Forward and backward ms of each stage of the train plan in ``folder``, alone and side by
    side (module docstring): ``{"alone_forward_ms": [...], "alone_backward_ms": [...],
    "forward_ms": [...], "backward_ms": [...]}``, the last two side by side; a ZB-H1 plan's
    backward runs as the engine's input and weight passes, and ``backward_input_ms`` (side by
    side) is the first's."""
    import torch

    from onnx_partition.runtime.train.modules import require_trainable, stage_modules

    folder = os.fspath(folder)
    plan = require_trainable(folder)
    inputs = _stage_inputs(folder, plan)
    count = len(plan.stages)
    split = plan.schedule == "zb-h1"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    alone = []
    try:
        for k, stage in enumerate(stage_modules(folder)):
            step = _stepper(stage.module, inputs[k], _device(plan, k), split)
            alone.append(_medians([step() for _ in range(warmup + repeats + 1)], warmup))
    finally:
        torch.set_num_threads(before)
    if count == 1:
        together = alone
    else:
        ctx = mp.get_context("spawn")
        barrier, stop = ctx.Barrier(count), ctx.Event()
        counts = ctx.Array("i", count)
        results = ctx.Queue()
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(folder, k, inputs[k], _device(plan, k), threads,
                                   warmup + repeats, barrier, counts, stop, results, split))
                 for k in range(count)]
        for p in procs:
            p.start()
        got: dict[int, list[tuple[float, ...]]] = {}
        try:
            for _ in range(count):
                k, times, error = results.get(timeout=timeout_s)
                if error is not None:
                    raise PartitionError(f"stage {k} failed while timed: {error}")
                got[k] = times
        finally:
            stop.set()
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
        together = [_medians(got[k], warmup) for k in range(count)]
    return {"alone_forward_ms": [a[0] for a in alone], "alone_backward_ms": [a[1] for a in alone],
            "forward_ms": [t[0] for t in together], "backward_ms": [t[1] for t in together],
            **({"backward_input_ms": [t[2] for t in together]} if split else {})}
