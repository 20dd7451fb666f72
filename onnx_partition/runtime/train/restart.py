"""Restart after a lost rank (``train --max-restarts N --checkpoint-dir D``): when a rank dies
or raises, every rank is stopped (the launcher's supervision) and the job starts again from the
newest complete checkpoint in ``D``, up to ``N`` times, without the user.

Rank 0 writes each finished step into a progress file (:func:`write_progress`, atomically),
so the parent knows the step the job failed in; the restarted run resumes from the newest
complete checkpoint (from the start when none is complete yet) and logs the steps it trains
again with ``"replayed": true``. Lost work is bounded by ``--checkpoint-every``. Under
``torchrun --max-restarts`` the agent restarts the workers itself; a restarted worker
(``TORCHELASTIC_RESTART_COUNT`` above 0) resumes from ``D`` the same way
(:func:`torchrun_resume`), while a first start into a non-empty ``D`` behaves as without
restarts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from onnx_partition.errors import StageFailed
from onnx_partition.settings.train import TrainJob

__all__ = ["Restart", "read_progress", "restarted_job", "run_restarting", "torchrun_resume",
           "write_progress"]

T = TypeVar("T")


@dataclass(frozen=True)
class Restart:
    """One restart: the step the job failed in (1-based), the checkpoint's step it resumed
    from (0: the start), and the finished steps it trained again."""

    failed_step: int
    resumed_from_step: int
    replayed_steps: list[int]
    error: str

    def to_json(self) -> dict[str, Any]:
        return {"failed_step": self.failed_step, "resumed_from_step": self.resumed_from_step,
                "replayed_steps": self.replayed_steps, "error": self.error}


def write_progress(path: str, done: int) -> None:
    """Record that ``done`` steps are finished (rank 0, after each step; write then rename)."""
    partial = f"{path}.partial"
    Path(partial).write_text(str(done))
    os.replace(partial, path)


def read_progress(path: str | Path, start: int) -> int:
    """The steps finished by the run that wrote ``path`` (``start`` when it wrote none)."""
    try:
        return int(Path(path).read_text())
    except (OSError, ValueError):
        return start


def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a complete checkpoint (a ``step-*`` folder published with
    its manifest)."""
    root = Path(directory)
    return root.is_dir() and any(p.name.startswith("step-") and (p / "manifest.json").is_file()
                                 for p in root.iterdir())


def restarted_job(job: TrainJob) -> TrainJob:
    """``job`` as a restart runs it: resumed from its checkpoint folder's newest complete
    checkpoint when it has one, else from the start (checkpointing into the folder as
    before)."""
    directory = job.checkpoint.dir
    if directory is None or not has_checkpoint(directory):
        return job
    return replace(job, checkpoint=replace(job.checkpoint, resume=directory))


def run_restarting(launch: Callable[[TrainJob, str, int], T], job: TrainJob,
                   say: Callable[[str], None]) -> tuple[T, list[Restart]]:
    """``launch(job, progress_file, replayed_through)`` until it returns, restarting on a
    :class:`StageFailed` up to ``job.checkpoint.max_restarts`` times (:func:`restarted_job`);
    the result and the restarts. ``say`` is told of each restart."""
    restarts: list[Restart] = []
    with tempfile.TemporaryDirectory(prefix="onnx-partition-progress-") as scratch:
        progress = os.path.join(scratch, "progress")
        current, replayed, began = job, 0, _start_step(job)
        while True:
            try:
                return launch(current, progress, replayed), restarts
            except StageFailed as exc:
                if len(restarts) >= job.checkpoint.max_restarts:
                    raise
                done = read_progress(progress, began)
                current = restarted_job(job)
                began = _start_step(current)
                replayed = done
                restarts.append(Restart(done + 1, began, list(range(began + 1, done + 1)),
                                        str(exc)))
                say(f"rank lost in step {done + 1} ({exc}); restart {len(restarts)} of "
                    f"{job.checkpoint.max_restarts}: resuming from "
                    f"{f'step {began}' if began else 'the start'}"
                    f"{_replaying(began, done)}")


def _replaying(began: int, done: int) -> str:
    """``, replaying step 3`` / ``, replaying steps 3-5`` (nothing when none is replayed)."""
    if done <= began:
        return ""
    return (f", replaying step {done}" if done == began + 1
            else f", replaying steps {began + 1}-{done}")


def _start_step(job: TrainJob) -> int:
    """The step ``job`` starts from: its resumed checkpoint's, else 0."""
    if job.checkpoint.resume is None:
        return 0
    root = Path(job.checkpoint.resume)
    steps = [int(p.name.partition("-")[2]) for p in root.iterdir()
             if p.name.startswith("step-") and (p / "manifest.json").is_file()
             and p.name.partition("-")[2].isdigit()] if root.is_dir() else []
    return max(steps, default=0)


def torchrun_resume(job: TrainJob, environ: dict[str, str] | None = None) -> TrainJob:
    """Under torchrun's own ``--max-restarts``: a restarted worker (``TORCHELASTIC_RESTART_COUNT``
    above 0) with ``--checkpoint-dir`` resumes from its newest complete checkpoint; a first
    start is ``job`` as given."""
    env = os.environ if environ is None else environ
    if int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) <= 0:
        return job
    return restarted_job(job) if job.checkpoint.resume is None else job
