"""The hybrid problem as data, and the stage model's formulas: a sequence's per-position costs
(:class:`SequenceCosts`), the cluster and the run (:class:`HybridConfig`), a priced stage
(:class:`HybridStage`), a stage's period over an iteration (:func:`stage_period`, PipeDream's
replicated-stage model), the replica counts a plan may give a stage (:func:`replica_choices`)
and those the DP need try (:func:`dominant_counts`), a recomputing
stage's costs (:func:`recompute_stage`) and the shared initializers a stage holds
(:func:`shared_spans`). The DP over them: :mod:`.hybrid`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnx_partition.settings.partition import TrainSpec

__all__ = ["DP_SCHEDULES", "HybridConfig", "HybridStage", "SequenceCosts", "allreduce_terms",
           "dominant_counts", "recompute_stage", "replica_choices", "shared_spans", "stage_period"]


@dataclass(frozen=True)
class SequenceCosts:
    """Per-position costs of a sequence (plain arrays; positions are operators or blocks)."""

    forward_ms: Sequence[float]
    backward_ms: Sequence[float]
    param_bytes: Sequence[float]
    activation_bytes: Sequence[float]  # stashed per micro-batch for the backward pass
    cut_bytes: Sequence[float]  # n + 1 boundaries, ends 0 (see order.topo.cut_bytes)
    labels: Sequence[str] = ()  # a name per position (its first operator), for messages
    last_labels: Sequence[str] = ()  # its last operator, where positions are blocks
    #: memory only, the one count (:class:`~onnx_partition.solve.scoring.NodeArrays`): every
    #: initializer's bytes and the trainable ones' (empty: ``param_bytes``, all trained), and
    #: what stage 0 receives (the graph inputs)
    weight_bytes: Sequence[float] = ()
    trainable_bytes: Sequence[float] = ()
    input_bytes: float = 0.0
    #: initializers several positions hold (a tied parameter): (bytes, trainable bytes, the
    #: positions holding it), in every stage holding one (not in ``weight_bytes``)
    shared: Sequence[tuple[float, float, Sequence[int]]] = ()
    #: the output-gradient bytes ZB-H1 keeps per micro-batch from ``I`` to ``W``
    #: (:attr:`~onnx_partition.pipeline.memory.StageBytes.kept`; a stage starting at 0 keeps
    #: none): empty, none anywhere
    kept_bytes: Sequence[float] = ()
    #: the most gradient bytes live in the backward of one op of each position
    #: (:attr:`~onnx_partition.pipeline.memory.StageBytes.working`; a stage's is its
    #: positions' largest): empty, none counted
    working_bytes: Sequence[float] = ()


@dataclass(frozen=True)
class HybridConfig:
    """The cluster and the run, as numbers."""

    devices: int
    memory_bytes: float = math.inf
    microbatches: int = TrainSpec().microbatches
    train: bool = False
    speed: float = 1.0
    link_bytes_per_ms: float = math.inf  # between neighbouring stages
    link_latency_ms: float = 0.0
    group_bytes_per_ms: Sequence[float] = ()  # all-reduce bandwidth for r replicas (index r)
    group_latency_ms: Sequence[float] = ()
    optimizer_factor: float = 4.0  # parameters + gradients + Adam moments, in parameter bytes
    shard: str = TrainSpec().shard  # optimizer: each of r replicas holds 1/r of the state
    max_stages: int = 16
    depth: int | None = None  # exactly this many stages (None: any depth up to max_stages)
    budgets: Sequence[int] = ()  # also propose plans on at most this many devices
    precision: float = 0.0  # unused: the bisection over the stages' periods is exact
    #: train: which stages keep only their inputs (recompute_stage): ``none``, ``all``, or
    #: ``auto``, chosen per stage inside the DP (:func:`~.hybrid_dp.exact_fewest`)
    recompute: str = "none"
    #: train: the schedule whose memory the DP counts: ``1f1b``, or ``zb-h1`` (every stage
    #: holds stage 0's ``min(W_0 + 1, M)`` window and the gradients kept from ``I`` to ``W``,
    #: :func:`~onnx_partition.pipeline.memory.kept_held`)
    train_schedule: str = "1f1b"


#: The train schedules whose memory the hybrid DP counts (:attr:`HybridConfig.train_schedule`).
DP_SCHEDULES = ("1f1b", "zb-h1")


@dataclass(frozen=True)
class HybridStage:
    start: int
    end: int
    replicas: int
    latency_ms: float  # one micro-batch through one replica (fwd [+ bwd] + transfers)
    compute_ms: float
    comm_ms: float
    allreduce_ms: float
    memory_bytes: float  # per device
    period_ms: float
    recompute: bool = False  # keeps only its inputs, recomputes its forward in backward


def recompute_stage(compute: np.ndarray, forward: np.ndarray, static: np.ndarray,
                    acts: np.ndarray, received: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stage costs (``compute``, ``static``, ``stash`` over (start, end)) when the stage keeps
    only its inputs and recomputes its forward in backward: one more forward, one micro-batch's
    activations held once, only the received inputs per micro-batch in flight (the memory
    model's recomputation, :func:`~onnx_partition.pipeline.memory.memory_per_device`)."""
    return compute + forward, static + acts, np.asarray(received, dtype=float)


