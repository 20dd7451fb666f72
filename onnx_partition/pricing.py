"""The price step of ``partition``: the model loaded at its shapes and every figure a plan is
priced with (:func:`price`: per-node costs from the costs file or the analytic model, a fleet's
per kind, the backward per aten op, the bytes a train plan saves and trains, the engine's terms,
plan.json's ``device_model``), and the solvers' problem of the priced graph
(:func:`problem_of`: plain arrays, :class:`~onnx_partition.solve.plan.Problem`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import CostsFile, CostsLike, NodeCosts, annotate, load_costs
from onnx_partition.cost.aten import ANALYTIC_BACKWARD, with_aten_backward
from onnx_partition.cost.cluster import Cluster, Fleet
from onnx_partition.cost.costs_file import (
    CostsCheck,
    check_costs,
    compute_scale,
    recorded_shapes,
    rescale,
)
from onnx_partition.cost.devices import device_for, for_precision
from onnx_partition.cost.engine_price import (
    EngineTerms,
    action_call_ms,
    engine_terms,
    split_call_ms,
)
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.graph.emit import cut_stages
from onnx_partition.graph_arrays import (
    grad_input_ms,
    per_unit,
    per_unit_max,
    saved_activations,
    train_program,
    trainable_parameters,
    trainable_tensors,
    unit_problem,
    unit_weights,
)
from onnx_partition.request.partition import PartitionRequest
from onnx_partition.solve.plan import Problem, StageFigures
from onnx_partition.solve.scoring import node_arrays

__all__ = ["Priced", "device_model", "keeps_torch_ops", "measured_here", "price", "problem_of"]

log = logging.getLogger("onnx_partition")


@dataclass(frozen=True)
class Priced:
    """What prices a plan: the ``graph`` at its shapes and its ``node_costs``; the costs file
    read once (a fleet: its first kind's) and its check against the graph (``checked``: notes
    for the summary), the analytic ``device`` (None where a file prices the nodes), the
    compute scale of processes sharing a CPU (``shared``), plan.json's ``device_model``; a
    fleet's per-kind costs, engines and input-gradient shares; how the backward was priced
    (``backward``); a train plan's saved bytes per node (``saved``), trainable parameters,
    the autocast ``policy`` that counted them, each node's input-gradient share
    (``grad_input``), the output gradients ZB-H1 keeps per node from ``I`` to ``W``
    (``kept``), the gradients live in each node's backward (``working``) and the engine's
    terms (``engine``, ``split_call_ms``, ``action_ms``)."""

    graph: OpGraph
    node_costs: NodeCosts
    costs: CostsFile | None
    checked: CostsCheck | None
    device: DeviceSpec | None
    shared: dict[str, Any] | None
    device_model: dict[str, Any]
    kinds: dict[str, NodeCosts] | None
    kind_engines: dict[str, EngineTerms] | None
    kind_grad_input: dict[str, list[float]] | None
    backward: str
    saved: list[float] | None
    kept: list[float] | None
    working: list[float] | None
    trainable: frozenset[str] | None
    policy: str
    grad_input: list[float]
    engine: EngineTerms | None
    split_call_ms: float
    action_ms: float


def price(request: PartitionRequest) -> Priced:
    """Load the model and price its nodes as ``request`` asks (the one read of its costs
    file); a train plan's saved bytes, trainable parameters and engine terms too."""
    cluster, train = request.devices.cluster, request.training
    precision = request.train.precision
    costs: CostsLike | None = request.costs.file
    device = request.devices.device
    profiled = None
    if request.costs.measure:  # a train plan for this CPU: its cached profile
        costs, profiled = measured_here(request)
        device = None if costs is not None else device_for("cpu")
    files = None
    if isinstance(cluster, Fleet):  # each kind priced on its own (cost.kinds)
        from onnx_partition.cost.kinds import costs_by_kind

        files = costs_by_kind(cluster, costs, request.costs.kinds)
        costs = files[cluster.kinds[0]]
        device = None if costs is not None else device_for("cuda", cluster.kinds[0])
    costs = load_costs(costs) if costs is not None else None  # the one read of the file
    graph, checked = _load_for_costs(request, costs)
    assert costs is not None or device is not None  # the request resolved one
    if device is not None:
        device = for_precision(device, precision)
    if checked is not None and costs is not None and train \
            and costs.body.get("precision", "fp32") != precision:
        checked.notes.append(f"warning: costs file {costs.path} was measured in "
                             f"{costs.body.get('precision', 'fp32')}; this plan is priced for "
                             f"{precision}: its times may not fit")
    node_costs = annotate(graph, device=device, costs=costs)
    if costs is not None and checked is not None:
        node_costs = rescale(node_costs, graph, list(costs.nodes), checked.scale)
    shared = compute_scale(costs, _processes_per_machine(cluster, request.stages)) \
        if costs is not None and train else None
    if costs is not None and shared is not None:  # beside the other stages' processes
        node_costs = rescale(node_costs, graph, list(costs.nodes), shared["forward"],
                             backward=shared["backward"])
    priced = device_model(device, costs, cluster, strict=request.costs.strict)
    if profiled is not None:
        priced["profiled"] = profiled
    return _train_figures(request, graph, node_costs, costs, device, files, priced,
                          checked=checked, shared=shared)


