"""What a plan is planned for, as data (each default written once, here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO", "TrainSpec"]

#: ``--schedule auto`` / ``--recompute auto``: the planner chooses.
AUTO = "auto"


@dataclass(frozen=True)
class TrainSpec:
    """How the plan's iteration runs: ``microbatches`` per iteration (also an inference plan's
    default for ``run`` and ``simulate``); and for a train plan the pipeline ``schedule`` it is
    planned for (``auto``: each planned schedule, the fastest kept), ``recompute`` (``auto``:
    a stage recomputes its forward only where keeping does not fit; ``none``; ``all``), the
    ``precision`` it is priced in (fp32, or autocast bf16/fp16 over fp32 weights) and the
    ``optimizer`` whose state the memory model counts (AdamW: weights, gradients, two moments).
    """

    microbatches: int = 8
    schedule: str = AUTO
    recompute: str = AUTO
    precision: str = "fp32"
    optimizer: str = "adamw"
