"""Serving a plan: :mod:`.sessions` (onnxruntime sessions of the stage files), :mod:`.pipeline`
(threads in one process), :mod:`.worker` and :mod:`.processes` (one process per stage replica),
:mod:`.torchrun_rank` (one rank under torchrun), :mod:`.check` (outputs against the whole model),
:mod:`.measure` (a run measured against its prediction)."""

__all__ = ["check", "measure", "pipeline", "processes", "sessions", "torchrun_rank", "worker"]
