"""The partitioner's pipeline: load -> annotate -> order -> solve -> emit.

Each step lives in its own module; this one wires them together and turns the solver's answer
(plain arrays) back into a :class:`~onnx_partition.plan.Plan`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from onnx_partition import __version__
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import CostsFile, CostsLike, NodeCosts, annotate, load_costs
from onnx_partition.cost.aten import ANALYTIC_BACKWARD, with_aten_backward
from onnx_partition.cost.cluster import Cluster, Fleet, Link
from onnx_partition.cost.costs_file import (
    CostsCheck,
    batch_size_of,
    check_costs,
    compute_scale,
    recorded_shapes,
    rescale,
)
from onnx_partition.cost.devices import DEFAULT_GPU, device_for, for_precision, measured_cpu
from onnx_partition.cost.engine_price import (
    EngineTerms,
    action_call_ms,
    engine_terms,
    price_engine,
    split_call_ms,
    split_ms,
    tied_bytes,
)
from onnx_partition.cost.saved import check_precision
from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sha256_file
from onnx_partition.graph import OpGraph, load
from onnx_partition.graph.emit import StageCut, cut_stages, emit, io_specs
from onnx_partition.graph.fxtag import fx_unit
from onnx_partition.pipeline.from_plan import comm_factor, simulate_plan, stage_comm
from onnx_partition.pipeline.layout import relay_names
from onnx_partition.pipeline.memory import (
    RECOMPUTE_MODES,
    StageBytes,
    memory_parts,
    memory_per_device,
    peak_inflight,
    rebuilt_held,
    stash_bytes,
    static_bytes,
)
from onnx_partition.pipeline.schedules import PLANNED_NAMES, build
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import Plan, Predicted, Stage
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.solve.baselines import parameter_balanced, time_balanced, uniform
from onnx_partition.solve.contract import contract, expand
from onnx_partition.solve.exact import EXACT_BUDGET_S, exact_split
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import (
    LAST,
    HybridPlan,
    NodeArrays,
    RunSpec,
    node_arrays,
)
from onnx_partition.solve.search import best_split

__all__ = ["AUTO", "BASELINES", "SOLVERS", "TRAIN_ASSUMPTIONS", "dag_problem", "device_model",
           "devices_line", "partition", "plan_on_cluster", "plan_stages", "priced_as_run",
           "priced_by", "proof_line", "saved_activations", "unit_problem"]

#: What a train plan's memory model assumes, recorded in plan.json (``train`` defaults to
#: them and warns when told otherwise): AdamW (weights, gradients, two moments:
#: ``optimizer_factor`` 4), fp32 (``partition(precision=)`` records its own), 1F1B.
TRAIN_ASSUMPTIONS = {"optimizer": "adamw", "precision": "fp32", "schedule": "1f1b"}
#: ``partition --schedule``: plan for each planned train schedule, keep the fastest.
AUTO = "auto"

#: Baseline splits (one device per stage), for comparison: Megatron's and DeepSpeed's "uniform",
#: DeepSpeed's "parameters", torchgpipe's time balance (no communication).
BASELINES = ("uniform", "parameters", "time")
SOLVERS = ("dp", "ilp", *BASELINES)


def dag_problem(
    graph: OpGraph, forward_ms: Sequence[float], link: Link
) -> tuple[DagProblem, list[int]]:
    """The solvers' view of ``graph``: plain arrays over the cut (non-free) nodes, numbered
    0..n-1 in the graph's topological order; also the OpGraph index of each."""
    nodes = graph.compute_nodes
    local = {g: i for i, g in enumerate(nodes)}
    names = list(graph.tensors)
    outputs = set(graph.outputs)
    problem = DagProblem(
        compute_ms=[forward_ms[g] for g in nodes],
        producer=[local.get(graph.tensors[t].producer, -1) for t in names],
        consumers=[[local[c] for c in graph.tensors[t].consumers] for t in names],
        is_output=[t in outputs for t in names],
        nbytes=[float(graph.tensors[t].nbytes) for t in names],
        bandwidth_bytes_per_ms=link.bytes_per_ms,
        latency_ms=link.latency_ms,
    )
    return problem, nodes


def unit_problem(
    graph: OpGraph, forward_ms: Sequence[float], link: Link
) -> tuple[DagProblem, list[int], list[list[int]]]:
    """:func:`dag_problem` with the nodes exported from one FX node (their
    ``pkg.torch.onnx.fx_node`` tag; a ``getitem`` joins the op it reads) contracted into one
    unit, so no plan splits a torch op.
    Returns the units' problem, the OpGraph index of each cut node, and each unit's members
    (indices into that list). Untagged models give one unit per node."""
    problem, nodes = dag_problem(graph, forward_ms, link)
    protos = graph.protos()
    labels = [fx_unit(protos[graph.nodes[g].key]) for g in nodes]
    if all(label is None for label in labels):
        return problem, nodes, [[i] for i in range(len(nodes))]
    units, members = contract(problem, labels)
    return units, nodes, members


def _per_unit(values: Sequence[float], members: Sequence[Sequence[int]]) -> list[float]:
    return [float(sum(values[i] for i in m)) for m in members]


