"""One rank of a training run started by ``torchrun`` (the plan folder on each machine), through
the entry :func:`onnx_partition.cli.torchrun.train_main`::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST \\
        -m onnx_partition.train.runtime PLAN --steps 10 --microbatches 8 --batch-size 4

The request is checked as a local run's is (:func:`onnx_partition.runtime.train.trainer.run_job`)
in every rank; rank 0 returns the figures (and ``--check``'s comparison)."""

from __future__ import annotations

import functools
import os
from dataclasses import replace
from pathlib import Path

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.pipeline.layout import layout
from onnx_partition.runtime.infer.worker import choose_backend
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.launch.ranks import check_placement, torchrun_env
from onnx_partition.runtime.train.data_plan import plan_job, prepare_data
from onnx_partition.runtime.train.preflight import check_request
from onnx_partition.runtime.train.reference_check import compare_with_reference
from onnx_partition.runtime.train.restart import torchrun_resume
from onnx_partition.runtime.train.results import TrainStats, summarize
from onnx_partition.runtime.train.spawn import torchrun_rank
from onnx_partition.runtime.train.trainer import rank_run
from onnx_partition.settings.train import TORCHRUN_TIMEOUT_S, TrainJob

__all__ = ["train_rank"]


def train_rank(plan_dir: str | os.PathLike[str], job: TrainJob, *,
               hook: RankHook | None = None) -> TrainStats | None:
    """This process's rank of a training run started by ``torchrun`` (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT from the environment, read by
    :func:`~onnx_partition.runtime.launch.ranks.torchrun_env`), our engine training as ``job``
    (resolved: :func:`~onnx_partition.request.train.resolve_job`) asks: every rank checks the
    request and the data (a :class:`PartitionError`); rank 0 returns the figures (and
    ``--check``'s comparison), the other ranks None. Raises :class:`StageFailed` naming this
    rank's stage and replica when it fails. A worker that torchrun's ``--max-restarts``
    restarted resumes from ``--checkpoint-dir``'s newest complete checkpoint
    (:func:`~onnx_partition.runtime.train.restart.torchrun_resume`). ``hook``: the rank's
    fault seam (:mod:`~onnx_partition.runtime.launch.hooks`)."""
    env = torchrun_env()
    job = torchrun_resume(job)  # a worker torchrun restarted: from the newest checkpoint
    folder = Path(plan_dir).resolve()
    plan = check_request(folder, job, nproc=env.world_size)
    lay = layout(plan)
    check_placement(env, [d for stage in lay.devices for d in stage], lay.name)
    per_step = (job.schedule.batch_size or 0) * (job.schedule.microbatches or 0)
    spec = prepare_data(plan, job.data, per_step=per_step, steps=job.steps, seed=job.seed,
                        folder=folder)
    run = replace(rank_run(folder, plan, job, keep_state=False, hook=hook),
                  eval_batches=spec.eval_steps)
    build = functools.partial(plan_job, str(folder), per_step, job.seed, job.check, spec,
                              job.data.eval_every > 0)
    timeout_s = TORCHRUN_TIMEOUT_S if job.engine.timeout_s is None else job.engine.timeout_s
    try:
        ranks = torchrun_rank(build, run, backend=choose_backend(lay, job.engine.backend),
                              timeout_s=timeout_s, env=env)
    except PartitionError:
        raise
    except Exception as exc:  # this rank's failure: name it (the entry exits 1)
        raise StageFailed(f"{lay.name(env.rank)} failed: {one_line(exc)}") from exc
    if ranks is None:
        return None
    stats = summarize(plan, ranks, run, per_step, "ours")
    stats.data, stats.loss_kind = spec.described, spec.kind or ""
    if run.check_steps:
        stats.mismatches = compare_with_reference(folder, ranks, run, per_step, spec)
        stats.checked_steps = run.check_steps
    return stats
