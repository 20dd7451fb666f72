"""Serving a plan: :mod:`.sessions` (onnxruntime sessions of the stage files), :mod:`.pipeline`
(threads in one process), :mod:`.rank` and :mod:`.distributed` (one process per stage replica),
:mod:`.check` (outputs against the whole model), :mod:`.measure` (a run measured against its
prediction)."""

__all__ = ["check", "distributed", "measure", "pipeline", "rank", "sessions"]