def saved_activations(graph: OpGraph, model: Path, precision: str = "fp32",
                      policy: str = "cpu") -> list[float] | None:
    """Bytes autograd saves for backward per OpGraph node (:mod:`onnx_partition.cost.saved`,
    under FakeTensorMode at the graph's input shapes, autocast to ``precision``'s half dtype
    unless fp32, by the ``policy`` of the plan's devices: ``cpu`` or ``cuda``), when the
    model's program ``.pt2`` lies beside it; None otherwise (the memory model then counts
    every output)."""
    program = model.with_suffix(".pt2")
    if not program.is_file():
        if precision != "fp32":
            raise PartitionError(f"--precision {precision} counts what autocast saves by "
                                 f"running the model's program, and {model} has none "
                                 f"({program.name}): export it with onnx_partition.export")
        return None
    from onnx_partition.cost.saved import saved_bytes_per_node  # torch: train plans only

    try:
        return saved_bytes_per_node(graph, program, precision=precision, policy=policy)
    except PartitionError:
        raise
    except Exception as exc:  # a program torch cannot run at these shapes
        raise PartitionError(f"could not count the activations of program {program}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                             ) from None


def trainable_parameters(model: Path) -> frozenset[str] | None:
    """Names of the trainable parameters of the program ``.pt2`` beside ``model`` (its
    signature's parameters: what has gradients and optimizer state in training; buffers and
    the exporter's constants have none), which the ONNX initializers carry; None without a
    program (every initializer then counts as trainable)."""
    program = model.with_suffix(".pt2")
    if not program.is_file():
        return None
    import torch  # train plans with a program only

    try:
        loaded = torch.export.load(str(program))
    except Exception as exc:  # a program this torch cannot read
        raise PartitionError(f"could not read program {program}: {type(exc).__name__}"
                             ) from None
    return frozenset(loaded.graph_signature.parameters)


def stage_sizes(graph: OpGraph, cuts: Sequence[StageCut], *, train: bool,
                activation_bytes: Sequence[float] | None = None,
                trainable: Collection[str] | None = None) -> list[StageBytes]:
    """The one count of what each stage holds, from its cut (the stage file it runs), for
    every plan (plain pipeline or cluster): weights, every initializer the stage reads
    (constants included; a tied parameter in each stage reading it, as each rank holds its
    own copy; the last stage also the graph outputs that are initializers or constants);
    of those the ``trainable`` ones (None: all) have gradients and optimizer state;
    activations per micro-batch (``activation_bytes`` per OpGraph node in training where
    given: saved for backward; else its operators' outputs); received, what the runtime
    hands the stage per micro-batch (:func:`~onnx_partition.pipeline.layout.relay_names`:
    its inputs and every tensor it relays to a later stage; stage 0: the graph inputs read
    anywhere, held by rank 0 per micro-batch in flight); sent (training, all but the last
    stage), what it sends on, relayed tensors included, whose gradients come back."""
    def nbytes(names: Sequence[str]) -> float:
        return float(sum(graph.tensors[t].nbytes for t in names if t in graph.tensors))

    def acts(cut: StageCut) -> float:
        if train and activation_bytes is not None:
            return float(sum(activation_bytes[i] for i in cut.nodes))
        return nbytes([o for i in cut.nodes for o in graph.nodes[i].outputs])

    last = len(cuts) - 1
    received, sent = relay_names(graph.inputs, [c.inputs for c in cuts],
                                 [c.outputs for c in cuts], graph.outputs)
    return [StageBytes(float(sum(graph.initializer_bytes[t] for t in cut.initializers)),
                       acts(cut), nbytes(received[k]),
                       nbytes(sent[k]) if train and k < last else 0.0,
                       None if trainable is None else float(sum(
                           graph.initializer_bytes[t] for t in cut.initializers
                           if t in trainable)))
            for k, cut in enumerate(cuts)]


def unit_weights(graph: OpGraph, nodes: Sequence[int], members: Sequence[Sequence[int]],
                 trainable: Collection[str] | None = None) -> dict[str, Any]:
    """:func:`stage_sizes`'s weights as plain arrays over units, for the planner
    (:class:`~onnx_partition.solve.scoring.NodeArrays`' memory fields): each unit holds the
    initializers its nodes read and those of the constant nodes copied in for them (what
    :func:`~onnx_partition.graph.emit.cut_stages` puts in a stage file); an initializer one
    unit holds counts in its ``weight_bytes`` (and ``trainable_bytes`` if ``trainable``,
    None: all), one several hold is ``shared`` (bytes, trainable bytes, holders), held by
    every stage with a holder; a graph output that is an initializer, or a constant made from
    some, the last stage file holds: those initializers are ``shared`` with the holder
    :data:`~onnx_partition.solve.scoring.LAST`; ``input_bytes`` the graph inputs some node
    reads or the outputs name, which stage 0 receives (:func:`stage_sizes`);
    ``trainable_tensors`` the trainable initializers each unit alone holds and ``ties_train``
    whether ``trainable`` is known (what :func:`trainable_tensors` and
    :func:`~onnx_partition.cost.engine_price.tied_bytes` count per stage)."""
    producer = graph.producer_of()
    copied: dict[int, frozenset[str]] = {}  # a free node's and those of the free ones it reads
    for node in graph.nodes:  # topological order: a producer before its readers
        if node.free:
            copied[node.index] = frozenset(node.initializers).union(*(
                copied[producer[t]] for t in node.inputs if producer.get(t, -1) in copied))

    holders: dict[str, list[int]] = {}
    for unit, local in enumerate(members):
        held: set[str] = set()
        for i in local:
            node = graph.nodes[nodes[i]]
            held.update(node.initializers)
            for t in node.inputs:
                if t not in graph.tensors and producer.get(t, -1) in copied:
                    held |= copied[producer[t]]
        for name in held:
            holders.setdefault(name, []).append(unit)
    for name in graph.outputs:  # the last stage file's own (graph.emit.cut_stages)
        if name in graph.tensors:
            continue
        tail = {name} & graph.initializer_bytes.keys() or copied.get(producer.get(name, -1),
                                                                     frozenset())
        for init in tail:
            if LAST not in holders.setdefault(init, []):
                holders[init].append(LAST)
    weights, trained = [0.0] * len(members), [0.0] * len(members)
    tensors = [0] * len(members)
    shared: list[tuple[float, float, tuple[int, ...]]] = []
    for name in sorted(holders):
        units = holders[name]
        nbytes = float(graph.initializer_bytes.get(name, 0))
        train_bytes = nbytes if trainable is None or name in trainable else 0.0
        if len(units) == 1 and units[0] != LAST:
            weights[units[0]] += nbytes
            trained[units[0]] += train_bytes
            tensors[units[0]] += trainable is None or name in trainable
        else:
            shared.append((nbytes, train_bytes, tuple(units)))
    outputs = set(graph.outputs)
    inputs = float(sum(graph.tensors[t].nbytes for t in graph.inputs if t in graph.tensors
                       and (graph.tensors[t].consumers or t in outputs)))
    return {"weight_bytes": weights, "trainable_bytes": trained, "shared": shared,
            "input_bytes": inputs, "trainable_tensors": tensors,
            "ties_train": trainable is not None}


def grad_input_ms(graph: OpGraph, node_costs: NodeCosts,
                  costs: CostsFile | None) -> list[float]:
    """Each node's input-gradient share of its backward time (what zero-bubble schedules run
    as ``I``; the rest is ``W``): the costs file's ``backward_input_ms`` over its
    ``backward_input_ms + backward_weight_ms`` where it measured them (``profile --mode
    train``), else the analytic split: a node with no weights has no weight gradient (all
    ``I``), one with weights computes the two gradients alike (half each, the dense rule of
    :func:`~onnx_partition.pipeline.simulate.backward_factor`)."""
    given = costs.nodes if costs is not None else {}
    out = []
    for node, bwd in zip(graph.nodes, node_costs.backward_ms, strict=True):
        entry = given.get(node.key, {})
        grad_in, grad_w = entry.get("backward_input_ms"), entry.get("backward_weight_ms")
        if grad_in is not None and grad_w is not None and grad_in + grad_w > 0:
            out.append(bwd * grad_in / (grad_in + grad_w))
        else:
            out.append(bwd if node.param_bytes == 0 else bwd / 2.0)
    return out


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
    cluster: Cluster | Fleet | None = None,
    mode: str = "infer",
    microbatches: int = 8,
    ordering: str = "auto",
    solver: str = "dp",
    time_limit_s: float = 60.0,
    exact_budget_s: float = EXACT_BUDGET_S,
    force: bool = False,
    check: bool = True,
    strict_costs: bool = False,
    schedule: str = AUTO,
    recompute: str = "auto",
    sources: Mapping[str, str] | None = None,
    reporter: Reporter = SILENT,
    kind_costs: Mapping[str, CostsLike] | None = None,
    precision: str = "fp32",
) -> Plan:
    """Cut ``model`` into pipeline stages and write them with plan.json to ``out``.

    Without a ``cluster``: exactly ``num_stages`` stages, one device each, slowest stage
    minimised. With one: stages *and* replicas per stage on its devices (``num_stages`` then
    fixes the depth, or ``None`` lets the planner choose), fastest simulated iteration of
    ``microbatches`` micro-batches in ``mode`` ("infer" or "train") within device memory.
    ``costs`` (a path, or a :class:`~onnx_partition.cost.annotate.CostsFile`) is read once and
    that one reading is handed to every step. Without it the analytic model prices the nodes
    on ``device``, by default the cluster's (:func:`~onnx_partition.cost.devices.device_for`:
    its GPU, or the measured CPU).
    A costs file measured on another device kind than the cluster's is noted in plan.json's
    ``device_model.warning`` (an error with ``strict_costs``). The long steps (planning,
    writing stage files) report to ``reporter`` (the command line's bars; default: nothing).
    A train plan is planned for ``schedule`` (one of
    :data:`~onnx_partition.pipeline.schedules.PLANNED_NAMES`, or ``auto``: each, keeping the
    fastest simulated plan), its stages recomputing per ``recompute`` (``auto``: a stage that
    fits the device memory only so; ``none``; ``all``); both are ignored in inference.
    ``sources``: where the device memory and links came from (``memory``, ``link``,
    ``inter_link``: datasheet, cluster.json, option or default), kept in plan.json's
    ``device_model.sources`` for the summary (:func:`devices_line`).
    A pipeline cut by ``solver="dp"`` is then proven optimal or bettered by CP-SAT within
    ``exact_budget_s`` deterministic seconds (:func:`~onnx_partition.solve.exact.exact_split`;
    0 turns it off); plan.json's ``exact`` says what is proven.
    A :class:`~onnx_partition.cost.cluster.Fleet` (mixed GPU kinds) prices each group on its
    own GPU, or by its costs file in ``kind_costs`` (keyed by the group's ``gpu``), and plans
    with :func:`~onnx_partition.solve.fleet.plan_fleet`.
    A train plan is priced for ``precision`` (:data:`~onnx_partition.cost.saved.PRECISIONS`:
    fp32, or autocast to bf16/fp16 over fp32 parameters): activations as autocast saves them,
    a GPU's matrix products at its half-precision peak; weights, gradients and optimizer
    state stay fp32 (16 bytes per parameter with AdamW), as ``train --precision bf16`` keeps
    them. Returns the plan as written. Raises :class:`PartitionError` on bad input.
    """
    started = time.perf_counter()
    if mode not in ("infer", "train"):
        raise PartitionError(f"mode must be infer or train, got {mode!r}")
    if schedule != AUTO and schedule not in PLANNED_NAMES:
        raise PartitionError(f"cannot plan for schedule {schedule!r}; choose "
                             f"{', '.join((AUTO, *PLANNED_NAMES))}")
    if recompute not in RECOMPUTE_MODES:
        raise PartitionError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, "
                             f"got {recompute!r}")
    schedules = PLANNED_NAMES if schedule == AUTO else (schedule,)
    check_precision(precision)
    if precision != "fp32" and mode != "train":
        raise PartitionError(f"--precision {precision} prices mixed-precision training: it "
                             "needs --mode train (inference runs the graph's own dtypes)")
    if not 0 <= exact_budget_s < math.inf:
        raise PartitionError(f"--exact-budget must be 0 (off) or a number of seconds, got "
                             f"{exact_budget_s:g}")
    files = None
    if isinstance(cluster, Fleet):  # each kind priced on its own (cost.kinds)
        from onnx_partition.cost.kinds import costs_by_kind, price_kinds

        files = costs_by_kind(cluster, costs, kind_costs)
        costs = files[cluster.kinds[0]]
        device = None if costs is not None else device_for("cuda", cluster.kinds[0])
    elif kind_costs:
        raise PartitionError("--costs KIND=FILE prices the GPU kinds of a fleet (cluster.json "
                             "with groups); give a plain --costs FILE")
    costs = load_costs(costs) if costs is not None else None  # the one read of the file
    graph, checked = _load_for_costs(model, costs, input_shapes, batch_size)
    if checked is not None and costs is not None and costs.body.get("mode") == "train" \
            and mode != "train":
        checked.notes.append(f"warning: costs file {costs.path} was measured for training "
                             f"({costs.body.get('executor') or 'torch eager'}); this inference "
                             "plan runs in onnxruntime: profile without --mode train")
    if costs is None and device is None:
        device = device_for(cluster.kind, cluster.gpu) if cluster else measured_cpu()
    if device is not None:
        device = for_precision(device, precision)
    if checked is not None and costs is not None and mode == "train" \
            and costs.body.get("precision", "fp32") != precision:
        checked.notes.append(f"warning: costs file {costs.path} was measured in "
                             f"{costs.body.get('precision', 'fp32')}; this plan is priced for "
                             f"{precision}: its times may not fit")
    node_costs = annotate(graph, device=device, costs=costs)
    if costs is not None and checked is not None:
        node_costs = rescale(node_costs, graph, list(costs.nodes), checked.scale)
    shared = compute_scale(costs, _processes_per_machine(cluster, num_stages)) \
        if costs is not None and mode == "train" else None
    if costs is not None and shared is not None:  # beside the other stages' processes
        node_costs = rescale(node_costs, graph, list(costs.nodes), shared["forward"],
                             backward=shared["backward"])
    priced = device_model(device, costs, cluster, strict=strict_costs)
    kinds = None
    aten = None
    kind_engines: dict[str, EngineTerms] | None = None
    kind_grad_input: dict[str, list[float]] | None = None
    if files is not None:
        from onnx_partition.cost.kinds import kind_devices

        kinds, priced = price_kinds(graph, files, strict=strict_costs, precision=precision,
                                    model=Path(model) if mode == "train" else None)
        aten = any(m.get("backward") for m in priced["kinds"].values())
        if mode == "train":  # each kind's engine and ZB-H1 split, as one kind's plan has
            devices = kind_devices(dict.fromkeys(files), precision)  # each kind's GPU, also
            # where a costs file prices its nodes: the step's bandwidth, unless it measured one
            kind_engines = {k: engine_terms(files[k], devices[k], TRAIN_ASSUMPTIONS["optimizer"])
                            for k in files}
            kind_grad_input = {k: grad_input_ms(graph, kinds[k], files[k]) for k in files}
    elif mode == "train" and costs is None and device is not None and device.kind == "cuda":
        node_costs, aten = with_aten_backward(graph, node_costs, Path(model), device)
    on_gpu = device.kind == "cuda" if device is not None else (
        (cluster is not None and cluster.kind == "cuda")
        or (costs is not None and str(costs.device or "").startswith("cuda")))
    policy = "cuda" if on_gpu else "cpu"  # whose autocast policy counts the activations
    saved = saved_activations(graph, Path(model), precision, policy) if mode == "train" \
        else None
    trainable = trainable_parameters(Path(model)) if mode == "train" else None
    if cluster is None:
        if num_stages is None:
            raise PartitionError("give --stages S, or a cluster (--devices N or --cluster FILE)")
        plan, cuts = plan_stages(graph, node_costs, num_stages, link=link or Link(),
                                 ordering=ordering, solver=solver, time_limit_s=time_limit_s,
                                 exact_budget_s=exact_budget_s,
                                 mode=mode, microbatches=microbatches, activation_bytes=saved,
                                 reporter=reporter, schedules=schedules, recompute=recompute,
                                 grad_input=grad_input_ms(graph, node_costs, costs),
                                 trainable=trainable, split_call_ms=split_call_ms(costs),
                                 action_ms=action_call_ms(costs, device))
    else:
        if solver != "dp":
            raise PartitionError(f"--solver {solver} plans pipelines without replicas: drop "
                                 "the cluster options or use --solver dp")
        plan, cuts = plan_on_cluster(graph, node_costs, cluster, num_stages=num_stages,
                                     mode=mode, microbatches=microbatches,
                                     activation_bytes=saved, reporter=reporter,
                                     schedules=schedules, recompute=recompute,
                                     grad_input=grad_input_ms(graph, node_costs, costs),
                                     kinds=kinds, kind_engines=kind_engines,
                                     kind_grad_input=kind_grad_input, trainable=trainable,
                                     exact_budget_s=exact_budget_s,
                                     split_call_ms=split_call_ms(costs),
                                     action_ms=action_call_ms(costs, device),
                                     engine=engine_terms(costs, device,
                                                         TRAIN_ASSUMPTIONS["optimizer"])
                                     if mode == "train" else None)
    if mode == "train":
        chosen = plan.extra.pop("schedule")
        plan.extra.update(TRAIN_ASSUMPTIONS, schedule=chosen, precision=precision)
        if recompute != AUTO:  # what a re-cut (profile --plan) asks for again
            plan.extra["recompute"] = recompute
        plan.extra["activations"] = (
            {"source": "saved-tensors", "program": Path(model).with_suffix(".pt2").name,
             "total_bytes": int(sum(saved)),  # in half precision: by whose autocast policy
             **({"precision": precision, "autocast": policy} if precision != "fp32" else {})}
            if saved is not None
            else {"source": "outputs", "note": "no program beside the model: every operator "
                  "output counted, as stored"})
        plan.extra["costs"]["backward"] = (
            "measured" if costs is not None and any("backward_ms" in v
                                                    for v in costs.nodes.values())
            else ANALYTIC_BACKWARD if aten else "estimated")
        price_engine(plan, costs=costs, device=device, tied=tied_bytes(
            [c.initializers for c in cuts], graph.initializer_bytes, trainable),
            tensors=trainable_tensors(cuts, trainable), kinds=kind_engines)
    else:
        plan.extra["schedule"] = "infer"  # what simulate, report and run default to
    plan.batch_size = batch_size_of(graph)  # rows per micro-batch
    plan.predicted["microbatches"] = microbatches  # run's and simulate's default
    priced_as_run(plan)
    if checked is not None:
        plan.extra["costs"]["check"] = checked.to_json()
    if shared is not None:
        plan.extra["compute_scale"] = shared
    plan.device_model = {**priced, **({"sources": dict(sources)} if sources else {})}
    plan.partition_s = round(time.perf_counter() - started, 4)
    _record_program(plan, Path(model), Path(out))
    return emit(graph, cuts, plan, Path(out), force=force, check=check, reporter=reporter)


