"""One rank of a distributed inference run under ``torchrun``, on one machine or several:
:func:`main_worker`, which the entry :func:`onnx_partition.cli.torchrun.infer_main` calls.

**Several machines** (the plan folder copied to each; devices name local devices)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST --master-port 29500 \\
        -m onnx_partition.runtime.distributed PLAN --iterations 10

``--nproc-per-node`` times ``--nnodes`` must equal the plan's replicas in total (set
``GLOO_SOCKET_IFNAME`` if gloo picks the wrong network interface). A single machine:
``torchrun --nproc-per-node N -m onnx_partition.runtime.distributed PLAN``. The entry takes
``run``'s options; rank 0 feeds ``run``'s inputs, prints the figures and saves the outputs. The
environment is read, the world size and this rank's placement (its plan device on this machine,
``check_placement``) checked before the first operation, and the rank's result judged by the
rules the local launcher shares (:func:`~onnx_partition.runtime.launch.ranks.torchrun_env`,
``check_world_size``, ``rank_result``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.pipeline.layout import layout
from onnx_partition.plan import read_plan
from onnx_partition.runtime.infer.sessions import verify_plan_folder
from onnx_partition.runtime.infer.worker import (
    DistStats,
    RankConfig,
    check_feeds,
    check_hop,
    choose_backend,
    on_device,
    serve_rank,
)
from onnx_partition.runtime.launch.ranks import (
    TorchrunEnv,
    bind_gloo_to_loopback,
    check_placement,
    check_world_size,
    rank_result,
    torchrun_env,
)

__all__ = ["main_worker"]


def main_worker(
    plan_dir: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    microbatches: int | None = None,
    iterations: int = 1,
    backend: str | None = None,
    timeout_s: float = 60.0,
    threads_per_stage: int = 1,
    device: str | None = None,
    env: TorchrunEnv | None = None,
    hop: str = "host",
) -> tuple[dict[str, np.ndarray], DistStats] | None:
    """One rank under ``torchrun`` (``env``, default :func:`torchrun_env`: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT from the environment). Only rank 0 needs ``feeds``; it returns the
    outputs and figures, the others None. ``device="cpu"`` puts every rank on CPU (as
    ``run_distributed``'s), and ``hop`` is its hop too (``device``: tensors stay on the GPU,
    with ``backend="nccl"``). Raises :class:`~onnx_partition.errors.StageFailed` naming this
    rank when it fails.
    """
    env = torchrun_env() if env is None else env
    rank, world = env.rank, env.world_size
    folder = Path(plan_dir)
    plan = read_plan(folder)
    if device not in (None, "cpu"):
        raise PartitionError(f"device {device!r}: only cpu replaces the plan's devices")
    lay = on_device(layout(plan), device)
    if microbatches is None:  # the plan's (predicted.microbatches, else 8)
        microbatches = plan.microbatches
    check_world_size(lay.replicas, world)
    check_placement(env, [d for stage in lay.devices for d in stage], lay.name)
    k, _ = lay.place(rank)
    verify_plan_folder(folder, plan, stages=[k])  # this machine's copy
    chosen = choose_backend(lay, backend, auto_nccl=False)
    check_hop(lay, chosen, hop)
    config = RankConfig(folder, plan, lay, chosen, microbatches, iterations, threads_per_stage,
                        timeout_s, hop=hop)
    if rank == 0:
        if feeds is None:
            raise PartitionError("rank 0 needs the feeds")
        check_feeds(plan, feeds, microbatches)
        feeds = {n: np.asarray(feeds[n]) for n in lay.recv_names[0]}
    bind_gloo_to_loopback(env.master_addr)
    try:
        result = serve_rank(config, rank, feeds if rank == 0 else None, None)
    except Exception as exc:
        raise StageFailed(f"{lay.name(rank)} failed: {one_line(exc)}") from exc
    return rank_result(rank, result, "the inference ranks")
