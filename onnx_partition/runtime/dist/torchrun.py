"""One rank of a distributed inference run under ``torchrun``, on one machine or several.

**Several machines** (the plan folder copied to each; devices name local devices)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST --master-port 29500 \\
        -m onnx_partition.runtime.distributed PLAN --iterations 10

``--nproc-per-node`` times ``--nnodes`` must equal the plan's replicas in total (set
``GLOO_SOCKET_IFNAME`` if gloo picks the wrong network interface). A single machine:
``torchrun --nproc-per-node N -m onnx_partition.runtime.distributed PLAN``. Rank 0 prints the
figures; ``--output-dir`` saves the outputs as ``.npy``. Rank 0's inputs are ``run``'s
(:func:`onnx_partition.runtime.infer.check.run_feeds`), and errors end the rank as ``run``'s do
(:func:`onnx_partition.cli.verbs.guarded`: ``error: <one line>``, exit code 2 for bad input, 1 for a
failed run), so torchrun stops the others.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.pipeline.layout import Layout, layout
from onnx_partition.plan import read_plan
from onnx_partition.runtime.dist.launcher import bind_gloo_to_loopback
from onnx_partition.runtime.infer.rank import (
    DistStats,
    RankConfig,
    check_feeds,
    choose_backend,
    format_stats,
    serve_rank,
)
from onnx_partition.runtime.infer.sessions import verify_plan_folder

__all__ = ["check_world_size", "main_worker"]


def main_worker(
    plan_dir: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    microbatches: int | None = None,
    iterations: int = 1,
    backend: str | None = None,
    timeout_s: float = 60.0,
    threads_per_stage: int = 1,
) -> tuple[dict[str, np.ndarray], DistStats] | None:
    """One rank under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
    environment). Only rank 0 needs ``feeds``; it returns the outputs and figures, the others
    None. Raises :class:`~onnx_partition.errors.StageFailed` naming this rank when it fails.
    """
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise PartitionError("RANK and WORLD_SIZE must be set (run under torchrun)") from None
    folder = Path(plan_dir)
    plan = read_plan(folder)
    lay = layout(plan)
    if microbatches is None:  # the plan's (predicted.microbatches, else 8)
        microbatches = plan.microbatches
    check_world_size(lay, world)
    k, _ = lay.place(rank)
    verify_plan_folder(folder, plan, stages=[k])  # this machine's copy
    config = RankConfig(folder, plan, lay, choose_backend(lay, backend), microbatches,
                        iterations, threads_per_stage, timeout_s)
    if rank == 0:
        if feeds is None:
            raise PartitionError("rank 0 needs the feeds")
        check_feeds(plan, feeds, microbatches)
        feeds = {n: np.asarray(feeds[n]) for n in lay.recv_names[0]}
    bind_gloo_to_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    try:
        return serve_rank(config, rank, feeds if rank == 0 else None, None)
    except Exception as exc:
        raise StageFailed(f"{lay.name(rank)} failed: {one_line(exc)}") from exc


def check_world_size(lay: Layout, processes: int) -> None:
    """One process per stage replica of the plan, or a clear error."""
    if processes != lay.world_size:
        raise PartitionError(f"the plan has {lay.world_size} stage replicas "
                             f"({' + '.join(map(str, lay.replicas))}); got {processes} processes")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m onnx_partition.runtime.distributed",
        description="One rank of a distributed pipeline run (start it with torchrun).")
    parser.add_argument("plan", type=Path)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per micro-batch (default: the plan's)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per iteration (default: the plan's)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per operation")
    parser.add_argument("--output-dir", type=Path, help="rank 0 saves the outputs here as .npy")
    return parser


def _rank(args: argparse.Namespace) -> int:
    """Run this rank; rank 0 prints the figures and saves the outputs if asked."""
    from onnx_partition.runtime.infer.check import run_feeds
    from onnx_partition.pipeline.predict import run_shape

    plan = read_plan(args.plan)
    shape = run_shape(plan, batch_size=args.batch_size, microbatches=args.microbatches)
    feeds = (run_feeds(plan, args.input, rows=shape.rows, seed=args.seed)
             if os.environ.get("RANK") == "0" else None)
    result = main_worker(args.plan, feeds, microbatches=shape.microbatches,
                         iterations=args.iterations, backend=args.backend,
                         timeout_s=args.timeout)
    if result is not None:
        outputs, stats = result
        print(format_stats(stats))
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            for name, value in outputs.items():
                np.save(args.output_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.npy", value)
    return 0


def torchrun_main(argv: Sequence[str] | None = None) -> int:
    """``python -m onnx_partition.runtime.distributed PLAN ...``: this rank's exit code."""
    from onnx_partition import values
    from onnx_partition.cli.verbs import guarded

    parser = _parser()
    values.install(parser)  # the numeric options checked as ``run``'s are
    return guarded(lambda: _rank(parser.parse_args(argv)))