def _processes_per_machine(cluster: Cluster | Fleet | None, num_stages: int | None) -> int:
    """How many training processes a CPU plan runs on one machine: one per stage without a
    cluster (``train`` runs them all here), a CPU cluster's devices per machine (the most its
    stages and replicas put on one); 1 on GPUs (each process its own device)."""
    if cluster is None:
        return num_stages or 1
    if isinstance(cluster, Fleet) or cluster.kind != "cpu":
        return 1
    return cluster.devices_per_machine


def _load_for_costs(
    model: str | os.PathLike[str],
    costs: CostsFile | None,
    input_shapes: Mapping[str, Sequence[int]] | None,
    batch_size: int | None,
) -> tuple[OpGraph, CostsCheck | None]:
    """Load ``model`` (at the costs file's input shapes when neither ``input_shapes`` nor
    ``batch_size`` is given) and check the costs file (read and validated by
    :func:`~onnx_partition.cost.annotate.load_costs`) against it (``cost.costs_file``)."""
    if costs is None:
        return load(model, input_shapes=input_shapes, batch_size=batch_size), None
    graph = None
    defaulted = None
    if batch_size is None and not input_shapes:
        defaulted = recorded_shapes(costs)
        if defaulted:
            try:
                graph = load(model, input_shapes=defaulted)
            except PartitionError:  # another model's inputs: the check below says so
                defaulted = None
    if graph is None:
        graph = load(model, input_shapes=input_shapes, batch_size=batch_size)
    checked = check_costs(costs, graph)
    if defaulted:
        shapes = ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in defaulted.items())
        checked.notes.append(f"note: planning at the input shapes costs file {costs.path} was "
                             f"measured at ({shapes})")
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


