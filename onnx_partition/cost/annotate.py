"""Per-node costs of an :class:`OpGraph`: costs.json where given, the analytic model elsewhere.

The adapter between ONNX protos and the pure analytic model: it decodes attributes and shapes into
:class:`~onnx_partition.cost.analytic.OpInfo` records.
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
from onnx_partition.graph import OpGraph
from onnx_partition.graph.protos import Shape, itemsize, shape_of

__all__ = ["COSTS_FORMAT", "NodeCosts", "annotate", "costs_device", "op_infos", "read_costs",
           "write_costs"]

COSTS_FORMAT = "onnx-partition/costs@1"


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


def read_costs(path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """Read costs.json (the contract): node key -> {"forward_ms": ..., "backward_ms": ...}."""
    from onnx_partition.plan.schema import validate_costs  # pydantic: loaded when first needed

    path = Path(path)
    spec = validate_costs(read_json(path, "costs"), f"costs file {path}")
    return {
        key: {"forward_ms": entry.forward_ms}
        | ({"backward_ms": entry.backward_ms} if entry.backward_ms is not None else {})
        for key, entry in spec.nodes.items()
    }


def costs_device(path: str | os.PathLike[str]) -> str | None:
    """The ``device`` a costs file says it was measured on (``cpu``, ``cuda:0``), if any."""
    body = read_json(Path(path), "costs")
    device = body.get("device") if isinstance(body, dict) else None
    return str(device) if device is not None else None


def write_costs(path: Path, costs: Mapping[str, Mapping[str, float]], **meta: Any) -> None:
    """Write costs.json atomically (temporary name, then rename)."""
    body = {"format": COSTS_FORMAT, "unit": "ms", **meta, "nodes": dict(costs)}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, path)


def annotate(
    graph: OpGraph,
    *,
    device: DeviceSpec | None = None,
    costs_path: str | os.PathLike[str] | None = None,
) -> NodeCosts:
    """Costs of every node: from ``costs_path`` where it names the node, else analytic.

    Free (constant) nodes cost nothing: they are folded or copied, never scheduled.
    ``source`` says what priced them: ``analytic:<device spec name>`` or the costs file.
    """
    device = device or DeviceSpec.cpu()
    infos = op_infos(graph)
    fwd = [0.0 if n.free else forward_ms(info, device) for n, info in zip(graph.nodes, infos)]
    bwd = [0.0 if n.free else backward_ms(info, device) for n, info in zip(graph.nodes, infos)]
    source, measured = f"analytic:{device.name}", 0
    if costs_path is not None:
        given = read_costs(costs_path)
        keys = {n.key: n.index for n in graph.nodes}
        matched = [k for k in given if k in keys]
        if given and not matched:
            raise PartitionError(
                f"costs file {costs_path} names none of the model's nodes (another model?)"
            )
        for key in matched:
            index = keys[key]
            if graph.nodes[index].free:
                continue
            fwd[index] = given[key]["forward_ms"]
            # a measured forward alone: the factor of an operator of unknown class (2)
            bwd[index] = given[key].get("backward_ms", backward_factor() * fwd[index])
            measured += 1
        source = str(costs_path)
    return NodeCosts(fwd, bwd, source, measured)
