"""ONNX model -> operator DAG with tensor and parameter bytes.

:func:`load` reads a model without its external weights, names every node by its key (the
contract in ``docs/design.md``), sorts the nodes topologically, runs shape inference with the
symbolic dims fixed (through :mod:`onnx_partition.graph.protos`, which reads the protos), and
records
for every tensor its producer, its consumers and its size in bytes. Solvers never see the
protos: :func:`onnx_partition.graph_arrays.dag_problem` hands them plain arrays.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import google.protobuf.message
import onnx

from onnx_partition.dag import kahn_order
from onnx_partition.errors import PartitionError
from onnx_partition.graph.protos import (
    Shape,
    check_external_data,
    fixed_input_shapes,
    infer_types,
    shape_and_type,
    shape_bytes,
    shape_loop_outputs,
    tensor_proto_bytes,
    used_names,
    with_input_shapes,
)

__all__ = ["NONDETERMINISTIC", "Node", "OpGraph", "TensorInfo", "from_model", "load", "node_keys"]

#: Operators that draw random numbers: never copied into several stages (nor constant-folded).
NONDETERMINISTIC = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
     "Bernoulli", "Dropout"}
)
#: Initializers up to this size may feed constant-only ("free") nodes copied into every stage.
_SMALL_CONSTANT_BYTES = 4096
#: ONNX ops whose output holds their first input's values, rearranged (index bounds follow them)
_SAME_VALUES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity",
                          "Transpose", "Expand"})


@dataclass(frozen=True)
class TensorInfo:
    """A value flowing between operators (initializers and free constants excluded)."""

    name: str
    producer: int  # node index, or -1 for a graph input
    consumers: tuple[int, ...]
    nbytes: int
    shape: Shape | None  # concrete shape after fixing the symbolic dims; None when unknown
    elem_type: int  # onnx.TensorProto data type; 0 when unknown


@dataclass(frozen=True)
class Node:
    """One operator: its key, its flow inputs and outputs, and the weights it reads first."""

    key: str
    op_type: str
    index: int  # position in OpGraph.nodes (a topological order)
    inputs: tuple[str, ...]  # flow tensors read, outer-scope captures of subgraphs included
    outputs: tuple[str, ...]
    initializers: tuple[str, ...]  # initializer names read (subgraph captures included)
    param_bytes: int  # bytes of the initializers this node is the first reader of
    free: bool  # constant-only: copied into each stage that needs it, never cut


@dataclass
class OpGraph:
    """A model as a DAG of operators, in topological order."""

    model: onnx.ModelProto  # as loaded (no external weights read), nodes renamed to their keys
    path: Path | None
    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    inputs: list[str]  # real graph inputs (initializers listed as inputs excluded)
    outputs: list[str]
    input_shapes: dict[str, Shape]  # the concrete shapes used for byte sizes
    initializer_bytes: dict[str, int]
    # name -> TypeProto, from shape inference on the unmodified (symbolic) model
    types: dict[str, onnx.TypeProto] = field(repr=False, default_factory=dict)
    # name -> TypeProto with concrete dims (fallback when symbolic inference gave nothing)
    concrete_types: dict[str, onnx.TypeProto] = field(repr=False, default_factory=dict)
    unknown_size: list[str] = field(default_factory=list)  # flow tensors whose size was estimated

    @property
    def compute_nodes(self) -> list[int]:
        """Indices of the nodes that are cut into stages (free constants excluded)."""
        return [n.index for n in self.nodes if not n.free]

    @cached_property
    def free_outputs(self) -> frozenset[str]:
        """Outputs of the free (constant-only) nodes."""
        return frozenset(o for n in self.nodes if n.free for o in n.outputs if o)

    @cached_property
    def index_bounds(self) -> Mapping[str, int]:
        """Integer graph inputs used as Gather indices, directly or through ops that keep their
        values (a reshape: Hugging Face's ``input_ids.view(-1, n)``): the size of the gathered
        axis (so that random feeds stay in range, e.g. token ids below the vocabulary size)."""
        protos = self.protos()
        init_dims = {t.name: list(t.dims) for t in self.model.graph.initializer}
        made_by = {o: p for p in protos.values() for o in p.output if o}
        bounds: dict[str, int] = {}
        for node in self.nodes:
            proto = protos[node.key]
            if proto.op_type != "Gather" or len(proto.input) < 2:
                continue
            source = proto.input[1]
            while source not in self.inputs and source in made_by \
                    and made_by[source].op_type in _SAME_VALUES:
                source = made_by[source].input[0]
            if source not in self.inputs:
                continue
            axis = next((a.i for a in proto.attribute if a.name == "axis"), 0)
            dims = init_dims.get(proto.input[0])
            if dims is None:
                shape = self.tensors.get(proto.input[0])
                dims = list(shape.shape) if shape and shape.shape else None
            if dims:
                size = dims[axis]
                bounds[source] = min(bounds.get(source, size), size)
        return bounds

    def protos(self) -> dict[str, onnx.NodeProto]:
        """Node key -> its NodeProto in :attr:`model` (named by its key)."""
        return {n.name: n for n in self.model.graph.node}

    def producer_of(self) -> dict[str, int]:
        """Tensor name -> index of the node producing it (free nodes included)."""
        return {out: n.index for n in self.nodes for out in n.outputs if out}

    def free_closure(self, tensor_names: Sequence[str]) -> list[int]:
        """Free nodes needed to compute ``tensor_names`` from constants, in topological order."""
        producer = self.producer_of()
        needed: set[int] = set()
        stack = [producer[t] for t in tensor_names if t in producer]
        while stack:
            i = stack.pop()
            if i in needed or not self.nodes[i].free:
                continue
            needed.add(i)
            stack.extend(producer[t] for t in self.nodes[i].inputs if t in producer)
        return sorted(needed)


# -------------------------------------------------------------------- loading


def load(
    path: str | os.PathLike[str],
    *,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    batch_size: int | None = None,
) -> OpGraph:
    """Load an ONNX file as an :class:`OpGraph` without reading its external weights.

    ``input_shapes`` fixes whole input shapes; ``batch_size`` fixes a symbolic leading dim. A
    symbolic dim left unfixed is an error: tensor sizes drive the partition.
    """
    path = Path(path)
    if not path.exists():
        raise PartitionError(f"no such file: {path}")
    if not path.is_file():
        raise PartitionError(f"not a file: {path}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (google.protobuf.message.DecodeError, RuntimeError, ValueError) as exc:
        msg = f"{path} is not a valid ONNX model (truncated or not ONNX): {exc}"
        raise PartitionError(msg) from None
    check_external_data(model, path.parent.resolve())
    return from_model(model, path=path, input_shapes=input_shapes, batch_size=batch_size)


def from_model(
    model: onnx.ModelProto,
    *,
    path: Path | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    batch_size: int | None = None,
) -> OpGraph:
    """Build an :class:`OpGraph` from an in-memory model (see :func:`load`)."""
    where = str(path) if path else "model"
    if model.ir_version <= 0 or not model.HasField("graph") or not model.graph.node:
        raise PartitionError(f"{where} is not a valid ONNX model (no graph or no nodes)")
    graph = model.graph
    init_bytes = {t.name: tensor_proto_bytes(t) for t in graph.initializer}
    inputs = [v.name for v in graph.input if v.name not in init_bytes]
    outputs = [v.name for v in graph.output]

    keys = node_keys(graph.node)
    for node, key in zip(graph.node, keys, strict=True):
        node.name = key
    order = _topological_order(graph, keys, set(inputs) | set(init_bytes))
    shapes = fixed_input_shapes(graph, inputs, input_shapes or {}, batch_size, where)
    shape_loop_outputs(graph)
    concrete = infer_types(with_input_shapes(model, shapes), where)
    symbolic = infer_types(model, where)

    produced = {o for n in graph.node for o in n.output if o}
    missing = [o for o in outputs if o not in produced and o not in inputs and o not in init_bytes]
    if missing:
        raise PartitionError(f"{where}: graph output {missing[0]!r} is never produced (truncated?)")

    # Nodes in topological order; free = constant-only, computed from constants in every stage.
    nodes: list[Node] = []
    is_const: set[str] = {n for n, b in init_bytes.items() if b <= _SMALL_CONSTANT_BYTES}
    first_reader: dict[str, int] = {}
    for index, file_pos in enumerate(order):
        proto = graph.node[file_pos]
        used = used_names(proto)
        inits = tuple(dict.fromkeys(u for u in used if u in init_bytes))
        flow = tuple(dict.fromkeys(u for u in used if u and u not in init_bytes))
        free = (
            proto.op_type not in NONDETERMINISTIC
            and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                        for a in proto.attribute)
            and all(u in is_const for u in flow + inits)
        )
        if free:
            is_const.update(o for o in proto.output if o)
        param = 0
        if not free:
            for name in inits:
                if name not in first_reader:
                    first_reader[name] = index
                    param += init_bytes[name]
        nodes.append(Node(keys[file_pos], proto.op_type, index, flow,
                          tuple(o for o in proto.output), inits, param, free))

    tensors, unknown = _flow_tensors(nodes, inputs, concrete)
    return OpGraph(model=model, path=path, nodes=nodes, tensors=tensors, inputs=inputs,
                   outputs=outputs, input_shapes=shapes, initializer_bytes=init_bytes,
                   types=symbolic, concrete_types=concrete, unknown_size=unknown)


def node_keys(nodes: Sequence[onnx.NodeProto]) -> list[str]:
    """Node keys (the contract): the name if non-empty and not taken earlier, else the first
    output's name. A key still taken gets a ``#k`` suffix so that keys stay unique."""
    taken: set[str] = set()
    keys = []
    for i, node in enumerate(nodes):
        key = node.name
        if not key or key in taken:
            key = next((o for o in node.output if o), "") or f"{node.op_type}_{i}"
        base, k = key, 1
        while key in taken:
            key, k = f"{base}#{k}", k + 1
        taken.add(key)
        keys.append(key)
    return keys


# -------------------------------------------------------------------- helpers


def _topological_order(graph: onnx.GraphProto, keys: list[str], sources: set[str]) -> list[int]:
    """File positions in a topological order, file order kept wherever it is already valid."""
    producer: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for out in node.output:
            if out:
                producer[out] = i
    succ: list[set[int]] = [set() for _ in graph.node]
    for i, node in enumerate(graph.node):
        for name in used_names(node):
            if name in producer and name not in sources:
                succ[producer[name]].add(i)  # a node reading its own output: a cycle of one
    order = kahn_order(succ)  # file order kept wherever it is already valid
    if len(order) < len(succ):
        import networkx as nx  # only to name the cycle

        dag = nx.DiGraph((i, j) for i, targets in enumerate(succ) for j in targets)
        cycle = nx.find_cycle(dag)
        path = " -> ".join(keys[u] for u, _ in cycle) + f" -> {keys[cycle[0][0]]}"
        raise PartitionError(f"the graph has a cycle: {path}")
    return order


def _flow_tensors(
    nodes: list[Node], inputs: list[str], types: Mapping[str, onnx.TypeProto]
) -> tuple[dict[str, TensorInfo], list[str]]:
    """Every tensor made by a cut node or fed as a graph input, with producer, consumers and
    bytes; free nodes' outputs are left out (copied into stages, never sent). Also the names whose
    size had to be estimated."""
    producer: dict[str, int] = {name: -1 for name in inputs}
    consumers: dict[str, list[int]] = {}
    for node in nodes:
        if node.free:
            continue
        for name in node.inputs:
            consumers.setdefault(name, []).append(node.index)
        for name in node.outputs:
            if name:
                producer[name] = node.index
    tensors: dict[str, TensorInfo] = {}
    unknown: list[str] = []
    for name, prod in producer.items():
        if prod >= 0 and nodes[prod].free:
            continue
        shape, elem = shape_and_type(types.get(name))
        nbytes = shape_bytes(shape, elem)
        if nbytes is None:
            unknown.append(name)
            nbytes = _estimate_bytes(nodes, prod, tensors)
        cons = tuple(dict.fromkeys(consumers.get(name, [])))
        tensors[name] = TensorInfo(name, prod, cons, nbytes, shape, elem)
    return tensors, unknown


def _estimate_bytes(nodes: list[Node], prod: int, known: Mapping[str, TensorInfo]) -> int:
    """A tensor of unknown shape (data-dependent) is taken to be as large as the largest input of
    the node that makes it."""
    if prod < 0:
        return 0
    return max((known[i].nbytes for i in nodes[prod].inputs if i in known), default=0)