def priced_by(plan: Plan) -> str:
    """One line naming what priced ``plan`` (its ``device_model``), for the summary."""
    model = plan.device_model
    if model is None:
        return "priced by: unknown (plan.json has no device_model)"
    backward = (plan.extra.get("costs") or {}).get("backward")
    estimated = (
        "; backward estimated from forward (profile MODEL --mode train measures it in torch)"
        if plan.mode == "train" and backward not in ("measured", ANALYTIC_BACKWARD) else
        "; backward per aten op of the program (roofline)" if plan.mode == "train"
        and backward == ANALYTIC_BACKWARD else "")
    if model.get("source") == "kinds":  # a fleet: each GPU kind by its own model
        return "priced by: each GPU kind on its own: " + "; ".join(
            f"{kind} by costs file {m.get('file')}" if m.get("source") == "costs" else
            f"{kind} by the analytic roofline of {m.get('name')}"
            for kind, m in (model.get("kinds") or {}).items()) + estimated
    if model.get("source") == "costs":
        where = model.get("measured_on") or "an unnamed device"
        return f"priced by: costs file {model.get('file')} (measured on {where}){estimated}"
    named = (model.get("sources") or {}).get("gpu", "default") != "default"
    default = " (the default GPU; --gpu NAME to change)" if str(model.get("name")) in (
        f"{DEFAULT_GPU}:tf32", f"{DEFAULT_GPU}:bf16", f"{DEFAULT_GPU}:fp16") and not named \
        else ""
    source = f" ({model['figures_from']})" if model.get("figures_from") else ""
    return (f"priced by: analytic roofline of {model.get('name')}{default}, "
            f"{model.get('peak_tflops', 0):.4g} TFLOP/s dense, "
            f"{model.get('mem_gbps', 0):.4g} GB/s{source}{estimated}")


def devices_line(plan: Plan) -> str:
    """One line: the device memory and links the plan assumed, and where each came from; a
    train plan whose hops the engine's measurements price (plan.json's ``engine_costs``) says
    so, with the ``send_ms`` the simulator plays (the link above it shaped only the cut), as
    does one whose link-model hops carry the probe's measured work per hop."""
    line = _links_line(plan)
    said = str((plan.extra.get("engine_costs") or {}).get("send_ms") or "")
    sends = (plan.simulator_costs or {}).get("send_ms") if plan.mode == "train" else None
    measured = said.startswith(("measured", "calibrated"))
    if sends and (measured or "(the probe)" in said):  # the probe: link + measured work per hop
        hops = " / ".join(f"{float(x):.3g}" for x in sends)
        how = said.split(":", 1)[0] if measured else "the link model + the probe's work per hop"
        line += (f"; train hops priced as measured: {hops} ms "
                 f"({how}, plan.json engine_costs.send_ms)")
    return line


def _links_line(plan: Plan) -> str:
    sources = (plan.device_model or {}).get("sources") or {}
    if not sources:
        link = plan.extra.get("link") or {}
        return (f"link between stages: {link.get('bandwidth_gbps', '?')} GB/s, "
                f"{link.get('latency_ms', '?')} ms" if link else "devices: as plan.json says")
    if "memory" not in sources:
        return f"link between stages: {sources.get('link', '?')}"
    return (f"devices: memory {sources['memory']}; link within a machine "
            f"{sources.get('link', '?')}; between machines {sources.get('inter_link', '?')}")


#: Why an exact pass stopped short of a proof, for the summary.
_SHORT = {"budget": "the budget ran out (--exact-budget SECONDS to search longer)",
          "off": "exact search off (--exact-budget 0)",
          "size": "graph too large for the default exact search (--solver ilp to run it)"}


#: Why a hybrid plan's DP objective was not judged, for the summary.
_HYBRID_SHORT = {"off": "exact search off (--exact-budget 0)",
                 "recompute": "stages recompute, which the hybrid judge does not model",
                 "fleet": "the hybrid judge models one device kind, not a fleet"}


