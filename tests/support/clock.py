"""A rank hook that records when each rank's forward actions end (wall clock, comparable across
the processes of one machine) and slows one rank's forwards: the send-timing tests' probe."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ForwardClock", "read_clock"]


@dataclass(frozen=True)
class ForwardClock:
    """Appends ``rank time`` to ``path`` after each forward; rank ``slow`` then sleeps
    ``delay_s`` (a slow forward, as its next one starts later)."""

    path: str
    slow: int
    delay_s: float

    def __call__(self, rank: int, point: str) -> None:
        if point != "forward":
            return
        with open(self.path, "a") as out:
            out.write(f"{rank} {time.time()!r}\n")
        if rank == self.slow:
            time.sleep(self.delay_s)


def read_clock(path: str | Path) -> dict[int, list[float]]:
    """Rank -> the times its forwards ended, in order."""
    ends: dict[int, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        rank, at = line.split()
        ends.setdefault(int(rank), []).append(float(at))
    return ends
