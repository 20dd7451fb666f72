"""What a plan is planned for, as data (each default written once, here)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AUTO", "MODES", "SearchSpec", "TrainSpec"]

#: ``--schedule auto`` / ``--recompute auto`` / ``--order auto``: the planner chooses.
AUTO = "auto"
#: A plan's modes, the default first: forward only, or forward, backward and the optimizer.
MODES = ("infer", "train")


@dataclass(frozen=True)
class TrainSpec:
    """How the plan's iteration runs: ``microbatches`` per iteration (also an inference plan's
    default for ``run`` and ``simulate``); and for a train plan the pipeline ``schedule`` it is
    planned for (``auto``: each planned schedule, the fastest kept), ``recompute`` (``auto``:
    a stage recomputes its forward only where keeping does not fit; ``none``; ``all``), the
    ``precision`` it is priced in (fp32, or autocast bf16/fp16 over fp32 weights) and the
    ``optimizer`` whose state the memory model counts (AdamW: weights, gradients, two moments),
    and whether a stage's replicas ``shard`` that state (``none``, or ``optimizer``: each of
    ``r`` replicas holds ``1 / r`` of it, ZeRO-1; ``partition --shard-optimizer``).
    """

    microbatches: int = 8
    schedule: str = AUTO
    recompute: str = AUTO
    precision: str = "fp32"
    optimizer: str = "adamw"
    shard: str = "none"


@dataclass(frozen=True)
class SearchSpec:
    """How the cut is searched: the plan's ``mode`` (one of :data:`MODES`), the ``ordering``
    that sequences the DAG before the DP (``auto``: every ordering, the best kept), the
    ``solver`` (``dp``, ``ilp`` or a baseline), the ILP's ``time_limit_s``, and the CP-SAT pass
    that proves or betters the DP's cut within ``exact_budget_s`` deterministic seconds (0: off).
    """

    mode: str = MODES[0]
    ordering: str = AUTO
    solver: str = "dp"
    time_limit_s: float = 60.0
    exact_budget_s: float = 1.0
