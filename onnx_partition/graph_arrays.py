"""The graph's figures as the solvers' plain arrays, and what each stage of a cut holds: the one
place an :class:`~onnx_partition.graph.OpGraph` meets the planners (which see only
:class:`~onnx_partition.solve.problem.DagProblem` and
:class:`~onnx_partition.solve.scoring.NodeArrays`, never an ONNX proto). The DAG and its units
(:func:`dag_problem`, :func:`unit_problem`), the weights per unit (:func:`unit_weights`), the
one count of a stage's bytes (:func:`stage_sizes`), what a train plan saves for backward and
trains (:func:`saved_activations`, :func:`trainable_parameters`, :func:`trainable_tensors`) and
each node's input-gradient share (:func:`grad_input_ms`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_partition.cost.annotate import CostsFile, NodeCosts
from onnx_partition.cost.cluster import Link
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph
from onnx_partition.graph.emit import StageCut, io_specs
from onnx_partition.graph.fxtag import fx_unit
from onnx_partition.pipeline.layout import relay_names
from onnx_partition.pipeline.memory import StageBytes
from onnx_partition.settings.partition import TrainSpec
from onnx_partition.solve.contract import contract
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import LAST

if TYPE_CHECKING:
    from torch.export import ExportedProgram

    from onnx_partition.cost.saved import OutputsLoss, PerNode

__all__ = ["dag_problem", "grad_input_ms", "per_unit", "per_unit_max", "saved_activations",
           "stage_sizes", "train_program", "trainable_parameters", "trainable_tensors",
           "unit_problem", "unit_weights", "untyped_values"]

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
    graph: OpGraph, forward_ms: Sequence[float], link: Link, *, torch_ops: bool = True
) -> tuple[DagProblem, list[int], list[list[int]]]:
    """:func:`dag_problem` over the units a plan may not split. With ``torch_ops`` (a train
    plan run by its program) the nodes exported from one FX node (their
    ``pkg.torch.onnx.fx_node`` tag; a ``getitem`` joins the op it reads) form one unit, so no
    plan splits a torch op; without, every ONNX node is its own unit. Either way a value whose
    type shape inference left unknown (:func:`untyped_values`) cannot cross a cut: its
    producer and readers join one unit. Returns the units' problem, the OpGraph index of each
    cut node, and each unit's members (indices into that list)."""
    problem, nodes = dag_problem(graph, forward_ms, link)
    labels: list[str | None] = [None] * len(nodes)
    if torch_ops:
        protos = graph.protos()
        labels = [fx_unit(protos[graph.nodes[g].key]) for g in nodes]
    labels = _join_untyped(graph, nodes, labels)
    if all(label is None for label in labels):
        return problem, nodes, [[i] for i in range(len(nodes))]
    units, members = contract(problem, labels)
    return units, nodes, members


def untyped_values(graph: OpGraph) -> list[str]:
    """The flow tensors made by a cut node whose element type shape inference did not find
    (Hugging Face GPT-2's ``split`` outputs): a stage file could not declare one that crossed a
    cut (:func:`~onnx_partition.graph.emit.stage_proto`)."""
    return [name for name, t in graph.tensors.items()
            if t.producer >= 0 and not t.elem_type
            and graph.types.get(name) is None and graph.concrete_types.get(name) is None]


def _join_untyped(graph: OpGraph, nodes: Sequence[int], labels: Sequence[str | None]
                  ) -> list[str | None]:
    """``labels`` with each untyped value's producer and readers under one label (theirs
    merged, union-find over the labels and the nodes)."""
    untyped = untyped_values(graph)
    if not untyped:
        return list(labels)
    local = {g: i for i, g in enumerate(nodes)}
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, label in enumerate(labels):  # nodes of one label start joined
        if label is not None:
            parent[root(i)] = root(first.setdefault(label, i))
    joined: set[int] = set()
    for name in untyped:
        tensor = graph.tensors[name]
        group = [local[tensor.producer], *(local[c] for c in tensor.consumers)]
        joined.update(group)
        for i in group[1:]:
            parent[root(i)] = root(group[0])
    return [f"#join{root(i)}" if i in joined or label is not None else None
            for i, label in enumerate(labels)]


def per_unit(values: Sequence[float], members: Sequence[Sequence[int]]) -> list[float]:
    """Per-node ``values`` summed over each unit's ``members``."""
    return [float(sum(values[i] for i in m)) for m in members]


def per_unit_max(values: Sequence[float], members: Sequence[Sequence[int]]) -> list[float]:
    """Per-node ``values`` maximised over each unit's ``members`` (a working set: the
    backward runs one op at a time)."""
    return [float(max((values[i] for i in m), default=0.0)) for m in members]



