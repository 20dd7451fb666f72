"""The JSON contracts' fields and defaults, declared once; and their format strings.

The dataclasses here are what the code uses (:class:`~onnx_partition.plan.planfile.Plan` and
:class:`~onnx_partition.cost.cluster.Cluster` add behaviour to :class:`PlanFields` and
:class:`ClusterFields`), and the one home of every default: the pydantic schemas of
:mod:`onnx_partition.plan.schema` read theirs from here, and ``tests/test_contracts.py`` checks
field by field that the two declare the same keys and defaults. This module loads no pydantic
(the CLI starts without it; the schemas load it when a file is read).

A file's ``format`` names its contract and version. A field added to a contract comes with a
version bump (``plan@2``, ``cluster@2``); files of an older version still read, and so do files
written before a contract had a format string (older costs files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CLUSTER_FORMAT", "COSTS_FORMAT", "FLEET_FORMAT", "PLAN_FORMAT", "RUN_FORMAT",
           "STAGE_COSTS_FORMAT",
           "TRAIN_FORMAT",
           "ClusterFields", "FleetFields", "GroupFields", "IOSpec", "Link", "PlanFields",
           "Predicted", "Stage"]

PLAN_FORMAT = "onnx-partition/plan@2"  # plan.json (partition); @1 files still read
CLUSTER_FORMAT = "onnx-partition/cluster@1"  # cluster.json (partition --cluster)
FLEET_FORMAT = "onnx-partition/cluster@2"  # cluster.json with groups (a mixed fleet)
COSTS_FORMAT = "onnx-partition/costs@1"  # costs.json (profile)
RUN_FORMAT = "onnx-partition/run@1"  # run --json, read back by report --measured
STAGE_COSTS_FORMAT = "onnx-partition/stage-costs@1"  # train --record FILE
TRAIN_FORMAT = "onnx-partition/train@1"  # train --json (written, not read back)


# --------------------------------------------------------------------------- plan.json


@dataclass
class Predicted:
    """A stage's predicted times and memory per device. Train plans (plan@2) add the parts:
    ``forward_ms + backward_ms = compute_ms``, and ``memory_bytes = weights_bytes + grad_bytes
    + optimizer_bytes + inflight * activation_bytes + buffer_bytes`` (``activation_bytes``: what
    autograd saves per micro-batch; ``inflight``: micro-batches held under the schedule;
    ``buffer_bytes``: received inputs of those and one gradient receive buffer). Absent (None)
    in inference plans and plan@1 files."""

    compute_ms: float
    comm_ms: float
    memory_bytes: int
    forward_ms: float | None = None
    backward_ms: float | None = None
    weights_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None
    activation_bytes: int | None = None
    inflight: int | None = None
    buffer_bytes: int | None = None


@dataclass
class Stage:
    """A pipeline stage of plan.json."""

    index: int
    file: str
    nodes: list[str]  # node keys cut into this stage, in topological order
    inputs: list[str]
    outputs: list[str]
    replicas: int = 1
    devices: list[str] = field(default_factory=lambda: ["cpu"])
    predicted: Predicted | None = None
    constants: list[str] = field(default_factory=list)  # free nodes copied into this stage
    sha256: str = ""
    # train plans: the stage keeps only its inputs and recomputes its forward in backward
    # (written only where true; absent: false)
    recompute: bool | None = None
    gpu: str | None = None  # a mixed fleet's plan: the GPU kind running this stage (cluster@2)


@dataclass
class IOSpec:
    """A graph input or output: name, ONNX dtype name, shape (a string for a symbolic dim)."""

    name: str
    dtype: str
    shape: list[int | str]
    high: int | None = None  # integer inputs: exclusive upper bound of valid values, if known


@dataclass
class PlanFields:
    """plan.json's own fields (:class:`onnx_partition.plan.planfile.Plan` adds reading and
    writing it); ``extra`` holds the file's other keys, each declared by the schema."""

    model: str
    stages: list[Stage]
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    mode: str = "infer"
    ordering: str = "topo"
    solver: str = "dp"
    predicted: dict[str, float] = field(default_factory=dict)
    # the torch program exported with the model (onnx_partition.export), relative to the plan
    # folder, and its sha256; empty when the model has none (then the plan cannot be trained)
    program: str = ""
    program_sha256: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # costs source, candidates, versions


# --------------------------------------------------------------------------- cluster.json


@dataclass(frozen=True)
class Link:
    """A link between devices (the default: between neighbouring stages on one machine; CPU
    processes there copy at memory speed). plan.json's ``link`` and cluster.json's ``intra``
    and ``inter``."""

    bandwidth_gbps: float = 10.0  # GB/s; 0 means unlimited
    latency_ms: float = 0.02

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbps * 1e6 if self.bandwidth_gbps > 0 else math.inf


@dataclass(frozen=True)
class ClusterFields:
    """``machines`` x ``devices_per_machine`` identical devices: cluster.json's fields, in the
    order :meth:`Cluster.to_json <onnx_partition.cost.cluster.Cluster.to_json>` writes them
    (``memory_gb`` infinite is ``null`` in the file)."""

    machines: int = 1
    devices_per_machine: int = 1
    memory_gb: float = math.inf
    speed: float = 1.0
    kind: str = "cpu"
    intra: Link = field(default_factory=Link)
    inter: Link = field(default_factory=lambda: Link(1.25, 0.05))
    gpu: str | None = None  # the GPU of the analytic costs (cost/devices.py), kind "cuda"


@dataclass(frozen=True)
class GroupFields:
    """One kind of GPU in a mixed fleet (cluster@2's ``groups``): ``machines`` x
    ``devices_per_machine`` devices of GPU ``gpu`` (:mod:`onnx_partition.cost.devices`), each
    with ``memory_gb`` (None: the GPU's datasheet memory), linked by ``intra`` on a machine."""

    gpu: str
    machines: int = 1
    devices_per_machine: int = 1
    memory_gb: float | None = None
    intra: Link = field(default_factory=Link)


@dataclass(frozen=True)
class FleetFields:
    """A mixed fleet (cluster@2 with ``groups``): its groups' machines in file order, one
    ``inter`` link between any two machines."""

    groups: tuple[GroupFields, ...] = ()
    kind: str = "cuda"
    inter: Link = field(default_factory=lambda: Link(1.25, 0.05))
