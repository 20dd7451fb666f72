"""A seam at fixed points of every rank's run: :data:`RankHook`.

A hook travels to each rank with its configuration (``run_distributed(..., hook=)``,
``RankRun.hook``) and is called there as ``hook(rank, point)`` at these points:

* ``"compute"``: an inference rank, before it runs its stage on a micro-batch;
* ``"forward"``: a training rank, after each forward action;
* ``"checkpoint"``: a training rank, after writing its file of a checkpoint and before the
  checkpoint is published (:mod:`onnx_partition.runtime.train.checkpoint`).

Ranks start by ``spawn`` or from a fork server, so a hook must pickle: a module-level function,
or an instance of a module-level class, importable in the rank. Runs of the command line pass
none; the tests' faults (a rank that exits or stops mid-run) are hooks.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["POINTS", "RankHook"]

#: Where ranks call their hook.
POINTS = ("compute", "forward", "checkpoint")
RankHook = Callable[[int, str], None]
