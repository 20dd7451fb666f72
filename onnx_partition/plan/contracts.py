"""The JSON contracts, each declared once: plan.json, cluster.json, costs.json, the ``run --json``
file and the stage-costs file of ``train --record``; and their format strings.

Each contract is a stdlib dataclass whose fields carry their types, ranges and defaults
(:mod:`onnx_partition.plan.declare`): the same declaration is the type the code uses
(:class:`~onnx_partition.plan.planfile.Plan` and :class:`~onnx_partition.cost.cluster.Cluster`
add behaviour to :class:`PlanFields` and :class:`ClusterFields`) and, through
:mod:`onnx_partition.plan.schema`, the check of a file. plan.json's keys beyond the plan's own
fields are typed records too (:mod:`onnx_partition.plan.extras`). This module loads no pydantic
(the CLI starts without it; the schema loads it when a file is read).

Unknown keys are errors everywhere: a misspelled key is named, with the nearest known one,
instead of silently leaving the default in force. A file's ``format`` names its contract and
version. A field added to a contract comes with a version bump (``plan@2``, ``cluster@2``);
files of an older version still read, and so do files written before a contract had a format
string (older costs files).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen

from onnx_partition.plan.declare import (
    Check,
    Count,
    Dim,
    Finite,
    FromList,
    InfIsNull,
    Ms,
    Name,
    Nullable,
    Number,
    OneOf,
    OptionalSha256,
    Pattern,
    Record,
    RelPath,
    Seconds,
    dtype_name,
    elements,
)
from onnx_partition.plan.extras import (
    Activations,
    Calibrated,
    Candidate,
    ComputeScale,
    CostsSource,
    DeviceModel,
    EngineCosts,
    Exact,
    IlpResult,
    Manifest,
    OrderingResult,
    PlannedOver,
    SimulatorCosts,
)
from onnx_partition.values import MAX_DEVICES, MAX_GBPS, MAX_REPLICAS, MAX_STAGES

__all__ = ["CLUSTER_FORMAT", "COSTS_FORMAT", "FLEET_FORMAT", "PLAN_FORMAT", "RUN_FORMAT",
           "STAGE_COSTS_FORMAT", "TRAIN_FORMAT", "ClusterFields", "ClusterFile", "ClusterOrFleet",
           "CostsBody", "FleetFields", "FleetFile", "GroupFields", "IOSpec", "Link",
           "MathName", "MeasuredStageCosts", "NodeCost", "PlanFields", "PlanFile",
           "PlanPredicted", "Predicted", "RunBody", "RunPart", "Stage", "StageCostsBody"]

PLAN_FORMAT = "onnx-partition/plan@2"  # plan.json (partition); @1 files still read
CLUSTER_FORMAT = "onnx-partition/cluster@1"  # cluster.json (partition --cluster)
FLEET_FORMAT = "onnx-partition/cluster@2"  # cluster.json with groups (a mixed fleet)
COSTS_FORMAT = "onnx-partition/costs@1"  # costs.json (profile)
RUN_FORMAT = "onnx-partition/run@1"  # run --json, read back by report --measured
STAGE_COSTS_FORMAT = "onnx-partition/stage-costs@1"  # train --record FILE
TRAIN_FORMAT = "onnx-partition/train@1"  # train --json (written, not read back)
#: The matrix-product math a train plan is priced and run in (plan.json ``math``).
MathName = Literal["fp32", "tf32", "bf16", "fp16"]


def _any_version(format_: str) -> Pattern:
    """The pattern of ``format_``'s contract at any version (``^onnx-partition/plan@``)."""
    return Pattern("^" + re.escape(format_.partition("@")[0] + "@"))


def _one_of(*names: str) -> Check:
    """A string that is one of ``names`` (typed ``str`` for the code that passes them)."""
    said = " or ".join(repr(n) for n in names) if len(names) < 3 else \
        ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"

    def check(value: str) -> str:
        if value not in names:
            raise ValueError(f"Input should be {said}, got {value!r}")
        return value

    return Check(check)


