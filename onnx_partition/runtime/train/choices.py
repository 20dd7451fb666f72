"""The training runtime's named choices, importable without torch: the command line's parser
lists them (``train --schedule/--optimizer/--engine``) before anything runs, and the runtime
checks a request against the same tuples."""

from __future__ import annotations

__all__ = ["ENGINES", "OPTIMIZERS", "SCHEDULES"]

#: The schedules a training rank executes (:mod:`onnx_partition.runtime.train.rank`).
SCHEDULES = ("1f1b", "gpipe")
#: Optimizers by CLI name (:func:`onnx_partition.runtime.train.reference.make_optimizer`).
OPTIMIZERS = ("sgd", "adamw")
#: ours (any plan); torch (``torch.distributed.pipelining``), refused for now.
ENGINES = ("ours", "torch")
