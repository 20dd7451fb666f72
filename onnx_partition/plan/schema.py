"""The JSON contracts, each declared once: plan.json, cluster.json, costs.json, the ``run --json``
file and the stage-costs file of ``train --record``.

One pydantic model per file states every key's type and range (the bounds come from
:mod:`onnx_partition.values`). The defaults that the code's dataclasses also have are not
restated here: they are read from those dataclasses, declared in
:mod:`onnx_partition.plan.contracts` (which loads no pydantic, so the CLI starts without it);
``tests/test_contracts.py`` checks that every field and default agrees.

Unknown keys are errors everywhere (``extra="forbid"``): a misspelled key is named, with the
nearest known one, instead of silently leaving the default in force
(``cluster file c.json: unknown key 'memory_gbs' (did you mean 'memory_gb'?)``). plan.json's
keys beyond :class:`Plan`'s fields (``costs``, ``candidates``, ``device_model``...) are declared
here too; free-form data lives only under such declared containers. A field added later comes
with a format bump (``plan@2``, ``cluster@2``); files of an older format still read.

Validation is strict: ``"2"`` is not an integer, ``true`` is not a number, ``NaN`` and
``Infinity`` are not finite numbers, and the first offending field is named in a one-line
:class:`~onnx_partition.errors.PartitionError`:
``plan.json: stages[0].replicas: Input should be a valid integer, got '2'``.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from dataclasses import MISSING, asdict, fields
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from onnx_partition.errors import PartitionError
from onnx_partition.plan.contracts import (
    CLUSTER_FORMAT,
    COSTS_FORMAT,
    FLEET_FORMAT,
    PLAN_FORMAT,
    RUN_FORMAT,
    STAGE_COSTS_FORMAT,
    ClusterFields,
    FleetFields,
    GroupFields,
    IOSpec,
    Link,
    PlanFields,
    Predicted,
    Stage,
)
from onnx_partition.values import (
    MAX_DEVICES,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_GBPS,
    MAX_MS,
    MAX_REPLICAS,
    MAX_STAGES,
)

__all__ = ["ClusterSchema", "CostsSchema", "Count", "Dim", "FileEntry", "FleetSchema",
           "GroupSchema", "IOSchema", "LinkSchema",
           "Ms", "Name", "NodeCostSchema", "PlanSchema", "PredictedSchema", "RelPath",
           "RunPartSchema", "RunSchema", "Sha256", "SimulatorCostsSchema", "StageCostsSchema",
           "StageSchema", "default_of", "validate", "validate_cluster", "validate_costs",
           "validate_plan", "validate_run", "validate_stage_costs"]

_CONFIG = ConfigDict(extra="forbid", strict=True)


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (a fresh one for a factory): the one
    home of every default a schema shares with the code."""
    for f in fields(cls):
        if f.name == name:
            if f.default_factory is not MISSING:
                return f.default_factory()
            if f.default is not MISSING:
                return f.default
            raise TypeError(f"{cls.__name__}.{name} has no default")
    raise TypeError(f"{cls.__name__} has no field {name!r}")


def _version_of(format_: str) -> str:
    """The pattern of ``format_``'s contract at any version (``^onnx-partition/plan@``)."""
    return "^" + re.escape(format_.partition("@")[0] + "@")


def _factory(cls: type, name: str) -> Any:
    """``Field(default_factory=...)`` of a mutable dataclass default."""
    return Field(default_factory=lambda: default_of(cls, name))


