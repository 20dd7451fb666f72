"""Cut a sequence of operators into pipeline stages by dynamic programming.

The sequence is a topological order of the DAG (or of its clustered blocks). A stage is a
contiguous run ``[i, j)`` of it; its time is its compute plus the transfer of every tensor that
crosses its two boundaries (the relay model of :mod:`onnx_partition.solve.problem`):

    time(i, j) = C[j] - C[i] + (cut[i] + cut[j]) / bandwidth + latency * (#interior boundaries)

with ``C`` the prefix sum of compute and ``cut[b]`` the bytes crossing boundary ``b`` (``cut[0]``
and ``cut[n]`` are 0: the pipeline's ends). The DP is the classic linear-partition recurrence
(Skiena, *The Algorithm Design Manual*, 8.5), minimising the bottleneck instead of a sum:

    f[s, j] = min_{s-1 <= i < j} max(f[s-1, i], time(i, j)),   f[0, 0] = 0

``f[s, j]`` is the best bottleneck of ``s`` non-empty stages covering positions ``[0, j)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnx_partition.errors import PartitionError


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
) -> SequenceSplit:
    """The split of a sequence into exactly ``num_stages`` non-empty stages whose slowest stage
    is fastest. ``cut_bytes[b]`` (length n + 1) is the bytes crossing boundary b.

    O(S n^2) time with the inner minimum vectorised; O(S n) memory for the argmin table.
    """
    n = len(compute_ms)
    if not 1 <= num_stages <= n:
        raise PartitionError(f"cannot cut {n} operators into {num_stages} non-empty stages")
    if len(cut_bytes) != n + 1:
        raise ValueError(f"cut_bytes needs n + 1 = {n + 1} entries, got {len(cut_bytes)}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(compute_ms, dtype=float))])
    cut = _cut_ms(cut_bytes, n, bandwidth_bytes_per_ms, latency_ms)

    # f[s, j]: best bottleneck of s stages over positions [0, j); arg[s, j]: start of the last.
    f = np.full((num_stages + 1, n + 1), np.inf)
    arg = np.zeros((num_stages + 1, n + 1), dtype=np.int64)
    f[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        # The last stage may start at i in [s-1, j-1]; later stages need n - j >= S - s nodes.
        for j in range(s, n - (num_stages - s) + 1):
            starts = np.arange(s - 1, j)
            last = prefix[j] - prefix[starts] + cut[starts] + cut[j]
            candidates = np.maximum(f[s - 1, starts], last)
            best = int(np.argmin(candidates))
            f[s, j], arg[s, j] = candidates[best], starts[best]

    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(int(arg[s, bounds[-1]]))
    bounds.reverse()
    times = [float(prefix[j] - prefix[i] + cut[i] + cut[j]) for i, j in itertools.pairwise(bounds)]
    assert bounds[0] == 0 and all(i < j for i, j in itertools.pairwise(bounds))
    assert math.isclose(max(times), float(f[num_stages, n]), rel_tol=1e-9, abs_tol=1e-12)
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