def _hybrid_proof_line(exact: Mapping[str, Any]) -> str:
    """:func:`proof_line` of a hybrid plan: what CP-SAT proved of the DP's bottleneck period
    over one sequence (plan.json's ``exact``, :mod:`~onnx_partition.solve.hybrid_proof`)."""
    by = exact.get("by", "")
    if by in _HYBRID_SHORT:
        return f"plan quality: not proven; {_HYBRID_SHORT[by]}"
    where = (f"over the {exact.get('ordering')} sequence ({exact.get('positions')} blocks, "
             f"{exact.get('devices')} devices)" if exact.get("positions") else
             f"on {exact.get('devices')} devices")
    if by == "size":
        return (f"plan quality: not proven; CP-SAT judges the DP's bottleneck period up to "
                f"{exact.get('max_cells')} stage choices (blocks squared times stages) and "
                f"{exact.get('max_devices')} devices: here {where}")
    period, plan_ms = exact.get("period_ms"), exact.get("plan_period_ms")
    if period is None:  # the DP found no plan of the sequence within memory
        agreed = ("CP-SAT agrees" if by == "none-fits" else "CP-SAT disagrees: please report"
                  if by == "disagree" else "CP-SAT's budget ran out")
        return (f"plan quality: not proven; the DP finds no plan {where} within memory "
                f"without recomputation ({agreed}); the plan comes from another proposal")
    chosen = ("; the plan, chosen by simulated iteration (not proven), has period "
              f"{plan_ms:.6g} ms (+{(plan_ms / period - 1) * 100:.2f}%)"
              if period and plan_ms is not None and plan_ms > period * (1 + 1e-6) else
              "; the plan, chosen by simulated iteration (not proven), has it"
              if plan_ms is not None else
              "; the plan, chosen by simulated iteration (not proven), is not a split of "
              "that sequence")
    if by == "disagree":
        return (f"plan quality: CP-SAT found a bottleneck period below the DP's "
                f"{period:.6g} ms {where}: the DP missed a plan (please report){chosen}")
    least = f"the DP's least bottleneck period {where}, {period:.6g} ms per micro-batch"
    if exact.get("proven_optimal"):
        how = ("it meets the bound of all compute over all devices" if by == "bound"
               else f"CP-SAT, {exact.get('seconds', 0):.2f} s")
        return f"plan quality: {least}, proven optimal ({how}){chosen}"
    return (f"plan quality: {least}, within {exact.get('gap', 0) * 100:.2f}% of the bound "
            f"{exact.get('lower_bound_ms', 0):.6g} ms (all compute over all devices); CP-SAT's "
            f"budget ran out (--exact-budget SECONDS to search longer){chosen}")


def proof_line(plan: Plan) -> str | None:
    """One line saying whether a pipeline plan is proven optimal, or its gap to the best lower
    bound (plan.json's ``exact``, or ``ilp`` for ``--solver ilp``); of a hybrid plan, what is
    proven of the DP's bottleneck period (:func:`_hybrid_proof_line`); None for other plans."""
    exact, ilp = plan.extra.get("exact"), plan.extra.get("ilp")
    if isinstance(exact, dict) and exact.get("kind") == "hybrid-period":
        return _hybrid_proof_line(exact)
    if isinstance(exact, dict):
        how = {"single": "one stage", "bound": "it meets the lower bound",
               "chain": "the DAG is a chain, cut exactly by the DP",
               "cp-sat": f"CP-SAT, {exact.get('seconds', 0):.2f} s"}
        better = exact.get("dp_ms", 0) - exact.get("bottleneck_ms", 0)
        gained = (f"; {better / exact['dp_ms'] * 100:.2f}% faster than the DP's cut"
                  if better > 0 else "")
        if exact.get("proven_optimal"):
            rounding = (f", to {exact['gap'] * 100:.4f}% (the integer model's rounding)"
                        if exact.get("gap", 0) > 0 else "")
            return (f"plan quality: proven optimal ({how.get(exact.get('by', ''), '?')}"
                    f"{rounding}){gained}")
        return (f"plan quality: within {exact.get('gap', 0) * 100:.2f}% of optimal (lower bound "
                f"{exact.get('lower_bound_ms', 0):.6g} ms); "
                f"{_SHORT.get(exact.get('by', ''), 'not proven')}{gained}")
    if isinstance(ilp, dict) and "optimal" in ilp:
        if ilp["optimal"]:
            return f"plan quality: proven optimal (CP-SAT, {ilp.get('seconds', 0):.2f} s)"
        return (f"plan quality: within {ilp.get('gap', 0) * 100:.2f}% of optimal (lower bound "
                f"{ilp.get('lower_bound_ms', 0):.6g} ms); the time limit ran out")
    return None


def plan_stages(
    graph: OpGraph,
    node_costs: NodeCosts,
    num_stages: int,
    *,
    link: Link,
    ordering: str = "auto",
    solver: str = "dp",
    time_limit_s: float = 60.0,
    exact_budget_s: float = EXACT_BUDGET_S,
    mode: str = "infer",
    microbatches: int = 8,
    activation_bytes: Sequence[float] | None = None,
    reporter: Reporter = SILENT,
    schedules: Sequence[str] = ("1f1b",),
    recompute: str = "none",
    grad_input: Sequence[float] | None = None,
    trainable: Collection[str] | None = None,
    split_call_ms: float = 0.0,
    action_ms: float = 0.0,
) -> tuple[Plan, list[StageCut]]:
    """Sequence the graph (every ordering for ``auto``), cut by DP, then prove the cut optimal
    or better it by CP-SAT (``exact_budget_s`` deterministic seconds, or the full ILP for
    ``time_limit_s`` with ``solver="ilp"``), and describe the stages. A train plan is for the
    fastest simulated of ``schedules`` on that split (``grad_input``: each node's
    input-gradient ms; ``split_call_ms``: ZB-H1's split backward per weight group;
    ``action_ms``: the engine's work per action,
    :func:`~onnx_partition.cost.engine_price.action_ms`),
    every stage recomputing if ``recompute`` is ``all`` (no memory limit: ``auto`` recomputes
    none). Inference is balanced on forward times, training on forward +
    backward (what a train step runs); a train plan's memory is its schedule's peak of
    ``microbatches``, its activations ``activation_bytes`` per OpGraph node where given (bytes
    saved for backward), else every output; its gradients and optimizer state those of the
    ``trainable`` initializers (None: all), :func:`stage_sizes`."""
    train = mode == "train"
    balanced = ([f + b for f, b in zip(node_costs.forward_ms, node_costs.backward_ms)]
                if train else node_costs.forward_ms)
    problem, nodes, members = unit_problem(graph, balanced, link)
    _check_stages(num_stages, problem.num_nodes)
    if solver not in SOLVERS:
        raise PartitionError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    extra: dict[str, Any] = {
        "link": {"bandwidth_gbps": link.bandwidth_gbps, "latency_ms": link.latency_ms},
    }
    if solver in BASELINES:  # the splits other tools make, for comparison
        params = _per_unit([float(graph.nodes[g].param_bytes) for g in nodes], members)
        local_stage = _baseline(solver, problem, params, num_stages)
        ordering = "topo"
    else:
        best, candidates = best_split(problem, num_stages, ordering, reporter=reporter)
        local_stage, ordering = best.stage_of, best.ordering
        extra["candidates"] = {
            c.ordering: {"dp_ms": round(c.dp_ms, 6), "refined_ms": round(c.refined_ms, 6),
                         "positions": c.positions, "seconds": round(c.seconds, 4)}
            for c in candidates
        }
    if solver == "ilp":
        from onnx_partition.solve.ilp import solve_ilp  # OR-Tools, for this solver only

        try:
            result = solve_ilp(problem, num_stages, time_limit_s=time_limit_s, hint=local_stage)
        except PartitionError as exc:  # no solution within the limit: keep the DP's plan
            extra["ilp"] = {"error": str(exc), "fallback": "dp"}
        else:
            local_stage = result.stage_of
            extra["ilp"] = {"optimal": result.optimal, "bottleneck_ms": result.bottleneck_ms,
                            "lower_bound_ms": result.lower_bound_ms, "gap": result.gap,
                            "seconds": round(result.wall_s, 3)}
    elif solver == "dp":  # exact where it is cheap: the DP's cut proven, or bettered
        proof = exact_split(problem, num_stages, local_stage, budget_s=exact_budget_s)
        local_stage = proof.stage_of
        extra["exact"] = proof.to_json(exact_budget_s)
    times = problem.stage_times(local_stage, num_stages)
    if train:  # simulate/report replay the split and the sends the plan was balanced on
        crossing = problem.cross_bytes(local_stage, num_stages) if num_stages > 1 else []
        extra["simulator_costs"] = {"send_ms": [
            b / problem.bandwidth_bytes_per_ms + problem.latency_ms for b in crossing],
            "hop_bytes": [float(b) for b in crossing]}
    compute = [0.0] * num_stages
    for i, k in enumerate(local_stage):
        compute[k] += problem.compute_ms[i]
    comm = [t - c for t, c in zip(times, compute)]
    bottleneck = max(times)
    predicted = {  # no throughput when nothing costs time (JSON has no Infinity)
        "bottleneck_ms": round(bottleneck, 6),
        **({"throughput_per_s": round(1000.0 / bottleneck, 3)} if bottleneck > 0 else {}),
        "total_compute_ms": round(sum(compute), 6),
    }
    return _describe(graph, node_costs, nodes, expand(local_stage, members, len(nodes)),
                     compute, comm, replicas=[1] * num_stages, devices=[["cpu"]] * num_stages,
                     ordering=ordering, solver=solver, mode=mode,
                     predicted=predicted, extra=extra, microbatches=microbatches,
                     activation_bytes=activation_bytes, schedules=schedules,
                     recomputed=[recompute == "all"] * num_stages, grad_input=grad_input,
                     trainable=trainable, split_call_ms=split_call_ms, action_ms=action_ms)


