"""Declared schemas of the JSON files users hand in: plan.json, cluster.json, costs.json.

One pydantic model per file states every known field's type and range (the bounds come from
:mod:`onnx_partition.values`); unknown keys are allowed everywhere, so the contracts can grow
(``program``, ``program_sha256``, a costs ``fingerprint``, a cluster ``device_model``...).
Validation is strict: ``"2"`` is not an integer, ``true`` is not a number, ``NaN`` and
``Infinity`` are not finite numbers, and the first offending field is named in a one-line
:class:`~onnx_partition.errors.PartitionError`:
``plan.json: stages[0].replicas: Input should be a valid integer, got '2'``.
"""

from __future__ import annotations

import math
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
from onnx_partition.values import (
    MAX_DEVICES,
    MAX_DIM,
    MAX_ELEMENTS,
    MAX_GBPS,
    MAX_MS,
    MAX_REPLICAS,
    MAX_STAGES,
)

__all__ = ["ClusterSchema", "CostsSchema", "Count", "Dim", "FileEntry", "IOSchema", "LinkSchema",
           "Ms", "Name", "NodeCostSchema", "PlanSchema", "PredictedSchema", "RelPath",
           "Sha256", "StageSchema", "validate", "validate_cluster", "validate_costs",
           "validate_plan"]

_CONFIG = ConfigDict(extra="allow", strict=True)

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


class StageSchema(BaseModel):
    model_config = _CONFIG
    index: Annotated[int, Field(ge=0, lt=MAX_STAGES)]
    file: RelPath
    nodes: list[str]
    inputs: list[Name]
    outputs: Annotated[list[Name], Field(min_length=1)]
    replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    devices: Annotated[list[Name], Field(min_length=1)] = ["cpu"]
    predicted: PredictedSchema | None = None
    constants: list[str] = []
    sha256: Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")] = ""


Dim = Annotated[int, Field(ge=0, le=MAX_DIM)]


def _elements(shape: list[Any]) -> list[Any]:
    if math.prod(d for d in shape if isinstance(d, int)) > MAX_ELEMENTS:
        raise ValueError(f"more than {MAX_ELEMENTS} elements")
    return shape


class IOSchema(BaseModel):
    model_config = _CONFIG
    name: Name
    dtype: Annotated[str, AfterValidator(_dtype)]
    shape: Annotated[list[Dim | str], AfterValidator(_elements)]
    high: Annotated[int, Field(ge=1)] | None = None


class PlanSchema(BaseModel):
    model_config = _CONFIG
    format: Annotated[str, Field(pattern=r"^onnx-partition/plan@")]
    model: str
    mode: Literal["infer", "train"] = "infer"
    ordering: str = "topo"
    solver: str = "dp"
    stages: Annotated[list[StageSchema], Field(min_length=1, max_length=MAX_STAGES)]
    inputs: list[IOSchema] = []
    outputs: Annotated[list[IOSchema], Field(min_length=1)]
    predicted: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = {}
    input_shapes: dict[str, Annotated[list[Dim], AfterValidator(_elements)]] = {}
    manifest: dict[RelPath, FileEntry] | None = None

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


class LinkSchema(BaseModel):
    model_config = _CONFIG
    bandwidth_gbps: Annotated[float, Field(ge=0, le=MAX_GBPS, allow_inf_nan=False)]
    latency_ms: Ms = 0.0


class ClusterSchema(BaseModel):
    model_config = _CONFIG
    format: str = "onnx-partition/cluster@1"
    kind: Literal["cpu", "cuda"] = "cpu"
    gpu: str | None = None  # a named GPU of cost/devices.py (kind cuda)
    machines: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 1
    devices_per_machine: Annotated[int, Field(ge=1, le=MAX_DEVICES)] = 1
    memory_gb: Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)] | None = None
    speed: Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)] = 1.0
    intra: LinkSchema = LinkSchema(bandwidth_gbps=10.0, latency_ms=0.02)
    inter: LinkSchema = LinkSchema(bandwidth_gbps=1.25, latency_ms=0.05)

    @model_validator(mode="after")
    def _bounded(self) -> ClusterSchema:
        if self.machines * self.devices_per_machine > MAX_DEVICES:
            raise ValueError(f"machines x devices_per_machine is more than {MAX_DEVICES}")
        return self


# --------------------------------------------------------------------------- costs.json


class NodeCostSchema(BaseModel):
    model_config = _CONFIG
    forward_ms: Ms
    backward_ms: Ms | None = None


class CostsSchema(BaseModel):
    model_config = _CONFIG
    format: str = "onnx-partition/costs@1"
    unit: Literal["ms"] = "ms"
    nodes: dict[str, NodeCostSchema]


# --------------------------------------------------------------------------- validation

def validate(schema: type[BaseModel], body: Any, where: str) -> Any:
    """``body`` checked against ``schema`` (a model instance); a one-line PartitionError naming
    ``where`` and the first offending field otherwise. NaN or Infinity anywhere, also under
    unknown keys, is an error."""
    try:
        model = schema.model_validate(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
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


def validate_cluster(body: Any, where: str = "cluster.json") -> ClusterSchema:
    result: ClusterSchema = validate(ClusterSchema, body, where)
    return result


def validate_costs(body: Any, where: str = "costs.json") -> CostsSchema:
    result: CostsSchema = validate(CostsSchema, body, where)
    return result