def measured_here(request: PartitionRequest) -> tuple[Path | None, str | None]:
    """The cached profile that prices a train plan for this CPU
    (:func:`~onnx_partition.cost.profile.train_cache.cached_train_profile`), measured now by
    ``profile --mode train`` where the cache has none, and how it was got; (None, None) for a
    model without weights, which the roofline prices."""
    import onnx

    from onnx_partition.cost.profile.torch_ops import profile_train_to_file
    from onnx_partition.cost.profile.train_cache import (
        REPEATS,
        cached_train_profile,
        profile_key,
    )
    from onnx_partition.graph.weightless import model_weights
    from onnx_partition.runtime.train.passes import split_call_ms
    from onnx_partition.runtime.train.probe import probe_engine

    model = request.model
    if model_weights(onnx.load(str(model), load_external_data=False)) == "none":
        return None, None
    shapes, batch, precision = request.input_shapes, request.batch_size, request.train.precision
    key = profile_key(model, input_shapes=shapes, batch_size=batch, precision=precision)

    def measure(path: Path) -> None:
        log.info(f"pricing the train plan by measuring it on this CPU (profile --mode train, "
                 f"{REPEATS} repeats, once: cached in {path}; --analytic for the roofline)")
        profile_train_to_file(model, path, batch_size=batch, input_shapes=shapes,
                              repeats=REPEATS, threads=1, precision=precision,
                              split=lambda: split_call_ms(device="cpu"), probe=probe_engine)

    path, hit = cached_train_profile(key, measure)
    return path, "cached profile" if hit else "profiled now and cached"


def _train_figures(request: PartitionRequest, graph: OpGraph, node_costs: NodeCosts,
                   costs: CostsFile | None, device: DeviceSpec | None,
                   files: Mapping[str, CostsFile | None] | None, priced: dict[str, Any], *,
                   checked: CostsCheck | None, shared: dict[str, Any] | None) -> Priced:
    """:func:`price`'s second half: a fleet's kinds, the backward per aten op, what a train
    plan saves and trains, the engine's terms."""
    train, precision = request.training, request.train.precision
    model = request.model
    program = train_program(model) if train else None  # read once for the three counts
    kinds = aten = kind_engines = kind_grad_input = None
    if files is not None:
        from onnx_partition.cost.kinds import kind_devices, price_kinds

        kinds, priced = price_kinds(graph, files, strict=request.costs.strict,
                                    precision=precision, model=model if train else None,
                                    loaded=program)
        aten = any(m.get("backward") for m in priced["kinds"].values())
        if train:  # each kind's engine and ZB-H1 split, as one kind's plan has
            devices = kind_devices(dict.fromkeys(files), precision)  # each kind's GPU, also
            # where a costs file prices its nodes: the step's bandwidth, unless it measured one
            kind_engines = {k: engine_terms(files[k], devices[k], request.train.optimizer)
                            for k in files}
            kind_grad_input = {k: grad_input_ms(graph, kinds[k], files[k]) for k in files}
    elif train and costs is None and device is not None and device.kind == "cuda":
        node_costs, aten = with_aten_backward(graph, node_costs, model, device, program)
    cluster = request.devices.cluster
    on_gpu = device.kind == "cuda" if device is not None else (
        (cluster is not None and cluster.kind == "cuda")
        or (costs is not None and str(costs.device or "").startswith("cuda")))
    policy = "cuda" if on_gpu else "cpu"  # whose autocast policy counts the activations
    counted = saved_activations(graph, model, precision, policy, program) if train else None
    backward = ("measured" if costs is not None and any("backward_ms" in v
                                                        for v in costs.nodes.values())
                else ANALYTIC_BACKWARD if aten else "estimated")
    return Priced(
        graph=graph, node_costs=node_costs, costs=costs, checked=checked, device=device,
        shared=shared, device_model=priced, kinds=kinds, kind_engines=kind_engines,
        kind_grad_input=kind_grad_input, backward=backward,
        saved=counted.saved if counted is not None else None,
        kept=counted.kept if counted is not None else None,
        working=counted.working if counted is not None else None,
        trainable=trainable_parameters(model, program) if train else None, policy=policy,
        grad_input=grad_input_ms(graph, node_costs, costs),
        engine=engine_terms(costs, device, request.train.optimizer) if train else None,
        split_call_ms=split_call_ms(costs), action_ms=action_call_ms(costs, device))


