"""Learning-rate schedules as ``transformers``' schedulers compute them, stateless.

``lr_factor(kind, step, warmup, total)`` is the multiplier of the base learning rate for the
optimizer step ``step`` (0-based, the first step is 0): ``constant`` (with warm-up:
``get_constant_schedule_with_warmup``), ``linear`` (``get_linear_schedule_with_warmup``) and
``cosine`` (``get_cosine_schedule_with_warmup``, half a cycle). As there, the warm-up ramps
linearly from 0 (step 0 takes no step at all when ``warmup > 0``). A function of the step alone,
so a resumed run sets the same rates as a straight one (``total`` is the run's whole ``--steps``).
"""

from __future__ import annotations

import math

from onnx_partition.errors import PartitionError

__all__ = ["LR_SCHEDULES", "lr_factor"]

#: The schedules by CLI name (``train --lr-schedule``).
LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(kind: str, step: int, warmup: int, total: int) -> float:
    """The learning-rate multiplier at 0-based ``step`` of ``total`` steps after ``warmup``."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if kind == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise PartitionError(f"unknown learning-rate schedule {kind!r}; choose "
                         f"{', '.join(LR_SCHEDULES)}")
