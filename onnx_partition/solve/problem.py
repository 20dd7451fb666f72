"""The partition problem as plain arrays, and its cost model (the relay model).

Nodes ``0..n-1`` with compute times; tensors with a producer (or -1 for a graph input), consumers
and bytes. A stage assignment is valid when every stage is non-empty and no tensor flows
backwards. :meth:`DagProblem.stage_times` is the one place the cost model is written in code; the
DP (over sequences), the refinement, the ILP and the brute force all agree with it:

* a tensor ``t`` is made at ``first(t) = stage(producer[t])`` (``0`` for a graph input: graph
  inputs are available at the pipeline start and relayed) and last needed at ``last(t) =``
  the largest stage of its consumers (``S-1`` if it is a graph output);
* it crosses interior boundary ``b`` (between stages ``b`` and ``b+1``) iff
  ``first(t) <= b < last(t)``; a tensor nobody reads that is not an output crosses nothing;
* ``time(s) = compute(s) + (cross_bytes(s-1) + cross_bytes(s)) / bandwidth
  + latency * ([s > 0] + [s < S-1])``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from onnx_partition.dag import kahn_order
from onnx_partition.errors import PartitionError

__all__ = ["DagProblem", "TensorArrays", "topological_order"]


class TensorArrays(NamedTuple):
    """A problem's tensors as arrays: one entry per (tensor, consumer) pair, then per tensor."""

    read_tensor: np.ndarray  # the tensor of each (tensor, consumer) pair
    read_by: np.ndarray  # its consumer node
    producer: np.ndarray
    is_output: np.ndarray
    nbytes: np.ndarray


