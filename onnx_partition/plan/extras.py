"""plan.json's keys beyond the plan's own fields, each a typed record (declared once, as
:mod:`onnx_partition.plan.declare` says): what priced the plan, what the simulator replays,
what is proven of it, how it was calibrated. :class:`~onnx_partition.plan.contracts.PlanFields`
holds them as fields of these types; docs/design.md describes each key.

Each record began as a JSON object (a dict in the code that wrote it): as a :class:`Part` it
keeps the order its keys were given or set, and leaves out an optional field that holds None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from onnx_partition.plan.declare import (
    Count,
    Ms,
    Number,
    OneOf,
    Record,
    RelPath,
    Seconds,
    Sha256,
)

__all__ = ["Activations", "AnalyticDevice", "Calibrated", "CalibrationRound", "Candidate",
           "CheckedCosts", "ComputeScale", "CostsDevice", "CostsSource", "DeviceModel",
           "EngineCosts", "EngineRun", "Exact", "FileEntry", "HybridPeriodProof", "IlpResult",
           "KindsDevice", "Manifest", "OrderingResult", "Part", "PipelineProof", "PlannedOver",
           "ScalePart", "SimulatorCosts"]

Times = list[Ms]  # one per stage (or per boundary: send_ms)
Sizes = list[Number]  # bytes, one per stage or boundary


class Part(Record):
    """A record that was a JSON object: its keys written in the order given or set, an optional
    field holding None left out; equal to its JSON object, as the dict was (dataclasses
    declared ``eq=False`` keep this equality)."""

    FIXED: ClassVar[tuple[str, ...] | None] = ()


# --------------------------------------------------------------------------- pricing


@dataclass(kw_only=True, eq=False)
class CheckedCosts(Part):
    """``costs.check``: the costs file checked against the graph
    (:class:`onnx_partition.cost.costs_file.CostsCheck`)."""

    covered_nodes: Count
    compute_nodes: Count
    batch_size: int | None  # the batch the file was measured at, if it says
    scale: Number
    notes: list[str]


@dataclass(kw_only=True, eq=False)
class CostsSource(Part):
    """``costs``: where the node costs came from. Other keys are kept as they are (free data
    of a costs source; tests/test_schema.py)."""

    __pydantic_config__: ClassVar[dict[str, Any]] = {"strict": True, "extra": "allow"}
    source: str | None = None  # analytic:<device>, a costs file's path, ...
    measured_nodes: Count | None = None
    backward: str | None = None  # train: measured, estimated, per aten op
    check: CheckedCosts | None = None  # a costs file: its check against the graph


@dataclass(kw_only=True, eq=False)
class AnalyticDevice(Part):
    """``device_model`` of an analytic roofline (``onnx_partition.partition.device_model``)."""

    source: Literal["analytic"] = "analytic"
    name: str
    kind: str
    peak_tflops: Number
    mem_gbps: Number
    launch_overhead_ms: Number
    figures_from: str | None = None  # where the datasheet figures come from
    backward: str | None = None  # a fleet's kind: "per aten op"
    sources: dict[str, str] | None = None  # memory, link, inter_link, gpu: where each came from


@dataclass(kw_only=True, eq=False)
class CostsDevice(Part):
    """``device_model`` of a costs file."""

    source: Literal["costs"] = "costs"
    file: str
    measured_on: str | None  # the device the file says (None: it does not)
    warning: str | None = None  # measured on another kind of device than the cluster's
    sources: dict[str, str] | None = None
    profiled: str | None = None  # partition measured this CPU itself: how (cached, or now)


def _by_source(value: Any) -> str:
    given = value.get("source") if isinstance(value, dict) else getattr(value, "source", None)
    return {"costs": "CostsDevice", "kinds": "KindsDevice"}.get(str(given), "AnalyticDevice")


OneDevice = Annotated[AnalyticDevice | CostsDevice, OneOf(_by_source, (
    ("AnalyticDevice", AnalyticDevice), ("CostsDevice", CostsDevice)))]


@dataclass(kw_only=True, eq=False)
class KindsDevice(Part):
    """``device_model`` of a mixed fleet: each GPU kind by its own model."""

    source: Literal["kinds"] = "kinds"
    kinds: dict[str, OneDevice]
    warning: str | None = None
    sources: dict[str, str] | None = None


DeviceModel = Annotated[AnalyticDevice | CostsDevice | KindsDevice, OneOf(_by_source, (
    ("AnalyticDevice", AnalyticDevice), ("CostsDevice", CostsDevice),
    ("KindsDevice", KindsDevice)))]


@dataclass(kw_only=True, eq=False)
class ScalePart(Part):
    forward: Number
    backward: Number


@dataclass(kw_only=True, eq=False)
class ComputeScale(Part):
    """``compute_scale``: a train plan's CPU compute times scaled by what the profile measured
    (side by side, cold caches: ``parts``), ``forward`` and ``backward`` their products."""

    forward: Number
    backward: Number
    parts: dict[str, ScalePart]
    why: str


@dataclass(kw_only=True, eq=False)
class Activations(Part):
    """``activations``: where a train plan's ``activation_bytes`` come from."""

    source: str  # saved-tensors (the program's), outputs (every operator output)
    program: str | None = None
    total_bytes: Count | None = None
    precision: str | None = None
    autocast: str | None = None  # whose autocast policy counted half-precision tensors
    note: str | None = None


