"""What a training rank is given and what it returns, for both engines (ours:
:mod:`onnx_partition.runtime.train.rank`; torch pipelining's:
:mod:`onnx_partition.runtime.train.torch_engine`): the :class:`RankRun` every rank runs (the
:class:`~onnx_partition.settings.train.TrainJob`, resolved, and what was settled from it before
any process started), the stages (:class:`StageLike`), the loss and the batches, and the
:class:`RankResult` it measured."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from onnx_partition.pipeline.microbatch import rows_of
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.train.checkpoint import CheckpointRequest
from onnx_partition.runtime.train.comm import Tensors
from onnx_partition.runtime.train.pretrained import PretrainedWeights
from onnx_partition.settings.train import TrainJob

__all__ = ["Batches", "LossFn", "RankResult", "RankRun", "StageLike", "microbatch"]

T = TypeVar("T")
LossFn = Callable[[Tensors, Tensors], torch.Tensor]
# step -> (model inputs, targets), the whole batch of the step
Batches = Callable[[int], tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]]


class StageLike(Protocol):
    """What the engine needs of a stage (``onnx_partition.runtime.train.modules.StageModule``)."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tied: dict[str, tuple[int, ...]]

    @property
    def module(self) -> torch.nn.Module: ...  # read only: a stage may build it on first read


@dataclass(frozen=True)
class RankRun:
    """What every rank runs (it travels to each): ``job``, resolved against the plan
    (:func:`onnx_partition.request.train.resolve_job`: its optimizer, precision, schedule and
    micro-batches are set), and what was settled before any process started: the steps whose
    parameters ``--check`` keeps, whether replica 0 returns its final state (``--save``), the
    fault ``hook`` (:mod:`onnx_partition.runtime.launch.hooks`: called as
    ``hook(rank, "forward")`` after each forward), the batches per evaluation (``--eval-data``:
    every whole step of its rows) and the checkpoints (the folder, every how many steps, the
    step a resumed run starts from) and the ``--from-pretrained`` weights' sources."""

    job: TrainJob
    check_steps: tuple[int, ...] = ()  # keep the parameters after these steps (1-based)
    keep_state: bool = False  # replica 0 returns its module's state_dict at the end
    hook: RankHook | None = None
    eval_batches: int = 1
    checkpoints: CheckpointRequest = field(default_factory=CheckpointRequest)
    # --max-restarts: the file rank 0 writes each finished step into (the parent reads the
    # step a lost rank failed in), and the steps a restarted run replays (logged "replayed")
    progress_file: str | None = None
    replayed_through: int = 0
    # --from-pretrained: where each rank reads its stage's weights (checked by the parent)
    weights: PretrainedWeights | None = None

    def __post_init__(self) -> None:
        unset = [what for what, value in (
            ("optimizer", self.job.optimizer.name), ("precision", self.job.engine.precision),
            ("schedule", self.job.schedule.name),
            ("microbatches", self.job.schedule.microbatches)) if value is None]
        if unset:
            raise ValueError(f"a rank runs a resolved job (request.train.resolve_job); "
                             f"{', '.join(unset)} not set")

    @property
    def optimizer(self) -> str:
        return _set(self.job.optimizer.name)

    @property
    def precision(self) -> str:
        return _set(self.job.engine.precision)

    @property
    def schedule(self) -> str:
        return _set(self.job.schedule.name)

    @property
    def microbatches(self) -> int:
        return _set(self.job.schedule.microbatches)


def _set(value: T | None) -> T:
    assert value is not None  # RankRun.__post_init__
    return value


@dataclass
class RankResult:
    """What one rank did and measured."""

    rank: int
    stage: int
    replica: int
    actions: list[str]  # executed, in order, every step (``str(Action)``)
    peak_inflight: int  # most micro-batches stashed at once
    step_ms: list[float]  # per step: start to optimizer step done
    forward_ms: list[float]  # per step: this rank's forward compute (with the loss)
    backward_ms: list[float]  # per step: this rank's backward compute
    loss: list[float]  # rank 0 only: the whole batch's loss, per step
    table: list[list[float]] = field(default_factory=list)  # rank 0: per step, per rank [fwd, bwd]
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> params
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # check: step 1's, summed
    state: dict[str, torch.Tensor] | None = None  # keep_state: the module's final state_dict
    grad_norm: list[float] = field(default_factory=list)  # per step, the whole model's
    lr: list[float] = field(default_factory=list)  # per step
    eval_loss: list[tuple[int, float]] = field(default_factory=list)  # rank 0: (step, loss)
    # bytes the stage module saved for backward, per micro-batch of the run's first step
    # (the saved-tensor hook: unique storages, parameters and buffers left out)
    activation_bytes: list[int] = field(default_factory=list)
    # CPU: per step, the thread's CPU time in forward and backward compute (one torch thread
    # computes in the calling thread): what a busy machine's other processes do not stretch
    forward_cpu_ms: list[float] = field(default_factory=list)
    backward_cpu_ms: list[float] = field(default_factory=list)
    # the run's peak of live tensor storages (CUDA: max_memory_allocated; CPU: the storage
    # tracker, :mod:`onnx_partition.runtime.memtrack`), the process's VmHWM (None where the OS
    # has none) and CUDA's allocator reserve (None elsewhere)
    memory_bytes: int | None = None
    resident_bytes: int | None = None
    reserved_bytes: int | None = None
    # the math this rank computed in, read back from torch's TF32 flags after its set-up
    math: str = "fp32"
    # per step, where the wall time went (ms; ``spans``: per action, from the step's start,
    # (action, start, end, of which blocked in receives); ``tail``: the step's end, from the
    # last action to the step done: sends awaited, gradient sums and the norm's all-reduce
    # (a barrier over every rank), the optimizer step)
    spans: list[list[tuple[str, float, float, float]]] = field(default_factory=list)
    tail: list[dict[str, float]] = field(default_factory=list)


def microbatch(batch: Mapping[str, torch.Tensor], m: int, count: int,
               names: Iterable[str] | None = None) -> Tensors:
    """Micro-batch ``m`` of ``count`` of ``names`` (all when None): the one split rule
    (:func:`onnx_partition.pipeline.microbatch.rows_of`; a step's ``B x M`` rows give
    micro-batch ``m`` rows ``m B .. (m + 1) B``); a
    :class:`~onnx_partition.runtime.train.rows.StepRows` reads only those rows."""
    own = getattr(batch, "microbatch", None)
    if own is not None:
        return dict(own(m, count, names))
    return rows_of(batch if names is None else {n: batch[n] for n in names}, m, count)