def _processes_per_machine(cluster: Cluster | Fleet | None, num_stages: int | None) -> int:
    """How many training processes a CPU plan runs on one machine: one per stage without a
    cluster (``train`` runs them all here), a CPU cluster's devices per machine (the most its
    stages and replicas put on one); 1 on GPUs (each process its own device)."""
    if cluster is None:
        return num_stages or 1
    if isinstance(cluster, Fleet) or cluster.kind != "cpu":
        return 1
    return cluster.devices_per_machine


def _load_for_costs(request: PartitionRequest, costs: CostsFile | None
                    ) -> tuple[OpGraph, CostsCheck | None]:
    """Load the model (at the costs file's input shapes when neither input shapes nor a
    batch size is given) and check the costs file (read and validated by
    :func:`~onnx_partition.cost.annotate.load_costs`) against it (``cost.costs_file``)."""
    model, shapes, batch = request.model, request.input_shapes, request.batch_size
    if costs is None:
        return load(model, input_shapes=shapes, batch_size=batch), None
    graph = None
    defaulted = None
    if batch is None and not shapes:
        defaulted = recorded_shapes(costs)
        if defaulted:
            try:
                graph = load(model, input_shapes=defaulted)
            except PartitionError:  # another model's inputs: the check below says so
                defaulted = None
    if graph is None:
        graph = load(model, input_shapes=shapes, batch_size=batch)
    checked = check_costs(costs, graph)
    if defaulted:
        given = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in defaulted.items())
        checked.notes.append(f"note: planning at the input shapes costs file {costs.path} was "
                             f"measured at ({given})")
    if costs.body.get("mode") == "train" and not request.training:
        checked.notes.append(f"warning: costs file {costs.path} was measured for training "
                             f"({costs.body.get('executor') or 'torch eager'}); this inference "
                             "plan runs in onnxruntime: profile without --mode train")
    return graph, checked


def device_model(device: DeviceSpec | None, costs: CostsLike | None,
                 cluster: Cluster | Fleet | None, *, strict: bool = False) -> dict[str, Any]:
    """plan.json's ``device_model``: what priced the plan. Analytic: the spec's name, peaks
    and launch overhead; a costs file (read, or its path): its path and the device it was
    measured on, with a ``warning`` when that is not the cluster's kind
    (:class:`PartitionError` if ``strict``)."""
    if costs is None:
        assert device is not None
        return {"source": "analytic", "name": device.name, "kind": device.kind,
                "peak_tflops": device.peak_gflops / 1e3, "mem_gbps": device.mem_gbps,
                "launch_overhead_ms": device.launch_overhead_ms,
                **({"figures_from": device.source} if device.source else {})}
    costs = load_costs(costs)
    measured, path = costs.device, costs.path
    body: dict[str, Any] = {"source": "costs", "file": path, "measured_on": measured}
    want = cluster.kind if cluster is not None else None
    if measured is not None and want is not None and measured.split(":")[0] != want:
        body["warning"] = (f"costs file {path} was measured on {measured}, the cluster's "
                           f"devices are {want}: its times may not fit them")
        if strict:
            raise PartitionError(body["warning"] + " (--strict-costs)")
    return body


