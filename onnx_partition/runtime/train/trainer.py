"""Train a plan folder: one process per stage replica (or one rank under ``torchrun``).

:func:`train_plan` checks the request before any process starts (a plan that cannot be trained,
an altered stage file or program, a process count that is not the plan's replicas: a
:class:`PartitionError`), builds the stage modules in every rank
(:func:`onnx_partition.runtime.train.modules.stage_modules`), makes synthetic batches from the
recipe's
task (every rank draws the same batch from the same seed; stage 0 keeps the inputs, the last
stage the targets), runs :func:`onnx_partition.runtime.train.rank.train_stages` in each rank and
returns :class:`TrainStats`: loss and time per step, per-stage forward and backward times
measured, and the simulator's iteration time for the same plan and schedule, both from the
plan's predicted costs and from the measured stage times.

``--check`` compares every rank's parameters after step 1 (and 3) with the whole program
trained in one process on the same batches (``reference_train``). ``--save`` writes replica 0
of every stage back as a servable plan folder (``save_trained``).

Several machines (the plan folder on each): :func:`train_rank` is one rank under ``torchrun``,
started through the entry :func:`onnx_partition.cli.torchrun.train_main`::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST \\
        -m onnx_partition.train.runtime PLAN --steps 10 --microbatches 8 --batch-size 4
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.fileio import atomic_write
from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.from_plan import plan_costs, simulate_plan
from onnx_partition.pipeline.layout import layout
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import Plan
from onnx_partition.plan.contracts import STAGE_COSTS_FORMAT
from onnx_partition.plan.folder import is_earlier_plan
from onnx_partition.runtime.dist.launcher import check_world_size, torchrun_env
from onnx_partition.runtime.infer.rank import choose_backend
from onnx_partition.runtime.infer.sessions import verify_plan_folder
from onnx_partition.runtime.train.choices import ENGINES, OPTIMIZERS
from onnx_partition.runtime.train.comm import Tensors
from onnx_partition.runtime.train.launch import launch_training, torchrun_rank
from onnx_partition.runtime.train.rank import (
    Batches,
    LossFn,
    RankResult,
    StageLike,
    TrainConfig,
    train_stages,
)

__all__ = ["TrainStats", "format_train", "train_plan", "train_rank", "train_stages"]

CHECK_STEPS = (1, 3)


@dataclass
class TrainStats:
    """What a training run measured (times in ms; ``*_ms`` per stage are per micro-batch on
    one replica, the simulator's unit)."""

    ranks: list[RankResult]
    rows: int  # samples per step (micro-batch rows x micro-batches)
    microbatches: int
    schedule: str
    engine: str
    loss: list[float]  # per step
    step_ms: list[float]  # per step, rank 0: start of the step to the optimizer step done
    forward_ms: list[float]  # per stage, measured
    backward_ms: list[float]  # per stage, measured
    simulated_ms: float  # the simulator on the plan's predicted costs
    calibrated_ms: float  # the simulator on the measured stage times (plan's send times)
    mismatches: list[str] = field(default_factory=list)  # --check: "stage k parameter p: ..."
    checked_steps: tuple[int, ...] = ()
    saved: Path | None = None

    @property
    def measured_ms(self) -> float:
        """Mean step time, the first step (warm-up) left out when there are several."""
        steady = self.step_ms[1:] or self.step_ms
        return sum(steady) / len(steady)

    @property
    def samples_per_s(self) -> float:
        return self.rows / self.measured_ms * 1000.0 if self.measured_ms > 0 else 0.0


def synthetic_batch(make_batch: Callable[[int, torch.Generator], tuple[Tensors, Tensors]],
                    rows: int, seed: int, step: int) -> tuple[Tensors, Tensors]:
    """Step ``step``'s batch: the same on every rank and in the reference."""
    return make_batch(rows, torch.Generator().manual_seed(seed * 1_000_003 + step))


def plan_job(plan_dir: str, rows: int, seed: int, deterministic: bool
             ) -> tuple[Sequence[StageLike], LossFn, Plan, Batches]:
    """What every rank builds for ``plan_dir``
    (a :data:`~onnx_partition.runtime.train.launch.Build`)."""
    from onnx_partition.runtime.train.modules import lazy_stages, require_trainable
    from onnx_partition.runtime.train.task import task_for

    plan = require_trainable(plan_dir)
    stages = lazy_stages(plan_dir, deterministic=deterministic)  # a rank builds its own only
    task = task_for(Path(plan_dir))
    return stages, task.loss_fn, plan, functools.partial(synthetic_batch, task.make_batch, rows,
                                                         seed)


def check_request(plan_dir: Path, *, nproc: int | None, steps: int, microbatches: int,
                  batch_size: int, schedule: str, optimizer: str, lr: float, engine: str
                  ) -> Plan:
    """The plan, if the request is sound; else a PartitionError (before any process)."""
    from onnx_partition.runtime.train.modules import require_trainable

    plan = require_trainable(plan_dir)
    verify_plan_folder(plan_dir, plan)
    lay = layout(plan)
    if nproc is not None:
        check_world_size(lay.replicas, nproc)
    for what, value in (("step", steps), ("micro-batch", microbatches),
                        ("row per micro-batch", batch_size)):
        if value < 1:
            raise PartitionError(f"need at least one {what}, got {value}")
    if schedule not in schedules.TRAIN_NAMES:
        raise PartitionError(f"unknown schedule {schedule!r}; choose "
                             f"{', '.join(schedules.TRAIN_NAMES)}")
    if optimizer not in OPTIMIZERS:
        raise PartitionError(f"unknown optimizer {optimizer!r}; choose {', '.join(OPTIMIZERS)}")
    if not lr > 0:
        raise PartitionError(f"the learning rate must be positive, got {lr}")
    if engine not in ENGINES:
        raise PartitionError(f"unknown engine {engine!r}; choose {', '.join(ENGINES)}")
    if engine == "torch":
        from onnx_partition.runtime.train.torch_engine import torch_engine_refusal

        raise PartitionError(f"--engine torch: {torch_engine_refusal(plan)}")
    return plan


def check_save(plan_dir: Path, out: Path) -> None:
    """Refuse before training what ``save_trained`` would refuse after it (the rules of
    :func:`onnx_partition.graph.emit.write_plan_folder`)."""
    if out.resolve() == plan_dir.resolve():
        raise PartitionError(f"--save writes a new plan folder, not over {plan_dir}")
    if out.exists() and not out.is_dir():
        raise PartitionError(f"--save {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not is_earlier_plan(out):
        raise PartitionError(f"--save {out}: the folder exists and is not an earlier plan")


RECORD_FORMAT = STAGE_COSTS_FORMAT  # declared in plan.schema.StageCostsSchema


def check_record(path: Path) -> None:
    """``--record FILE`` may replace only an earlier record."""
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("format") == RECORD_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise PartitionError(f"--record {path}: the file exists and is not an earlier "
                                 f"record ({RECORD_FORMAT}); choose another name")


def write_record(path: Path, stats: TrainStats, rows: int, device: str) -> None:
    """The measured per-stage times (per micro-batch of ``rows`` rows on one replica) in the
    ``simulator_costs`` form that plan.json accepts (``onnx_partition.pipeline.from_plan``), written
    atomically; the body is checked against its schema
    (:class:`~onnx_partition.plan.schema.StageCostsSchema`) first."""
    from onnx_partition.plan.schema import validate_stage_costs

    body = {"format": RECORD_FORMAT, "unit": "ms", "device": device,
            "rows_per_microbatch": rows, "microbatches": stats.microbatches,
            "schedule": stats.schedule, "measured_iteration_ms": stats.measured_ms,
            "simulator_costs": {"forward_ms": stats.forward_ms,
                                "backward_ms": stats.backward_ms}}
    validate_stage_costs(body, f"--record {path}")
    atomic_write(path, json.dumps(body, indent=1) + "\n")


def train_plan(
    plan_dir: str | os.PathLike[str],
    *,
    nproc: int | None = None,
    steps: int = 10,
    microbatches: int | None = None,
    batch_size: int | None = None,
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    lr: float = 0.01,
    check: bool = False,
    save: str | os.PathLike[str] | None = None,
    record: str | os.PathLike[str] | None = None,
    engine: str = "ours",
    seed: int = 0,
    verbose: bool = False,
    backend: str | None = None,
    timeout_s: float = 120.0,
) -> TrainStats:
    """Train the plan in ``plan_dir`` with one local process per stage replica.

    ``batch_size`` is rows per micro-batch (default: :attr:`Plan.rows_per_microbatch`); a
    step takes ``microbatches`` of them (default: :attr:`Plan.microbatches`, the plan's own
    count). ``check``: dropout off, and the parameters after step 1 (and 3) compared with
    single-process training
    (:attr:`TrainStats.mismatches`). ``save``: a new plan folder with the trained weights.
    Raises PartitionError for a bad request (before any process starts) and
    :class:`StageFailed` naming the stage, replica and rank that raised or died.
    """
    folder = Path(plan_dir).resolve()
    from onnx_partition.runtime.train.modules import require_trainable

    plan0 = require_trainable(folder)
    count = microbatches or plan0.microbatches
    rows = batch_size or plan0.rows_per_microbatch or 1
    plan = check_request(folder, nproc=nproc, steps=steps, microbatches=count, batch_size=rows,
                         schedule=schedule, optimizer=optimizer, lr=lr, engine=engine)
    if save is not None:
        check_save(folder, Path(save))
    if record is not None:
        check_record(Path(record))
    checks = tuple(s for s in CHECK_STEPS if s <= steps) if check else ()
    config = TrainConfig(steps=steps, microbatches=count, schedule=schedule, optimizer=optimizer,
                         lr=lr, check_steps=checks, keep_state=save is not None,
                         verbose=verbose)
    build = functools.partial(plan_job, str(folder), rows * count, seed, check)
    ranks = launch_training(plan, build, config, backend=backend, timeout_s=timeout_s)
    stats = summarize(plan, ranks, config, rows * count, engine)
    if checks:
        stats.mismatches = compare_with_reference(folder, ranks, config, rows * count, seed)
        stats.checked_steps = checks
    if record is not None:
        write_record(Path(record), stats, rows, "cuda" if torch.cuda.is_available() and
                     any(d.startswith("cuda") for s in plan.stages for d in s.devices) else "cpu")
    if save is not None:
        from onnx_partition.runtime.train.save import save_trained

        states = [next(r.state for r in ranks if r.stage == k and r.state is not None)
                  for k in range(len(plan.stages))]
        stats.saved = save_trained(folder, states, Path(save))
    return stats


def summarize(plan: Plan, ranks: Sequence[RankResult], config: TrainConfig, rows: int,
              engine: str) -> TrainStats:
    """Per-stage times (steady steps, per micro-batch on one replica) and both simulations."""
    steady = slice(1, None) if config.steps > 1 else slice(None)
    count = config.microbatches
    stages = len(plan.stages)
    fwd, bwd = [0.0] * stages, [0.0] * stages
    for r in ranks:
        f, b = r.forward_ms[steady], r.backward_ms[steady]
        # a replica's total over its micro-batches; all replicas together ran all ``count``
        fwd[r.stage] += sum(f) / len(f) / count
        bwd[r.stage] += sum(b) / len(b) / count
    simulated, _ = simulate_plan(plan, schedule=config.schedule, microbatches=count)
    base = plan_costs(plan, train=True)
    measured = PipelineCosts(
        [StageCosts(fwd[k], bwd[k], s.replicas, s.allreduce_ms) for k, s in
         enumerate(base.stages)], base.send_ms)
    replicas = [s.replicas for s in base.stages]
    calibrated = simulate(schedules.build(config.schedule, replicas, count), measured)
    rank0 = ranks[0]
    return TrainStats(ranks=list(ranks), rows=rows, microbatches=count,
                      schedule=config.schedule, engine=engine, loss=rank0.loss,
                      step_ms=rank0.step_ms, forward_ms=fwd, backward_ms=bwd,
                      simulated_ms=simulated.iteration_ms, calibrated_ms=calibrated.iteration_ms)


def compare_with_reference(folder: Path, ranks: Sequence[RankResult], config: TrainConfig,
                           rows: int, seed: int) -> list[str]:
    """One line per parameter (stage, replica, name) that differs from single-process training
    beyond rounding (:func:`~onnx_partition.runtime.train.reference.mismatch`: a tolerance of
    the dtype's precision, relative to the tensor's scale or at least the model's largest
    element): its gradient after the first
    backward, and with SGD its value after each checked step. AdamW's parameters are not
    compared: its first step's ``g / |g|`` turns rounding in a tiny gradient into ``±lr``."""
    from onnx_partition.runtime.train.reference import (
        mismatch,
        reference_gradients,
        reference_train,
    )
    from onnx_partition.runtime.train.task import task_for

    task = task_for(folder)
    problems: list[str] = []

    def compare(what: str, got_by_rank: Sequence[dict[str, torch.Tensor]],
                want: dict[str, torch.Tensor]) -> None:
        floor = max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)
        for r, got_all in zip(ranks, got_by_rank):
            for name, got in got_all.items():
                where = f"{what}: stage {r.stage} replica {r.replica} (rank {r.rank})"
                if name not in want:
                    problems.append(f"{where} parameter {name!r} is not in the reference")
                elif (off := mismatch(got, want[name], floor)) is not None:
                    problems.append(f"{where} parameter {name!r} differs (max abs "
                                    f"{float((got - want[name].to(got.dtype)).abs().max()):.3g}, "
                                    f"{off:.2g} of its largest element)")

    if config.check_steps:
        first = synthetic_batch(task.make_batch, rows, seed, 0)
        want = reference_gradients(folder, first, microbatches=config.microbatches, task=task)
        compare("gradient of step 1", [r.grads for r in ranks], want)
    if config.optimizer != "sgd":
        return problems
    for step in config.check_steps:
        batches = [synthetic_batch(task.make_batch, rows, seed, s) for s in range(step)]
        want = reference_train(folder, batches, optimizer=config.optimizer, lr=config.lr,
                               steps=step, microbatches=config.microbatches)
        compare(f"after step {step}", [r.states[step] for r in ranks], want)
    return problems


def format_train(stats: TrainStats) -> str:
    """The end-of-run summary."""
    ratio = stats.measured_ms / stats.simulated_ms if stats.simulated_ms > 0 else float("inf")
    cal = stats.measured_ms / stats.calibrated_ms if stats.calibrated_ms > 0 else float("inf")
    lines = [
        f"{len(stats.ranks)} ranks ({stats.engine} engine, {stats.schedule}), batch {stats.rows} "
        f"= {stats.microbatches} micro-batches x {stats.rows // stats.microbatches} rows: "
        f"{stats.samples_per_s:.1f} samples/s, {stats.measured_ms:.2f} ms per step",
        f"  loss per step: {' '.join(f'{v:.4f}' for v in stats.loss)}",
        "  stage  forward ms  backward ms  (per micro-batch on one replica, measured)",
    ]
    lines += [f"  {k:>5}  {f:10.3f}  {b:11.3f}"
              for k, (f, b) in enumerate(zip(stats.forward_ms, stats.backward_ms))]
    lines.append(f"  iteration: measured {stats.measured_ms:.2f} ms; simulated "
                 f"{stats.simulated_ms:.2f} ms from the plan's costs (measured/simulated "
                 f"{ratio:.2f}); "
                 f"{stats.calibrated_ms:.2f} ms from the measured stage times ({cal:.2f})")
    if stats.checked_steps:
        verdict = "OK" if not stats.mismatches else f"MISMATCH ({len(stats.mismatches)})"
        steps = " and ".join(map(str, stats.checked_steps))
        lines.append(f"check against single-process training after step {steps}: {verdict}")
        lines += [f"  {m}" for m in stats.mismatches[:10]]
    if stats.saved is not None:
        lines.append(f"saved the trained plan to {stats.saved}")
    return "\n".join(lines)


# ---------------------------------------------------------------- one rank under torchrun


def train_rank(
    plan_dir: str | os.PathLike[str],
    *,
    steps: int = 10,
    microbatches: int | None = None,
    batch_size: int | None = None,
    schedule: str = "1f1b",
    optimizer: str = "sgd",
    lr: float = 0.01,
    check: bool = False,
    seed: int = 0,
    backend: str | None = None,
) -> TrainStats | None:
    """This process's rank of a training run started by ``torchrun`` (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT from the environment, read by
    :func:`~onnx_partition.runtime.dist.launcher.torchrun_env`; the entry is
    :func:`onnx_partition.cli.torchrun.train_main`). The request is checked as
    :func:`train_plan` checks it (a :class:`PartitionError`); rank 0 returns the figures (and
    ``check``'s comparison), the other ranks None. Raises :class:`StageFailed` naming this
    rank's stage and replica when it fails."""
    from onnx_partition.runtime.train.modules import require_trainable

    env = torchrun_env()
    folder = Path(plan_dir).resolve()
    plan0 = require_trainable(folder)
    count = microbatches or plan0.microbatches
    rows = batch_size or plan0.rows_per_microbatch or 1
    plan = check_request(folder, nproc=env.world_size, steps=steps, microbatches=count,
                         batch_size=rows, schedule=schedule, optimizer=optimizer, lr=lr,
                         engine="ours")
    checks = tuple(s for s in CHECK_STEPS if s <= steps) if check else ()
    config = TrainConfig(steps=steps, microbatches=count, schedule=schedule,
                         optimizer=optimizer, lr=lr, check_steps=checks, verbose=True)
    build = functools.partial(plan_job, str(folder), rows * count, seed, check)
    try:
        ranks = torchrun_rank(build, config, backend=choose_backend(layout(plan), backend),
                              env=env)
    except PartitionError:
        raise
    except Exception as exc:  # this rank's failure: name it (the entry exits 1)
        raise StageFailed(f"{layout(plan).name(env.rank)} failed: {one_line(exc)}") from exc
    if ranks is None:
        return None
    stats = summarize(plan, ranks, config, rows * count, "ours")
    if checks:
        stats.mismatches = compare_with_reference(folder, ranks, config, rows * count, seed)
        stats.checked_steps = checks
    return stats
