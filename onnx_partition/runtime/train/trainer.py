"""Train a plan folder with one local process per stage replica: :func:`train_plan` (the Python
API, whose keywords are ``train``'s options) and :func:`run_job` (a resolved
:class:`~onnx_partition.settings.train.TrainJob`: what ``train`` runs).

The request is checked before any process starts (:mod:`onnx_partition.runtime.train.preflight`:
a plan that cannot be trained, an altered stage file or program, a process count that is not the
plan's replicas; bad ``--data`` too, :func:`~onnx_partition.runtime.train.data_plan.prepare_data`;
the checkpoints, :func:`~onnx_partition.runtime.train.checkpoint.resume_request`), every rank
builds its stage module (:func:`~onnx_partition.runtime.train.data_plan.plan_job`) and runs
:func:`onnx_partition.runtime.train.rank.train_stages`, and the run returns
:class:`~onnx_partition.runtime.train.results.TrainStats`: loss and time per step, per-stage
forward and backward times measured, and the simulator's iteration time for the same plan and
schedule, both from the plan's predicted costs and from the measured stage times.

``--check`` compares every rank's parameters after step 1 (and 3) with the whole program
trained in one process on the same batches
(:func:`~onnx_partition.runtime.train.reference_check.compare_with_reference`). ``--save``
writes replica 0 of every stage back as a servable plan folder (``save_trained``);
``--from-pretrained`` and ``--save-pretrained``: :mod:`onnx_partition.runtime.train.pretrained`.

Several machines (the plan folder on each): one rank under ``torchrun`` is
:func:`onnx_partition.runtime.train.torchrun_rank.train_rank`.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from onnx_partition.pipeline import schedules
from onnx_partition.plan import Plan, read_plan
from onnx_partition.progress import echo
from onnx_partition.request.train import (
    API_SPELLING,
    keyword_defaults,
    resolve_job,
    train_job,
    warn_planned,
)
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.train.checkpoint import optimizer_record, resume_request
from onnx_partition.runtime.train.data_plan import DataPlan, plan_job, prepare_data
from onnx_partition.runtime.train.paths import check_log_path
from onnx_partition.runtime.train.preflight import check_options, check_request, check_save
from onnx_partition.runtime.train.pretrained import (
    check_save_pretrained,
    hf_config_of,
    resolve_pretrained,
    save_pretrained,
)
from onnx_partition.runtime.train.rank_io import RankResult, RankRun
from onnx_partition.runtime.train.record import check_record, write_record
from onnx_partition.runtime.train.reference_check import compare_with_reference
from onnx_partition.runtime.train.restart import Restart, run_restarting
from onnx_partition.runtime.train.results import TrainStats, summarize
from onnx_partition.runtime.train.spawn import launch_training
from onnx_partition.settings.train import LOCAL_TIMEOUT_S, DataSettings, TrainJob

__all__ = ["CHECK_STEPS", "rank_run", "run_job", "train_plan"]

#: The steps whose parameters ``--check`` compares.
CHECK_STEPS = (1, 3)


def train_plan(plan_dir: str | os.PathLike[str], *, hook: RankHook | None = None,
               **keywords: Any) -> TrainStats:
    """Train the plan in ``plan_dir`` with one local process per stage replica; ``keywords``
    are ``train``'s options by their ``dest`` (:data:`onnx_partition.request.train.KEYWORDS`,
    each default in :mod:`onnx_partition.settings.train`; a :class:`TypeError` for any other).

    ``batch_size`` is rows per micro-batch (default: :attr:`Plan.rows_per_microbatch`); a
    step takes ``microbatches`` of them (default: :attr:`Plan.microbatches`, the plan's own
    count). ``check``: dropout off, and the parameters after step 1 (and 3) compared with
    single-process training (:attr:`TrainStats.mismatches`). ``save``: a new plan folder with
    the trained weights. ``data``: a ``.npz`` or a folder of ``.npy``, a mapping of arrays, or a
    factory called in each rank that reads data returning an iterable of whole-step batches
    (every such rank must yield the same batches; :mod:`onnx_partition.runtime.train.data`);
    None: synthetic batches from ``seed``. ``shuffle``: permute the rows once per epoch from
    this seed. ``loss``: one of ``auto``, ``cross_entropy``, ``mse``, ``output``, or
    ``loss_fn(outputs, targets) -> scalar`` (a mean over the rows given, picklable;
    :mod:`onnx_partition.runtime.train.loss`). ``seed`` also seeds dropout. ``schedule``,
    ``optimizer`` and ``precision`` default (None) to what the plan was priced for
    (plan.json), else sgd, fp32, 1F1B, as ``train`` does
    (:func:`~onnx_partition.request.train.planned_choices`); one that differs from the plan's
    is warned about (:class:`~onnx_partition.request.train.PlannedChoiceWarning`: its
    predicted time and memory do not hold). Optimisation (``weight_decay`` ... ``precision``),
    checkpoints (``checkpoint_dir`` every ``checkpoint_every`` steps; ``resume`` from a
    checkpoint folder's latest complete checkpoint up to ``steps`` in all, writing on there),
    evaluation (``eval_every`` on ``eval_data``, else synthetic batches of another seed) and
    the per-step JSON ``log`` are the command line's options, as are ``from_pretrained``,
    ``save_pretrained``, ``save_dtype`` and ``hf_config``
    (:mod:`~onnx_partition.runtime.train.pretrained`); ``hook`` the ranks' fault seam.
    Raises PartitionError for a bad request (before any process starts) and
    :class:`StageFailed` naming the stage, replica and rank that raised or died.
    """
    job = train_job(**keywords)
    folder = Path(plan_dir).resolve()
    plan = read_plan(folder) if (folder / "plan.json").is_file() else None
    job, warning = resolve_job(job, plan, spelled=API_SPELLING)
    warn_planned(warning, stacklevel=3)
    return run_job(folder, job, hook=hook)


def _signature() -> inspect.Signature:
    """``train_plan``'s signature as the job declares it: ``plan_dir``, then every keyword
    with its default (``help(train_plan)`` and ``inspect.signature`` show them)."""
    params = [inspect.Parameter("plan_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation="str | os.PathLike[str]")]
    params += [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default)
               for key, default in keyword_defaults().items()]
    params.append(inspect.Parameter("hook", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation="RankHook | None"))
    return inspect.Signature(params, return_annotation="TrainStats")


train_plan.__signature__ = _signature()  # type: ignore[attr-defined]


def run_job(plan_dir: str | os.PathLike[str], job: TrainJob, *,
            hook: RankHook | None = None) -> TrainStats:
    """Train the plan in ``plan_dir`` as ``job`` asks (resolved against the plan:
    :func:`~onnx_partition.request.train.resolve_job`), one local process per stage replica
    (as :func:`train_plan`, which resolves the job of its keywords and runs it here)."""
    folder = Path(plan_dir).resolve()
    plan = check_request(folder, job, nproc=job.engine.nproc)
    if job.save is not None:
        check_save(folder, Path(job.save), plan)
    if job.record is not None:
        check_record(Path(job.record))
    per_step = (job.schedule.batch_size or 0) * (job.schedule.microbatches or 0)
    spec = prepare_data(plan, job.data, per_step=per_step, steps=job.steps, seed=job.seed,
                        folder=folder)
    out = job.pretrained
    check_save_pretrained(out)
    keep = job.save is not None or out.save is not None
    timeout_s = LOCAL_TIMEOUT_S if job.engine.timeout_s is None else job.engine.timeout_s

    def launch(current: TrainJob, progress: str | None, replayed: int
               ) -> tuple[RankRun, list[RankResult]]:
        run = rank_run(folder, plan, current, keep_state=keep, hook=hook)
        run = replace(run, eval_batches=spec.eval_steps, progress_file=progress,
                      replayed_through=replayed)
        build = functools.partial(plan_job, str(folder), per_step, job.seed, job.check, spec,
                                  job.data.eval_every > 0)
        return run, launch_training(plan, build, run, backend=job.engine.backend,
                                    timeout_s=timeout_s)

    first = rank_run(folder, plan, job, keep_state=keep, hook=hook)
    if job.engine.name == "torch":  # torch.distributed.pipelining: uniform plans, our loss
        from onnx_partition.runtime.train.torch_engine import check_torch_engine

        check_torch_engine(plan, first)
    if job.logging.verbose:
        print(_data_line(spec, job.data), flush=True)
    restarts: list[Restart] = []
    if job.checkpoint.max_restarts:
        (run, ranks), restarts = run_restarting(launch, job, echo)
    else:
        run, ranks = launch(job, None, 0)
    stats = _figures(folder, plan, ranks, run, spec, per_step)
    stats.restarts = [r.to_json() for r in restarts]
    if job.record is not None:
        write_record(Path(job.record), stats, job.schedule.batch_size or 0,
                     "cuda" if torch.cuda.is_available() and any(
                         d.startswith("cuda") for s in plan.stages for d in s.devices) else "cpu")
    if job.save is not None:
        from onnx_partition.runtime.train.save import save_trained

        states = [next(r.state for r in ranks if r.stage == k and r.state is not None)
                  for k in range(len(plan.stages))]
        stats.saved = save_trained(folder, states, Path(job.save), seed=job.seed)
    if out.save is not None:
        stats.saved_pretrained = save_pretrained(
            folder, [next(r.state for r in ranks if r.stage == k and r.state is not None)
                     for k in range(len(plan.stages))], Path(out.save), save_dtype=out.dtype,
            config=hf_config_of(out), weights=run.weights)
    return stats


def _data_line(spec: DataPlan, asked: DataSettings) -> str:
    """``training on ...; loss ...`` (and the validation data), said before the ranks start."""
    auto = asked.loss == "auto" and asked.loss_fn is None
    return (f"training on {spec.described}; loss {spec.kind}{' (auto)' if auto else ''}"
            f"{f'; validation on {spec.eval_described}' if spec.eval_described else ''}")


def _figures(folder: Path, plan: Plan, ranks: list[RankResult], run: RankRun, spec: DataPlan,
             per_step: int) -> TrainStats:
    """The run's figures (the simulator has no interleaved schedule: 1F1B's iteration stands
    in for it) and ``--check``'s comparison."""
    simulated = run
    if run.schedule not in schedules.TRAIN_NAMES:
        simulated = replace(run, job=replace(run.job, schedule=replace(run.job.schedule,
                                                                       name="1f1b")))
    stats = summarize(plan, ranks, simulated, per_step, run.job.engine.name)
    stats.schedule = run.schedule
    stats.data, stats.loss_kind = spec.described, spec.kind or ""
    if run.check_steps:
        stats.mismatches = compare_with_reference(folder, ranks, run, per_step, spec)
        stats.checked_steps = run.check_steps
    return stats