@dataclass(kw_only=True, eq=False)
class SimulatorCosts(Part):
    """``simulator_costs``: the simulator's exact inputs per stage (``send_ms`` and
    ``hop_bytes`` per boundary), so that ``simulate`` and ``report`` replay the plan as planned
    (``onnx_partition.pipeline.from_plan``); written by the planner, the engine's pricing and
    ``profile --plan``."""

    forward_ms: Times | None = None
    backward_ms: Times | None = None
    activation_bytes: Sizes | None = None  # stashed per micro-batch in flight
    static_bytes: Sizes | None = None
    send_ms: Times | None = None
    hop_bytes: Sizes | None = None
    input_bytes: Sizes | None = None  # a recomputing stage's kept inputs
    backward_input_ms: Times | None = None  # ZB-H1: the input-gradient share of backward
    step_ms: Times | None = None  # the optimizer step and its barriers
    accumulate_ms: Times | None = None  # gradient accumulation per micro-batch
    split_ms: Times | None = None  # ZB-H1: the split backward's calls
    action_ms: Times | None = None  # the engine's work around each action
    kept_bytes: Sizes | None = None  # ZB-H1: the output gradients kept from I to W


@dataclass(kw_only=True, eq=False)
class EngineCosts(Part):
    """``engine_costs``: how each engine term of ``simulator_costs`` was priced (measured,
    analytic, calibrated: a line each)."""

    step_ms: str | None = None
    accumulate_ms: str | None = None
    action_ms: str | None = None
    send_ms: str | None = None
    split_ms: str | None = None


# --------------------------------------------------------------------------- solving


@dataclass(kw_only=True, eq=False)
class Candidate(Part):
    """``candidates.<ordering>``: the DP's and the refined bottleneck of one ordering."""

    dp_ms: Number
    refined_ms: Number
    positions: int | list[int]  # blocks of the sequence (early plans: the cut positions)
    seconds: Seconds


@dataclass(kw_only=True, eq=False)
class IlpResult(Part):
    """``ilp`` (``--solver ilp``): optimal, bound and gap; or the error and the fallback."""

    optimal: bool | None = None
    bottleneck_ms: Number | None = None
    lower_bound_ms: Number | None = None
    gap: Number | None = None
    seconds: Seconds | None = None
    error: str | None = None
    fallback: str | None = None


@dataclass(kw_only=True, eq=False)
class PlannedOver(Part):
    """``planned_over``: what the plan, and what is proven of it, holds over: ``units``
    planned, torch ops kept whole (``torch-ops``: a train plan of a model with a program) or
    ONNX nodes (``onnx-nodes``, joined only where an untyped value would cross a cut), of
    ``nodes`` cut ONNX nodes."""

    granularity: Literal["onnx-nodes", "torch-ops"]
    units: Count
    nodes: Count

    def phrase(self) -> str:
        """``over 249 ONNX nodes``, ``over 180 torch-op units of 249 nodes``."""
        if self.units == self.nodes:
            return f"over {self.nodes} ONNX nodes"
        kind = "torch-op units" if self.granularity == "torch-ops" else "units"
        return f"over {self.units} {kind} of {self.nodes} nodes"