def _origin(value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """plan.json's ``origin``: ``{"hf": {"class": NAME, "config": {...}}}`` (a Hugging Face
    class and its config as ``save_pretrained`` writes it)."""
    if set(value) != {"hf"}:
        raise ValueError(f"Input should have the one key 'hf', got {sorted(value)}")
    hf = value["hf"]
    if set(hf) != {"class", "config"}:
        raise ValueError(f"origin.hf should have the keys 'class' and 'config', got {sorted(hf)}")
    if not isinstance(hf["class"], str) or not hf["class"].isidentifier():
        raise ValueError(f"origin.hf.class should be a class name, got {hf['class']!r}")
    if not isinstance(hf["config"], dict):
        raise ValueError("origin.hf.config should be an object")
    return value


#: Where a model came from, so its weights can be made or loaded later.
Origin = Annotated[dict[str, dict[str, Any]], Check(_origin)]
GBps = Annotated[float, Ge(0), Le(MAX_GBPS), Finite()]
Gigabytes = Annotated[float, Gt(0), Le(1e9), Finite()]


# --------------------------------------------------------------------------- plan.json


@dataclass
class Predicted(Record):
    """A stage's predicted times and memory per device. Train plans (plan@2) add the parts:
    ``forward_ms + backward_ms = compute_ms``, and ``memory_bytes = weights_bytes + grad_bytes
    + optimizer_bytes + inflight * activation_bytes + buffer_bytes`` (``activation_bytes``: what
    autograd saves per micro-batch; ``inflight``: micro-batches held under the schedule;
    ``buffer_bytes``: received inputs of those and one gradient receive buffer). Absent (None)
    in inference plans and plan@1 files."""

    compute_ms: Ms
    comm_ms: Ms
    memory_bytes: Count
    forward_ms: Ms | None = None
    backward_ms: Ms | None = None
    weights_bytes: Count | None = None
    grad_bytes: Count | None = None
    optimizer_bytes: Count | None = None
    activation_bytes: Count | None = None
    inflight: Count | None = None
    buffer_bytes: Count | None = None

    def _leave_out(self, name: str, value: Any) -> bool:
        return value is None  # plan@2's parts only where set (train plans)


@dataclass
class Stage(Record):
    """A pipeline stage of plan.json."""

    index: Annotated[int, Ge(0), Lt(MAX_STAGES)]
    file: RelPath
    nodes: list[str]  # node keys cut into this stage, in topological order
    inputs: list[Name]
    outputs: Annotated[list[Name], MinLen(1)]
    replicas: Annotated[int, Ge(1), Le(MAX_REPLICAS)] = 1
    devices: Annotated[list[Name], MinLen(1)] = field(default_factory=lambda: ["cpu"])
    predicted: Predicted | None = None
    constants: list[str] = field(default_factory=list)  # free nodes copied into this stage
    sha256: OptionalSha256 = ""
    # train plans: the stage keeps only its inputs and recomputes its forward in backward
    # (written only where true; absent: false)
    recompute: bool | None = None
    gpu: Name | None = None  # a mixed fleet's plan: the GPU kind running this stage (cluster@2)
    # train plans planned with --shard-optimizer: each replica holds 1/replicas of the stage's
    # optimizer state ("optimizer", ZeRO-1) or all of it ("none"; absent: none)
    shard: Literal["none", "optimizer"] | None = None

    def _leave_out(self, name: str, value: Any) -> bool:
        return ((name == "recompute" and not value) or (name in ("gpu", "shard")
                                                        and value is None))

    @property
    def sharded(self) -> bool:
        """Whether the stage's replicas shard its optimizer state (``train`` follows it)."""
        return self.shard == "optimizer"


@dataclass
class IOSpec(Record):
    """A graph input or output: name, ONNX dtype name, shape (a string for a symbolic dim)."""

    name: Name
    dtype: Annotated[str, Check(dtype_name)]
    shape: Annotated[list[Dim | str], Check(elements)]
    high: Annotated[int, Ge(1)] | None = None  # integer inputs: exclusive bound of valid values


# --------------------------------------------------------------------------- links, clusters


@dataclass(frozen=True)
class Link(Record):
    """A link between devices (the default: between neighbouring stages on one machine; CPU
    processes there copy at memory speed). plan.json's ``link`` and cluster.json's ``intra``
    and ``inter``; a file gives the bandwidth (a latency left out is 0.02 ms)."""

    FILE_REQUIRED: ClassVar[tuple[str, ...]] = ("bandwidth_gbps",)
    bandwidth_gbps: GBps = 10.0  # GB/s; 0 means unlimited
    latency_ms: Ms = 0.02

    @property
    def bytes_per_ms(self) -> float:
        return self.bandwidth_gbps * 1e6 if self.bandwidth_gbps > 0 else math.inf


@dataclass(frozen=True)
class ClusterFields(Record):
    """``machines`` x ``devices_per_machine`` identical devices: cluster.json's fields, in the
    order :meth:`Cluster.to_json <onnx_partition.cost.cluster.Cluster.to_json>` writes them
    (``memory_gb`` infinite is ``null`` in the file; ``gpu``: a GPU of
    :mod:`onnx_partition.cost.devices`, kind cuda)."""

    format: Annotated[str, _any_version(CLUSTER_FORMAT)] = field(
        default=CLUSTER_FORMAT, kw_only=True, compare=False)
    machines: Annotated[int, Ge(1), Le(MAX_DEVICES)] = 1
    devices_per_machine: Annotated[int, Ge(1), Le(MAX_DEVICES)] = 1
    memory_gb: Annotated[float, Gt(0), Le(1e9), Finite(), InfIsNull()] = math.inf
    speed: Annotated[float, Gt(0), Le(1e6), Finite()] = 1.0
    kind: Annotated[str, _one_of("cpu", "cuda")] = "cpu"
    intra: Link = field(default_factory=Link)
    inter: Link = field(default_factory=lambda: Link(1.25, 0.05))
    gpu: str | None = None


@dataclass(frozen=True)
class GroupFields(Record):
    """One kind of GPU in a mixed fleet (cluster@2's ``groups``): ``machines`` x
    ``devices_per_machine`` devices of GPU ``gpu`` (:mod:`onnx_partition.cost.devices`), each
    with ``memory_gb`` (None: the GPU's datasheet memory), linked by ``intra`` on a machine."""

    gpu: Name
    machines: Annotated[int, Ge(1), Le(MAX_DEVICES)] = 1
    devices_per_machine: Annotated[int, Ge(1), Le(MAX_DEVICES)] = 1
    memory_gb: Gigabytes | None = None
    intra: Link = field(default_factory=Link)


@dataclass(frozen=True)
class FleetFields(Record):
    """A mixed fleet (cluster@2 with ``groups``): its groups' machines in file order, one
    ``inter`` link between any two machines."""

    format: Annotated[str, Pattern(r"^onnx-partition/cluster@2$")] = field(
        default=FLEET_FORMAT, kw_only=True, compare=False)
    groups: Annotated[tuple[GroupFields, ...], MinLen(1), FromList()] = ()
    kind: Annotated[str, _one_of("cuda")] = "cuda"
    inter: Link = field(default_factory=lambda: Link(1.25, 0.05))


def _cluster_bounded(cluster: ClusterFields) -> ClusterFields:
    if cluster.machines * cluster.devices_per_machine > MAX_DEVICES:
        raise ValueError(f"machines x devices_per_machine is more than {MAX_DEVICES}")
    return cluster


def _fleet_bounded(fleet: FleetFields) -> FleetFields:
    if sum(g.machines * g.devices_per_machine for g in fleet.groups) > MAX_DEVICES:
        raise ValueError(f"the groups hold more than {MAX_DEVICES} devices")
    return fleet


#: cluster.json of one kind of device, and of a mixed fleet: the files' checks.
ClusterFile = Annotated[ClusterFields, Check(_cluster_bounded)]
FleetFile = Annotated[FleetFields, Check(_fleet_bounded)]


def _by_groups(value: Any) -> str:
    fleet = "groups" in value if isinstance(value, dict) else isinstance(value, FleetFields)
    return "FleetFields" if fleet else "ClusterFields"


#: plan.json's ``cluster``: the cluster planned for, as cluster.json (one kind, or a fleet).
ClusterOrFleet = Annotated[ClusterFields | FleetFields, OneOf(_by_groups, (
    ("ClusterFields", ClusterFields), ("FleetFields", FleetFields)))]


# --------------------------------------------------------------------------- the plan


@dataclass(kw_only=True, eq=False)
class PlanPredicted(Record):
    """plan.json's ``predicted``: the whole plan's figures, as the planner simulated it (equal
    to its JSON object, as the dict was)."""

    FIXED: ClassVar[tuple[str, ...] | None] = ()
    bottleneck_ms: Number | None = None  # the slowest stage (with its sends)
    throughput_per_s: Number | None = None  # absent where nothing costs time
    total_compute_ms: Number | None = None
    iteration_ms: Number | None = None  # one iteration of ``microbatches``, simulated
    bubble_fraction: Number | None = None
    microbatches: Count | None = None  # what run, simulate and train default to
    devices_used: Count | None = None  # hybrid plans
    devices_available: Count | None = None


_OWN = ("model", "stages", "inputs", "outputs", "mode", "ordering", "solver", "predicted",
        "program", "program_sha256")


@dataclass
class PlanFields(Record):
    """plan.json: the plan's own fields (written first, in this order, after ``format``), then
    the keys ``partition``, ``profile --plan``, ``train --save`` and the plan folder add, in the
    order they were set (:mod:`onnx_partition.plan.extras`; docs/design.md lists them). A key
    left at None (an empty container) is absent from the file."""

    FIXED: ClassVar[tuple[str, ...] | None] = _OWN
    model: str
    stages: Annotated[list[Stage], MinLen(1), MaxLen(MAX_STAGES)]
    inputs: list[IOSpec]  # (a file may lack it: early plans; read as [])
    outputs: Annotated[list[IOSpec], MinLen(1)]
    mode: Annotated[str, _one_of("infer", "train")] = "infer"
    ordering: str = "topo"
    solver: str = "dp"
    predicted: PlanPredicted = field(default_factory=PlanPredicted)
    # the torch program exported with the model (onnx_partition.export), relative to the plan
    # folder, and its sha256; empty when the model has none (then the plan cannot be trained)
    program: str = ""
    program_sha256: OptionalSha256 = ""
    # ---- every plan
    version: str | None = None  # the onnx-partition version that wrote it
    costs: CostsSource = field(default_factory=CostsSource)  # where the costs came from
    # the input shapes the model was partitioned with (--input-shape), by name
    input_shapes: dict[str, Annotated[list[Dim], Check(elements)]] = field(default_factory=dict)
    unknown_size_tensors: Count | None = None
    batch_size: Annotated[int, Ge(1), Nullable()] | None = None  # rows per micro-batch
    device_model: DeviceModel | None = None  # what priced the plan
    partition_s: Seconds | None = None  # seconds the partitioning took
    manifest: Manifest = field(default_factory=dict)  # every file of the folder
    trained_from: str | None = None  # train --save: the plan folder trained
    # what the stage files' weights are: "data", "random" (built from a config) or "none"
    # (weightless: every initializer's name, dtype and shape, no data; `train` makes them)
    weights: Annotated[str, _one_of("none", "random", "data")] | None = None
    origin: Origin | None = None  # the model's origin: {"hf": {"class": ..., "config": ...}}
    calibrated: Calibrated | None = None  # profile --plan: stage times measured, rounds
    # ---- plan@2, train plans: what the memory model assumed (train defaults to them)
    optimizer: str | None = None  # "adamw" ("adam" in early plans): weights, grads, 2 moments
    precision: str | None = None  # "fp32"
    # the matrix-product math the plan was priced in, which train sets torch's TF32 flags to
    math: MathName | None = None
    schedule: str | None = None  # planned for: "1f1b", "zb-h1" (train), "infer"
    recompute: Literal["none", "all"] | None = None  # train: --recompute when not auto
    activations: Activations | None = None  # source of activation_bytes, whole-program total
    # ---- pipeline plans
    link: Link | None = None
    candidates: dict[str, Candidate] | None = None  # per ordering: DP and refined bottleneck
    ilp: IlpResult | None = None  # optimal, bound, gap; or the error and the fallback
    exact: Exact | None = None  # what is proven of the plan (or of the hybrid DP's period)
    planned_over: PlannedOver | None = None  # the units planned: ONNX nodes or torch ops
    # ---- hybrid plans
    cluster: ClusterOrFleet | None = None  # the cluster planned for (Cluster.to_json)
    orderings: dict[str, OrderingResult] | None = None
    planning_s: Seconds | None = None
    devices_notes: list[str] | None = None  # what more devices would buy, why some are unused
    allreduce_ms: list[Ms] | None = None  # each stage's gradient all-reduce
    # the simulator's exact inputs (empty: none), and how the engine's terms were priced
    simulator_costs: SimulatorCosts = field(default_factory=SimulatorCosts)
    engine_costs: EngineCosts = field(default_factory=EngineCosts)
    compute_scale: ComputeScale | None = None  # train, CPU: side_by_side x cold_cache


def _stages_in_order(plan: PlanFields) -> PlanFields:
    for position, stage in enumerate(plan.stages):
        if stage.index != position:
            raise ValueError(f"stages[{position}].index is {stage.index}; stages must be "
                             f"listed in pipeline order with index 0, 1, ...")
    files = [s.file for s in plan.stages]
    if len(set(files)) != len(files):
        raise ValueError("two stages name the same file")
    return plan


#: plan.json's check: its fields, and the stages listed in pipeline order.
PlanFile = Annotated[PlanFields, Check(_stages_in_order)]


# --------------------------------------------------------------------------- costs.json


@dataclass(kw_only=True)
class NodeCost(Record):
    forward_ms: Ms
    backward_ms: Ms | None = None
    backward_input_ms: Ms | None = None  # profile --mode train: the input-gradient pass
    backward_weight_ms: Ms | None = None  # ... and the weight-gradient pass


@dataclass(kw_only=True)
class CostsBody(Record):
    """costs.json: what ``profile`` writes (``cost.annotate.write_costs``, the provenance of
    ``cost.costs_file``); only ``nodes.<key>.forward_ms`` is required."""

    format: Annotated[str, _any_version(COSTS_FORMAT)] = COSTS_FORMAT
    unit: Literal["ms"] = "ms"
    device: str | None = None  # cpu, cuda:N
    source: str | None = None  # "profile", "profile --mode train"
    mode: Literal["infer", "train"] | None = None  # train: torch eager forward and backward
    executor: str | None = None  # train: "torch <version> eager"
    precision: Literal["fp32", "bf16", "fp16"] | None = None  # train: autocast (None: fp32)
    onnxruntime: str | None = None
    fingerprint: str | None = None  # sha256:<hex> of the graph's structure
    input_shapes: dict[str, list[Any]] | None = None  # checked by cost.costs_file
    batch_size: Annotated[int, Ge(1)] | None = None
    device_kind: Literal["cpu", "cuda"] | None = None
    device_name: str | None = None
    whole_model_ms: Ms | None = None
    raw_sum_ms: Ms | None = None
    unique_signatures: Count | None = None
    reused: Count | None = None
    settings: dict[str, Any] | None = None  # MeasureSettings and the profile's options
    engine: dict[str, Any] | None = None  # train: optimizer steps, hops (cost.engine_price)
    nodes: dict[str, NodeCost]


# --------------------------------------------------------------------------- run --json

MsOrNone = Number | None  # null: not finite (pipeline.predict.dumps)


@dataclass(kw_only=True)
class RunPart(Record):
    """The ``measured`` or ``predicted`` part of a run file (``pipeline.predict``)."""

    schedule: str | None = None  # predicted
    microbatches: Annotated[int, Ge(1)]
    batch_size: Annotated[int, Ge(1)] | None = None
    rows: Count | None = None
    iterations: Count | None = None  # measured
    iteration_ms: MsOrNone
    iteration_ms_each: list[MsOrNone] | None = None  # measured
    throughput_per_s: MsOrNone = None
    samples_per_s: MsOrNone
    bubble_fraction: MsOrNone = None  # predicted
    stages: list[dict[str, Any]]
    devices: list[dict[str, Any]] | None = None
    scaled_from_batch_size: int | None = None  # predicted
    setup_ms: MsOrNone = None  # measured, run --nproc
    comm_ms: dict[str, MsOrNone] | None = None  # measured, run --nproc: per rank


@dataclass(kw_only=True)
class RunBody(Record):
    """What ``run --json`` prints and ``report --measured`` reads (``pipeline.predict``)."""

    format: Annotated[str, _any_version(RUN_FORMAT)]
    runtime: str | None = None
    stages: Count | None = None
    replicas: list[int] | None = None
    microbatches: Annotated[int, Ge(1)]
    batch_size: Annotated[int, Ge(1)]
    rows: Count | None = None
    warmup: Count | None = None
    check: str | None = None
    measured: RunPart
    predicted: RunPart
    ratio: dict[str, Any] | None = None


# --------------------------------------------------------------------------- stage costs


@dataclass(kw_only=True)
class MeasuredStageCosts(Record):
    forward_ms: list[Ms]
    backward_ms: list[Ms]


@dataclass(kw_only=True)
class StageCostsBody(Record):
    """What ``train --record FILE`` writes: measured per-stage times, per micro-batch on one
    replica, in plan.json's ``simulator_costs`` form (``runtime.train.trainer``)."""

    format: Annotated[str, _any_version(STAGE_COSTS_FORMAT)]
    unit: Literal["ms"] = "ms"
    device: str
    rows_per_microbatch: Annotated[int, Ge(1)]
    microbatches: Annotated[int, Ge(1)]
    schedule: str
    measured_iteration_ms: Ms
    simulator_costs: MeasuredStageCosts
