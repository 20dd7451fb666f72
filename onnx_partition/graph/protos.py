"""Reading ONNX protos for :mod:`onnx_partition.graph`: the tensors of a model and its subgraphs,
external data checks, the names a node reads, input shapes and shape inference, byte sizes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import onnx
from onnx import helper, shape_inference

from onnx_partition.errors import PartitionError
from onnx_partition.values import MAX_BYTES, Rule, check

__all__ = ["Shape", "check_external_data", "external_files", "fixed_input_shapes", "infer_types",
           "itemsize", "iter_tensors", "shape_and_type", "shape_bytes",
           "shape_loop_outputs", "shape_of", "tensor_proto_bytes", "used_names",
           "with_input_shapes"]

Shape = tuple[int, ...]


# --------------------------------------------------------------------------- tensors


def check_external_data(model: onnx.ModelProto, folder: Path) -> None:
    """Every external tensor's file exists inside the model's folder and is long enough."""
    for tensor in iter_tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        target = (folder / location).resolve()
        if not location or os.path.isabs(location) or folder not in target.parents:
            raise PartitionError(
                f"external data of {tensor.name!r} points outside the model's folder: {location!r}"
            )
        if not target.is_file():
            raise PartitionError(f"missing external data file {location!r} (for {tensor.name!r})")
        span = Rule(int, 0, MAX_BYTES, "bytes")
        what = f"external data of {tensor.name!r}:"
        offset = check(info.get("offset") or 0, f"{what} offset", span)
        end = offset + check(info.get("length") or tensor_proto_bytes(tensor), f"{what} length",
                             span)
        if end > target.stat().st_size:
            raise PartitionError(
                f"external data file {location!r} is too short for {tensor.name!r} "
                f"(needs {end} bytes, has {target.stat().st_size})"
            )


def external_files(model: onnx.ModelProto) -> list[str]:
    """The external data files (relative locations) the model's tensors point at."""
    found = {e.value for t in iter_tensors(model.graph) for e in t.external_data
             if t.data_location == onnx.TensorProto.EXTERNAL and e.key == "location"}
    return sorted(found)


def iter_tensors(
    graph: onnx.GraphProto, *, nested_only: bool = False
) -> Iterator[onnx.TensorProto]:
    """Initializers of a graph and of all its subgraphs, and tensor attributes (Constant values).
    ``nested_only`` leaves out the graph's own initializers."""
    if not nested_only:
        yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
            for sub in _subgraphs(attr):
                yield from iter_tensors(sub)


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []

# ----------------------------------------------------------------- names read


def used_names(node: onnx.NodeProto) -> list[str]:
    """Names a node reads: its inputs plus values its subgraphs capture from outer scopes."""
    used = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in _subgraphs(attr):
            used.extend(_captured(sub))
    return used


def _captured(graph: onnx.GraphProto) -> list[str]:
    """Outer-scope names a subgraph reads (recursively through nested subgraphs)."""
    local = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    local |= {t.name for t in graph.sparse_initializer}
    captured: list[str] = []
    for node in graph.node:
        for name in used_names(node):
            if name not in local:
                captured.append(name)
        local.update(node.output)
    return captured

# --------------------------------------------------------------------- shapes


def fixed_input_shapes(
    graph: onnx.GraphProto,
    inputs: list[str],
    given: Mapping[str, Sequence[int]],
    batch_size: int | None,
    where: str,
) -> dict[str, Shape]:
    """Concrete shape of every graph input, or a clear error naming the dim left unknown."""
    unknown = sorted(set(given) - set(inputs))
    if unknown:
        raise PartitionError(
            f"--input-shape names unknown input {unknown[0]!r}; the model's inputs are: "
            + ", ".join(inputs)
        )
    by_name = {v.name: v for v in graph.input}
    shapes: dict[str, Shape] = {}
    for name in inputs:
        ttype = by_name[name].type.tensor_type
        if name in given:
            shape = tuple(int(d) for d in given[name])
            declared = ttype.shape.dim if ttype.HasField("shape") else []
            if declared and len(declared) != len(shape):
                raise PartitionError(
                    f"--input-shape {name}: rank {len(shape)} but the model declares rank "
                    f"{len(declared)}"
                )
            shapes[name] = shape
            continue
        if not ttype.HasField("shape"):
            raise PartitionError(f"input {name!r} has no declared shape; give --input-shape")
        dims: list[int] = []
        for axis, dim in enumerate(ttype.shape.dim):
            if dim.HasField("dim_value"):
                dims.append(dim.dim_value)
            elif axis == 0 and batch_size is not None:
                dims.append(batch_size)
            else:
                label = dim.dim_param or "?"
                hint = "--batch-size B or " if axis == 0 else ""
                raise PartitionError(
                    f"input {name!r} dim {axis} ({label!r}) is symbolic; give {hint}"
                    f"--input-shape {name}=D0,D1,..."
                )
        shapes[name] = tuple(dims)
    return shapes


