"""Start the training ranks: locally through the inference runtime's launcher
(:func:`onnx_partition.runtime.launch.ranks.launch_ranks`: fork server, rendezvous store,
supervision naming the failing stage, replica and rank), or as one rank under ``torchrun``;
both with the launcher's rules (``torchrun_env``, ``rank_result``: rank 0 ending without its
result is a failed run, exit code 1).

What each rank trains comes from a ``build`` callable (module-level, or a
``functools.partial`` of one, so it pickles to the children): ``build()`` returns the stage
list, the loss function, the plan and the batch function (and, optionally, fifth, the
validation batch function). Rank 0 gathers every rank's
:class:`~onnx_partition.runtime.train.rank_io.RankResult` and returns them in rank order.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from onnx_partition.graph.ort import local_device
from onnx_partition.pipeline.layout import layout
from onnx_partition.plan import Plan
from onnx_partition.runtime.infer.worker import choose_backend
from onnx_partition.runtime.launch.ranks import (
    PRELOAD,
    RankFailure,
    TorchrunEnv,
    join_group,
    launch_ranks,
    rank_result,
    torchrun_env,
)
from onnx_partition.runtime.train.rank import train_stages
from onnx_partition.runtime.train.rank_io import Batches, LossFn, RankResult, RankRun, StageLike
from onnx_partition.settings.train import TORCHRUN_TIMEOUT_S

__all__ = ["TRAIN_PRELOAD", "Build", "launch_training", "rank_device", "run_rank", "torchrun_rank"]

Build = Callable[[], tuple[Sequence[StageLike], LossFn, Plan, Batches]
                 | tuple[Sequence[StageLike], LossFn, Plan, Batches, Batches | None]]
# torch.optim imports torch._dynamo on first use: seconds per rank unless preloaded
TRAIN_PRELOAD = [*PRELOAD, "torch._dynamo", "torch.optim", "onnx_partition.runtime.train.rank"]


def rank_device(plan: Plan, rank: int, backend: str) -> torch.device:
    """Where the rank computes: its CUDA device under nccl, else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    lay = layout(plan)
    k, r = lay.place(rank)
    index = int(local_device(lay.devices[k][r]).partition(":")[2] or 0)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def run_rank(rank: int, world: int, build: Build, run: RankRun, backend: str,
             timeout_s: float, store: dist.Store | None) -> list[RankResult] | None:
    """One rank from process-group set-up to the gathered results (rank 0) or None."""
    try:
        built = build()
        stages, loss_fn, plan, batches = built[0], built[1], built[2], built[3]
        evals = built[4] if len(built) == 5 else None
        device = rank_device(plan, rank, backend)
    except Exception as exc:
        raise RankFailure("setup", f"cannot start: {exc}") from exc
    join_group(backend, rank, world, timeout_s, store)
    if run.job.engine.name == "torch":  # a list: one result per stage the rank holds
        from onnx_partition.runtime.train.torch_engine import train_stages_torch

        result: Any = train_stages_torch(stages, loss_fn, plan, batches, run, rank=rank,
                                         device=device, eval_batches=evals)
    else:
        result = train_stages(stages, loss_fn, plan, batches, run, rank=rank,
                              device=device, eval_batches=evals)
    gathered: list[Any] = [None] * world if rank == 0 else []
    # the results (saved states among them) travel over gloo: gather_object over NCCL would
    # copy every pickle to a GPU and back
    group = dist.new_group(backend="gloo") if backend == "nccl" else None
    dist.gather_object(result, gathered if rank == 0 else None, dst=0, group=group)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return [r for got in gathered for r in (got if isinstance(got, list) else [got])]


def _spawned(rank: int, store: dist.Store, world: int, build: Build, run: RankRun,
             backend: str, timeout_s: float) -> bytes | None:
    """Results pickled plainly: a queue would share the tensors' memory through file
    descriptors that die with this process."""
    results = run_rank(rank, world, build, run, backend, timeout_s, store)
    return None if results is None else pickle.dumps(results)


def launch_training(
    plan: Plan,
    build: Build,
    run: RankRun,
    *,
    backend: str | None = None,
    timeout_s: float,
    start_method: str | None = None,
) -> list[RankResult]:
    """Train with one local process per stage replica of ``plan``; every rank's result.
    Raises :class:`~onnx_partition.errors.StageFailed` naming the stage, replica
    and rank that raised or died (the others are killed)."""
    lay = layout(plan)
    chosen = choose_backend(lay, backend, one_machine=True)
    world = lay.world_size
    if run.job.engine.name == "torch":  # interleaved: two stages per rank
        from onnx_partition.runtime.train.torch_engine import world_size

        world = world_size(lay, run.schedule)
    args = [(world, build, run, chosen, timeout_s)] * world
    results = launch_ranks(_spawned, args, lay.name, timeout_s=timeout_s,
                           start_method=start_method, preload=TRAIN_PRELOAD)
    return list(pickle.loads(rank_result(0, results.get(0), "the training ranks")))


def torchrun_rank(build: Build, run: RankRun, *, backend: str | None = None,
                  timeout_s: float = TORCHRUN_TIMEOUT_S, env: TorchrunEnv | None = None
                  ) -> list[RankResult] | None:
    """One rank under ``torchrun`` (``env``, default
    :func:`~onnx_partition.runtime.launch.ranks.torchrun_env`: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT from the environment): rank 0's gathered results, None on the others
    (:func:`~onnx_partition.runtime.launch.ranks.rank_result`)."""
    env = torchrun_env() if env is None else env
    results = run_rank(env.rank, env.world_size, build, run, backend or "gloo", timeout_s,
                       None)
    return rank_result(env.rank, results, "the training ranks")
