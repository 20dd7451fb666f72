"""The devices a plan runs on: machines x devices, memory, speed, and the links between them.

``cluster.json``::

    {"format": "onnx-partition/cluster@1", "kind": "cuda", "gpu": "h100", "machines": 2,
     "devices_per_machine": 8, "memory_gb": 80, "speed": 1.0,
     "intra": {"bandwidth_gbps": 300, "latency_ms": 0.005},
     "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02}}

Bandwidths are in GB/s (1e9 bytes per second), memory in GB (1e9 bytes). ``speed`` divides every
compute time (a device twice as fast as the one the costs were measured on has speed 2). ``gpu``
names the GPU the analytic costs price (:mod:`onnx_partition.cost.devices`, ``NAME[:MODE]``;
default ``h100``) when no costs file is given; it needs ``"kind": "cuda"``.

A mixed fleet (``cluster@2``) lists each kind of GPU as a group instead, the machines placed in
file order, one ``inter`` link between any two machines (:class:`Fleet`)::

    {"format": "onnx-partition/cluster@2", "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02},
     "groups": [{"gpu": "a100-80gb", "machines": 1, "devices_per_machine": 4,
                 "intra": {"bandwidth_gbps": 300, "latency_ms": 0.005}},
                {"gpu": "v100", "machines": 1, "devices_per_machine": 4, "memory_gb": 32,
                 "intra": {"bandwidth_gbps": 150, "latency_ms": 0.005}}]}
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json
from onnx_partition.plan.contracts import (
    CLUSTER_FORMAT,
    FLEET_FORMAT,
    ClusterFields,
    FleetFields,
    GroupFields,
    Link,
)
from onnx_partition.plan.declare import json_of
from onnx_partition.values import MAX_BYTES, Rule, check

__all__ = ["FORMAT", "Cluster", "Fleet", "GpuGroup", "Link", "load_cluster", "parse_bytes"]

FORMAT = CLUSTER_FORMAT


@dataclass(frozen=True)
class Cluster(ClusterFields):
    """``machines`` x ``devices_per_machine`` identical devices: the fields and defaults of
    :class:`~onnx_partition.plan.contracts.ClusterFields` (declared once, with cluster.json's
    schema reading them), and how stages are placed on them."""

    def __post_init__(self) -> None:
        if self.machines < 1 or self.devices_per_machine < 1:
            raise PartitionError(
                f"a cluster needs at least one machine and one device per machine, got "
                f"{self.machines} x {self.devices_per_machine}"
            )
        if not self.memory_gb > 0 or not self.speed > 0:
            raise PartitionError("device memory and speed must be positive")
        if self.kind not in ("cpu", "cuda"):
            raise PartitionError(f"device kind must be cpu or cuda, got {self.kind!r}")
        if self.gpu is not None:
            from onnx_partition.cost.devices import device_for

            device_for(self.kind, self.gpu)  # a known GPU, on a cuda cluster

    @property
    def devices(self) -> int:
        return self.machines * self.devices_per_machine

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    def device_name(self, index: int) -> str:
        """Device id of global device ``index`` (machine-major): ``cuda:3`` or ``m1/cuda:3``."""
        machine, local = divmod(index, self.devices_per_machine)
        name = "cpu" if self.kind == "cpu" else f"cuda:{local}"
        return name if self.machines == 1 else f"m{machine}/{name}"

    def link(self, devices: int) -> Link:
        """The link among ``devices`` devices placed on as few machines as possible (a group
        larger than a machine talks over the inter-machine link). For a placed group, see
        :meth:`group_link`."""
        return self.intra if devices <= self.devices_per_machine else self.inter

    def machine_of(self, index: int) -> int:
        return index // self.devices_per_machine

    def group_link(self, indices: Sequence[int]) -> Link:
        """The slowest link among the devices ``indices``: intra only if one machine holds
        them all (a ring all-reduce runs at its slowest hop)."""
        # machines hold consecutive indices: the lowest and highest share one iff all do
        one = self.machine_of(min(indices)) == self.machine_of(max(indices))
        return self.intra if one else self.inter

    def place(self, replicas: Sequence[int]) -> list[list[int]]:
        """Device indices per stage, in pipeline order, machine-major. A stage that fits on a
        machine is moved to the next machine's start rather than split across two, while
        devices are left over to skip; otherwise stages are packed."""
        if sum(replicas) > self.devices:
            raise PartitionError(f"the plan needs {sum(replicas)} devices; the cluster has "
                                 f"{self.devices}")
        spare = self.devices - sum(replicas)
        placed, at = [], 0
        for r in replicas:
            local = at % self.devices_per_machine
            gap = self.devices_per_machine - local
            if local and r <= self.devices_per_machine and r > gap and gap <= spare:
                at, spare = at + gap, spare - gap
            placed.append(list(range(at, at + r)))
            at += r
        return placed

    def to_json(self) -> dict[str, Any]:
        """cluster.json's form (``memory_gb`` infinite as null)."""
        body: dict[str, Any] = {**json_of(self), "format": FORMAT}
        return body

    @classmethod
    def of(cls, fields: ClusterFields) -> Cluster:
        """The cluster of cluster.json's fields (as a file or plan.json's ``cluster`` gives)."""
        return cls(**_values(fields))


