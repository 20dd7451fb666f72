"""Stage times as the pipeline sees them, and the per-node costs that reproduce them
(``profile --plan``: :mod:`onnx_partition.calibrate.recut` drives it).

A per-node profile prices a stage as the sum of its nodes measured one signature at a time on an
otherwise idle core; inside the pipeline the stage runs as one session beside the other stages
(shared caches, memory bandwidth, and on a shared machine other processes), and ``run`` measured
0.59-0.87x of ``simulate`` on CPU at 2 stages. So each stage is timed twice:

* **alone**: its callable (one onnxruntime session run, or a stage module's step) in a loop,
  ``warmup`` runs then the median of ``repeats``;
* **side by side**: every stage's callable in its own thread at once (as ``run`` does: one worker
  thread per stage replica; onnxruntime and torch release the GIL), each looping until all have
  made ``warmup + repeats`` runs, so every timed run overlaps the others; the median of each
  thread's runs after its warmup (the last run, which may finish alone, left out).

:func:`reprice` then scales each stage's nodes by ``measured / priced`` so that the stage sums
to the side-by-side time: the solvers re-cut on costs that include what running together costs
(the fixed point of :func:`onnx_partition.calibrate.calibrate_plan`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median

from onnx_partition.errors import PartitionError

__all__ = ["StageTimes", "reprice", "time_stages"]


@dataclass(frozen=True)
class StageTimes:
    """Median ms per callable: each alone, and all of them side by side."""

    alone_ms: list[float]
    together_ms: list[float]
    repeats: int
    warmup: int


def _alone(run: Callable[[], object], repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        began = time.perf_counter()
        run()
        if i >= warmup:
            times.append((time.perf_counter() - began) * 1e3)
    return median(times)


def _together(runs: Sequence[Callable[[], object]], repeats: int, warmup: int) -> list[float]:
    want = warmup + repeats
    done = [0] * len(runs)
    times: list[list[float]] = [[] for _ in runs]
    failures: list[BaseException] = []
    stop = threading.Event()
    start = threading.Barrier(len(runs))

    def loop(k: int) -> None:
        try:
            start.wait()
            while not stop.is_set():
                began = time.perf_counter()
                runs[k]()
                times[k].append((time.perf_counter() - began) * 1e3)
                done[k] += 1
                if all(d >= want for d in done):
                    stop.set()
        except BaseException as exc:  # reported below, on the caller's thread
            failures.append(exc)
            stop.set()
            start.abort()

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    out = []
    for series in times:
        kept = series[warmup:-1] if len(series) > warmup + 1 else series[-1:]
        out.append(median(kept))
    return out


def time_stages(runs: Sequence[Callable[[], object]], *, repeats: int = 10,
                warmup: int = 2) -> StageTimes:
    """Time each of ``runs`` alone, then all side by side in threads (module docstring)."""
    if not runs:
        raise PartitionError("no stages to time")
    if repeats < 1 or warmup < 0:
        raise PartitionError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    alone = [_alone(run, repeats, warmup) for run in runs]
    together = _together(runs, repeats, warmup) if len(runs) > 1 else list(alone)
    return StageTimes(alone, together, repeats, warmup)


def reprice(costs: Mapping[str, float], stages: Sequence[Sequence[str]],
            measured_ms: Sequence[float]) -> dict[str, float]:
    """``costs`` (node key -> ms) with each stage's nodes scaled so that they sum to that stage's
    measured ms; a stage priced at 0 gets its time spread evenly over its nodes. Nodes in no
    stage keep their cost."""
    if len(stages) != len(measured_ms):
        raise PartitionError(f"{len(stages)} stages, {len(measured_ms)} measured times")
    out = dict(costs)
    for nodes, measured in zip(stages, measured_ms, strict=True):
        priced = sum(costs.get(n, 0.0) for n in nodes)
        for n in nodes:
            if priced > 0:
                out[n] = costs.get(n, 0.0) * measured / priced
            else:
                out[n] = measured / len(nodes)
    return out