Ms = Annotated[float, Field(ge=0, le=MAX_MS, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
Name = Annotated[str, Field(min_length=1)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _relative(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    if path.startswith(("/", "\\")) or ".." in parts or not path.strip():
        raise ValueError("must be a path inside the plan folder")
    return path


def _dtype(name: str) -> str:
    if name != "unknown":
        try:
            kind: str = np.dtype(name).kind
        except TypeError:
            kind = "?"
        if kind not in "biufc":
            raise ValueError(f"is not a numeric dtype name (e.g. float32, int64, bool): {name!r}")
    return name


RelPath = Annotated[str, AfterValidator(_relative)]


# --------------------------------------------------------------------------- links


class LinkSchema(BaseModel):
    """A link: the fields of :class:`~onnx_partition.plan.contracts.Link` (the bandwidth is
    required in a file; a latency left out is Link's default, 0.02 ms)."""

    model_config = _CONFIG
    bandwidth_gbps: Annotated[float, Field(ge=0, le=MAX_GBPS, allow_inf_nan=False)]
    latency_ms: Ms = default_of(Link, "latency_ms")


def _link(name: str) -> Any:
    return Field(default_factory=lambda: LinkSchema(**asdict(default_of(ClusterFields, name))))


# --------------------------------------------------------------------------- plan.json


class FileEntry(BaseModel):
    """One file of a plan folder in its manifest."""

    model_config = _CONFIG
    size: Count
    sha256: Sha256


class PredictedSchema(BaseModel):
    model_config = _CONFIG
    compute_ms: Ms
    comm_ms: Ms
    memory_bytes: Count
    # ---- plan@2, train plans: the parts (contracts.Predicted)
    forward_ms: Ms | None = default_of(Predicted, "forward_ms")
    backward_ms: Ms | None = default_of(Predicted, "backward_ms")
    weights_bytes: Count | None = default_of(Predicted, "weights_bytes")
    grad_bytes: Count | None = default_of(Predicted, "grad_bytes")
    optimizer_bytes: Count | None = default_of(Predicted, "optimizer_bytes")
    activation_bytes: Count | None = default_of(Predicted, "activation_bytes")
    inflight: Count | None = default_of(Predicted, "inflight")
    buffer_bytes: Count | None = default_of(Predicted, "buffer_bytes")


class StageSchema(BaseModel):
    """A stage of plan.json: the fields of :class:`~onnx_partition.plan.contracts.Stage`."""

    model_config = _CONFIG
    index: Annotated[int, Field(ge=0, lt=MAX_STAGES)]
    file: RelPath
    nodes: list[str]
    inputs: list[Name]
    outputs: Annotated[list[Name], Field(min_length=1)]
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = default_of(Stage, "replicas")
    devices: Annotated[list[Name], Field(min_length=1)] = _factory(Stage, "devices")
    predicted: PredictedSchema | None = default_of(Stage, "predicted")
    constants: list[str] = _factory(Stage, "constants")
    sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = default_of(Stage, "sha256")
    recompute: bool | None = default_of(Stage, "recompute")  # train: keeps only its inputs
    gpu: Name | None = default_of(Stage, "gpu")  # a mixed fleet's plans: the stage's GPU kind


Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]


def _elements(shape: list[Any]) -> list[Any]:
    if math.prod(d for d in shape if isinstance(d, int)) > MAX_ELEMENTS:
        raise ValueError(f"more than {MAX_ELEMENTS} elements")
    return shape


class IOSchema(BaseModel):
    """A graph input or output of plan.json: the fields of
    :class:`~onnx_partition.plan.contracts.IOSpec`."""

    model_config = _CONFIG
    name: Name
    dtype: Annotated[str, AfterValidator(_dtype)]
    shape: Annotated[list[Dim | str], AfterValidator(_elements)]
    high: Annotated[int, Field(ge=1)] | None = default_of(IOSpec, "high")


Seconds = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Anything = dict[str, Any]  # a declared container of free-form data (written by the code)


class PlanSchema(BaseModel):
    """plan.json: ``format``, the fields of :class:`~onnx_partition.plan.contracts.PlanFields`,
    then the keys ``partition``, ``train --save`` and the plan folder add (kept in
    :attr:`Plan.extra <onnx_partition.plan.planfile.Plan.extra>`); design.md lists them."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=_version_of(PLAN_FORMAT))]
    model: str
    stages: Annotated[list[StageSchema], Field(min_length=1, max_length=MAX_STAGES)]
    inputs: list[IOSchema] = Field(default_factory=list)  # (required by Plan; old plans)
    outputs: Annotated[list[IOSchema], Field(min_length=1)]
    mode: Literal["infer", "train"] = default_of(PlanFields, "mode")
    ordering: str = default_of(PlanFields, "ordering")
    solver: str = default_of(PlanFields, "solver")
    predicted: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = _factory(PlanFields,
                                                                                  "predicted")
    program: str = default_of(PlanFields, "program")
    program_sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = default_of(
        PlanFields, "program_sha256")
    # ---- Plan.extra: every plan
    version: str | None = None
    costs: Anything | None = None  # source, measured_nodes, check
    input_shapes: dict[str, Annotated[list[Dim], AfterValidator(_elements)]] = {}
    unknown_size_tensors: Count | None = None
    batch_size: Annotated[int, Field(ge=1)] | None = None  # rows per micro-batch
    device_model: Anything | None = None  # what priced the plan
    partition_s: Seconds | None = None
    manifest: dict[RelPath, FileEntry] | None = None
    trained_from: str | None = None  # train --save: the plan folder trained
    calibrated: Anything | None = None  # profile --plan: stage times measured, rounds
    # ---- plan@2, train plans: what the memory model assumed (train defaults to them)
    optimizer: str | None = None  # "adamw" ("adam" in early plans): weights, grads, 2 moments
    precision: str | None = None  # "fp32"
    schedule: str | None = None  # planned for: "1f1b", "zb-h1" (train), "infer"
    recompute: Literal["none", "all"] | None = None  # train: --recompute when not auto
    activations: Anything | None = None  # source of activation_bytes, whole-program total
    # ---- pipeline plans
    link: LinkSchema | None = None
    candidates: dict[str, Anything] | None = None  # per ordering: DP and refined bottleneck
    ilp: Anything | None = None  # optimal, bound, gap; or the error and the fallback
    exact: Anything | None = None  # --solver dp: proven_optimal, by, lower_bound_ms, gap, ...
    # ---- hybrid plans
    cluster: Anything | None = None  # the cluster planned for (Cluster.to_json)
    orderings: dict[str, Anything] | None = None
    planning_s: Seconds | None = None
    devices_notes: list[str] | None = None  # what more devices would buy, why some are unused
    allreduce_ms: list[Ms] | None = None
    simulator_costs: Anything | None = None  # checked by pipeline.from_plan
    engine_costs: Anything | None = None  # train: how step_ms and send_ms were priced
    compute_scale: Anything | None = None  # train, CPU: side_by_side x cold_cache

    @model_validator(mode="after")
    def _stages_in_order(self) -> PlanSchema:
        for position, stage in enumerate(self.stages):
            if stage.index != position:
                raise ValueError(f"stages[{position}].index is {stage.index}; stages must be "
                                 f"listed in pipeline order with index 0, 1, ...")
        files = [s.file for s in self.stages]
        if len(set(files)) != len(files):
            raise ValueError("two stages name the same file")
        return self


# --------------------------------------------------------------------------- cluster.json


class ClusterSchema(BaseModel):
    """cluster.json: the fields of :class:`~onnx_partition.plan.contracts.ClusterFields`, in
    their order, after ``format`` (``memory_gb`` null: unlimited, ClusterFields' infinity)."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=_version_of(CLUSTER_FORMAT))] = CLUSTER_FORMAT
    machines: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = default_of(ClusterFields,
                                                                        "machines")
    devices_per_machine: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = default_of(
        ClusterFields, "devices_per_machine")
    memory_gb: Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)] | None = None
    speed: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] = default_of(
        ClusterFields, "speed")
    kind: Literal["cpu", "cuda"] = default_of(ClusterFields, "kind")
    intra: LinkSchema = _link("intra")
    inter: LinkSchema = _link("inter")
    gpu: str | None = default_of(ClusterFields, "gpu")  # a named GPU of cost/devices.py (cuda)

    @model_validator(mode="after")
    def _bounded(self) -> ClusterSchema:
        if self.machines * self.devices_per_machine > MAX_DEVICES:
            raise ValueError(f"machines x devices_per_machine is more than {MAX_DEVICES}")
        return self


class GroupSchema(BaseModel):
    """One GPU kind of a mixed fleet: the fields of
    :class:`~onnx_partition.plan.contracts.GroupFields` (``memory_gb`` null or absent: the
    GPU's datasheet memory)."""

    model_config = _CONFIG
    gpu: Name
    machines: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = default_of(GroupFields, "machines")
    devices_per_machine: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = default_of(
        GroupFields, "devices_per_machine")
    memory_gb: Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)] | None = None
    intra: LinkSchema = Field(default_factory=lambda: LinkSchema(
        **asdict(default_of(GroupFields, "intra"))))