@dataclass(kw_only=True, eq=False)
class PipelineProof(Part):
    """``exact`` of a pipeline plan (:class:`onnx_partition.solve.exact.Proof`)."""

    proven_optimal: bool
    by: str  # single, bound, chain, cp-sat; unproven: budget, off, size
    bottleneck_ms: Number
    lower_bound_ms: Number
    gap: Number
    dp_ms: Number
    budget_s: Seconds
    seconds: Seconds
    rounding_ms: Number


@dataclass(kw_only=True, eq=False)
class HybridPeriodProof(Part):
    """``exact`` of a hybrid plan (:class:`onnx_partition.solve.hybrid_proof.HybridProof`):
    ``proven_optimal`` and ``gap`` of the plan's simulated iteration against
    ``iteration_bound_ms``, ``period_proven`` and ``period_gap`` of the DP's bottleneck
    period. A record without ``period_proven`` (written before the bound) gives the period's
    in ``proven_optimal`` and ``gap``."""

    kind: Literal["hybrid-period"] = "hybrid-period"
    proven_optimal: bool
    by: str
    objective: str
    budget_s: Seconds
    ordering: str | None = None
    positions: Count | None = None
    devices: Count | None = None
    period_ms: Number | None = None
    lower_bound_ms: Number | None = None
    gap: Number | None = None
    plan_period_ms: Number | None = None
    period_proven: bool | None = None
    period_gap: Number | None = None
    iteration_bound_ms: Number | None = None
    iteration_ms: Number | None = None
    max_cells: Count | None = None
    max_devices: Count | None = None
    seconds: Seconds | None = None
    rounding_ms: Number | None = None


def _by_kind(value: Any) -> str:
    given = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return "HybridPeriodProof" if given is not None else "PipelineProof"


Exact = Annotated[PipelineProof | HybridPeriodProof, OneOf(_by_kind, (
    ("PipelineProof", PipelineProof), ("HybridPeriodProof", HybridPeriodProof)))]


@dataclass(kw_only=True, eq=False)
class OrderingResult(Part):
    """``orderings.<family>``: its best simulated iteration, or the bound that spared
    simulating it (a fleet's ``as-slowest`` also its ``planned_ms``)."""

    iteration_ms: Number | None = None
    lower_bound_ms: Number | None = None
    planned_ms: Number | None = None


# --------------------------------------------------------------------------- calibration


@dataclass(kw_only=True, eq=False)
class CalibrationRound(Part):
    """One round of ``profile --plan``: the stages priced, measured and re-cut."""

    stages: list[Count]  # nodes per stage
    priced_ms: list[Number]
    alone_ms: list[Number]
    together_ms: list[Number]
    side_by_side_ms: list[Number] | None = None  # inference: threads side by side
    pipeline_busy_ms: list[Number] | None = None
    pipeline_iteration_ms: Number | None = None
    hop_ms: Number | None = None
    forward_ms: list[Number] | None = None  # train
    backward_ms: list[Number] | None = None
    bottleneck_ms: Number
    resolved: str | None = None  # what the re-cut found


@dataclass(kw_only=True, eq=False)
class EngineRun(Part):
    """``calibrated.engine_run``: the plan run in the training engine (``profile --plan``)."""

    by: str
    schedule: str
    microbatches: Count
    measured_ms: Number
    forward_ms: list[Number]
    backward_ms: list[Number]
    action_ms: list[Number]
    barrier_ms: Number
    idle_send_ms: list[Number]
    hop_ms: Number
    measured_where: dict[str, str]
    memory: dict[str, Any] | None = None  # the memory model calibrated (calibrate.memory)


@dataclass(kw_only=True, eq=False)
class Calibrated(Part):
    """``calibrated``: how ``profile --plan`` measured the plan, round by round."""

    by: str
    executor: str
    device: str
    threads_per_stage: Count
    repeats: Count
    warmup: Count
    side_by_side: str
    converged: bool
    chosen_round: Count
    rounds: list[CalibrationRound]
    engine_run: EngineRun | None = None


# --------------------------------------------------------------------------- the folder


@dataclass(kw_only=True, eq=False)
class FileEntry(Part):
    """One file of a plan folder in its manifest."""

    size: Count
    sha256: Sha256


Manifest = dict[RelPath, FileEntry]
