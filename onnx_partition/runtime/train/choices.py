"""The training runtime's named choices, importable without torch: the command line's parser
lists them (``train --optimizer/--engine/--loss``; schedules are
:data:`onnx_partition.pipeline.schedules.TRAIN_NAMES`) before anything runs, and the runtime
checks a request against the same tuples. What ``train`` chooses where nothing is given is
:mod:`onnx_partition.settings.train` (the defaults) and :mod:`onnx_partition.request.train` (the
plan's choices)."""

from __future__ import annotations

__all__ = ["ENGINES", "LOSSES", "OPTIMIZERS", "PRECISIONS", "TORCH_SCHEDULES"]

#: Optimizers by CLI name (:func:`onnx_partition.runtime.train.optim.make_optimizer`; their
#: weight decay where none is given: :data:`~onnx_partition.settings.train.WEIGHT_DECAY`).
OPTIMIZERS = ("sgd", "adamw")
#: ours (any plan); torch (``torch.distributed.pipelining``, uniform plans: ``torch_engine``).
ENGINES = ("ours", "torch")
#: Schedules only ``--engine torch`` runs (torch's ``ScheduleInterleavedZeroBubble``).
TORCH_SCHEDULES = ("interleaved-zb",)
#: Losses by CLI name (:mod:`onnx_partition.runtime.train.loss`).
LOSSES = ("auto", "cross_entropy", "mse", "output")
#: Training precisions (``train --precision``): fp32, or bfloat16 autocast over fp32 weights.
PRECISIONS = ("fp32", "bf16")
