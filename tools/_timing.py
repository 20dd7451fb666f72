"""Timing shared by the benchmark scripts: medians of timed runs after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def samples_per_s(run: Callable[[], object], rows: int, iterations: int, warmup: int = 2) -> float:
    """``rows`` processed per second by ``run``: the median of ``iterations`` timed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(iterations):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return rows / statistics.median(times)