#: cluster.json's top-level keys that describe one kind of device: not with ``groups``.
HOMOGENEOUS_KEYS = ("gpu", "machines", "devices_per_machine", "memory_gb", "speed", "intra")


class FleetSchema(BaseModel):
    """cluster@2 with ``groups``: a mixed fleet, the fields of
    :class:`~onnx_partition.plan.contracts.FleetFields` after ``format``; machines are placed in
    file order."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=r"^onnx-partition/cluster@2$")] = FLEET_FORMAT
    groups: Annotated[list[GroupSchema], Field(min_length=1)]
    kind: Literal["cuda"] = "cuda"
    inter: LinkSchema = Field(default_factory=lambda: LinkSchema(
        **asdict(default_of(FleetFields, "inter"))))

    @model_validator(mode="after")
    def _bounded(self) -> FleetSchema:
        if sum(g.machines * g.devices_per_machine for g in self.groups) > MAX_DEVICES:
            raise ValueError(f"the groups hold more than {MAX_DEVICES} devices")
        return self


# --------------------------------------------------------------------------- costs.json


class NodeCostSchema(BaseModel):
    model_config = _CONFIG
    forward_ms: Ms
    backward_ms: Ms | None = None
    backward_input_ms: Ms | None = None  # profile --mode train: the input-gradient pass
    backward_weight_ms: Ms | None = None  # ... and the weight-gradient pass


class CostsSchema(BaseModel):
    """costs.json: what ``profile`` writes (``cost.annotate.write_costs``, the provenance of
    ``cost.costs_file``); only ``nodes.<key>.forward_ms`` is required."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=_version_of(COSTS_FORMAT))] = COSTS_FORMAT
    unit: Literal["ms"] = "ms"
    device: str | None = None  # cpu, cuda:N
    source: str | None = None  # "profile", "profile --mode train"
    mode: Literal["infer", "train"] | None = None  # train: torch eager forward and backward
    executor: str | None = None  # train: "torch <version> eager"
    precision: Literal["fp32", "bf16", "fp16"] | None = None  # train: autocast (None: fp32)
    onnxruntime: str | None = None
    fingerprint: str | None = None  # sha256:<hex> of the graph's structure
    input_shapes: dict[str, list[Any]] | None = None  # checked by cost.costs_file
    batch_size: Annotated[int, Field(ge=1)] | None = None
    device_kind: Literal["cpu", "cuda"] | None = None
    device_name: str | None = None
    whole_model_ms: Ms | None = None
    raw_sum_ms: Ms | None = None
    unique_signatures: Count | None = None
    reused: Count | None = None
    settings: Anything | None = None  # MeasureSettings and the profile's options
    engine: Anything | None = None  # train: optimizer steps, two-process hops (cost.engine_price)
    nodes: dict[str, NodeCostSchema]


