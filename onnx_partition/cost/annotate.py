"""Per-node costs of an :class:`OpGraph`: costs.json where given, the analytic model elsewhere.

The adapter between ONNX protos and the pure analytic model: it decodes attributes and shapes into
:class:`~onnx_partition.cost.analytic.OpInfo` records.

A costs file is read once per command: :func:`load_costs` parses and validates it into a
:class:`CostsFile`, which is what :func:`annotate`, :func:`costs_device`,
:mod:`~onnx_partition.cost.costs_file` and the partitioner are handed (each also takes a path,
and reads it then, once).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx
from onnx import helper

from onnx_partition.cost.analytic import (
    DeviceSpec,
    OpInfo,
    backward_factor,
    backward_ms,
    forward_ms,
)
from onnx_partition.errors import PartitionError, read_json
from onnx_partition.fileio import atomic_write
from onnx_partition.graph import OpGraph
from onnx_partition.graph.protos import Shape, itemsize, shape_of
from onnx_partition.plan.contracts import COSTS_FORMAT

__all__ = ["COSTS_FORMAT", "CostsFile", "CostsLike", "NodeCosts", "annotate", "costs_device",
           "load_costs", "op_infos", "read_costs", "write_costs"]


@dataclass(frozen=True)
class NodeCosts:
    """Forward and backward milliseconds per node index, and where they came from."""

    forward_ms: list[float]
    backward_ms: list[float]
    source: str  # "analytic:<device>" or the costs file's path
    measured: int  # nodes whose forward time came from the costs file


def op_infos(graph: OpGraph) -> list[OpInfo]:
    """The analytic model's view of every node (shapes concrete, attributes decoded)."""
    protos = graph.protos()
    init_shapes: dict[str, Shape] = {
        t.name: tuple(t.dims) for t in graph.model.graph.initializer
    }
    init_types = {t.name: t.data_type for t in graph.model.graph.initializer}
    types = graph.concrete_types

    def shape(name: str) -> Shape | None:
        if not name:
            return None
        return init_shapes[name] if name in init_shapes else shape_of(types, name)

    def size(name: str) -> int:
        if name in init_types:
            return itemsize(init_types[name])
        ttype = types.get(name)
        return itemsize(ttype.tensor_type.elem_type) if ttype is not None else 0

    infos = []
    for node in graph.nodes:
        proto = protos[node.key]
        attrs = {a.name: _attr_value(a) for a in proto.attribute}
        infos.append(OpInfo(
            op_type=proto.op_type,
            attrs=attrs,
            input_shapes=[shape(i) for i in proto.input],
            output_shapes=[shape(o) for o in proto.output],
            input_itemsizes=[size(i) for i in proto.input],
            output_itemsizes=[size(o) for o in proto.output],
        ))
    return infos


def _attr_value(attr: onnx.AttributeProto) -> Any:
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS,
                     onnx.AttributeProto.TENSOR, onnx.AttributeProto.SPARSE_TENSOR):
        return None  # the analytic model needs none of these
    value = helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return list(value) if isinstance(value, list | tuple) else value


@dataclass(frozen=True)
class CostsFile:
    """One costs.json, read and checked against the contract once (:func:`load_costs`)."""

    path: str  # as the user gave it (messages and plan.json name it so)
    body: dict[str, Any]  # the whole document (provenance fields: ``cost.costs_file``)
    nodes: dict[str, dict[str, float]]  # node key -> {"forward_ms": ..., ["backward_ms": ...]}

    @property
    def device(self) -> str | None:
        """The ``device`` it says it was measured on (``cpu``, ``cuda:0``), if any."""
        device = self.body.get("device")
        return str(device) if device is not None else None


CostsLike = CostsFile | str | os.PathLike[str]


def load_costs(costs: CostsLike) -> CostsFile:
    """Read and validate the costs file at ``costs`` (one read; a :class:`CostsFile` is
    returned as it is). A missing, unreadable or malformed file is a one-line PartitionError
    naming the bad field."""
    if isinstance(costs, CostsFile):
        return costs
    from onnx_partition.plan.schema import validate_costs  # pydantic: loaded when first needed

    body = read_json(costs, "costs")
    spec = validate_costs(body, f"costs file {Path(costs)}")
    nodes = {
        key: {"forward_ms": entry.forward_ms}
        | ({"backward_ms": entry.backward_ms} if entry.backward_ms is not None else {})
        | {k: v for k in ("backward_input_ms", "backward_weight_ms")
           if (v := getattr(entry, k)) is not None}
        for key, entry in spec.nodes.items()
    }
    return CostsFile(os.fspath(costs), body, nodes)


def read_costs(costs: CostsLike) -> dict[str, dict[str, float]]:
    """The nodes of costs.json (the contract): node key -> {"forward_ms": ..., "backward_ms":
    ...}."""
    return load_costs(costs).nodes


def costs_device(costs: CostsLike) -> str | None:
    """The ``device`` a costs file says it was measured on (``cpu``, ``cuda:0``), if any."""
    return load_costs(costs).device


def write_costs(path: Path, costs: Mapping[str, Mapping[str, float]], **meta: Any) -> None:
    """Write costs.json whole or not at all (:func:`onnx_partition.fileio.atomic_write`)."""
    body = {"format": COSTS_FORMAT, "unit": "ms", **meta, "nodes": dict(costs)}
    atomic_write(path, json.dumps(body, indent=1) + "\n")


def annotate(
    graph: OpGraph,
    *,
    device: DeviceSpec | None = None,
    costs: CostsLike | None = None,
) -> NodeCosts:
    """Costs of every node: from the costs file ``costs`` (a :class:`CostsFile` or its path)
    where it names the node, else analytic.

    Free (constant) nodes cost nothing: they are folded or copied, never scheduled.
    ``source`` says what priced them: ``analytic:<device spec name>`` or the costs file's path.
    """
    device = device or DeviceSpec.cpu()
    infos = op_infos(graph)
    fwd = [0.0 if n.free else forward_ms(info, device) for n, info in zip(graph.nodes, infos)]
    bwd = [0.0 if n.free else backward_ms(info, device) for n, info in zip(graph.nodes, infos)]
    source, measured = f"analytic:{device.name}", 0
    if costs is not None:
        costs = load_costs(costs)
        given = costs.nodes
        keys = {n.key: n.index for n in graph.nodes}
        matched = [k for k in given if k in keys]
        if given and not matched:
            raise PartitionError(
                f"costs file {costs.path} names none of the model's nodes (another model?)"
            )
        for key in matched:
            index = keys[key]
            if graph.nodes[index].free:
                continue
            fwd[index] = given[key]["forward_ms"]
            # a measured forward alone: the factor of an operator of unknown class (2)
            bwd[index] = given[key].get("backward_ms", backward_factor() * fwd[index])
            measured += 1
        source = costs.path
    return NodeCosts(fwd, bwd, source, measured)
