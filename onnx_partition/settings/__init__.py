"""Every setting a verb takes, as frozen dataclasses with each default written once, here:
:mod:`.partition` (what a plan is planned for: :class:`~.partition.TrainSpec`) and :mod:`.train`
(what a training run takes). Plain data, standard library only: the command line and the Python
API build them (:mod:`onnx_partition.request`), every layer below reads them."""

__all__ = ["export", "partition", "train"]
