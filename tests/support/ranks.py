"""Rank bodies for :func:`onnx_partition.runtime.launch.ranks.launch_ranks` tests: module-level,
so that the launcher's worker processes can import them."""

from __future__ import annotations

import time
from typing import Any


def fail_after(rank: int, store: Any, world: int, delay_s: float, message: str) -> None:
    """Wait until all ``world`` ranks have started (on the launcher's store), then ``delay_s``,
    then raise ``RuntimeError(message)`` (an error of no declared kind)."""
    if store.add("started", 1) == world:
        store.set("go", "1")
    store.wait(["go"])
    time.sleep(delay_s)
    raise RuntimeError(message)


class KillOnce:
    """A training hook: ``rank`` kills itself (SIGKILL, as ``kill -9``) at its forward number
    ``at`` (1-based, counted in this process), once per ``marker`` file: the first run
    creates it and dies, a restarted run finds it and trains on."""

    def __init__(self, marker: str, rank: int, at: int) -> None:
        self.marker, self.rank, self.at, self.seen = marker, rank, at, 0

    def __call__(self, rank: int, point: str) -> None:
        import os
        import signal
        from pathlib import Path

        if rank != self.rank or point != "forward":
            return
        self.seen += 1
        if self.seen == self.at and not Path(self.marker).exists():
            Path(self.marker).write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)
