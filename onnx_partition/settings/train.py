"""What a training run takes, as data (each default written once, here): the :class:`TrainJob`
tree that ``train``, its torchrun entry, :func:`~onnx_partition.runtime.train.trainer.train_plan`
and every rank read. torchtitan's ``JobConfig`` is the model: one frozen dataclass per concern
(:class:`OptimizerSettings`, :class:`ScheduleSettings`, :class:`DataSettings`,
:class:`CheckpointSettings`, :class:`PretrainedSettings`, :class:`EngineSettings`,
:class:`LoggingSettings`) under the job.

Each field has one flat name, its ``keyword``: the ``train_plan`` keyword and the ``train``
option's ``dest`` (``--checkpoint-dir`` is ``checkpoint_dir``, the field
``CheckpointSettings.dir``); a field's keyword is its name unless its metadata says another.
:mod:`onnx_partition.request.train` builds a job from those keywords and resolves it against
a plan (a None below: what the plan was priced for, else :data:`TRAIN_FALLBACKS`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULTS", "LOCAL_TIMEOUT_S", "ROWS_FALLBACK", "TORCHRUN_TIMEOUT_S",
           "TRAIN_FALLBACKS", "WEIGHT_DECAY", "CheckpointSettings", "DataSettings",
           "EngineSettings", "LoggingSettings", "OptimizerSettings", "PathArg",
           "PretrainedSettings", "ScheduleSettings", "TrainJob"]

#: A path given on the command line or to the API.
PathArg = str | os.PathLike[str]

#: What ``train`` uses when neither the caller nor the plan (plan.json's ``optimizer``,
#: ``precision``, ``schedule``: what it was priced for) says.
TRAIN_FALLBACKS = {"optimizer": "sgd", "precision": "fp32", "schedule": "1f1b"}
#: Each optimizer's weight decay where ``--weight-decay`` is not given (``torch.optim``'s).
WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}
#: Rows per micro-batch when neither ``--batch-size`` nor the plan says.
ROWS_FALLBACK = 1
#: Seconds a rank may block on one collective, where ``timeout_s`` is None: started here
#: (``train``, ``train_plan``: the launcher's supervision too), or by ``torchrun``.
LOCAL_TIMEOUT_S = 120.0
TORCHRUN_TIMEOUT_S = 60.0


def _keyword(name: str) -> dict[str, str]:
    """A field's metadata: its flat name (the ``train_plan`` keyword, the option's ``dest``)."""
    return {"keyword": name}


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and its learning rate over the run (``torch.optim``'s SGD or AdamW;
    :mod:`onnx_partition.runtime.train.lr_schedule`)."""

    name: str | None = field(default=None, metadata=_keyword("optimizer"))  # None: the plan's
    lr: float = 0.01
    weight_decay: float | None = None  # None: WEIGHT_DECAY[name]
    momentum: float = 0.0  # SGD's
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    warmup_steps: int = 0  # linear warm-up from 0
    lr_schedule: str = "constant"  # after the warm-up, over the run's steps in all
    clip_grad_norm: float | None = None  # by the whole model's gradient norm


@dataclass(frozen=True)
class ScheduleSettings:
    """The pipeline schedule every rank executes and the step's shape: ``microbatches`` of
    ``batch_size`` rows (None: the plan's own)."""

    name: str | None = field(default=None, metadata=_keyword("schedule"))  # None: the plan's
    microbatches: int | None = None  # per step
    batch_size: int | None = None  # rows per micro-batch


@dataclass(frozen=True)
class DataSettings:
    """What the run trains on and is validated on (:mod:`onnx_partition.runtime.train.data`).
    ``file``: a ``.npz`` or a folder of ``.npy``; the Python API also takes a mapping of arrays
    or a factory of batches; None: synthetic batches from the seed. ``loss`` by name, or
    ``loss_fn(outputs, targets) -> scalar`` (the API's)."""

    file: Any = field(default=None, metadata=_keyword("data"))
    shuffle: int | None = None  # permute the rows once per epoch from this seed
    loss: str = "auto"
    loss_fn: Callable[..., Any] | None = None
    eval_file: PathArg | None = field(default=None, metadata=_keyword("eval_data"))
    eval_every: int = 0  # steps between validation losses (0: none)


@dataclass(frozen=True)
class CheckpointSettings:
    """Checkpoints every ``every`` steps into ``dir``, a run resumed from ``resume``, and up to
    ``max_restarts`` restarts after a lost rank (from ``dir``'s newest complete checkpoint)."""

    dir: PathArg | None = field(default=None, metadata=_keyword("checkpoint_dir"))
    every: int = field(default=0, metadata=_keyword("checkpoint_every"))
    resume: PathArg | None = None  # a checkpoint folder: its latest complete checkpoint
    # a lost rank restarts every rank from the newest complete checkpoint in ``dir``, this often
    max_restarts: int = field(default=0, metadata=_keyword("max_restarts"))


@dataclass(frozen=True)
class PretrainedSettings:
    """Weights in from a ``save_pretrained`` folder (``load``: ``--from-pretrained``) and out
    to one (``save``: ``--save-pretrained``, float tensors in ``dtype``, with ``config``'s
    config.json, else the loaded folder's)."""

    load: PathArg | None = field(default=None, metadata=_keyword("from_pretrained"))
    save: PathArg | None = field(default=None, metadata=_keyword("save_pretrained"))
    dtype: str = field(default="fp32", metadata=_keyword("save_dtype"))
    config: PathArg | None = field(default=None, metadata=_keyword("hf_config"))


@dataclass(frozen=True)
class EngineSettings:
    """What runs the ranks: ``name`` (ours, or torch pipelining), the ``precision`` (None: the
    plan's), the processes (``nproc``, None: one per stage replica), the process group's
    ``backend`` (None: nccl when every rank has its own GPU, else gloo), ``timeout_s`` (None:
    :data:`LOCAL_TIMEOUT_S` or :data:`TORCHRUN_TIMEOUT_S`) and torch's intra-op ``threads``
    per rank (0: torch's default)."""

    name: str = field(default="ours", metadata=_keyword("engine"))
    precision: str | None = None
    nproc: int | None = None
    backend: str | None = None
    timeout_s: float | None = None
    threads: int = 1


@dataclass(frozen=True)
class LoggingSettings:
    """What the run says: a JSON object per step appended to ``file``; rank 0's line per step
    (``verbose``), a progress bar on a terminal (``progress``), one JSON object at the end
    instead of the summary (``json``: ``train --json``)."""

    file: PathArg | None = field(default=None, metadata=_keyword("log"))
    verbose: bool = False
    progress: bool = False
    json: bool = False


@dataclass(frozen=True)
class TrainJob:
    """One training run: ``steps`` in all (a resumed run's included), ``seed`` (dropout, and the
    synthetic batches), ``check`` (dropout off; every rank's gradients and parameters compared
    with single-process training), ``save`` (the trained weights as a new plan folder),
    ``record`` (the measured stage times as a ``simulator_costs`` file), and the groups."""

    steps: int = 10
    seed: int = 0
    check: bool = False
    save: PathArg | None = None
    record: PathArg | None = None
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    pretrained: PretrainedSettings = field(default_factory=PretrainedSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)


#: Every default, as a job: ``DEFAULTS.optimizer.lr`` is the learning rate's.
DEFAULTS = TrainJob()