def shape_loop_outputs(graph: onnx.GraphProto) -> None:
    """Declare the shapes of Loop outputs that the body states but shape inference drops: a
    loop-carried value's final shape is the body output's declared shape (inference leaves it
    unknown, as it may change between iterations; the body's declaration says it does not).
    Without a shape such a tensor cannot cross a cut (stage files need typed inputs)."""
    known = {v.name for v in graph.value_info} | {v.name for v in graph.output}
    for node in graph.node:
        if node.op_type != "Loop":
            continue
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        if body is None:
            continue
        carried = len(node.input) - 2
        for i, name in enumerate(node.output[:carried]):
            declared = body.output[1 + i] if 1 + i < len(body.output) else None
            if (not name or name in known or declared is None
                    or not declared.type.tensor_type.HasField("shape")):
                continue
            info = graph.value_info.add()
            info.name = name
            info.type.CopyFrom(declared.type)
            known.add(name)


def with_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Shape]) -> onnx.ModelProto:
    """A copy whose inputs have concrete dims, and whose symbolic dims of the same names are
    substituted everywhere, ready for shape inference."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    symbols: dict[str, int] = {}
    for value in fixed.graph.input:
        if value.name not in shapes:
            continue
        tshape = value.type.tensor_type.shape
        for dim, size in zip(tshape.dim, shapes[value.name], strict=False):
            if dim.dim_param:
                symbols.setdefault(dim.dim_param, size)
        del tshape.dim[:]
        for size in shapes[value.name]:
            tshape.dim.add().dim_value = size
    for value in list(fixed.graph.value_info) + list(fixed.graph.output):
        if not value.type.HasField("tensor_type"):
            continue
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                dim.dim_value = symbols[dim.dim_param]
    return fixed


def infer_types(model: onnx.ModelProto, where: str) -> dict[str, onnx.TypeProto]:
    """Name -> TypeProto of every value shape inference can type (inputs and outputs too)."""
    try:
        inferred = shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # inference is best effort; missing types are handled by the caller
        inferred = model
    graph = inferred.graph
    types: dict[str, onnx.TypeProto] = {}
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types.setdefault(value.name, value.type)
    return types

# ---------------------------------------------------------------------- sizes


def shape_and_type(ttype: onnx.TypeProto | None) -> tuple[Shape | None, int]:
    """Concrete shape (None unless every dim is known) and element type (0: unknown)."""
    if ttype is None or not ttype.HasField("tensor_type"):
        return None, 0
    tt = ttype.tensor_type
    if not tt.HasField("shape"):
        return None, tt.elem_type
    dims = []
    for dim in tt.shape.dim:
        if not dim.HasField("dim_value") or dim.dim_value < 0:
            return None, tt.elem_type
        dims.append(dim.dim_value)
    return tuple(dims), tt.elem_type


def shape_of(types: Mapping[str, onnx.TypeProto], name: str) -> Shape | None:
    """Concrete shape of a value in ``types``, or None."""
    return shape_and_type(types.get(name))[0]


def itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX tensor type (sub-byte types round up to one byte)."""
    if elem_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0
    try:
        return max(1, int(helper.tensor_dtype_to_np_dtype(elem_type).itemsize))
    except (KeyError, TypeError, ValueError):
        return 1


def shape_bytes(shape: Shape | None, elem_type: int) -> int | None:
    """Bytes of a tensor of this shape and type; None when either is unknown."""
    if shape is None or elem_type == 0:
        return None
    return math.prod(shape) * itemsize(elem_type)


def tensor_proto_bytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor proto by its dims (its data is not read)."""
    return math.prod(tensor.dims) * itemsize(tensor.data_type)
