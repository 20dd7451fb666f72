"""Faults the tests inject through the production seams, never through the environment.

* rank hooks (:mod:`onnx_partition.runtime.launch.hooks`), passed as ``run_distributed(...,
  hook=)`` or ``RankRun(hook=)``: :class:`ExitAt` (the rank dies, as a crash or a kill
  would leave it) and :class:`StopAt` (the rank is stopped, as a hung one would be);
* a publication's ``step_hook`` (:func:`onnx_partition.plan.folder.publish`): :class:`CrashAt`.

Each is a frozen dataclass of this module, so it pickles by reference and reaches ranks started
by spawn or from a fork server, which import it as ``support.faults``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["CrashAt", "ExitAt", "StopAt"]


_REACHED: dict[tuple[int, str], int] = {}  # per process: (rank, point) -> times reached


@dataclass(frozen=True)
class ExitAt:
    """Rank ``rank`` exits at once with ``code`` (``os._exit``: no clean-up, no report) the
    ``nth`` time it reaches ``point`` (the first, by default)."""

    rank: int
    point: str
    code: int = 1
    nth: int = 1

    def __call__(self, rank: int, point: str) -> None:
        if (rank, point) == (self.rank, self.point):
            _REACHED[rank, point] = _REACHED.get((rank, point), 0) + 1
            if _REACHED[rank, point] >= self.nth:
                os._exit(self.code)


@dataclass(frozen=True)
class StopAt:
    """Rank ``rank`` stops itself (SIGSTOP: alive, silent) the first time it reaches
    ``point``."""

    rank: int
    point: str

    def __call__(self, rank: int, point: str) -> None:
        if (rank, point) == (self.rank, self.point):
            os.kill(os.getpid(), signal.SIGSTOP)


@dataclass(frozen=True)
class CrashAt:
    """A publication that dies with ``code`` (``os._exit``) at ``step``."""

    step: str
    code: int = 3

    def __call__(self, step: str) -> None:
        if step == self.step:
            os._exit(self.code)
