"""The plan: which nodes go to which stage, and plan.json (the contract) read and written.

plan.json is declared once, in :mod:`onnx_partition.plan.contracts` (:class:`PlanFields`, and
its extras' records in :mod:`onnx_partition.plan.extras`): :class:`Plan` is those fields plus
reading and writing them. A plan read from a file writes back to the same text (its extras in
the file's order); pydantic is loaded only when a plan is read or written
(:mod:`onnx_partition.plan.schema`). ``plan.extra`` and ``Plan(..., extra={...})`` are the
dict of the extras that code written before they were typed uses
(:mod:`onnx_partition.plan.legacy`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json
from onnx_partition.fileio import atomic_write
from onnx_partition.plan.contracts import (
    PLAN_FORMAT,
    IOSpec,
    PlanFields,
    PlanPredicted,
    Predicted,
    Stage,
)
from onnx_partition.plan.declare import Record, json_of
from onnx_partition.plan.legacy import EXTRAS, ExtraView, extra_type, holds_records
from onnx_partition.settings.partition import TrainSpec

__all__ = ["DEFAULT_MICROBATCHES", "FORMAT", "MANIFEST", "PLAN_FILE", "REPORT_FILE", "IOSpec",
           "Plan", "Predicted", "Stage", "plan_text", "read_plan", "write_plan"]

FORMAT = PLAN_FORMAT
PLAN_FILE = "plan.json"
#: Micro-batches per iteration of a plan that records none (:attr:`Plan.microbatches`): the
#: planner's default, written once in :class:`~onnx_partition.settings.partition.TrainSpec`.
DEFAULT_MICROBATCHES = TrainSpec.microbatches
MANIFEST = "manifest"  # plan.json's key naming the folder's files (onnx_partition.plan.folder)
REPORT_FILE = "report.html"  # written by `onnx-partition report`; part of a plan folder

_EXTRAS = frozenset(EXTRAS)


@dataclass
class Plan(PlanFields):
    """A plan: :class:`~onnx_partition.plan.contracts.PlanFields` (plan.json's fields, typed),
    what is derived from them, and plan.json read and written."""

    # the extras given as a dict (the old way, :mod:`onnx_partition.plan.legacy`): read into
    # their fields; afterwards the dict view of them
    extra: MutableMapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.__dict__["_keys"] = [k for k in self.__dict__["_keys"] if k != "extra"]
        if _plain(self.predicted):  # given as a dict (the old way): read into its record
            from onnx_partition.plan.schema import parse  # pydantic: loaded when first needed

            object.__setattr__(self, "predicted", parse(PlanPredicted, self.predicted,
                                                        "plan.json predicted"))
        given = self.extra
        object.__setattr__(self, "extra", ExtraView(self))
        if given and not isinstance(given, ExtraView):
            self.extra.update(given)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXTRAS and "_keys" in self.__dict__ and _plain(value) \
                and holds_records(name):  # a dict given for a record: read into it
            from onnx_partition.plan.schema import parse  # pydantic: loaded when first needed

            value = parse(extra_type(name), value, f"plan.json {name}")
        super().__setattr__(name, value)

    def _written(self) -> list[str]:
        return [k for k in super()._written() if k != "extra"]

    @property
    def microbatches(self) -> int:
        """Micro-batches per iteration the plan was planned for (``predicted.microbatches``),
        :data:`DEFAULT_MICROBATCHES` for a plan that records none: the one home of that default
        (``run``, ``simulate``, ``report`` and ``train`` read it here)."""
        given = self.predicted.microbatches
        return given if given is not None and given >= 1 else DEFAULT_MICROBATCHES

    @property
    def rows_per_microbatch(self) -> int | None:
        """Rows per micro-batch the plan was partitioned at: plan.json ``batch_size``, else
        (older plans, or inputs with a fixed leading dim) the leading dim of ``input_shapes``
        shared by the inputs declared with a symbolic one, or failing that by all inputs; None
        when nothing says."""
        given = self.batch_size
        if given is not None and given > 0:
            return given
        fixed = self.input_shapes
        for symbolic_only in (True, False):
            sizes = {int(fixed[s.name][0]) for s in self.inputs if fixed.get(s.name)
                     and (not symbolic_only or (s.shape and not isinstance(s.shape[0], int)))}
            if sizes:
                return sizes.pop() if len(sizes) == 1 else None
        return None

    def to_json(self) -> dict[str, Any]:
        """plan.json's body: ``format``, the own fields, then the extras in their order."""
        body: dict[str, Any] = {"format": FORMAT, **json_of(self)}
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Plan:
        """plan.json's body checked (a misspelled key is an error naming it) and read."""
        if not isinstance(body, dict) or not str(body.get("format", "")).startswith(
            "onnx-partition/plan@"
        ):
            raise PartitionError("plan.json has no onnx-partition/plan format tag")
        from onnx_partition.plan.schema import validate_plan  # pydantic: loaded when first needed

        return cls.of(validate_plan(body))

    @classmethod
    def of(cls, fields: PlanFields) -> Plan:
        """The plan of ``fields`` (read from a file: its extras' order kept)."""
        plan = cls(**{f.name: getattr(fields, f.name) for f in dataclasses.fields(PlanFields)})
        plan.__dict__["_keys"] = [k for k in fields.__dict__.get("_keys", []) if k in _EXTRAS]
        return plan


def _plain(value: Any) -> bool:
    """Whether ``value`` is JSON data (a dict or list holding no record)."""
    if isinstance(value, dict):
        return not any(isinstance(v, Record) for v in value.values())
    if isinstance(value, list):
        return not any(isinstance(v, Record) for v in value)
    return False


def read_plan(folder: str | os.PathLike[str]) -> Plan:
    """Read ``folder/plan.json``; a clear error when it is missing or malformed."""
    path = Path(folder) / PLAN_FILE
    if not path.is_file():
        raise PartitionError(f"{folder} is not a plan folder (no {PLAN_FILE})")
    return Plan.from_json(read_json(path, "plan"))


def write_plan(plan: Plan, folder: Path) -> None:
    """Write ``folder/plan.json`` whole or not at all (a plan folder as a whole is published by
    :func:`onnx_partition.plan.folder.publish`)."""
    atomic_write(folder / PLAN_FILE, plan_text(plan.to_json()))


def plan_text(body: dict[str, Any]) -> str:
    """plan.json's text: strict JSON (a NaN or Infinity is a PartitionError, never written),
    checked against the schema first, so that no plan is written that would not read back (a
    key the schema does not declare is named)."""
    try:
        text = json.dumps(body, indent=1, allow_nan=False) + "\n"
    except ValueError as exc:
        raise PartitionError(f"plan.json would hold a non-finite number: {exc}") from None
    from onnx_partition.plan.schema import validate_plan  # pydantic: loaded when first needed

    validate_plan(body, "plan.json to be written")
    return text