def rank_run(folder: Path, plan: Plan, job: TrainJob, *, keep_state: bool,
             hook: RankHook | None = None) -> RankRun:
    """What every rank runs for ``job`` (resolved): its options checked
    (:func:`~onnx_partition.runtime.train.preflight.check_options`), the checkpoints
    (:func:`~onnx_partition.runtime.train.checkpoint.resume_request`) and the ``--log`` file
    (:func:`~onnx_partition.runtime.train.paths.check_log_path`), before any process starts (a
    PartitionError)."""
    check_options(job)
    asked = job.optimizer
    rows = (job.schedule.batch_size or 0) * (job.schedule.microbatches or 0)
    checkpoints = resume_request(folder, plan, job.checkpoint, rows=rows, steps=job.steps,
                                 optimizer=optimizer_record(str(asked.name), asked.weight_decay,
                                                            asked.momentum, asked.betas))
    log = job.logging.file
    if log is not None:
        check_log_path(folder, plan, Path(log))
    checks = (tuple(s for s in CHECK_STEPS if s <= job.steps)
              if job.check and not checkpoints.start else ())
    shipped = replace(
        job, optimizer=replace(asked, betas=(float(asked.betas[0]), float(asked.betas[1]))),
        data=_shipped(job.data),
        logging=replace(job.logging, file=None if log is None else str(Path(log).resolve())))
    loading = job.pretrained.load
    weights = None if loading is None else resolve_pretrained(folder, Path(loading))
    return RankRun(shipped, check_steps=checks, keep_state=keep_state, hook=hook,
                   checkpoints=checkpoints, weights=weights)


def _shipped(asked: DataSettings) -> DataSettings:
    """The data settings as they travel to the ranks: arrays or a factory given in Python
    travel once, in the :class:`~onnx_partition.runtime.train.data_plan.DataPlan`."""
    if asked.file is None or isinstance(asked.file, str | os.PathLike):
        return asked
    return replace(asked, file=None)
