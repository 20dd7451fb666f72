"""Where a training run may write (``--save``, ``--checkpoint-dir``): never inside the plan folder
it trains, nor over the model or program the plan was cut from."""

from __future__ import annotations

from pathlib import Path

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan

__all__ = ["check_output_path"]


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
