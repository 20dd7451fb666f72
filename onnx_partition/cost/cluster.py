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
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json

FORMAT = "onnx-partition/cluster@1"


@dataclass(frozen=True)
class LinkSpec:
    bandwidth_gbps: float
    latency_ms: float = 0.0

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbps * 1e6 if self.bandwidth_gbps > 0 else math.inf


@dataclass(frozen=True)
class Cluster:
    """``machines`` x ``devices_per_machine`` identical devices."""

    machines: int = 1
    devices_per_machine: int = 1
    memory_gb: float = math.inf
    speed: float = 1.0
    kind: str = "cpu"
    intra: LinkSpec = field(default_factory=lambda: LinkSpec(10.0, 0.02))
    inter: LinkSpec = field(default_factory=lambda: LinkSpec(1.25, 0.05))
    gpu: str | None = None  # the GPU of the analytic costs (cost/devices.py), kind "cuda"

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

    def link(self, devices: int) -> LinkSpec:
        """The link among ``devices`` devices placed on as few machines as possible (a group
        larger than a machine talks over the inter-machine link). For a placed group, see
        :meth:`group_link`."""
        return self.intra if devices <= self.devices_per_machine else self.inter

    def machine_of(self, index: int) -> int:
        return index // self.devices_per_machine

    def group_link(self, indices: Sequence[int]) -> LinkSpec:
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
        body = {"format": FORMAT, **asdict(self)}
        if math.isinf(self.memory_gb):
            body["memory_gb"] = None
        return body


def parse_bytes(text: str) -> float:
    """``80GB``, ``512MiB``, ``1.5e9`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not match:
        raise PartitionError(f"cannot read a size from {text!r} (e.g. 80GB, 512MiB)")
    value = float(match[1])
    unit = (match[2] or "B").upper()
    scale = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return value * scale


def load_cluster(path: str | os.PathLike[str]) -> Cluster:
    """Read cluster.json; a clear error for a missing file or a bad field."""
    path = Path(path)
    body = read_json(path, "cluster")
    if not isinstance(body, dict):
        raise PartitionError(f"cluster file {path} is not a JSON object")
    try:
        memory = body.get("memory_gb")
        return Cluster(
            machines=int(body.get("machines", 1)),
            devices_per_machine=int(body.get("devices_per_machine", 1)),
            memory_gb=math.inf if memory is None else float(memory),
            speed=float(body.get("speed", 1.0)),
            kind=str(body.get("kind", "cpu")),
            gpu=None if body.get("gpu") is None else str(body["gpu"]),
            intra=LinkSpec(**body["intra"]) if "intra" in body else LinkSpec(10.0, 0.02),
            inter=LinkSpec(**body["inter"]) if "inter" in body else LinkSpec(1.25, 0.05),
        )
    except (TypeError, ValueError) as exc:
        raise PartitionError(f"cluster file {path}: {exc}") from None


def save_cluster(cluster: Cluster, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(cluster.to_json(), indent=1) + "\n")
    os.replace(tmp, path)