def plan_on_cluster(
    graph: OpGraph,
    node_costs: NodeCosts,
    cluster: Cluster | Fleet,
    *,
    num_stages: int | None = None,
    mode: str = "infer",
    microbatches: int = 8,
    activation_bytes: Sequence[float] | None = None,
    reporter: Reporter = SILENT,
    schedules: Sequence[str] = ("1f1b",),
    recompute: str = "none",
    grad_input: Sequence[float] | None = None,
    kinds: Mapping[str, NodeCosts] | None = None,
    kind_engines: Mapping[str, EngineTerms] | None = None,
    kind_grad_input: Mapping[str, Sequence[float]] | None = None,
    trainable: Collection[str] | None = None,
    exact_budget_s: float = EXACT_BUDGET_S,
    split_call_ms: float = 0.0,
    action_ms: float = 0.0,
    engine: EngineTerms | None = None,
) -> tuple[Plan, list[StageCut]]:
    """Hybrid-parallel plan on ``cluster``: the fastest simulated plan of the hybrid DP
    (``activation_bytes``: a train plan's saved bytes per OpGraph node, see
    :func:`plan_stages`); in training planned for each of ``schedules`` (the fastest kept,
    the first on a tie), stages recomputing per ``recompute`` (chosen per stage where memory
    is checked, :func:`~onnx_partition.solve.scoring.totals_costs`). A fleet's plan
    (``kinds``: per GPU kind, every node's costs) comes from
    :func:`~onnx_partition.solve.fleet.plan_fleet` (for each of ``schedules``, its stages
    recomputing per ``recompute`` each against its kind's memory, each stage's engine work on
    its own kind: ``kind_engines``, and ZB-H1's split by ``kind_grad_input``) and names each
    stage's ``gpu``. The plan states the memory of :func:`stage_sizes` (``trainable``: see
    :func:`plan_stages`), the count plain pipelines state and the one the planner checks
    (:func:`unit_weights`; docs/design.md, "One memory count"); a stage over the device
    memory so counted, which the planner should never return, is noted as a warning.
    plan.json's ``exact`` says what is proven of the hybrid DP's objective within
    ``exact_budget_s`` deterministic seconds
    (:func:`~onnx_partition.solve.hybrid_proof.prove_hybrid`).
    A train plan on a cluster of one kind is chosen among its candidates (and schedules) with
    ``engine`` (:func:`~onnx_partition.cost.engine_price.engine_terms`: each stage's step with its
    tied parameters' all-reduce, accumulation, ZB-H1's split backward and work per action, the
    work per hop), the terms :func:`~onnx_partition.cost.engine_price.price_engine` prices its final
    figure with. Without ``engine`` (on one kind) a ZB-H1 plan is run under 1F1B where that
    is faster on its split with ``split_call_ms`` per weight group and ``action_ms`` per
    action (as :func:`plan_stages` chooses; 1F1B holds no more micro-batches than ZB-H1, so it
    fits where ZB-H1 did)."""
    from onnx_partition.solve.hybrid_proof import HybridProof, prove_hybrid  # a cluster's only

    link = cluster.intra
    problem, nodes, members = unit_problem(graph, node_costs.forward_ms, link)
    if num_stages is not None:
        _check_stages(num_stages, problem.num_nodes)
        if num_stages > cluster.devices:
            raise PartitionError(f"--stages {num_stages} needs at least {num_stages} devices; "
                                 f"the cluster has {cluster.devices}")
    arrays = node_arrays(
        problem, _per_unit([node_costs.backward_ms[g] for g in nodes], members),
        _per_unit([float(graph.nodes[g].param_bytes) for g in nodes], members),
        [graph.nodes[nodes[m[0]]].key for m in members],
        _per_unit([activation_bytes[g] for g in nodes], members)
        if activation_bytes is not None and mode == "train" else None,
    )
    arrays = replace(arrays, **unit_weights(graph, nodes, members, trainable))
    gpus: list[str] | None = None
    best: HybridPlan
    if isinstance(cluster, Fleet):
        from onnx_partition.solve.fleet import KindCosts, plan_fleet

        assert kinds is not None
        run = RunSpec(cluster.clusters[0], train=mode == "train", microbatches=microbatches,
                      max_stages=max(16, num_stages or 0),
                      recompute=recompute if mode == "train" else "none")
        best, per_ordering = plan_fleet(problem, arrays, {
            gpu: KindCosts(_per_unit([c.forward_ms[g] for g in nodes], members),
                           _per_unit([c.backward_ms[g] for g in nodes], members),
                           (kind_engines or {}).get(gpu),
                           _per_unit([kind_grad_input[gpu][g] for g in nodes], members)
                           if kind_grad_input is not None else [])
            for gpu, c in kinds.items()}, cluster, run,
            schedules=schedules if mode == "train" else (), num_stages=num_stages)
        run = replace(run, train_schedule=best.schedule) if mode == "train" else run
        gpus = best.gpus
        proof = HybridProof(False, "fleet")
    else:
        if grad_input is not None and mode == "train":
            arrays = replace(arrays, backward_input_ms=_per_unit(
                [grad_input[g] for g in nodes], members))
        best, per_ordering, run = _plan_per_schedule(
            problem, arrays, cluster, num_stages=num_stages, microbatches=microbatches,
            schedules=schedules if mode == "train" else ("infer",), recompute=recompute,
            train=mode == "train", reporter=reporter, engine=engine)
        proof = prove_hybrid(problem, arrays, run, best, num_stages=num_stages,
                             budget_s=exact_budget_s)
    compute = [s.forward_ms + s.backward_ms for s in best.costs.stages]
    comm = stage_comm(best.costs.send_ms, comm_factor(run.train))
    sim = best.sim
    predicted = {
        "iteration_ms": round(sim.iteration_ms, 6),
        **({"throughput_per_s": round(sim.throughput_per_s, 3)}
           if math.isfinite(sim.throughput_per_s) else {}),
        "bubble_fraction": round(sim.bubble_fraction, 4),
        "microbatches": microbatches,
        "bottleneck_ms": round(max(
            (c + m) / s.replicas + s.allreduce_ms / microbatches
            for c, m, s in zip(compute, comm, best.costs.stages)), 6),
        "total_compute_ms": round(sum(problem.compute_ms) / cluster.speed, 6),
        "devices_used": sum(best.replicas),
        "devices_available": cluster.devices,
    }
    extra: dict[str, Any] = {
        "cluster": cluster.to_json(),
        # per family: its best simulated iteration, or the bound that spared simulating it
        "orderings": {k: {what: round(ms, 6) for what, ms in v.items()}
                      for k, v in per_ordering.items()},
        "planning_s": round(best.planning_s, 4),
        # what more devices would buy, and why devices are left unused
        **({"devices_notes": list(best.notes)} if best.notes else {}),
        "exact": proof.to_json(exact_budget_s),  # what is proven of the DP's objective
        "allreduce_ms": [round(s.allreduce_ms, 6) for s in best.costs.stages],
        # the simulator's exact inputs, so `simulate` and `report` replay this very plan
        "simulator_costs": {
            "forward_ms": [s.forward_ms for s in best.costs.stages],
            "backward_ms": [s.backward_ms for s in best.costs.stages],
            "activation_bytes": [s.activation_bytes for s in best.costs.stages],
            "static_bytes": [s.static_bytes for s in best.costs.stages],
            "send_ms": list(best.costs.send_ms),
        },
    }
    recomputed = [s.recompute for s in best.costs.stages]
    if any(recomputed):
        extra["simulator_costs"]["input_bytes"] = [s.input_bytes for s in best.costs.stages]
    plan, cuts = _describe(graph, node_costs, nodes, expand(best.stage_of, members, len(nodes)),
                     compute, comm,
                     replicas=best.replicas, devices=best.devices,
                     ordering=best.source.partition(":")[2] if best.source.startswith("dp")
                     else "topo",
                     solver=f"hybrid-{best.source.partition(':')[0].removesuffix('+rc')}",
                     mode=mode,
                     predicted=predicted, extra=extra, microbatches=microbatches,
                     activation_bytes=activation_bytes, trainable=trainable,
                     optimizer_factor=run.optimizer_factor,
                     split=[(s.forward_ms, s.backward_ms)
                                         for s in best.costs.stages],
                     schedules=(("zb-h1", "1f1b") if run.schedule == "zb-h1"
                                and "1f1b" in schedules
                                and (split_call_ms > 0 or action_ms > 0)
                                and run.engine is None and gpus is None  # else the
                                # planner weighed both (a fleet's with each kind's engine)
                                else (run.schedule,)),
                     recomputed=recomputed, split_call_ms=split_call_ms, action_ms=action_ms,
                     grad_input_split=[s.split()[0] for s in best.costs.stages])
    for stage, gpu in zip(plan.stages, gpus or []):
        stage.gpu = gpu
    limit = cluster.memory_bytes if isinstance(cluster, Cluster) else math.inf
    over = [s.index for s in plan.stages
            if s.predicted is not None and s.predicted.memory_bytes > limit]
    if over:  # a guard: the planner checks the same count
        plan.extra.setdefault("devices_notes", []).append(
            f"warning: stage(s) {', '.join(map(str, over))} hold more than the device memory "
            "counted as they run; the planner's count fitted them")
    return plan, cuts



