"""The pipeline model: what a plan does in time and memory, with no solver, ONNX or torch in it.

:mod:`.schedules` (the action IR, the schedule builders and their registry), :mod:`.simulate`
(the event simulator), :mod:`.layout` (replica routing, the rank layout, relay sets),
:mod:`.memory` (the one memory and all-reduce model), :mod:`.microbatch` (splitting a batch into
micro-batches and back), :mod:`.from_plan` (a plan's costs for the simulator),
:mod:`.predict` (what a run of a plan should measure). Imports only the plan contract and the
base modules; the solvers, the runtimes and the report build on it.
"""

__all__ = ["from_plan", "layout", "memory", "microbatch", "predict", "schedules", "simulate"]
