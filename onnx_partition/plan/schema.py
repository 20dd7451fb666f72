"""Checking a file against its contract: plan.json, cluster.json, costs.json, the ``run --json``
file and the stage-costs file of ``train --record``.

The contracts are declared once, as the dataclasses the code uses
(:mod:`onnx_partition.plan.contracts`, :mod:`onnx_partition.plan.extras`); here a pydantic
``TypeAdapter`` is built from each when first needed (this module loads pydantic; the CLI starts
without it), and a file's body is checked and read into those types in one step.

Unknown keys are errors everywhere: a misspelled key is named, with the nearest known one,
instead of silently leaving the default in force
(``cluster file c.json: unknown key 'memory_gbs' (did you mean 'memory_gb'?)``).

Validation is strict: ``"2"`` is not an integer, ``true`` is not a number, ``NaN`` and
``Infinity`` are not finite numbers, and the first offending field is named in a one-line
:class:`~onnx_partition.errors.PartitionError`:
``plan.json: stages[0].replicas: Input should be a valid integer, got '2'``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Annotated, Any

from pydantic import TypeAdapter, ValidationError

from onnx_partition.errors import PartitionError
from onnx_partition.plan.contracts import (
    FLEET_FORMAT,
    PLAN_FORMAT,
    ClusterFields,
    ClusterFile,
    CostsBody,
    FleetFields,
    FleetFile,
    PlanFields,
    PlanFile,
    RunBody,
    StageCostsBody,
)
from onnx_partition.plan.declare import Record, record_names

__all__ = ["HOMOGENEOUS_KEYS", "parse", "validate", "validate_cluster", "validate_costs",
           "validate_plan", "validate_run", "validate_stage_costs"]

@functools.cache
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


def validate(kind: Any, body: Any, where: str) -> Any:
    """``body`` checked against the contract type ``kind`` and read into it; a one-line
    PartitionError naming ``where`` and the first offending field otherwise. NaN or Infinity
    anywhere is an error."""
    value = parse(kind, body, where)
    bad = _non_finite(body, "")
    if bad is not None:
        raise PartitionError(f"{where}: {bad or '(top level)'}: NaN and Infinity are not allowed")
    return value


def parse(kind: Any, body: Any, where: str) -> Any:
    """``body`` (JSON data) read into ``kind`` (a contract type, or any type built of them),
    checked as :func:`validate` checks a file."""
    try:
        return _adapter(kind).validate_python(body)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            *parent, key = error["loc"]
            raise PartitionError(f"{where}: {_field(tuple(parent))}unknown key {key!r}"
                                 f"{_nearest(str(key), _record_at(kind, parent))}") from None
        raise PartitionError(f"{where}: {_field(error['loc'])}{_message(error)}") from None


# --------------------------------------------------------------------------- messages

#: Parts of pydantic's error location that name a union member, not a field.
_TAGS = {"int", "str", "float", "bool", "nullable", "constrained-int", "constrained-str",
         "constrained-float", "list", "dict"}


def _is_tag(part: str) -> bool:
    return (part in _TAGS or part.startswith("function-") or "[" in part
            or part in record_names())


def _field(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif not _is_tag(part):
            text += f".{part}" if text else str(part)
    return f"{text}: " if text else ""


def _members(annotation: Any) -> list[Any]:
    """``annotation`` without Annotated, split into a union's members."""
    if typing.get_origin(annotation) is Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _is_record(kind: Any) -> bool:
    return isinstance(kind, type) and issubclass(kind, Record) and dataclasses.is_dataclass(kind)


def _step(annotation: Any, part: int | str) -> Any:
    """The type of the value at ``part`` inside a value of ``annotation``, or None."""
    members = _members(annotation)
    if isinstance(part, str) and _is_tag(part):
        chosen = [m for m in members if getattr(m, "__name__", None) == part]
        return chosen[0] if chosen else annotation
    for kind in members:
        if _is_record(kind) and isinstance(part, str):
            hints = typing.get_type_hints(kind, include_extras=True)
            if part in hints:
                return hints[part]
        origin = typing.get_origin(kind)
        if origin in (list, tuple) and isinstance(part, int):
            return typing.get_args(kind)[0]
        if origin is dict and isinstance(part, str):
            return typing.get_args(kind)[1]
    return None


