"""Where micro-batches and tensors go: replica routing, the rank layout and the relay sets.

**Routing.** Replica ``j`` of a stage with ``r`` replicas takes the micro-batches ``m`` with
``m mod r = j`` (:func:`replica_of`): the schedules (:mod:`.schedules`), the simulator, the
scorer's placement of transfers, the threaded and the multi-process runtimes and the training
runtime all route by it, so replica counts may differ between stages.

**Relay sets.** A tensor crosses every boundary between the stage that makes it and the last
stage that needs it (the cost model's relay model): after stage ``k`` the pipeline keeps what a
later stage reads or the graph outputs name (:func:`needed_after`); the hop after stage ``k``
carries what is available there and still needed (:attr:`Layout.send_names`).

**Rank layout** (:class:`Layout`, :func:`layout`): one process per stage replica, stage 0's
replicas first, then stage 1's, and so on (replicas consecutive), so the rank serving
micro-batch ``m`` at stage ``k`` is ``first[k] + m mod replicas[k]``. Used by the distributed
inference runtime and the training runtime alike. Pure Python: the plan contract only.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from onnx_partition.errors import PartitionError
from onnx_partition.plan import Plan

__all__ = ["Layout", "layout", "needed_after", "relay_names", "replica_of"]


def replica_of(microbatch: int, replicas: int) -> int:
    """The replica (of a stage with ``replicas`` of them) that takes micro-batch
    ``microbatch``: ``microbatch mod replicas``."""
    return microbatch % replicas


def needed_after(plan: Plan) -> list[set[str]]:
    """Per stage ``k``, the tensor names still needed after it: the inputs of the stages after
    ``k`` and the graph outputs."""
    return _needed([s.inputs for s in plan.stages], [o.name for o in plan.outputs])


def _needed(stage_inputs: Sequence[Collection[str]], outputs: Collection[str]
            ) -> list[set[str]]:
    return [{n for names in stage_inputs[k + 1:] for n in names} | set(outputs)
            for k in range(len(stage_inputs))]


def relay_names(inputs: Collection[str], stage_inputs: Sequence[Collection[str]],
                stage_outputs: Sequence[Collection[str]], outputs: Collection[str]
                ) -> tuple[list[list[str]], list[list[str]]]:
    """Per stage, the tensors it receives and those it sends on (the last stage: the graph
    outputs), given the graph's ``inputs`` and ``outputs`` and each stage file's: what is
    available there (a graph input, or made by a stage so far) and read by the stage or
    needed after it (:func:`needed_after`). A tensor so crosses every boundary between the
    stage making it and the last one reading it, as the cost model's relay model says, and
    the memory model counts these bytes (``graph_arrays.stage_sizes``). A PartitionError if a
    stage reads a tensor no earlier stage or graph input makes."""
    avail = set(inputs)
    recv, send = [], []
    for k, (read, keep) in enumerate(zip(stage_inputs, _needed(stage_inputs, outputs),
                                         strict=True)):
        missing = [n for n in read if n not in avail]
        if missing:
            raise PartitionError(f"plan.json: stage {k} reads {missing[0]!r}, which no earlier "
                                 f"stage or graph input makes")
        recv.append(sorted(avail & (set(read) | keep)))
        avail |= set(stage_outputs[k])
        send.append(sorted(avail & keep))
    lost = sorted(set(outputs) - avail)
    if lost:
        raise PartitionError(f"plan.json: no stage makes the graph output {lost[0]!r}")
    return recv, send


@dataclass(frozen=True)
class Layout:
    """Where each stage replica runs and which tensors every hop carries."""

    replicas: list[int]  # per stage
    first: list[int]  # first rank of each stage
    devices: list[list[str]]  # per stage, per replica
    recv_names: list[list[str]]  # tensors stage k's replicas receive (stage 0: from rank 0)
    send_names: list[list[str]]  # tensors stage k sends on (the last stage: outputs to rank 0)

    @property
    def world_size(self) -> int:
        return sum(self.replicas)

    @property
    def stages(self) -> int:
        return len(self.replicas)

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for k in reversed(range(self.stages)):
            if rank >= self.first[k]:
                return k, rank - self.first[k]
        raise ValueError(f"rank {rank} is not in the layout")

    def rank_of(self, stage: int, m: int) -> int:
        """The rank serving micro-batch ``m`` at ``stage``."""
        return self.first[stage] + replica_of(m, self.replicas[stage])

    def name(self, rank: int) -> str:
        k, r = self.place(rank)
        return f"stage {k} replica {r} (rank {rank}, {self.devices[k][r]})"


def layout(plan: Plan) -> Layout:
    """The rank layout and relay sets of ``plan``; a PartitionError if a stage reads a tensor
    that no earlier stage or graph input makes."""
    replicas = [max(1, s.replicas) for s in plan.stages]
    first = list(itertools.accumulate([0, *replicas]))[:-1]
    devices = [[(s.devices or ["cpu"])[r % len(s.devices or ["cpu"])] for r in range(d)]
               for s, d in zip(plan.stages, replicas, strict=True)]
    recv, send = relay_names([i.name for i in plan.inputs], [s.inputs for s in plan.stages],
                             [s.outputs for s in plan.stages], [o.name for o in plan.outputs])
    return Layout(replicas, first, devices, recv, send)
