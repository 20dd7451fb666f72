"""The partitioner's driver: load -> price -> solve -> assemble -> emit.

Each step lives in its own module: the request resolved from the options
(:mod:`onnx_partition.request.resolve`), the model loaded and priced and the solvers' problem
(:mod:`onnx_partition.pricing`, :mod:`onnx_partition.graph_arrays`), the plan found
(:func:`onnx_partition.solve.plan.plan`), the stages cut, counted and built into a
:class:`~onnx_partition.plan.Plan` (:mod:`onnx_partition.assemble`), the stage files and
plan.json written (:func:`onnx_partition.graph.emit.emit`). This module wires them together,
for the command line (:func:`partition_request`) and the Python API (:func:`partition`) alike.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from onnx_partition.assemble import (
    TRAIN_ASSUMPTIONS,
    assemble,
    lay_out,
    price_engine_of,
    priced_as_run,
)
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import CostsLike
from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.graph.emit import emit
from onnx_partition.plan import Plan
from onnx_partition.pricing import price, problem_of
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.request.partition import CostSource, PartitionOptions, PartitionRequest
from onnx_partition.request.resolve import api_devices, resolve
from onnx_partition.settings.partition import AUTO, MODES, SearchSpec, TrainSpec
from onnx_partition.solve.plan import BASELINES, SOLVERS, plan

__all__ = ["AUTO", "BASELINES", "SOLVERS", "TRAIN_ASSUMPTIONS", "Link", "partition",
           "partition_request", "priced_as_run"]

_TRAIN, _SEARCH = TrainSpec(), SearchSpec()  # the defaults, written in settings


def partition(
    model: str | os.PathLike[str],
    num_stages: int | None,
    out: str | os.PathLike[str],
    *,
    costs: CostsLike | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    batch_size: int | None = None,
    device: DeviceSpec | None = None,
    link: Link | None = None,
    cluster: Cluster | Fleet | str | os.PathLike[str] | None = None,
    gpu: str | None = None,
    device_kind: str | None = None,
    mode: str = _SEARCH.mode,
    microbatches: int = _TRAIN.microbatches,
    ordering: str = _SEARCH.ordering,
    solver: str = _SEARCH.solver,
    time_limit_s: float = _SEARCH.time_limit_s,
    exact_budget_s: float = _SEARCH.exact_budget_s,
    force: bool = PartitionOptions.force,
    check: bool = PartitionOptions.check,
    strict_costs: bool = False,
    schedule: str = _TRAIN.schedule,
    recompute: str = _TRAIN.recompute,
    shard_optimizer: bool = False,
    sources: Mapping[str, str] | None = None,
    reporter: Reporter = SILENT,
    kind_costs: Mapping[str, CostsLike] | None = None,
    precision: str = _TRAIN.precision,
    analytic: bool | None = None,
) -> Plan:
    """Cut ``model`` into pipeline stages and write them with plan.json to ``out``: the
    command line's ``partition``, each keyword the option of its name (resolved alike,
    :func:`~onnx_partition.request.resolve.resolve`). Without a ``cluster``: exactly
    ``num_stages`` stages, one device each, slowest stage minimised (over ``link``; on
    ``gpu`` or ``device_kind`` as ``--gpu`` and ``--device-kind``). With one (a
    :class:`~onnx_partition.cost.cluster.Cluster`, whose named GPU brings its datasheet memory
    and link where it gives none, as ``--gpu`` does; a cluster.json path, as ``--cluster``;
    or a :class:`~onnx_partition.cost.cluster.Fleet`, each kind priced on its own GPU or by
    its file in ``kind_costs``): stages *and* replicas per stage (``num_stages`` fixes the
    depth, or ``None`` lets the planner choose), fastest simulated iteration of
    ``microbatches`` micro-batches in ``mode`` within device memory.
    ``costs`` (a path, or a :class:`~onnx_partition.cost.annotate.CostsFile`) is read once;
    without it a train plan for this CPU is priced by measuring it (its profile cached,
    :mod:`~onnx_partition.cost.profile.train_cache`) unless ``analytic`` (None:
    ``$ONNX_PARTITION_TRAIN_PRICING``), and the analytic model prices the rest on ``device``,
    by default the devices' (:func:`~onnx_partition.cost.devices.device_for`); one measured
    on another device kind is noted in plan.json (an error with ``strict_costs``). A train
    plan is planned for ``schedule`` (``auto``: each planned schedule, the fastest kept), its
    stages recomputing per ``recompute``, priced in ``precision``, its replicas sharding their
    optimizer state with ``shard_optimizer`` (an error in inference; the others are ignored
    there). A
    ``dp`` cut is proven optimal or bettered by CP-SAT within ``exact_budget_s``
    deterministic seconds (0: off). ``sources`` replaces the resolved description of the
    devices in plan.json. The long steps report to ``reporter``. Returns the plan as
    written; raises :class:`~onnx_partition.errors.PartitionError` on bad input."""
    train = mode == MODES[1]
    request = resolve(PartitionOptions(
        Path(model), Path(out), num_stages, CostSource(costs, dict(kind_costs or {}),
                                                        strict_costs),
        input_shapes, batch_size, api_devices(cluster, link=link, device=device, gpu=gpu,
                                              device_kind=device_kind),
        mode=mode, microbatches=microbatches, schedule=schedule if train else None,
        recompute=recompute if train else None, shard_optimizer=shard_optimizer or None,
        precision=precision, ordering=ordering,
        solver=solver, time_limit_s=time_limit_s, exact_budget_s=exact_budget_s, check=check,
        force=force, sources=sources, analytic=analytic))
    return partition_request(request, reporter=reporter)


def partition_request(request: PartitionRequest, *, reporter: Reporter = SILENT) -> Plan:
    """Plan ``request`` and write its plan folder: load and price the model, solve, lay the
    stages out, price the engine's work on them, assemble the plan, emit the stage files and
    plan.json. Returns the plan as written."""
    started = time.perf_counter()
    priced = price(request)
    problem = problem_of(priced, request)
    solution = plan(problem, request, reporter=reporter)
    layout = lay_out(priced, solution, request)
    engine = price_engine_of(priced, solution, layout, request)
    built = assemble(priced, solution, layout, request, engine, started=started,
                     planned_over=problem.planned_over())
    return emit(priced.graph, layout.cuts, built, request.out, force=request.force,
                check=request.check, reporter=reporter)
