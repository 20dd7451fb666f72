"""A seam at fixed points of every rank's run: :data:`RankHook`.

A hook travels to each rank with its configuration (``run_distributed(..., hook=)``,
``RankRun.hook``) and is called there as ``hook(rank, point)`` at these points:

* ``"compute"``: an inference rank, before it runs its stage on a micro-batch;
* ``"forward"``: a training rank, after each forward action;
* ``"checkpoint"``: a training rank, after writing its file of a checkpoint and before the
  checkpoint is published (:mod:`onnx_partition.runtime.train.checkpoint`).

Ranks start by ``spawn`` or from a fork server, so a hook must pickle: a module-level function,
or an instance of a module-level class, importable in the rank. Runs of the command line pass
none; the tests' faults (a rank that exits or stops mid-run) are hooks, and so is
:class:`KillOnce`, a drill for ``train --max-restarts``: one rank killed as ``kill -9`` kills
it, once.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["POINTS", "KillOnce", "RankHook"]

#: Where ranks call their hook.
POINTS = ("compute", "forward", "checkpoint")
RankHook = Callable[[int, str], None]


class KillOnce:
    """A training hook: ``rank`` kills itself (SIGKILL, as ``kill -9``) at its forward number
    ``at`` (1-based, counted in that process), once per ``marker`` file: the first run writes
    the time of the kill into it and dies; a restarted run finds it and trains on."""

    def __init__(self, marker: str, rank: int, at: int) -> None:
        self.marker, self.rank, self.at, self.seen = marker, rank, at, 0

    def __call__(self, rank: int, point: str) -> None:
        import os
        import signal
        import time
        from pathlib import Path

        if rank != self.rank or point != "forward":
            return
        self.seen += 1
        if self.seen == self.at and not Path(self.marker).exists():
            Path(self.marker).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
