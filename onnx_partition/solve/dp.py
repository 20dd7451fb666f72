"""Cut a sequence of operators into pipeline stages by dynamic programming.

The sequence is a topological order of the DAG (or of its clustered blocks). A stage is a
contiguous run ``[i, j)`` of it; its time is its compute plus the transfer of every tensor that
crosses its two boundaries (the relay model of :mod:`onnx_partition.solve.problem`):

    time(i, j) = C[j] - C[i] + (cut[i] + cut[j]) / bandwidth + latency * (#interior boundaries)

with ``C`` the prefix sum of compute and ``cut[b]`` the bytes crossing boundary ``b`` (``cut[0]``
and ``cut[n]`` are 0: the pipeline's ends). The optimum is that of the classic
linear-partition recurrence (Skiena, *The Algorithm Design Manual*, 8.5), minimising the
bottleneck instead of a sum:

    f[s, j] = min_{s-1 <= i < j} max(f[s-1, i], time(i, j)),   f[0, 0] = 0

``f[s, j]`` is the best bottleneck of ``s`` non-empty stages covering positions ``[0, j)``;
:func:`split_sequence` finds it by a parametric search instead of filling the table.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_partition.errors import PartitionError

__all__ = ["SequenceSplit", "split_sequence", "stage_times"]


@dataclass(frozen=True)
class SequenceSplit:
    """Stage boundaries ``[0, b1, ..., n]`` of a sequence and the times they give."""

    bounds: list[int]
    stage_ms: list[float]

    @property
    def bottleneck_ms(self) -> float:
        return max(self.stage_ms)


def stage_times(
    compute_ms: Sequence[float],
    cut_bytes: Sequence[float] | np.ndarray,
    bounds: Sequence[int],
    *,
    bandwidth_bytes_per_ms: float = math.inf,
    latency_ms: float = 0.0,
) -> list[float]:
    """Time of every stage of a split, under the model in the module docstring."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(compute_ms, dtype=float))])
    cut = _cut_ms(cut_bytes, len(compute_ms), bandwidth_bytes_per_ms, latency_ms)
    return [float(prefix[j] - prefix[i] + cut[i] + cut[j]) for i, j in itertools.pairwise(bounds)]


def split_sequence(
    compute_ms: Sequence[float],
    cut_bytes: Sequence[float] | np.ndarray,
    num_stages: int,
    *,
    bandwidth_bytes_per_ms: float = math.inf,
    latency_ms: float = 0.0,
    precision: float = 1e-12,
) -> SequenceSplit:
    """The split of a sequence into exactly ``num_stages`` non-empty stages whose slowest stage
    is fastest (to a relative ``precision``). ``cut_bytes[b]`` (length n + 1) is the bytes
    crossing boundary b.

    Parametric search (the "probe" approach to 1-D partitioning, Pinar and Aykanat, JPDC 2004):
    bisect on the bottleneck ``T``; a probe decides whether ``T`` is reachable. Writing a stage's
    time as ``g[j] - h[i]`` with ``g = C + cut`` and ``h = C - cut``, position ``j`` closes the
    ``s``-th stage iff some position ``i < j`` closing ``s - 1`` stages has ``h[i] >= g[j] - T``:
    a running maximum, so one probe is O(S n) vectorised and the search O(S n log(1/eps)), which
    equals the recurrence above to float precision.
    """
    n = len(compute_ms)
    if not 1 <= num_stages <= n:
        raise PartitionError(f"cannot cut {n} operators into {num_stages} non-empty stages")
    if len(cut_bytes) != n + 1:
        raise ValueError(f"cut_bytes needs n + 1 = {n + 1} entries, got {len(cut_bytes)}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(compute_ms, dtype=float))])
    cut = _cut_ms(cut_bytes, n, bandwidth_bytes_per_ms, latency_ms)
    g, h = prefix + cut, prefix - cut

    def reachable(limit: float) -> np.ndarray:
        """reach[s, j]: s stages, each at most ``limit``, cover exactly [0, j)."""
        reach = np.zeros((num_stages + 1, n + 1), dtype=bool)
        reach[0, 0] = True
        for s in range(1, num_stages + 1):
            best = np.maximum.accumulate(np.where(reach[s - 1], h, -np.inf))
            reach[s, 1:] = best[:-1] >= g[1:] - limit
        return reach

    # Every stage's time is at least its compute, and the stages share all of it.
    lo = max(float(prefix[-1]) / num_stages, float(np.max(np.diff(prefix))))
    hi = float(prefix[-1] + 2.0 * cut.max())  # any split meets this, up to rounding:
    step = max(abs(hi), 1.0) * np.finfo(float).eps
    while not reachable(hi)[num_stages, n]:  # a cut below hi's last bit must still fit
        hi, step = hi + step, 2.0 * step
    reach = reachable(lo)
    if reach[num_stages, n]:
        hi = lo
    else:
        for _ in range(200):
            if hi - lo <= precision * hi:
                break
            mid = (lo + hi) / 2
            probe = reachable(mid)
            if probe[num_stages, n]:
                hi = mid
            else:
                lo = mid
        reach = reachable(hi)

    bounds = [n]
    for s in range(num_stages, 0, -1):  # the last stage's start: the cheapest reachable one
        j = bounds[-1]
        starts = np.flatnonzero(reach[s - 1, :j] & (h[:j] >= g[j] - hi))
        bounds.append(int(starts[np.argmax(h[starts])]))
    bounds.reverse()
    times = [float(prefix[j] - prefix[i] + cut[i] + cut[j]) for i, j in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and all(i < j for i, j in itertools.pairwise(bounds))
    return SequenceSplit(bounds, times)


def _cut_ms(
    cut_bytes: Sequence[float] | np.ndarray,
    n: int,
    bandwidth_bytes_per_ms: float,
    latency_ms: float,
) -> np.ndarray:
    """Per-boundary time charged to each adjacent stage; the pipeline's ends cost nothing."""
    cut = np.asarray(cut_bytes, dtype=float) / bandwidth_bytes_per_ms + latency_ms
    cut[0] = cut[n] = 0.0
    return cut
