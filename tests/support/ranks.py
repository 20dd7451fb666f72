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