def _record_at(kind: Any, loc: list[int | str]) -> type | None:
    """The record that checks the object at ``loc`` inside a value of ``kind``, or None."""
    here = kind
    for part in loc:
        here = _step(here, part)
        if here is None:
            return None
    found = [m for m in _members(here) if _is_record(m)]
    return found[0] if found else None


def _nearest(key: str, record: type | None) -> str:
    """`` (did you mean 'memory_gb'?)`` for the known key nearest to ``key``, if one is near."""
    known = [f.name for f in dataclasses.fields(record)] if record is not None else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _message(error: Any) -> str:
    message = str(error["msg"]).removeprefix("Value error, ")
    given = error.get("input")
    if isinstance(given, float) and not math.isfinite(given) and error["type"] != "finite_number":
        return "NaN and Infinity are not allowed"
    if error["type"] in ("missing", "value_error") or "input" not in error:
        return message
    shown = repr(given)
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


# --------------------------------------------------------------------------- the files

#: plan.json's ``format``: the plan contract at any version.
_PLAN_TAG = "^" + re.escape(PLAN_FORMAT.partition("@")[0] + "@")


def validate_plan(body: Any, where: str = "plan.json") -> PlanFields:
    """plan.json read into :class:`PlanFields` (``format``: any plan version; ``inputs`` may be
    missing in early plans: none)."""
    if not isinstance(body, dict):
        raise PartitionError(f"{where}: Input should be an object, got {type(body).__name__}")
    if "format" not in body:
        raise PartitionError(f"{where}: format: Field required")
    tag = body["format"]
    if not isinstance(tag, str):
        raise PartitionError(f"{where}: format: Input should be a valid string, got {tag!r}")
    if not re.match(_PLAN_TAG, tag):
        raise PartitionError(f"{where}: format: String should match pattern '{_PLAN_TAG}', "
                             f"got {tag!r}")
    rest = {k: v for k, v in body.items() if k != "format"}
    rest.setdefault("inputs", [])
    result: PlanFields = validate(PlanFile, rest, where)
    keys = result.__dict__.get("_keys")
    if keys is not None:  # the extras' order as the file gives it (not the inputs added here)
        keys[:] = [k for k in body if k in keys]
    return result


#: cluster.json's top-level keys that describe one kind of device: not with ``groups``.
HOMOGENEOUS_KEYS = ("gpu", "machines", "devices_per_machine", "memory_gb", "speed", "intra")


def validate_cluster(body: Any, where: str = "cluster.json") -> ClusterFields | FleetFields:
    """One kind of device (:class:`ClusterFields`), or with ``groups`` a mixed fleet
    (:class:`FleetFields`, cluster@2), never both in one file."""
    if isinstance(body, dict) and "groups" in body:
        both = [k for k in HOMOGENEOUS_KEYS if k in body]
        if both:
            raise PartitionError(f"{where}: 'groups' describes each kind of GPU; drop the "
                                 f"top-level {', '.join(repr(k) for k in both)} (give them "
                                 "per group)")
        if body.get("format", FLEET_FORMAT) != FLEET_FORMAT:
            raise PartitionError(f"{where}: 'groups' (a mixed fleet) needs \"format\": "
                                 f"\"{FLEET_FORMAT}\", got {body.get('format')!r}")
        fleet: FleetFields = validate(FleetFile, body, where)
        return fleet
    result: ClusterFields = validate(ClusterFile, body, where)
    return result


def validate_costs(body: Any, where: str = "costs.json") -> CostsBody:
    result: CostsBody = validate(CostsBody, body, where)
    return result


def validate_run(body: Any, where: str = "run.json") -> RunBody:
    result: RunBody = validate(RunBody, body, where)
    return result


def validate_stage_costs(body: Any, where: str = "stage-costs.json") -> StageCostsBody:
    result: StageCostsBody = validate(StageCostsBody, body, where)
    return result