# --------------------------------------------------------------------------- run --json

MsOrNone = Annotated[float, Field(allow_inf_nan=False)] | None  # null: not finite (dumps)


class RunPartSchema(BaseModel):
    """The ``measured`` or ``predicted`` part of a run file (``pipeline.predict``)."""

    model_config = _CONFIG
    schedule: str | None = None  # predicted
    microbatches: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)] | None = None
    rows: Count | None = None
    iterations: Count | None = None  # measured
    iteration_ms: MsOrNone
    iteration_ms_each: list[MsOrNone] | None = None  # measured
    throughput_per_s: MsOrNone = None
    samples_per_s: MsOrNone
    bubble_fraction: MsOrNone = None  # predicted
    stages: list[Anything]
    devices: list[Anything] | None = None
    scaled_from_batch_size: int | None = None  # predicted
    setup_ms: MsOrNone = None  # measured, run --nproc
    comm_ms: dict[str, MsOrNone] | None = None  # measured, run --nproc: per rank


class RunSchema(BaseModel):
    """What ``run --json`` prints and ``report --measured`` reads (``pipeline.predict``)."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=_version_of(RUN_FORMAT))]
    runtime: str | None = None
    stages: Count | None = None
    replicas: list[int] | None = None
    microbatches: Annotated[int, Field(ge=1)]
    batch_size: Annotated[int, Field(ge=1)]
    rows: Count | None = None
    warmup: Count | None = None
    check: str | None = None
    measured: RunPartSchema
    predicted: RunPartSchema
    ratio: dict[str, Any] | None = None


# --------------------------------------------------------------------------- stage costs


class SimulatorCostsSchema(BaseModel):
    model_config = _CONFIG
    forward_ms: list[Ms]
    backward_ms: list[Ms]


class StageCostsSchema(BaseModel):
    """What ``train --record FILE`` writes: measured per-stage times, per micro-batch on one
    replica, in plan.json's ``simulator_costs`` form (``runtime.train.trainer``)."""

    model_config = _CONFIG
    format: Annotated[str, Field(pattern=_version_of(STAGE_COSTS_FORMAT))]
    unit: Literal["ms"] = "ms"
    device: str
    rows_per_microbatch: Annotated[int, Field(ge=1)]
    microbatches: Annotated[int, Field(ge=1)]
    schedule: str
    measured_iteration_ms: Ms
    simulator_costs: SimulatorCostsSchema


# --------------------------------------------------------------------------- validation

