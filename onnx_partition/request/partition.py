"""What ``partition`` plans from: the user's options as given (:class:`PartitionOptions`, None
where not given) and the request they resolve to (:class:`PartitionRequest`, every default
filled from :mod:`onnx_partition.settings` and every device resolved,
:func:`~onnx_partition.request.resolve.resolve`). Plain frozen data; loading this module loads
no numpy (the command line builds its options before it runs anything)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.settings.partition import MODES, SearchSpec, TrainSpec

if TYPE_CHECKING:
    from onnx_partition.cost.annotate import CostsLike

__all__ = ["CostSource", "DeviceOptions", "Devices", "PartitionOptions", "PartitionRequest"]


@dataclass(frozen=True)
class DeviceOptions:
    """The devices as the command line spells them, each None where not given: ``cluster``
    (cluster.json), ``gpu`` (a GPU name, cuda implied), ``device_kind``, ``devices`` per
    machine and ``machines`` (a cluster without a file), ``device_memory`` (text as typed,
    ``80GB``, or a number of GB), the links (GB/s, ms) within and between machines, a pinned
    analytic CPU (``cpu_tflops``, ``cpu_gbps``). The Python API adds what no option spells:
    the ``speed`` of a :class:`~onnx_partition.cost.cluster.Cluster` it was given, a
    :class:`~onnx_partition.cost.cluster.Fleet` object and an analytic ``device``."""

    cluster: Path | None = None
    gpu: str | None = None
    device_kind: str | None = None
    devices: int | None = None
    machines: int | None = None
    device_memory: str | float | None = None
    bandwidth: float | None = None
    latency: float | None = None
    inter_bandwidth: float | None = None
    inter_latency: float | None = None
    cpu_tflops: float | None = None
    cpu_gbps: float | None = None
    speed: float | None = None
    fleet: Fleet | None = None
    device: DeviceSpec | None = None


@dataclass(frozen=True)
class Devices:
    """The devices resolved: the ``cluster`` (None: a plain pipeline), the ``link`` between
    stages, the analytic ``device`` (None where a costs file prices the nodes, or a fleet's
    kinds their own) and where each default came from (``sources``: memory, link,
    inter_link, gpu; for the summary and plan.json's ``device_model.sources``)."""

    cluster: Cluster | Fleet | None
    link: Link
    device: DeviceSpec | None
    sources: Mapping[str, str]


@dataclass(frozen=True)
class CostSource:
    """What prices the nodes: a costs ``file`` (a path, or one already read; None: the
    analytic model), a fleet's file per GPU kind (``kinds``), whether a file measured on
    another device kind is an error (``strict``) rather than a warning, and whether a train
    plan for this CPU is priced by its cached profile, measured here where the cache has none
    (``measure``; :mod:`onnx_partition.cost.profile.train_cache`)."""

    file: CostsLike | None = None
    kinds: Mapping[str, CostsLike] = field(default_factory=dict)
    strict: bool = False
    measure: bool = False


@dataclass(frozen=True)
class PartitionOptions:
    """What a user asks ``partition`` for, as given: None where not given (the defaults of
    :mod:`onnx_partition.settings.partition` then hold). ``program_required``: a train plan
    refuses a model without its exported program (the command line, unless
    ``--no-program``); ``sources``: the API's own description of the devices, in place of
    the resolved one; ``analytic``: a train plan for this CPU priced by the roofline rather
    than measured (None: ``$ONNX_PARTITION_TRAIN_PRICING``, else measured)."""

    model: Path
    out: Path
    stages: int | None = None
    costs: CostSource = field(default_factory=CostSource)
    input_shapes: Mapping[str, Sequence[int]] | None = None
    batch_size: int | None = None
    devices: DeviceOptions = field(default_factory=DeviceOptions)
    mode: str | None = None
    microbatches: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    shard_optimizer: bool | None = None
    precision: str | None = None
    ordering: str | None = None
    solver: str | None = None
    time_limit_s: float | None = None
    exact_budget_s: float | None = None
    check: bool = True
    force: bool = False
    program_required: bool = False
    sources: Mapping[str, str] | None = None
    analytic: bool | None = None


@dataclass(frozen=True)
class PartitionRequest:
    """Everything one plan is planned from, resolved: the ``model`` and the plan folder
    ``out``; ``stages`` (None: a cluster plan chooses its depth); the input shapes (or the
    batch size) it is loaded at; what prices its nodes (``costs``); the resolved ``devices``;
    how its iteration runs (``train``) and how it is searched (``search``); and whether the
    stage files are checked (``check``) and an output folder that is not a plan replaced
    (``force``)."""

    model: Path
    out: Path
    stages: int | None
    input_shapes: Mapping[str, Sequence[int]] | None
    batch_size: int | None
    costs: CostSource
    devices: Devices
    train: TrainSpec
    search: SearchSpec
    check: bool
    force: bool

    @property
    def mode(self) -> str:
        return self.search.mode

    @property
    def training(self) -> bool:
        """A train plan (forward, backward, optimizer), else inference."""
        return self.search.mode == MODES[1]
