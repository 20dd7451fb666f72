"""The torchrun entries: one rank of ``run`` or of ``train`` across processes or machines, one
process per stage replica (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from ``torchrun``)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST --master-port 29500 \\
        -m onnx_partition.runtime.distributed PLAN --iterations 10
    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST \\
        -m onnx_partition.train.runtime PLAN --steps 10 --microbatches 8 --batch-size 4

(those two modules call :func:`infer_main` and :func:`train_main`). Each takes its verb's own
options (:func:`onnx_partition.cli.args.rank_parser`: one declaration, checked as the verb's are),
and ends as the verb does (:func:`onnx_partition.cli.verbs.guarded`: ``error: <one line>``, exit
code 2 for bad input, 1 for a failed rank), so torchrun stops the others. Rank 0 feeds
``run``'s inputs (:func:`onnx_partition.runtime.infer.check.run_feeds`) and prints the figures. The
environment is read by :func:`onnx_partition.runtime.launch.ranks.torchrun_env`. The work is
the runtime's: :func:`onnx_partition.runtime.infer.torchrun_rank.main_worker` and
:func:`onnx_partition.runtime.train.torchrun_rank.train_rank`, imported when a rank runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from onnx_partition import values
from onnx_partition.cli.args import plan_defaults, rank_parser, train_options
from onnx_partition.cli.verbs import EXIT_FAILED, guarded

if TYPE_CHECKING:
    from onnx_partition.runtime.launch.hooks import RankHook

__all__ = ["infer_main", "train_main"]


def infer_main(argv: Sequence[str] | None = None) -> int:
    """``python -m onnx_partition.runtime.distributed PLAN ...``: this rank's exit code."""
    parser = rank_parser("run")
    values.install(parser)  # the numeric options checked as ``run``'s are
    return guarded(lambda: _infer(parser.parse_args(argv)))


def train_main(argv: Sequence[str] | None = None, hook: RankHook | None = None) -> int:
    """``python -m onnx_partition.train.runtime PLAN ...``: this rank's exit code (1 also when
    ``--check`` finds a parameter that differs from single-process training); ``hook``: the
    rank's fault seam (:mod:`onnx_partition.runtime.launch.hooks`, a drill's)."""
    parser = rank_parser("train")
    values.install(parser)  # the numeric options checked as ``train``'s are
    return guarded(lambda: _train(parser.parse_args(argv), hook))


def _infer(args: argparse.Namespace) -> int:
    """Run this rank; rank 0 prints the figures and saves the outputs if asked."""
    import numpy as np

    from onnx_partition.pipeline.predict import run_shape
    from onnx_partition.plan import read_plan
    from onnx_partition.runtime.infer.check import run_feeds
    from onnx_partition.runtime.infer.torchrun_rank import main_worker
    from onnx_partition.runtime.infer.worker import format_stats
    from onnx_partition.runtime.launch.ranks import torchrun_env

    env = torchrun_env()
    plan = read_plan(args.plan)
    shape = run_shape(plan, batch_size=args.batch_size, microbatches=args.microbatches)
    feeds = (run_feeds(plan, args.input, rows=shape.rows, seed=args.seed)
             if env.rank == 0 else None)
    result = main_worker(args.plan, feeds, microbatches=shape.microbatches,
                         iterations=args.iterations, backend=args.backend,
                         timeout_s=args.timeout, threads_per_stage=args.threads_per_stage,
                         device=args.device, env=env)
    if result is not None:
        outputs, stats = result
        print(format_stats(stats))
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            for name, value in outputs.items():
                np.save(args.output_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.npy", value)
    return 0


def _train(args: argparse.Namespace, hook: RankHook | None = None) -> int:
    """Train as this rank; rank 0 prints the summary."""
    from onnx_partition.cli.summary.train import format_train
    from onnx_partition.plan import read_plan
    from onnx_partition.request.train import priced_for, resolve_job, train_job
    from onnx_partition.runtime.train.torchrun_rank import train_rank

    plan = read_plan(args.plan)
    warning = plan_defaults(args, priced_for(plan))
    job, _ = resolve_job(train_job(**train_options(args, rank=True)), plan)
    stats = train_rank(args.plan, job, hook=hook)
    if stats is None:
        return 0
    print(format_train(stats))
    if warning:  # after the figures it explains
        print(warning, file=sys.stderr)
    return EXIT_FAILED if stats.mismatches else 0