def _plan_per_schedule(
    problem: DagProblem, arrays: NodeArrays, cluster: Cluster, *, num_stages: int | None,
    microbatches: int, schedules: Sequence[str], recompute: str, train: bool,
    reporter: Reporter, engine: EngineTerms | None = None,
) -> tuple[HybridPlan, dict[str, dict[str, float]], RunSpec]:
    """:func:`~onnx_partition.solve.planner.plan_cluster` for each schedule: the fastest
    simulated plan (the first schedule on a tie), its families and run. When none fits, the
    first schedule's error."""
    from onnx_partition.solve.planner import (  # a cluster's planner only
        HYBRID_ORDERINGS,
        Proposal,
        plan_cluster,
        proposals_for,
    )

    found: list[tuple[HybridPlan, dict[str, dict[str, float]], RunSpec]] = []
    failed: PartitionError | None = None
    proposals: list[Proposal] | None = None  # the same for every schedule: made once
    for name in schedules:
        run = RunSpec(cluster, train=train, microbatches=microbatches,
                      max_stages=max(16, num_stages or 0),
                      train_schedule=name if train else "1f1b",
                      recompute=recompute if train else "none", engine=engine)
        try:
            if proposals is None and len(schedules) > 1:
                proposals = proposals_for(problem, arrays, run, num_stages, HYBRID_ORDERINGS)
            best, families = plan_cluster(problem, arrays, run, num_stages=num_stages,
                                          reporter=reporter, proposals=proposals)
        except PartitionError as exc:
            failed = failed or exc
            continue
        found.append((best, families, run))
    if not found:
        assert failed is not None
        raise failed
    return min(found, key=lambda f: f[0].sim.iteration_ms)


def _fastest_schedule(schedules: Sequence[str], split: Sequence[tuple[float, float]],
                      grad_input: Sequence[float] | None, recompute: Sequence[bool],
                      replicas: Sequence[int], send_ms: Sequence[float] | None,
                      microbatches: int, split_cost: Sequence[float] | None = None,
                      action_ms: float = 0.0) -> str:
    """The schedule of ``schedules`` whose simulation of these stage costs is fastest (the
    first on a tie; one given: that one); ZB-H1 pays ``split_cost`` per stage (its split
    backward's overhead), every schedule ``action_ms`` per action (the engine's work: ZB-H1
    runs three actions per micro-batch and stage, 1F1B two)."""
    if len(schedules) == 1:
        return schedules[0]

    def costs(name: str) -> PipelineCosts:
        extra = split_cost if name == "zb-h1" and split_cost else [0.0] * len(split)
        stages = [StageCosts(f, b, r, backward_input_ms=grad_input[k] if grad_input else None,
                             recompute=rc, split_ms=extra[k], action_ms=action_ms)
                  for k, ((f, b), r, rc) in enumerate(zip(split, replicas, recompute,
                                                          strict=True))]
        return PipelineCosts(stages, list(send_ms or [0.0] * (len(stages) - 1)))

    times = [simulate(build(name, replicas, microbatches), costs(name)).iteration_ms
             for name in schedules]
    return schedules[times.index(min(times))]