def saved_activations(graph: OpGraph, model: Path, precision: str = TrainSpec.precision,
                      policy: str = "cpu", loaded: ExportedProgram | None = None
                      ) -> PerNode | None:
    """Bytes autograd saves for backward per OpGraph node (:mod:`onnx_partition.cost.saved`,
    under FakeTensorMode at the graph's input shapes, autocast to ``precision``'s half dtype
    unless fp32, by the ``policy`` of the plan's devices: ``cpu`` or ``cuda``) and, from the
    same run, the output-gradient bytes ZB-H1 keeps per node from ``I`` to ``W`` and the
    gradients live in each node's backward (:class:`~onnx_partition.cost.saved.PerNode`), when
    the model's program ``.pt2`` lies beside it; None otherwise (the memory model then counts
    every output, and no kept gradients nor working set). ``loaded``: that program, already
    read (:func:`train_program`)."""
    program = model.with_suffix(".pt2")
    if not program.is_file():
        if precision != TrainSpec.precision:
            raise PartitionError(f"--precision {precision} counts what autocast saves by "
                                 f"running the model's program, and {model} has none "
                                 f"({program.name}): export it with onnx_partition.export")
        return None
    from onnx_partition.cost.saved import counted_per_node  # torch: train plans only

    try:
        return counted_per_node(graph, program if loaded is None else loaded,
                                precision=precision, policy=policy, loss=trainer_loss(graph))
    except PartitionError:
        raise
    except Exception as exc:  # a program torch cannot run at these shapes
        raise PartitionError(f"could not count the activations of program {program}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                             ) from None


def trainer_loss(graph: OpGraph) -> OutputsLoss | None:
    """The loss ``train --loss auto`` runs after the graph's last stage on synthetic targets
    (:func:`~onnx_partition.runtime.train.task.auto_kind`, the outputs cast as the trainer
    casts them), as a function of the program's user outputs that also runs on fake and meta
    tensors; None where the model's first output is its loss (``output``)."""
    import torch

    from onnx_partition.runtime.train.loss import make_loss, upcast
    from onnx_partition.runtime.train.task import auto_kind

    inputs, outputs = io_specs(graph)
    kind = auto_kind(inputs, outputs)
    if kind == "output":
        return None
    names = [o.name for o in outputs]
    fn = make_loss(kind, names)

    def run(made: Sequence[torch.Tensor]) -> torch.Tensor:
        outs = upcast(made)
        first = outs[0]
        if kind == "cross_entropy":
            targets = {names[0]: torch.randint(0, int(first.shape[-1]), tuple(first.shape[:-1]),
                                               device=first.device)}
        else:
            targets = {n: torch.randn(o.shape, device=o.device) for n, o in zip(names, outs)
                       if o.is_floating_point()}
        return fn(dict(zip(names, outs)), targets)

    return run


def trainable_parameters(model: Path, loaded: ExportedProgram | None = None
                         ) -> frozenset[str] | None:
    """Names of the trainable parameters of the program ``.pt2`` beside ``model`` (its
    signature's parameters: what has gradients and optimizer state in training; buffers and
    the exporter's constants have none), which the ONNX initializers carry; None without a
    program (every initializer then counts as trainable). ``loaded``: that program, already
    read (:func:`train_program`)."""
    if loaded is None:
        loaded = train_program(model, weights=False)
    return None if loaded is None else frozenset(loaded.graph_signature.parameters)


def train_program(model: Path, *, weights: bool = True) -> ExportedProgram | None:
    """The program ``.pt2`` beside ``model``, with its weights
    (:func:`~onnx_partition.graph.program.load_program`) or, ``weights=False``, as stored
    (its signature only is read), read once for all that prices a train plan (a large
    model's program takes seconds to read: the Llama-3-8B's 17 s, three times before); None
    without one."""
    program = model.with_suffix(".pt2")
    if not program.is_file():
        return None
    from onnx_partition.graph.program import load_program, read_archive  # torch: train only

    try:
        return load_program(program) if weights else read_archive(program)
    except PartitionError:
        raise
    except Exception as exc:  # a program this torch cannot read
        raise PartitionError(f"could not read program {program}: {type(exc).__name__}"
                             ) from None


def stage_sizes(graph: OpGraph, cuts: Sequence[StageCut], *, train: bool,
                activation_bytes: Sequence[float] | None = None,
                trainable: Collection[str] | None = None,
                kept_bytes: Sequence[float] | None = None,
                working_bytes: Sequence[float] | None = None) -> list[StageBytes]:
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
    stage), what it sends on, relayed tensors included, whose gradients come back; kept
    (training, all but stage 0, which receives no activation), the output gradients ZB-H1
    keeps per micro-batch from ``I`` to ``W`` (``kept_bytes`` per OpGraph node); working
    (training), the most gradient bytes live in the backward of one of its nodes
    (``working_bytes`` per OpGraph node, the largest over the cut's)."""
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
                           if t in trainable)),
                       float(sum(kept_bytes[i] for i in cut.nodes))
                       if train and kept_bytes is not None and k > 0 else 0.0,
                       float(max((working_bytes[i] for i in cut.nodes), default=0.0))
                       if train and working_bytes is not None else 0.0)
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


def trainable_tensors(cuts: Sequence[StageCut], trainable: Collection[str] | None) -> list[int]:
    """Per stage, how many trainable tensors it holds (``trainable`` None: every initializer):
    the weight groups of ZB-H1's split backward (``cost.engine_price.split_ms``)."""
    return [len(set(c.initializers) if trainable is None
                else set(c.initializers) & set(trainable)) for c in cuts]