def validate(schema: type[BaseModel], body: Any, where: str) -> Any:
    """``body`` checked against ``schema`` (a model instance); a one-line PartitionError naming
    ``where`` and the first offending field otherwise. NaN or Infinity anywhere, also under
    unknown keys, is an error."""
    try:
        model = schema.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "extra_forbidden":
            *parent, key = error["loc"]
            raise PartitionError(f"{where}: {_field(tuple(parent))}unknown key {key!r}"
                                 f"{_nearest(str(key), _model_at(schema, parent))}") from None
        raise PartitionError(f"{where}: {_field(error['loc'])}{_message(error)}") from None
    bad = _non_finite(body, "")
    if bad is not None:
        raise PartitionError(f"{where}: {bad or '(top level)'}: NaN and Infinity are not allowed")
    return model


#: Parts of pydantic's error location that name a union member, not a field.
_TAGS = {"int", "str", "float", "bool", "nullable", "constrained-int", "constrained-str",
         "constrained-float", "list", "dict"}


def _field(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part not in _TAGS and not part.startswith("function-"):
            text += f".{part}" if text else str(part)
    return f"{text}: " if text else ""


def _model_at(schema: type[BaseModel], loc: list[int | str]) -> type[BaseModel] | None:
    """The model that validates the object at ``loc`` inside ``schema``'s input (list
    indices and dict keys are followed through the field's type), or None."""
    here: Any = schema
    for part in loc:
        if not (isinstance(here, type) and issubclass(here, BaseModel)):
            here = _inner(here, part)
            if here is None:
                return None
            continue
        if isinstance(part, int) or part not in here.model_fields:
            return None
        here = here.model_fields[part].annotation
        while not (isinstance(here, type) and issubclass(here, BaseModel)):
            if typing.get_origin(here) in (typing.Union, types.UnionType):
                models = [a for a in typing.get_args(here)
                          if isinstance(a, type) and issubclass(a, BaseModel)]
                if models:
                    here = models[0]
                    continue
            break
    return here if isinstance(here, type) and issubclass(here, BaseModel) else None


def _inner(annotation: Any, part: int | str) -> Any:
    """The item type of a list (``part`` an index) or the value type of a dict (a key)."""
    for arg in (annotation, *typing.get_args(annotation)):
        origin = typing.get_origin(arg)
        if origin is list and isinstance(part, int):
            return typing.get_args(arg)[0]
        if origin is dict and isinstance(part, str):
            return typing.get_args(arg)[1]
    return None


def _nearest(key: str, model: type[BaseModel] | None) -> str:
    """`` (did you mean 'memory_gb'?)`` for the known key nearest to ``key``, if one is near."""
    known = list(model.model_fields) if model is not None else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _message(error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] in ("missing", "value_error") or "input" not in error:
        return message
    shown = repr(error["input"])
    return f"{message}, got {shown if len(shown) <= 40 else shown[:37] + '...'}"


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinite float in ``value``, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = ((f"[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for key, item in items:
        sub = f"{path}{key}" if str(key).startswith("[") else f"{path}.{key}" if path else key
        found = _non_finite(item, sub)
        if found is not None:
            return found
    return None


def validate_plan(body: Any, where: str = "plan.json") -> PlanSchema:
    result: PlanSchema = validate(PlanSchema, body, where)
    return result


def validate_cluster(body: Any, where: str = "cluster.json") -> ClusterSchema | FleetSchema:
    """One kind of device (:class:`ClusterSchema`), or with ``groups`` a mixed fleet
    (:class:`FleetSchema`, cluster@2), never both in one file."""
    if isinstance(body, dict) and "groups" in body:
        both = [k for k in HOMOGENEOUS_KEYS if k in body]
        if both:
            raise PartitionError(f"{where}: 'groups' describes each kind of GPU; drop the "
                                 f"top-level {', '.join(repr(k) for k in both)} (give them "
                                 "per group)")
        if body.get("format", FLEET_FORMAT) != FLEET_FORMAT:
            raise PartitionError(f"{where}: 'groups' (a mixed fleet) needs \"format\": "
                                 f"\"{FLEET_FORMAT}\", got {body.get('format')!r}")
        fleet: FleetSchema = validate(FleetSchema, body, where)
        return fleet
    result: ClusterSchema = validate(ClusterSchema, body, where)
    return result


def validate_costs(body: Any, where: str = "costs.json") -> CostsSchema:
    result: CostsSchema = validate(CostsSchema, body, where)
    return result


def validate_run(body: Any, where: str = "run.json") -> RunSchema:
    result: RunSchema = validate(RunSchema, body, where)
    return result


def validate_stage_costs(body: Any, where: str = "stage-costs.json") -> StageCostsSchema:
    result: StageCostsSchema = validate(StageCostsSchema, body, where)
    return result