def trainable_tensors(cuts: Sequence[StageCut], trainable: Collection[str] | None) -> list[int]:
    """Per stage, how many trainable tensors it holds (``trainable`` None: every initializer):
    the weight groups of ZB-H1's split backward (``cost.engine_price.split_ms``)."""
    return [len(set(c.initializers) if trainable is None
                else set(c.initializers) & set(trainable)) for c in cuts]


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
    plan.predicted.pop("throughput_per_s", None)
    plan.predicted["iteration_ms"] = round(iteration, 6)
    if iteration > 0:  # JSON has no Infinity
        plan.predicted["throughput_per_s"] = round(plan.microbatches / iteration * 1000.0, 3)
    plan.predicted["bubble_fraction"] = round(result.bubble_fraction, 4)


def _record_program(plan: Plan, model: Path, out: Path) -> None:
    """Name the exported program lying beside ``model`` (``model.pt2``) in the plan, with its
    sha256, so training can find it and refuse an altered one."""
    program = model.with_suffix(".pt2")
    if program.is_file():
        plan.program = os.path.relpath(program.resolve(), out.resolve())
        plan.program_sha256 = sha256_file(program)


def _baseline(
    name: str, problem: DagProblem, params: Sequence[float], num_stages: int
) -> list[int]:
    if name == "uniform":
        return uniform(problem, num_stages)
    if name == "parameters":
        return parameter_balanced(problem, node_arrays(problem, [0.0] * len(params), params),
                                  num_stages)
    return time_balanced(problem, num_stages)


def _check_stages(num_stages: int, n: int) -> None:
    if not 1 <= num_stages <= n:
        raise PartitionError(
            f"--stages {num_stages} is not possible: the model has {n} operators to cut"
        )


def _describe(
    graph: OpGraph,
    node_costs: NodeCosts,
    nodes: list[int],
    local_stage: Sequence[int],
    compute: Sequence[float],
    comm: Sequence[float],
    *,
    replicas: Sequence[int],
    devices: Sequence[Sequence[str]],
    ordering: str,
    solver: str,
    mode: str,
    predicted: dict[str, Any],
    extra: dict[str, Any],
    microbatches: int = 8,
    activation_bytes: Sequence[float] | None = None,
    trainable: Collection[str] | None = None,
    optimizer_factor: float = 4.0,
    split: Sequence[tuple[float, float]] | None = None,
    schedules: Sequence[str] = ("1f1b",),
    recomputed: Sequence[bool] | None = None,
    grad_input: Sequence[float] | None = None,
    grad_input_split: Sequence[float] | None = None,
    split_call_ms: float = 0.0,
    action_ms: float = 0.0,
) -> tuple[Plan, list[StageCut]]:
    """The Plan and stage cuts of an assignment of the solvers' nodes to stages. Every plan gets
    the memory model's peak per stage, train plans its parts too, of the one count
    :func:`stage_sizes` (``activation_bytes``, ``trainable``; a cluster plan's
    ``simulator_costs`` memory figures rewritten to it), the forward/backward ``split`` of
    ``compute`` (the input gradient's share: ``grad_input_split`` per stage, or ``grad_input``
    per OpGraph node), the stages that recompute (``recomputed``) and the schedule: the one of
    ``schedules`` whose simulation of these costs is fastest (the first on a tie; ZB-H1 with
    its split backward's ``split_call_ms`` per weight group, :func:`~onnx_partition.cost.
    engine.split_ms`, as ``price_engine`` prices it after) and every schedule ``action_ms`` per
    action."""
    num_stages = len(replicas)
    train = mode == "train"
    cuts = cut_stages(graph, {nodes[i]: k for i, k in enumerate(local_stage)}, num_stages)
    sizes = stage_sizes(graph, cuts, train=train, activation_bytes=activation_bytes,
                        trainable=trainable)
    flags = list(recomputed) if train and recomputed is not None else [False] * num_stages
    if train and split is None:
        split = [(float(sum(node_costs.forward_ms[i] for i in cut.nodes)),
                  float(sum(node_costs.backward_ms[i] for i in cut.nodes))) for cut in cuts]
    if train and grad_input_split is None and grad_input is not None:
        grad_input_split = [float(sum(grad_input[i] for i in cut.nodes)) for cut in cuts]
    schedule = "infer"
    if train:
        assert split is not None
        tensors = trainable_tensors(cuts, trainable)
        schedule = _fastest_schedule(schedules, split, grad_input_split, flags, replicas,
                                     extra.get("simulator_costs", {}).get("send_ms"),
                                     microbatches, split_ms(tensors, split_call_ms),
                                     action_ms)
    # inference: one micro-batch at a time; training: the schedule's peak of the micro-batches
    memory = (memory_per_device(sizes, replicas, microbatches, schedule=schedule,
                                recompute=flags, optimizer_factor=optimizer_factor) if train
              else memory_per_device(sizes, replicas, 1, schedule="infer"))
    replayed = extra.get("simulator_costs", {})
    if "static_bytes" in replayed:  # a cluster plan: simulate replays the same count
        replayed["static_bytes"] = [static_bytes(z, train=train,
                                                 optimizer_factor=optimizer_factor)
                                    for z in sizes]
        replayed["activation_bytes"] = [stash_bytes(z) for z in sizes]
        if "input_bytes" in replayed:
            replayed["input_bytes"] = [z.received for z in sizes]
    held = peak_inflight(schedule, replicas, microbatches) if train else [1] * num_stages
    rebuilt = rebuilt_held(schedule, replicas, microbatches) if train else held
    if train and split is not None and "send_ms" in extra.get("simulator_costs", {}) \
            and "forward_ms" not in extra["simulator_costs"]:
        extra["simulator_costs"].update(forward_ms=[f for f, _ in split],
                                        backward_ms=[b for _, b in split])
    if train and schedule == "zb-h1" and grad_input_split is not None:
        extra["simulator_costs"]["backward_input_ms"] = list(grad_input_split)
    extra["schedule"] = schedule
    stages = []
    for k, cut in enumerate(cuts):
        parts: dict[str, Any] = {}
        if train:
            assert split is not None
            parts = dict(memory_parts(sizes[k], held[k], train=True,
                                      optimizer_factor=optimizer_factor,
                                      rebuilt=rebuilt[k] if flags[k] else None))
            parts.pop("memory_bytes")
            parts.update(forward_ms=round(split[k][0], 6), backward_ms=round(split[k][1], 6))
        stages.append(Stage(
            index=k,
            file=f"stage_{k}.onnx",
            nodes=[graph.nodes[i].key for i in cut.nodes],
            inputs=cut.inputs,
            outputs=cut.outputs,
            replicas=replicas[k],
            devices=list(devices[k]),
            constants=[graph.nodes[i].key for i in cut.constants],
            recompute=True if flags[k] else None,
            predicted=Predicted(
                compute_ms=round(compute[k], 6),
                comm_ms=round(comm[k], 6),
                memory_bytes=int(memory[k]),
                **parts,
            ),
        ))
    inputs, outputs = io_specs(graph)
    plan = Plan(
        model=str(graph.path) if graph.path else "",
        stages=stages,
        inputs=inputs,
        outputs=outputs,
        mode=mode,
        ordering=ordering,
        solver=solver,
        predicted=predicted,
        extra={
            **extra,
            "version": __version__,
            "costs": {"source": node_costs.source, "measured_nodes": node_costs.measured},
            "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
            "unknown_size_tensors": len(graph.unknown_size),
        },
    )
    return plan, cuts
