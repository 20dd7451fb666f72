"""A :class:`~onnx_partition.solve.plan.Solution` turned into a :class:`~onnx_partition.plan.Plan`,
in three steps: the stages cut and counted (:func:`lay_out`: each stage's bytes, the memory
model's peak and its parts), the engine's work priced from those figures
(:func:`price_engine_of`), and the plan built once with both (:func:`assemble`: one place that
writes ``predicted`` and every extra key for every route). It lives at the drivers' layer, not
in ``plan/`` (layer 1): it cuts the graph (``graph.emit``), counts memory
(``pipeline.memory``), replays the schedule (``pipeline.from_plan``) and reads the solver's
answer (``solve.plan``), all above the contracts."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from onnx_partition import __version__
from onnx_partition.cost.cluster import Cluster
from onnx_partition.cost.costs_file import batch_size_of
from onnx_partition.cost.devices import math_of
from onnx_partition.cost.engine_price import EnginePrice, engine_price, tied_bytes
from onnx_partition.fileio import sha256_file
from onnx_partition.graph.emit import StageCut, cut_stages, io_specs
from onnx_partition.graph.weightless import model_origin, model_weights
from onnx_partition.graph_arrays import stage_sizes, trainable_tensors
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.memory import (
    StageBytes,
    kept_held,
    memory_parts,
    memory_per_device,
    peak_inflight,
    rebuilt_held,
    stage_working,
    stash_bytes,
    static_bytes,
)
from onnx_partition.plan import Plan, Predicted, Stage
from onnx_partition.plan.contracts import MathName, PlanPredicted
from onnx_partition.plan.extras import (
    AnalyticDevice,
    CheckedCosts,
    ComputeScale,
    DeviceModel,
    KindsDevice,
)
from onnx_partition.plan.schema import parse
from onnx_partition.pricing import Priced
from onnx_partition.request.partition import PartitionRequest
from onnx_partition.settings.partition import AUTO, TrainSpec
from onnx_partition.settings.train import TRAIN_FALLBACKS
from onnx_partition.solve.plan import BASELINES, HybridRoute, PipelineRoute, Solution

__all__ = ["TRAIN_ASSUMPTIONS", "Layout", "assemble", "lay_out", "price_engine_of",
           "priced_as_run"]

#: What a train plan's memory model assumes, recorded in plan.json (``train`` defaults to
#: them and warns when told otherwise): AdamW (weights, gradients, two moments:
#: ``optimizer_factor`` 4), fp32 (``partition(precision=)`` records its own), 1F1B (the chosen
#: schedule is recorded in its place).
TRAIN_ASSUMPTIONS = {"optimizer": TrainSpec.optimizer, "precision": TrainSpec.precision,
                     "schedule": TRAIN_FALLBACKS["schedule"]}


@dataclass(frozen=True)
class Layout:
    """The stages of a solution as their files hold them: each stage's cut, its bytes (the
    one count, :func:`~onnx_partition.graph_arrays.stage_sizes`), the memory model's peak per
    device and, in training, its parts and forward/backward split (plan.json's per-stage
    ``predicted`` beside compute, comm and memory)."""

    cuts: list[StageCut]
    sizes: list[StageBytes]
    memory: list[float]
    parts: list[dict[str, Any]]


def lay_out(priced: Priced, solution: Solution, request: PartitionRequest) -> Layout:
    """Cut the stages and count them: in inference one micro-batch at a time; in training the
    schedule's peak of the micro-batches, the recomputing stages holding their rebuilt
    activations (:func:`~onnx_partition.pipeline.memory.rebuilt_held`)."""
    graph, train = priced.graph, request.training
    count, replicas, schedule = solution.num_stages, solution.replicas, solution.schedule
    microbatches, factor = request.train.microbatches, solution.optimizer_factor
    cuts = cut_stages(graph, solution.stage_of, count)
    sizes = stage_sizes(graph, cuts, train=train, activation_bytes=priced.saved,
                        trainable=priced.trainable, kept_bytes=priced.kept,
                        working_bytes=priced.working)
    flags = solution.recomputed
    shard = request.train.shard if train else "none"
    memory = (memory_per_device(sizes, replicas, microbatches, schedule=schedule,
                                recompute=flags, optimizer_factor=factor, shard=shard) if train
              else memory_per_device(sizes, replicas, 1, schedule="infer"))
    parts: list[dict[str, Any]] = [{} for _ in cuts]
    if train:
        assert solution.figures is not None
        held = peak_inflight(schedule, replicas, microbatches)
        rebuilt = rebuilt_held(schedule, replicas, microbatches)
        kept = kept_held(schedule, replicas, microbatches)
        for k, (f, b) in enumerate(solution.figures.split):
            parts[k] = dict(memory_parts(sizes[k], held[k], train=True, optimizer_factor=factor,
                                         rebuilt=rebuilt[k] if flags[k] else None,
                                         replicas=replicas[k], shard=shard, kept=kept[k],
                                         working=stage_working(sizes[k], schedule)))
            parts[k].pop("memory_bytes")
            parts[k].update(forward_ms=round(f, 6), backward_ms=round(b, 6))
    return Layout(cuts, sizes, list(memory), parts)


def _link_json(solution: Solution) -> dict[str, float] | None:
    """plan.json's ``link``: a plain pipeline's link between stages (a cluster's are in
    ``cluster``)."""
    route = solution.route
    if not isinstance(route, PipelineRoute):
        return None
    return {"bandwidth_gbps": route.link.bandwidth_gbps, "latency_ms": route.link.latency_ms}


def _replayed(solution: Solution, layout: Layout, train: bool) -> dict[str, Any] | None:
    """plan.json's ``simulator_costs`` before the engine's work: the simulator's exact inputs,
    so ``simulate`` and ``report`` replay this very plan (a plain pipeline's only in
    training: the sends and bytes it was cut on, its stages' split); the memory figures of the
    one count (:func:`lay_out`)."""
    route, figures = solution.route, solution.figures
    sizes, factor = layout.sizes, solution.optimizer_factor
    if isinstance(route, HybridRoute):
        stages = route.best.costs.stages
        body: dict[str, Any] = {
            "forward_ms": [s.forward_ms for s in stages],
            "backward_ms": [s.backward_ms for s in stages],
            "activation_bytes": [stash_bytes(z) for z in sizes],
            "static_bytes": [static_bytes(z, train=train, optimizer_factor=factor,
                                          replicas=r, shard=route.run.shard)
                             + (stage_working(z, solution.schedule) if train else 0.0)
                             for z, r in zip(sizes, solution.replicas, strict=True)],
            "send_ms": list(route.best.costs.send_ms)}
        if any(s.recompute for s in stages):
            body["input_bytes"] = [z.received for z in sizes]
        if solution.schedule == "zb-h1" and any(z.kept for z in sizes):
            body["kept_bytes"] = [z.kept for z in sizes]
    elif train:
        assert figures is not None
        body = {"send_ms": route.send_ms, "hop_bytes": route.hop_bytes,
                "forward_ms": [f for f, _ in figures.split],
                "backward_ms": [b for _, b in figures.split]}
    else:
        return None
    if train and solution.schedule == "zb-h1" and figures is not None:
        body["backward_input_ms"] = list(figures.grad_input)
    return body


def price_engine_of(priced: Priced, solution: Solution, layout: Layout,
                    request: PartitionRequest) -> EnginePrice | None:
    """The engine's work of a train plan (:func:`~onnx_partition.cost.engine_price.
    engine_price`), from the laid-out stages' weights, tied parameters and trainable tensors,
    and the sends the plan states before it; None in inference."""
    if not request.training:
        return None
    graph = priced.graph
    replayed = _replayed(solution, layout, True) or {}
    return engine_price(
        costs=priced.costs, device=priced.device, optimizer=request.train.optimizer,
        link=solution.route.link if isinstance(solution.route, PipelineRoute) else None,
        weights=[float(p["weights_bytes"]) for p in layout.parts],
        hop_bytes=replayed.get("hop_bytes"), send_ms=replayed.get("send_ms"),
        schedule=solution.schedule,
        tied=tied_bytes([c.initializers for c in layout.cuts], graph.initializer_bytes,
                        priced.trainable),
        tensors=trainable_tensors(layout.cuts, priced.trainable), kinds=priced.kind_engines,
        gpus=solution.gpus or [None] * solution.num_stages)


def _predicted(solution: Solution, request: PartitionRequest) -> dict[str, Any]:
    """plan.json's ``predicted`` as the planner found it (:func:`priced_as_run` then states
    the plan's own simulation): a pipeline's bottleneck and throughput; a cluster plan's
    simulated iteration, bottleneck and devices."""
    route, microbatches = solution.route, request.train.microbatches
    if isinstance(route, PipelineRoute):
        bottleneck = route.bottleneck_ms
        return {  # no throughput when nothing costs time (JSON has no Infinity)
            "bottleneck_ms": round(bottleneck, 6),
            **({"throughput_per_s": round(1000.0 / bottleneck, 3)} if bottleneck > 0 else {}),
            "total_compute_ms": round(route.total_compute_ms, 6)}
    best, sim = route.best, route.best.sim
    return {
        "iteration_ms": round(sim.iteration_ms, 6),
        **({"throughput_per_s": round(sim.throughput_per_s, 3)}
           if math.isfinite(sim.throughput_per_s) else {}),
        "bubble_fraction": round(sim.bubble_fraction, 4),
        "microbatches": microbatches,
        "bottleneck_ms": round(max(
            (c + m) / s.replicas + s.allreduce_ms / microbatches
            for c, m, s in zip(solution.compute_ms, solution.comm_ms, best.costs.stages)), 6),
        "total_compute_ms": round(route.total_compute_ms, 6),
        "devices_used": sum(best.replicas),
        "devices_available": route.cluster.devices,
    }


def _search_extras(solution: Solution, request: PartitionRequest) -> dict[str, Any]:
    """plan.json's record of the search: a pipeline's link, each ordering's candidate, the
    ILP's result or the exact pass's proof; a cluster plan's cluster, each family's best,
    the planner's notes, what is proven of its objective and each stage's all-reduce."""
    route, budget = solution.route, request.search.exact_budget_s
    if isinstance(route, PipelineRoute):
        extra: dict[str, Any] = {"link": _link_json(solution)}
        if request.search.solver not in BASELINES:
            extra["candidates"] = {
                c.ordering: {"dp_ms": round(c.dp_ms, 6), "refined_ms": round(c.refined_ms, 6),
                             "positions": c.positions, "seconds": round(c.seconds, 4)}
                for c in route.candidates}
        if route.ilp_error is not None:
            extra["ilp"] = {"error": route.ilp_error, "fallback": "dp"}
        elif route.ilp is not None:
            result = route.ilp
            extra["ilp"] = {"optimal": result.optimal, "bottleneck_ms": result.bottleneck_ms,
                            "lower_bound_ms": result.lower_bound_ms, "gap": result.gap,
                            "seconds": round(result.wall_s, 3)}
        elif route.proof is not None:
            extra["exact"] = route.proof.to_json(budget)
        return extra
    best = route.best
    return {
        "cluster": route.cluster.to_json(),
        # per family: its best simulated iteration, or the bound that spared simulating it
        "orderings": {k: {what: round(ms, 6) for what, ms in v.items()}
                      for k, v in route.families.items()},
        "planning_s": round(best.planning_s, 4),
        # what more devices would buy, and why devices are left unused
        **({"devices_notes": list(best.notes)} if best.notes else {}),
        "exact": route.proof.to_json(budget),  # what is proven of the DP's objective
        "allreduce_ms": [round(s.allreduce_ms, 6) for s in best.costs.stages],
    }


def _train_extras(priced: Priced, solution: Solution, request: PartitionRequest
                  ) -> dict[str, Any]:
    """What a train plan was priced for (:data:`TRAIN_ASSUMPTIONS`, its schedule and
    precision), its recomputation where asked, and how its activations were counted."""
    spec, saved = request.train, priced.saved
    extra: dict[str, Any] = {**TRAIN_ASSUMPTIONS, "optimizer": spec.optimizer,
                             "precision": spec.precision, "schedule": solution.schedule}
    if spec.recompute != AUTO:  # what a re-cut (profile --plan) asks for again
        extra["recompute"] = spec.recompute
    extra["activations"] = (
        {"source": "saved-tensors", "program": request.model.with_suffix(".pt2").name,
         "total_bytes": int(sum(saved)),  # in half precision: by whose autocast policy
         **({"precision": spec.precision, "autocast": priced.policy}
            if spec.precision != TrainSpec.precision else {})}
        if saved is not None
        else {"source": "outputs", "note": "no program beside the model: every operator "
              "output counted, as stored"})
    return extra


def _priced_math(model: DeviceModel | None, precision: str) -> MathName:
    """The matrix-product math a train plan was priced in
    (:func:`~onnx_partition.cost.devices.math_of`): a fleet's TF32 where any of its kinds was
    priced at it."""
    kinds = model.kinds.values() if isinstance(model, KindsDevice) else [model]
    maths = {math_of(k.name if isinstance(k, AnalyticDevice) else None, precision)
             for k in kinds}
    return cast(MathName, "tf32" if "tf32" in maths else min(maths, default="fp32"))


def _shard(solution: Solution, k: int) -> Literal["none", "optimizer"] | None:
    """plan.json's ``stages[k].shard``: in a plan with its optimizer state sharded, whether
    stage ``k``'s replicas shard it (``none`` on one replica); None (absent) otherwise."""
    route = solution.route
    if not isinstance(route, HybridRoute) or not route.run.train or route.run.shard == "none":
        return None
    return "optimizer" if solution.replicas[k] > 1 else "none"


def _stages(priced: Priced, solution: Solution, layout: Layout) -> list[Stage]:
    """plan.json's stages: each cut's nodes and boundaries, replicas, devices, GPU kind (a
    fleet's), recomputation, and its predicted compute, comm, memory (and parts)."""
    graph = priced.graph
    return [Stage(
        index=k, file=f"stage_{k}.onnx", nodes=[graph.nodes[i].key for i in cut.nodes],
        inputs=cut.inputs, outputs=cut.outputs, replicas=solution.replicas[k],
        devices=list(solution.devices[k]),
        constants=[graph.nodes[i].key for i in cut.constants],
        recompute=True if solution.recomputed[k] else None,
        shard=_shard(solution, k),
        predicted=Predicted(compute_ms=round(solution.compute_ms[k], 6),
                            comm_ms=round(solution.comm_ms[k], 6),
                            memory_bytes=int(layout.memory[k]), **layout.parts[k]),
        gpu=solution.gpus[k] if solution.gpus else None)
        for k, cut in enumerate(layout.cuts)]


def assemble(priced: Priced, solution: Solution, layout: Layout, request: PartitionRequest,
             engine: EnginePrice | None, *, started: float,
             planned_over: Mapping[str, Any] | None = None) -> Plan:
    """The plan, built once: its stages (:func:`_stages`), ``predicted`` (the planner's
    figures, then the plan's own simulation, :func:`priced_as_run`), and every extra key
    (the search's record, the simulator's inputs with the engine's work, the schedule, what
    priced it, the train plan's assumptions); the exported program beside the model named
    with its sha256; ``partition_s`` since ``started``; ``planned_over``, what the units
    planned were (:meth:`~onnx_partition.solve.plan.Problem.planned_over`)."""
    graph, train = priced.graph, request.training
    extra = _search_extras(solution, request)
    if planned_over is not None:
        extra["planned_over"] = dict(planned_over)
    replayed = _replayed(solution, layout, train)
    if replayed is not None:
        extra["simulator_costs"] = {**replayed, **(engine.costs if engine else {})}
    if not train:
        extra["schedule"] = solution.schedule  # what simulate, report and run default to
    costs: dict[str, Any] = {"source": priced.node_costs.source,
                             "measured_nodes": priced.node_costs.measured}
    extra.update(version=__version__, costs=costs,
                 input_shapes={k: list(v) for k, v in graph.input_shapes.items()},
                 unknown_size_tensors=len(graph.unknown_size))
    _warn_over_memory(solution, layout, extra)
    if train:
        extra.update(_train_extras(priced, solution, request))
        costs["backward"] = priced.backward
        if engine is not None:
            extra["engine_costs"] = engine.said
    extra["batch_size"] = batch_size_of(graph)  # rows per micro-batch
    inputs, outputs = io_specs(graph)
    plan = Plan(model=str(graph.path) if graph.path else "", stages=_stages(priced, solution,
                                                                             layout),
                inputs=inputs, outputs=outputs, mode=request.mode, ordering=solution.ordering,
                solver=solution.solver,
                predicted=PlanPredicted.given(_predicted(solution, request)), extra=extra)
    plan.predicted.microbatches = request.train.microbatches  # run's and simulate's default
    priced_as_run(plan)
    if priced.checked is not None:
        plan.costs.check = parse(CheckedCosts, priced.checked.to_json(), "plan.json costs.check")
    if priced.shared is not None:
        plan.compute_scale = parse(ComputeScale, priced.shared, "plan.json compute_scale")
    sources = request.devices.sources
    plan.device_model = parse(DeviceModel, {**priced.device_model, **(
        {"sources": dict(sources)} if sources else {})}, "plan.json device_model")
    if train:
        plan.math = _priced_math(plan.device_model, request.train.precision)
    plan.partition_s = round(time.perf_counter() - started, 4)
    plan.weights = model_weights(graph.model)
    plan.origin = model_origin(graph.model)
    program = request.model.with_suffix(".pt2")
    if program.is_file():  # so training can find it and refuse an altered one
        plan.program = os.path.relpath(program.resolve(), request.out.resolve())
        plan.program_sha256 = sha256_file(program)
    return plan


def _warn_over_memory(solution: Solution, layout: Layout, extra: dict[str, Any]) -> None:
    """A cluster plan with a stage over the device memory counted as it runs (the planner
    checks the same count, so never expected) says so in ``devices_notes``."""
    route = solution.route
    if not isinstance(route, HybridRoute):
        return
    limit = route.cluster.memory_bytes if isinstance(route.cluster, Cluster) else math.inf
    over = [k for k, m in enumerate(layout.memory) if int(m) > limit]
    if over:  # a guard: the planner checks the same count
        extra.setdefault("devices_notes", []).append(
            f"warning: stage(s) {', '.join(map(str, over))} hold more than the device memory "
            "counted as they run; the planner's count fitted them")


def priced_as_run(plan: Plan) -> None:
    """Put the plan's own simulation into ``plan.predicted``: ``iteration_ms``,
    ``throughput_per_s`` (micro-batches per second of that iteration) and ``bubble_fraction``
    of :attr:`Plan.microbatches` under the plan's schedule (1F1B forward + backward for a train
    plan, forward streaming otherwise), replayed from the plan as written
    (:func:`~onnx_partition.pipeline.from_plan.simulate_plan`, what ``simulate``, ``report`` and
    ``run`` replay), so every command states one figure for one quantity. ``bottleneck_ms``
    stays: the slowest stage with its sends charged to it, what a plain plan was cut on."""
    result, _ = simulate_plan(plan)
    iteration = result.iteration_ms
    predicted = plan.predicted
    predicted.throughput_per_s = None
    predicted.iteration_ms = round(iteration, 6)
    if iteration > 0:  # JSON has no Infinity
        predicted.throughput_per_s = round(plan.microbatches / iteration * 1000.0, 3)
    predicted.bubble_fraction = round(result.bubble_fraction, 4)
