"""Where a training run may write (``--save``, ``--checkpoint-dir``, ``--log``): never inside the
plan folder it trains, nor over the model or program the plan was cut from; ``--log`` appends,
so only to a file that is already a training log."""

from __future__ import annotations

import json
from pathlib import Path

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan

__all__ = ["check_log_path", "check_output_path"]


def check_output_path(plan_dir: Path, plan: Plan, out: Path, flag: str) -> None:
    """Refuse ``out`` (given as ``flag OUT``) when it is the plan folder or inside it, or is the
    model or program file (a PartitionError, before anything runs)."""
    folder = plan_dir.resolve()
    target = out.resolve()
    if target == folder or folder in target.parents:
        raise PartitionError(f"{flag} {out}: inside the plan folder {plan_dir}; choose a path "
                             "outside it")
    for what, name in (("model", plan.model), ("program", plan.program)):
        if name and target == (folder / name).resolve():
            raise PartitionError(f"{flag} {out}: that is the plan's {what} file; choose "
                                 "another path")


def check_log_path(plan_dir: Path, plan: Plan, log: Path) -> None:
    """``--log FILE`` appends one JSON object per step: refuse it inside the plan folder or over
    the model or program (:func:`check_output_path`), and an existing file that is not a
    training log (its first line a JSON object with ``step``), which appending would spoil."""
    check_output_path(plan_dir, plan, log, "--log")
    if not log.exists():
        return
    if not log.is_file():
        raise PartitionError(f"--log {log}: exists and is not a file")
    with open(log, "rb") as handle:
        first = handle.read(1 << 16).split(b"\n", 1)[0].strip()
    if not first:
        return  # empty: nothing to spoil
    try:
        body = json.loads(first)
    except ValueError:
        body = None
    if not (isinstance(body, dict) and "step" in body):
        raise PartitionError(f"--log {log}: the file exists and is not a training log (JSON "
                             "lines, one per step); choose another name")