def shared_spans(shared: Sequence[tuple[float, float, Sequence[int]]], n: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Bytes and trainable bytes of the shared initializers stage ``[i, j)`` holds, as
    (n + 1) x (n + 1) matrices: one is held iff its first holder at or after ``i`` lies before
    ``j``. Per start ``i`` that holder's position ``p(i)`` adds its bytes to every ``j > p(i)``:
    a histogram at ``p(i) + 1`` summed along ``j`` (O(S n + n^2) for S shared ones)."""
    starts = np.arange(n + 1)
    hist = np.zeros((2, n + 1, n + 2))
    for nbytes, train_bytes, holders in shared:
        where = np.unique(np.asarray(holders, dtype=np.int64))
        k = np.searchsorted(where, starts)  # first holder at or after each start
        first = np.where(k < len(where), where[np.minimum(k, len(where) - 1)], n)
        np.add.at(hist[0], (starts, first + 1), nbytes)
        np.add.at(hist[1], (starts, first + 1), train_bytes)
    summed = np.cumsum(hist, axis=2)[:, :, : n + 1]
    return summed[0], summed[1]


def stage_period(latency: Any, replicas: int, allreduce: Any, microbatches: int) -> Any:
    """A stage's time per micro-batch over an iteration: its fullest replica runs
    ``ceil(M / r)`` of the ``M`` micro-batches (replica ``j`` takes ``m = j (mod r)``), then
    the all-reduce once: ``ceil(M / r) L / M + allreduce / M`` (``L / r`` when ``r`` divides
    ``M``; a replica beyond the ``M``-th gets no work)."""
    m = max(microbatches, 1)
    return latency * (-(-m // replicas)) / m + allreduce / m


def replica_choices(devices: int) -> list[int]:
    """Every replica count ``1..devices`` (the counts a plan may give a stage; the DP tries
    those of :func:`dominant_counts` where memory does not depend on the plan)."""
    return list(range(1, max(devices, 0) + 1))


def allreduce_terms(config: HybridConfig, r: int) -> tuple[float, float]:
    """The ring all-reduce among ``r`` replicas as ``a W + b`` for ``W`` gradient bytes:
    ``(a, b) = (2 (r-1) / r / bw_r, 2 (r-1) lat_r)`` in training, ``(0, 0)`` otherwise or for
    one replica (:func:`~onnx_partition.pipeline.memory.ring_allreduce_ms`)."""
    if not config.train or r <= 1:
        return 0.0, 0.0
    bw = config.group_bytes_per_ms[r] if config.group_bytes_per_ms else config.link_bytes_per_ms
    lat = config.group_latency_ms[r] if config.group_latency_ms else config.link_latency_ms
    return 2.0 * (r - 1) / r / bw, 2.0 * (r - 1) * lat


def dominant_counts(config: HybridConfig) -> list[int]:
    """The replica counts of ``1..min(D, M)`` that no smaller count dominates for every
    stage (``docs/np_completeness.md``, "Which replica counts"): ``r' < r`` dominates ``r``
    where ``ceil(M / r') = ceil(M / r)`` (the same micro-batches on the fullest replica) and
    both all-reduce terms of :func:`allreduce_terms` are no larger. Where a stage's memory does
    not depend on the replica counts, a plan with dominated counts is matched by one on no
    more devices with no larger period, so the least period and the fewest devices reaching
    it are the same over these counts as over all of them."""
    m = max(config.microbatches, 1)
    most = min(config.devices, m)
    kept: list[int] = []
    classes: dict[int, list[tuple[int, float, float]]] = {}
    for r in range(1, most + 1):
        a, b = allreduce_terms(config, r)
        same = classes.setdefault(-(-m // r), [])
        if not any(a2 <= a and b2 <= b for _, a2, b2 in same):
            same.append((r, a, b))
            kept.append(r)
    return kept
