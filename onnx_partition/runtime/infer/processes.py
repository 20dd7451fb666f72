"""Run a plan folder as a multi-process pipeline over ``torch.distributed``: one rank per replica.

The runtime in three parts, by role:

* :mod:`~onnx_partition.runtime.launch.ranks`: start one local process per rank from a fork server
  and supervise them (shared with the training runtime);
* :mod:`~onnx_partition.runtime.infer.worker`: what one rank does (the plan's rank
  :class:`Layout`, the
  relay of every tensor a later stage needs, the wire, the figures);
* :mod:`~onnx_partition.runtime.infer.torchrun_rank`: one rank under ``torchrun``, on one machine or
  several.

This module holds :func:`run_distributed` (every rank on this machine) and the names callers
import; ``python -m onnx_partition.runtime.distributed PLAN ...`` runs a torchrun rank.

**One machine.** :func:`run_distributed` starts the workers from a fork server that has imported
torch and onnxruntime once (or with ``spawn``); the parent hosts the rendezvous store on
``master_addr`` (loopback by default, and gloo then binds loopback too).

**Faults.** Process-group set-up and every operation time out after ``timeout_s``. Under
:func:`run_distributed` the parent polls its children: a worker that raises reports its message
and exits, one that dies is seen by its exit code; the parent then kills the others and raises
:class:`StageFailed` naming the stage, replica and rank (0.2-0.4 s in the tests, no timeout
involved). A cause (a stage that raised, a rank that died) is named before the communication
errors it provokes in its peers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch.distributed as dist

from onnx_partition.errors import PartitionError, StageFailed
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.plan import Plan, read_plan
from onnx_partition.runtime.infer.sessions import check_devices, verify_plan_folder
from onnx_partition.runtime.infer.torchrun_rank import main_worker
from onnx_partition.runtime.infer.worker import (
    DistStats,
    RankConfig,
    check_feeds,
    check_hop,
    choose_backend,
    format_stats,
    on_device,
    serve_rank,
)
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.launch.ranks import (
    PRELOAD,
    SILENT_S,
    check_world_size,
    launch_ranks,
    rank_result,
)
from onnx_partition.runtime.wire import Env

__all__ = [
    "PRELOAD", "SILENT_S", "DistStats", "Layout", "RankHook", "StageFailed", "choose_backend",
    "format_stats", "launch_ranks", "layout", "main_worker", "run_distributed",
]


def run_distributed(
    plan_dir: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    nproc: int | None = None,
    microbatches: int | None = None,
    iterations: int = 1,
    backend: str | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    timeout_s: float = 60.0,
    threads_per_stage: int = 1,
    start_method: str | None = None,
    output_names: Sequence[str] | None = None,
    device: str | None = None,
    hook: RankHook | None = None,
    hop: str = "host",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[np.ndarray], DistStats]:
    """Run the plan with one local process per stage replica; the outputs (last iteration's,
    a list in the order of ``output_names``, default the plan's outputs, as onnxruntime's
    ``run``) and the figures. ``device="cpu"`` runs every rank on CPU whatever the plan's
    devices (a CUDA plan's numerics on a machine without a GPU).

    ``nproc`` must equal the plan's replicas in total (None: take it from the plan).
    ``master_port`` 0 picks a free port. A worker that raises or dies ends the run with
    :class:`StageFailed` naming its stage, replica and rank. ``start_method``: ``forkserver``
    (the default where available: torch and onnxruntime are imported once, in the fork server,
    which is reused by later runs) or ``spawn`` (every worker imports them itself). Neither
    forks a process that holds threads or a CUDA context. ``hook`` (picklable) is called in
    every rank before each micro-batch's compute (:mod:`onnx_partition.runtime.launch.hooks`).
    ``hop``: ``host`` (numpy through host memory, the default) or ``device`` (torch tensors
    from the wire through onnxruntime's IOBinding, :mod:`~onnx_partition.runtime.infer.hop`;
    on CUDA with ``backend="nccl"``; not yet confirmed on a GPU).
    ``progress`` (picklable, such as :class:`~onnx_partition.runtime.infer.worker.RankBar`) is
    called in rank 0 as ``progress(done, total)`` with the iterations every rank has finished,
    out of ``iterations x processes``.
    """
    folder = Path(plan_dir).resolve()
    plan, lay, chosen = _check_run(folder, nproc, backend, device, hop)
    known = [o.name for o in plan.outputs]
    names = list(output_names) if output_names else known
    if any(n not in known for n in names):
        raise PartitionError(f"unknown output {next(n for n in names if n not in known)!r}; "
                             f"outputs: {known}")
    if microbatches is None:  # the plan's (predicted.microbatches, else 8)
        microbatches = plan.microbatches
    check_feeds(plan, feeds, microbatches)
    if iterations < 1:
        raise PartitionError(f"need at least one iteration, got {iterations}")
    inputs = {n: np.asarray(feeds[n]) for n in lay.recv_names[0]}
    args = [(str(folder), chosen, inputs if rank == 0 else None, microbatches, iterations,
             threads_per_stage, timeout_s, device, hook, hop, progress)
            for rank in range(lay.world_size)]
    began = time.perf_counter()
    results = launch_ranks(_spawned, args, lay.name, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s,
                           start_method=start_method,
                           preload=[*PRELOAD, "onnx_partition.runtime.distributed"])
    outputs, stats = rank_result(0, results.get(0), "the inference ranks")
    stats.launch_ms = (time.perf_counter() - began) * 1000.0
    return [outputs[n] for n in names], stats


def _check_run(plan_dir: Path, nproc: int | None, backend: str | None,
               device: str | None = None, hop: str = "host") -> tuple[Plan, Layout, str]:
    plan = read_plan(plan_dir)
    verify_plan_folder(plan_dir, plan)
    if device not in (None, "cpu"):
        raise PartitionError(f"device {device!r}: only cpu replaces the plan's devices")
    check_devices(plan, ["CPUExecutionProvider"] if device else None)  # before any process
    lay = on_device(layout(plan), device)
    if nproc is not None:
        check_world_size(lay.replicas, nproc)
    chosen = choose_backend(lay, backend, one_machine=True, auto_nccl=False)
    check_hop(lay, chosen, hop)
    return plan, lay, chosen


def _spawned(
    rank: int,
    store: dist.Store,
    plan_dir: str,
    backend: str,
    feeds: dict[str, np.ndarray] | None,
    microbatches: int,
    iterations: int,
    threads: int,
    timeout_s: float,
    device: str | None,
    hook: RankHook | None,
    hop: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Env, DistStats] | None:
    """One rank of :func:`run_distributed` (a :func:`launch_ranks` target)."""
    folder = Path(plan_dir)
    plan = read_plan(folder)
    config = RankConfig(folder, plan, on_device(layout(plan), device), backend, microbatches,
                        iterations, threads, timeout_s, hook, hop, progress)
    return serve_rank(config, rank, feeds, store)