@dataclass(frozen=True)
class DagProblem:
    """An operator DAG with per-node compute times and per-tensor sizes.

    Nodes are ``0..n-1``; tensors ``0..T-1``. ``producer[t]`` is a node index or ``-1`` for a
    graph input; ``consumers[t]`` lists node indices (may be empty); ``is_output[t]`` marks a
    graph output. Times are in milliseconds, sizes in bytes. ``bandwidth_bytes_per_ms = inf``
    makes transfers free (latency still counts if it is non-zero).

    The fields are normalised to tuples of Python scalars on construction and validated;
    a bad problem (wrong lengths, negative or non-finite values, indices out of range, a
    cycle) raises :class:`PartitionError`.
    """

    compute_ms: Sequence[float]
    producer: Sequence[int]
    consumers: Sequence[Sequence[int]]
    is_output: Sequence[bool]
    nbytes: Sequence[float]
    bandwidth_bytes_per_ms: float = math.inf
    latency_ms: float = 0.0

    def __post_init__(self) -> None:
        compute = tuple(float(c) for c in self.compute_ms)
        producer = tuple(int(p) for p in self.producer)
        consumers = tuple(tuple(int(c) for c in cs) for cs in self.consumers)
        is_output = tuple(bool(o) for o in self.is_output)
        nbytes = tuple(float(b) for b in self.nbytes)
        object.__setattr__(self, "compute_ms", compute)
        object.__setattr__(self, "producer", producer)
        object.__setattr__(self, "consumers", consumers)
        object.__setattr__(self, "is_output", is_output)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "bandwidth_bytes_per_ms", float(self.bandwidth_bytes_per_ms))
        object.__setattr__(self, "latency_ms", float(self.latency_ms))

        n, num_t = len(compute), len(producer)
        if not (len(consumers) == len(is_output) == len(nbytes) == num_t):
            raise PartitionError(
                f"tensor arrays differ in length: producer {num_t}, consumers {len(consumers)}, "
                f"is_output {len(is_output)}, nbytes {len(nbytes)}"
            )
        for i, c in enumerate(compute):
            if not (math.isfinite(c) and c >= 0.0):
                raise PartitionError(f"compute_ms[{i}] must be finite and >= 0, got {c}")
        for t in range(num_t):
            if not (math.isfinite(nbytes[t]) and nbytes[t] >= 0.0):
                raise PartitionError(f"nbytes[{t}] must be finite and >= 0, got {nbytes[t]}")
            if not -1 <= producer[t] < n:
                raise PartitionError(f"producer[{t}] = {producer[t]} is not a node or -1")
            for c in consumers[t]:
                if not 0 <= c < n:
                    raise PartitionError(f"consumers[{t}] contains {c}, which is not a node")
        if not self.bandwidth_bytes_per_ms > 0.0:
            raise PartitionError(f"bandwidth must be > 0, got {self.bandwidth_bytes_per_ms}")
        if not (math.isfinite(self.latency_ms) and self.latency_ms >= 0.0):
            raise PartitionError(f"latency_ms must be finite and >= 0, got {self.latency_ms}")
        if len(topological_order(self)) != n:
            raise PartitionError("the graph has a cycle: it cannot be split into pipeline stages")

    def reweighted(self, compute_ms: Sequence[float], nbytes: Sequence[float]) -> DagProblem:
        """The same DAG and links with other compute times and tensor sizes. The structure was
        checked when this problem was built, so only the new numbers are (no cycle search)."""
        compute = tuple(float(c) for c in compute_ms)
        sizes = tuple(float(b) for b in nbytes)
        if len(compute) != self.num_nodes or len(sizes) != self.num_tensors:
            raise PartitionError(f"reweighted needs {self.num_nodes} compute times and "
                                 f"{self.num_tensors} sizes, got {len(compute)} and {len(sizes)}")
        if not all(math.isfinite(v) and v >= 0.0 for v in compute + sizes):
            raise PartitionError("reweighted compute times and sizes must be finite and >= 0")
        twin = object.__new__(DagProblem)
        for name, value in (("compute_ms", compute), ("producer", self.producer),
                            ("consumers", self.consumers), ("is_output", self.is_output),
                            ("nbytes", sizes),
                            ("bandwidth_bytes_per_ms", self.bandwidth_bytes_per_ms),
                            ("latency_ms", self.latency_ms)):
            object.__setattr__(twin, name, value)
        return twin

    @property
    def num_nodes(self) -> int:
        return len(self.compute_ms)

    @property
    def num_tensors(self) -> int:
        return len(self.producer)

    def edges(self) -> list[tuple[int, int]]:
        """Distinct (producer, consumer) node pairs, graph inputs left out."""
        return [(p, c) for p, succ in enumerate(self.successors) for c in succ]

    @functools.cached_property
    def successors(self) -> tuple[tuple[int, ...], ...]:
        """Node -> its distinct consumer nodes, ascending (a node reading its own output, which
        only a cyclic graph has, is kept so the cycle check sees it)."""
        succ: list[set[int]] = [set() for _ in range(len(self.compute_ms))]
        for p, cs in zip(self.producer, self.consumers, strict=True):
            if p >= 0:
                succ[p].update(cs)
        return tuple(tuple(sorted(s)) for s in succ)

    @functools.cached_property
    def made_by(self) -> tuple[tuple[int, ...], ...]:
        """Node -> the tensors it makes, ascending."""
        made: list[list[int]] = [[] for _ in range(len(self.compute_ms))]
        for t, p in enumerate(self.producer):
            if p >= 0:
                made[p].append(t)
        return tuple(tuple(m) for m in made)

    @functools.cached_property
    def read_by(self) -> tuple[tuple[int, ...], ...]:
        """Node -> the distinct tensors it reads, ascending."""
        reads: list[list[int]] = [[] for _ in range(len(self.compute_ms))]
        for t, cs in enumerate(self.consumers):
            for c in set(cs):
                reads[c].append(t)
        return tuple(tuple(r) for r in reads)

    def in_degrees(self) -> list[int]:
        """Node -> how many distinct nodes feed it (a fresh list: Kahn-style walks consume it)."""
        degree = [0] * self.num_nodes
        for succ in self.successors:
            for c in succ:
                degree[c] += 1
        return degree

    @functools.cached_property
    def compute_array(self) -> np.ndarray:
        return np.asarray(self.compute_ms, dtype=float)

    @functools.cached_property
    def arrays(self) -> TensorArrays:
        """The tensors as numpy arrays, for vectorised passes over them."""
        pairs = [(t, c) for t, cs in enumerate(self.consumers) for c in cs]
        flat = np.array(pairs, dtype=np.int64).reshape(-1, 2)
        return TensorArrays(flat[:, 0], flat[:, 1], np.asarray(self.producer, dtype=np.int64),
                            np.asarray(self.is_output, dtype=bool),
                            np.asarray(self.nbytes, dtype=float))

    def _check_assignment(self, stage_of: Sequence[int], num_stages: int) -> np.ndarray:
        if num_stages < 1:
            raise PartitionError(f"num_stages must be >= 1, got {num_stages}")
        if len(stage_of) != self.num_nodes:
            raise PartitionError(
                f"assignment has {len(stage_of)} entries for {self.num_nodes} nodes"
            )
        stages = np.asarray(stage_of, dtype=np.int64)
        bad = np.flatnonzero((stages < 0) | (stages >= num_stages))
        if bad.size:
            i = int(bad[0])
            raise PartitionError(f"stage_of[{i}] = {stage_of[i]} is outside 0..{num_stages - 1}")
        return stages

    def cross_bytes(self, stage_of: Sequence[int], num_stages: int) -> list[float]:
        """Bytes crossing each interior boundary ``b = 0..S-2`` under the relay model."""
        stages = self._check_assignment(stage_of, num_stages)
        cons_t, cons_v, producer, is_output, nbytes = self.arrays
        last = np.full(len(producer), -1, dtype=np.int64)
        np.maximum.at(last, cons_t, stages[cons_v])
        last[is_output] = num_stages - 1
        first = np.where(producer >= 0, stages[np.maximum(producer, 0)], 0)
        crossing = first < last
        diff = np.bincount(first[crossing], nbytes[crossing], minlength=num_stages + 1)
        diff -= np.bincount(last[crossing], nbytes[crossing], minlength=num_stages + 1)
        return [float(x) for x in np.cumsum(diff)[: num_stages - 1]]

    def stage_times(self, stage_of: Sequence[int], num_stages: int) -> list[float]:
        """Time of every stage for any assignment (valid or not), per the module's cost model."""
        cross = self.cross_bytes(stage_of, num_stages)
        compute = [0.0] * num_stages
        for i, s in enumerate(stage_of):
            compute[s] += self.compute_ms[i]
        times: list[float] = []
        for s in range(num_stages):
            left = cross[s - 1] if s > 0 else 0.0
            right = cross[s] if s < num_stages - 1 else 0.0
            hops = (s > 0) + (s < num_stages - 1)
            comm = (left + right) / self.bandwidth_bytes_per_ms if hops else 0.0
            times.append(compute[s] + comm + self.latency_ms * hops)
        return times

    def bottleneck_ms(self, stage_of: Sequence[int], num_stages: int) -> float:
        """The slowest stage's time: the objective the solvers minimise."""
        return max(self.stage_times(stage_of, num_stages))

    def is_valid(self, stage_of: Sequence[int], num_stages: int) -> bool:
        """True iff there are exactly ``num_stages`` non-empty stages and no tensor flows back."""
        if num_stages < 1 or len(stage_of) != self.num_nodes:
            return False
        if any(not 0 <= s < num_stages for s in stage_of):
            return False
        if len(set(stage_of)) != num_stages:
            return False
        return all(stage_of[p] <= stage_of[c] for p, c in self.edges())


def topological_order(problem: DagProblem) -> list[int]:
    """Kahn's order, smallest index first among ready nodes; shorter than n iff there is a cycle."""
    return kahn_order(problem.successors)