@dataclass(frozen=True)
class GpuGroup(GroupFields):
    """One GPU kind of a :class:`Fleet` (cluster@2's ``groups``)."""

    def __post_init__(self) -> None:
        if self.machines < 1 or self.devices_per_machine < 1:
            raise PartitionError(f"group {self.gpu}: needs at least one machine and one "
                                 f"device per machine, got {self.machines} x "
                                 f"{self.devices_per_machine}")
        if self.memory_gb is not None and not self.memory_gb > 0:
            raise PartitionError(f"group {self.gpu}: memory_gb must be positive")
        from onnx_partition.cost.devices import gpu

        gpu(self.gpu)  # a known GPU (NAME[:MODE]), named in a one-line error otherwise

    @property
    def devices(self) -> int:
        return self.machines * self.devices_per_machine

    @property
    def memory(self) -> float:
        """GB per device: ``memory_gb``, else the GPU's datasheet memory less the CUDA
        context's (:data:`~onnx_partition.cost.devices.CUDA_CONTEXT_GB`)."""
        if self.memory_gb is not None:
            return self.memory_gb
        from onnx_partition.cost.devices import CUDA_CONTEXT_GB, gpu

        return gpu(self.gpu).memory_gb - CUDA_CONTEXT_GB

    def cluster(self, inter: Link) -> Cluster:
        """The group alone, as a cluster of one kind (its own indices and machine numbers)."""
        return Cluster(machines=self.machines, devices_per_machine=self.devices_per_machine,
                       memory_gb=self.memory, kind="cuda", gpu=self.gpu, intra=self.intra,
                       inter=inter)


@dataclass(frozen=True)
class Fleet(FleetFields):
    """A mixed fleet: several :class:`GpuGroup`\\ s, their machines in file order (global
    machine ``m`` of group ``g`` is ``machine_offset[g] + m``), one ``inter`` link between any
    two machines. A plan puts each stage's replicas on one group
    (:mod:`onnx_partition.solve.fleet`)."""

    groups: tuple[GpuGroup, ...] = ()

    def __post_init__(self) -> None:
        if not self.groups:
            raise PartitionError("a fleet needs at least one group")
        if self.kind != "cuda":
            raise PartitionError(f"a fleet's groups are GPUs (kind cuda), got {self.kind!r}")

    @property
    def devices(self) -> int:
        return sum(g.devices for g in self.groups)

    @property
    def speed(self) -> float:
        """Each group is priced by its own GPU: no speed factor on top."""
        return 1.0

    @property
    def intra(self) -> Link:
        """The first group's machine link (the solvers' default link between stages)."""
        return self.groups[0].intra

    @property
    def gpu(self) -> str:
        """The GPUs of the fleet, ``a100-80gb+v100`` (each kind once, in file order)."""
        return "+".join(self.kinds)

    @property
    def kinds(self) -> list[str]:
        return list(dict.fromkeys(g.gpu for g in self.groups))

    @property
    def machine_offset(self) -> list[int]:
        return [sum(g.machines for g in self.groups[:k]) for k in range(len(self.groups))]

    @property
    def clusters(self) -> list[Cluster]:
        """Each group alone as a cluster of one kind."""
        return [g.cluster(self.inter) for g in self.groups]

    def device_name(self, group: int, index: int) -> str:
        """Device id of device ``index`` of group ``group``: ``m<global machine>/cuda:<k>``."""
        g = self.groups[group]
        machine, local = divmod(index, g.devices_per_machine)
        return f"m{self.machine_offset[group] + machine}/cuda:{local}"

    @classmethod
    def of(cls, fields: FleetFields) -> Fleet:
        """The fleet of cluster@2's fields (its groups checked: known GPUs, positive sizes)."""
        return cls(groups=tuple(GpuGroup(**_values(g)) for g in fields.groups),
                   kind=fields.kind, inter=fields.inter, format=fields.format)

    def to_json(self) -> dict[str, Any]:
        """cluster.json's form, every group's memory resolved."""
        groups = [{**asdict(g), "memory_gb": g.memory} for g in self.groups]
        return {"format": FLEET_FORMAT, "groups": groups, "kind": self.kind,
                "inter": asdict(self.inter)}


def _values(fields: Any) -> dict[str, Any]:
    return {f.name: getattr(fields, f.name) for f in dataclasses.fields(fields)}


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"
                   r"(?:([KMGTkmgt][iI]?)[bB]?|([bB]))?\s*")
_SCALE = {"": 1e9, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_bytes(text: str, name: str = "--device-memory") -> float:
    """A size as people type it -> bytes: ``80GB``, ``16G``, ``16gb``, ``16GiB``, ``512MiB``,
    ``512M``, ``1e6B``; a bare number is GB, as ``memory_gb`` in cluster.json (SI units are
    powers of 1000, ``Ki``/``Mi``/``Gi``/``Ti`` powers of 1024)."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise PartitionError(f"{name}: cannot read a size from {text!r} (e.g. 80GB, 16G, "
                             "512MiB; a bare number is GB)")
    unit = "B" if match[3] else (match[2] or "").upper()
    scale = _SCALE[unit]
    rule = Rule(float, 0.0, MAX_BYTES / scale, unit or "GB", low_open=True)
    return float(check(match[1], name, rule)) * scale


def load_cluster(path: str | os.PathLike[str]) -> Cluster | Fleet:
    """Read cluster.json, checked against its contract (:class:`~onnx_partition.plan.contracts.
    ClusterFields`, :class:`~onnx_partition.plan.contracts.FleetFields`); a clear one-line error
    for a missing file or a bad field. With ``groups``: a :class:`Fleet`."""
    from onnx_partition.plan.schema import validate_cluster  # pydantic: lazily

    path = Path(path)
    spec = validate_cluster(read_json(path, "cluster"), f"cluster file {path}")
    if isinstance(spec, FleetFields):
        try:
            return Fleet.of(spec)
        except PartitionError as exc:
            raise PartitionError(f"cluster file {path}: {exc}") from None
    return Cluster.of(spec)
