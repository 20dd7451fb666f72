"""The plan: which nodes go to which stage, and plan.json (the contract) read and written,
validated by :mod:`onnx_partition.plan.schema`.

plan.json's fields and defaults are declared once, in :mod:`onnx_partition.plan.contracts`
(:class:`Stage`, :class:`IOSpec`, :class:`Predicted` are re-exported here); the schema reads its
defaults from there, and pydantic is loaded only when a plan is read. Keys of plan.json beyond
:class:`Plan`'s fields live in :attr:`Plan.extra` (in file order, so a plan reads and writes
back byte for byte); the schema declares each of them, and the typed properties read them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, read_json
from onnx_partition.fileio import atomic_write
from onnx_partition.plan.contracts import PLAN_FORMAT, IOSpec, PlanFields, Predicted, Stage

__all__ = ["DEFAULT_MICROBATCHES", "FORMAT", "MANIFEST", "PLAN_FILE", "REPORT_FILE", "IOSpec",
           "Plan", "Predicted", "Stage", "plan_text", "read_plan", "write_plan"]

FORMAT = PLAN_FORMAT
PLAN_FILE = "plan.json"
#: Micro-batches per iteration of a plan that records none (:attr:`Plan.microbatches`).
DEFAULT_MICROBATCHES = 8
MANIFEST = "manifest"  # plan.json's key naming the folder's files (onnx_partition.plan.folder)
REPORT_FILE = "report.html"  # written by `onnx-partition report`; part of a plan folder


@dataclass
class Plan(PlanFields):
    """A plan: :class:`~onnx_partition.plan.contracts.PlanFields` (plan.json's own fields), the
    typed properties of the keys it keeps in ``extra``, and plan.json read and written."""

    # The keys of ``extra`` that readers rely on, typed. They stay in ``extra`` so that
    # plan.json keeps its key order; the schema checks their types when a plan is read, and a
    # value of the wrong JSON type (a Plan built in code) reads as absent.

    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """The input shapes the model was partitioned with (``--input-shape``), by name."""
        return _dict(self.extra.get("input_shapes"))

    @property
    def batch_size(self) -> int | None:
        """Rows per micro-batch the plan was partitioned at."""
        value = self.extra.get("batch_size")
        return value if isinstance(value, int) else None

    @batch_size.setter
    def batch_size(self, value: int | None) -> None:
        self.extra["batch_size"] = value

    @property
    def microbatches(self) -> int:
        """Micro-batches per iteration the plan was planned for (``predicted.microbatches``),
        :data:`DEFAULT_MICROBATCHES` for a plan that records none: the one home of that default
        (``run``, ``simulate``, ``report`` and ``train`` read it here)."""
        given = self.predicted.get("microbatches")
        return int(given) if isinstance(given, int | float) and given >= 1 else DEFAULT_MICROBATCHES

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

    @property
    def costs(self) -> dict[str, Any]:
        """Where the costs came from: ``source``, ``measured_nodes``, ``check``..."""
        return _dict(self.extra.get("costs"))

    @property
    def device_model(self) -> dict[str, Any] | None:
        """What priced the plan (``onnx_partition.partition.priced_by``)."""
        value = self.extra.get("device_model")
        return value if isinstance(value, dict) else None

    @device_model.setter
    def device_model(self, value: dict[str, Any]) -> None:
        self.extra["device_model"] = value

    @property
    def cluster(self) -> dict[str, Any]:
        """The cluster planned for, as in cluster.json; empty without one."""
        return _dict(self.extra.get("cluster"))

    @property
    def simulator_costs(self) -> dict[str, Any]:
        """Per-stage times and sizes that replace the predicted ones in the simulator."""
        return _dict(self.extra.get("simulator_costs"))

    @property
    def allreduce_ms(self) -> list[Any] | None:
        """Each stage's gradient all-reduce time."""
        value = self.extra.get("allreduce_ms")
        return value if isinstance(value, list) else None

    @property
    def partition_s(self) -> float | None:
        """Seconds the partitioning took."""
        value = self.extra.get("partition_s")
        return float(value) if isinstance(value, int | float) else None

    @partition_s.setter
    def partition_s(self, value: float) -> None:
        self.extra["partition_s"] = value

    @property
    def version(self) -> str | None:
        """The onnx-partition version that wrote the plan."""
        value = self.extra.get("version")
        return None if value is None else str(value)

    @property
    def manifest(self) -> dict[str, dict[str, Any]]:
        """Every file of the plan folder, by relative path: ``{"size": N, "sha256": H}``."""
        return _dict(self.extra.get(MANIFEST))

    @manifest.setter
    def manifest(self, value: dict[str, dict[str, Any]]) -> None:
        self.extra[MANIFEST] = value

    def to_json(self) -> dict[str, Any]:
        body = {"format": FORMAT, **asdict(self)}
        for stage in body["stages"]:  # plan@2's parts only where set (train plans)
            if not stage.get("recompute"):
                stage.pop("recompute", None)
            if stage.get("gpu") is None:  # a mixed fleet's plans only (cluster@2 groups)
                stage.pop("gpu", None)
            if stage.get("predicted"):
                stage["predicted"] = {k: v for k, v in stage["predicted"].items()
                                      if v is not None}
        body.update(body.pop("extra"))
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Plan:
        if not isinstance(body, dict) or not str(body.get("format", "")).startswith(
            "onnx-partition/plan@"
        ):
            raise PartitionError("plan.json has no onnx-partition/plan format tag")
        from onnx_partition.plan.schema import validate_plan  # pydantic: loaded when first needed

        validate_plan(body)  # every key declared: a misspelled one is an error naming it
        known = _PLAN_FIELDS - {"extra"}
        try:
            stages = []
            for raw in body["stages"]:
                pred = raw.get("predicted")
                stages.append(Stage(**{**raw, "predicted": Predicted(**pred) if pred else None}))
            given = {k: v for k, v in body.items() if k in known}  # absent: the defaults here
            return cls(**{**given, "stages": stages,
                          "inputs": [IOSpec(**x) for x in body.get("inputs", [])],
                          "outputs": [IOSpec(**x) for x in body.get("outputs", [])]},
                       extra={k: v for k, v in body.items() if k not in known | {"format"}})
        except (KeyError, TypeError) as exc:
            raise PartitionError(f"plan.json is malformed: {exc}") from None


_PLAN_FIELDS = {f.name for f in fields(Plan)}


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


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