def problem_of(priced: Priced, request: PartitionRequest) -> Problem:
    """The solvers' problem of the priced graph for the request's route, over ONNX nodes or,
    where :func:`keeps_torch_ops`, torch-op units: a plain pipeline's units balanced on
    forward (+ backward in training) times over the request's link; a cluster's on forward
    times over its machine link, with the planner's per-unit arrays (backward, weights, saved
    activations, the input-gradient share) and a fleet's costs per kind. Every route's stage
    figures come from the stage files' cuts (:class:`~onnx_partition.solve.plan.StageFigures`)."""
    graph, costs, cluster = priced.graph, priced.node_costs, request.devices.cluster
    train = request.training
    whole = keeps_torch_ops(request)
    if cluster is None:
        balanced = ([f + b for f, b in zip(costs.forward_ms, costs.backward_ms)]
                    if train else costs.forward_ms)
        dag, nodes, members = unit_problem(graph, balanced, request.devices.link,
                                           torch_ops=whole)
        arrays, kinds = None, None
    else:
        dag, nodes, members = unit_problem(graph, costs.forward_ms, cluster.intra,
                                           torch_ops=whole)
        arrays = node_arrays(
            dag, per_unit([costs.backward_ms[g] for g in nodes], members),
            per_unit([float(graph.nodes[g].param_bytes) for g in nodes], members),
            [graph.nodes[nodes[m[0]]].key for m in members],
            per_unit([priced.saved[g] for g in nodes], members)
            if priced.saved is not None and train else None)
        arrays = replace(arrays, **unit_weights(graph, nodes, members, priced.trainable))
        if priced.kept is not None and train:
            arrays = replace(arrays, kept_bytes=per_unit([priced.kept[g] for g in nodes],
                                                         members))
        if priced.working is not None and train:
            arrays = replace(arrays, working_bytes=per_unit_max(
                [priced.working[g] for g in nodes], members))
        kinds = _kind_costs(priced, nodes, members) if isinstance(cluster, Fleet) else None
        if kinds is None and train:
            arrays = replace(arrays, backward_input_ms=per_unit(
                [priced.grad_input[g] for g in nodes], members))

    def figures(stage_of: Mapping[int, int], count: int) -> StageFigures:
        cuts = cut_stages(graph, dict(stage_of), count)
        return StageFigures(
            [(float(sum(costs.forward_ms[i] for i in cut.nodes)),
              float(sum(costs.backward_ms[i] for i in cut.nodes))) for cut in cuts],
            [float(sum(priced.grad_input[i] for i in cut.nodes)) for cut in cuts],
            trainable_tensors(cuts, priced.trainable))

    return Problem(dag=dag, nodes=nodes, members=members,
                   params=per_unit([float(graph.nodes[g].param_bytes) for g in nodes], members),
                   arrays=arrays, kinds=kinds, engine=priced.engine,
                   split_call_ms=priced.split_call_ms, action_ms=priced.action_ms,
                   figures=figures, torch_ops=whole)


def keeps_torch_ops(request: PartitionRequest) -> bool:
    """Whether the plan keeps each torch op whole: a train plan of a model whose program
    (``.pt2``) lies beside it, which training runs op by op. Inference plans, and train plans
    without a program, may cut between any two ONNX nodes: any ONNX cut is a pair of valid
    stage files."""
    return request.training and request.model.with_suffix(".pt2").is_file()


def _kind_costs(priced: Priced, nodes: Sequence[int], members: Sequence[Sequence[int]]
                ) -> dict[str, Any]:
    """A fleet's per-unit costs on each GPU kind (:class:`~onnx_partition.solve.fleet.
    KindCosts`)."""
    from onnx_partition.solve.fleet import KindCosts

    assert priced.kinds is not None
    grad = priced.kind_grad_input
    return {gpu: KindCosts(per_unit([c.forward_ms[g] for g in nodes], members),
                           per_unit([c.backward_ms[g] for g in nodes], members),
                           (priced.kind_engines or {}).get(gpu),
                           per_unit([grad[gpu][g] for g in nodes], members)
                           if grad is not None else [])
            for gpu, c in priced.kinds.items()}
