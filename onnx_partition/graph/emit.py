"""Stage files: one valid ONNX model per stage, written atomically with plan.json.

A stage holds its nodes (renamed to their keys), copies of the free constant nodes they need, and
the initializers they read. Tensors crossing a cut keep their names and carry the types found by
shape inference. Weights of at least :data:`EXTERNAL_THRESHOLD` bytes go to ``stage_<k>.onnx.data``
beside the stage; weights that were external in the source are copied from its data file piece by
piece, never loaded whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnx_partition import __version__
from onnx_partition.errors import PartitionError, one_line
from onnx_partition.fileio import HashingWriter, sha256_file
from onnx_partition.graph import OpGraph
from onnx_partition.graph.protos import external_files, iter_tensors
from onnx_partition.graph.weightless import checkable, is_weightless
from onnx_partition.plan import IOSpec, Plan
from onnx_partition.plan.folder import publish, read_body
from onnx_partition.progress import SILENT, Reporter

__all__ = ["EXTERNAL_THRESHOLD", "StageCut", "cut_stages", "emit", "io_specs", "save_stage",
           "stage_proto", "write_plan_folder"]

#: Initializers of at least this many bytes are stored as external data.
EXTERNAL_THRESHOLD = 1 << 20
_ALIGN = 4096
_BLOCK = 1 << 20


@dataclass(frozen=True)
class StageCut:
    """What one stage holds, in node indices of the :class:`OpGraph`."""

    nodes: list[int]  # cut nodes, topological order
    constants: list[int]  # free nodes copied in
    inputs: list[str]
    outputs: list[str]
    initializers: list[str]


def cut_stages(graph: OpGraph, stage_of: dict[int, int], num_stages: int) -> list[StageCut]:
    """Inputs, outputs, constants and initializers of each stage of an assignment.

    ``stage_of`` maps every non-free node index to its stage; every edge must point forward.
    """
    last_use: dict[str, int] = {}
    for name, tensor in graph.tensors.items():
        stages = [stage_of[c] for c in tensor.consumers]
        if name in graph.outputs:
            stages.append(num_stages)
        last_use[name] = max(stages, default=-1)
    members: list[list[int]] = [[] for _ in range(num_stages)]
    for index in sorted(stage_of):
        members[stage_of[index]].append(index)

    cuts = []
    for k, nodes in enumerate(members):
        inputs: dict[str, None] = {}
        outputs: dict[str, None] = {}
        consts: list[str] = []
        for index in nodes:
            node = graph.nodes[index]
            for name in node.inputs:
                if name not in graph.tensors:
                    consts.append(name)
                    continue
                tensor = graph.tensors[name]
                if tensor.producer < 0 or stage_of[tensor.producer] != k:
                    if tensor.producer >= 0 and stage_of[tensor.producer] > k:
                        raise ValueError(f"{name!r} flows from a later stage into stage {k}")
                    inputs[name] = None
            for name in node.outputs:
                if name in graph.tensors and last_use[name] > k:
                    outputs[name] = None
        whole: list[str] = []
        if k == num_stages - 1:  # graph outputs computed from constants, or initializers
            for name in graph.outputs:
                if name in graph.initializer_bytes and name not in graph.tensors:
                    whole.append(name)
                    outputs[name] = None
                elif name not in graph.tensors:
                    consts.append(name)
                    outputs[name] = None
        if not outputs and nodes:  # a stage of dead ends still needs an output
            outputs[next(o for o in graph.nodes[nodes[-1]].outputs if o)] = None
        constants = graph.free_closure(consts)
        inits: dict[str, None] = dict.fromkeys(whole)
        for index in sorted(nodes + constants):
            inits.update(dict.fromkeys(graph.nodes[index].initializers))
        cuts.append(StageCut(nodes, constants, list(inputs), list(outputs), list(inits)))
    return cuts


def stage_proto(graph: OpGraph, cut: StageCut, index: int) -> onnx.ModelProto:
    """The ONNX model of one stage (initializers still pointing at the source's data)."""
    source = graph.model
    protos = graph.protos()
    nodes = [protos[graph.nodes[i].key] for i in sorted(cut.nodes + cut.constants)]
    wanted = set(cut.initializers)
    inits = [t for t in source.graph.initializer if t.name in wanted]
    sparse = [t for t in source.graph.sparse_initializer if t.values.name in wanted]
    stage_graph = helper.make_graph(
        nodes,
        f"{source.graph.name or 'model'}_stage_{index}",
        [_value_info(graph, name) for name in cut.inputs],
        [_value_info(graph, name) for name in cut.outputs],
        initializer=inits,
        sparse_initializer=sparse,
    )
    model = helper.make_model(
        stage_graph,
        opset_imports=list(source.opset_import),
        producer_name="onnx-partition",
        producer_version=__version__,
    )
    model.ir_version = max(source.ir_version, 4)  # IR < 4 wants initializers listed as inputs
    model.functions.extend(source.functions)
    model.metadata_props.extend(source.metadata_props)
    helper.set_model_props(model, {"onnx_partition.stage": str(index)})
    return model


def _value_info(graph: OpGraph, name: str) -> onnx.ValueInfoProto:
    ttype = graph.types.get(name) or graph.concrete_types.get(name)
    if ttype is None:
        tensor = graph.tensors.get(name)
        if tensor is None or not tensor.elem_type:
            raise PartitionError(f"no type known for {name!r}, which crosses a cut")
        return helper.make_tensor_value_info(name, tensor.elem_type, None)
    info = onnx.ValueInfoProto(name=name)
    info.type.CopyFrom(ttype)
    return info


def save_stage(
    model: onnx.ModelProto, path: Path, source_dir: Path | None, *, check: bool = True
) -> str:
    """Write a stage to ``path`` with large weights external; return its sha256.

    ``path`` lies in a plan folder being published (:func:`write_plan_folder`, :func:`emit`),
    which is what makes the write atomic; its files are written plainly. Weights external in
    the source are copied to the stage's data file in 1 MiB blocks, so a tensor of any size
    costs no more memory than one block."""
    data_name = path.name + ".data"
    with HashingWriter(path.parent / data_name) as data:
        for tensor in model.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                source, start, length = _external_span(tensor, source_dir)
                if length < EXTERNAL_THRESHOLD:
                    _set_inline(tensor, _read_span(source, start, length))
                    continue
                offset = _aligned(data)
                _copy_span(source, start, length, data)
                _set_external(tensor, data_name, offset, length)
                continue
            raw = _raw_bytes(tensor, source_dir)
            if raw is None or len(raw) < EXTERNAL_THRESHOLD:
                continue
            offset = _aligned(data)
            data.write(raw)
            _set_external(tensor, data_name, offset, len(raw))
    for tensor in iter_tensors(model.graph, nested_only=True):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # keep subgraphs self-contained
            _set_inline(tensor, _raw_bytes(tensor, source_dir) or b"")
    if (path.parent / data_name).stat().st_size == 0:
        (path.parent / data_name).unlink()
    onnx.save_model(model, str(path))
    if check:
        weightless = checkable(model)  # the checker wants data in every initializer
        try:
            onnx.checker.check_model(str(path) if weightless is model else weightless,
                                     full_check=True)
        except onnx.checker.ValidationError as exc:
            first = one_line(exc)
            msg = f"stage file {path.name} failed the ONNX checker: {first}"
            raise PartitionError(msg) from None
    return sha256_file(path)


def _aligned(data: HashingWriter) -> int:
    offset = -data.tell() % _ALIGN + data.tell()
    data.pad_to(offset)
    return offset


def _external_span(tensor: onnx.TensorProto, source_dir: Path | None) -> tuple[Path, int, int]:
    """(file, offset, length) of an external tensor's bytes (checked by :func:`graph.load`)."""
    if source_dir is None:
        raise PartitionError(f"{tensor.name!r} has external data but the model has no folder")
    info = {e.key: e.value for e in tensor.external_data}
    source = source_dir / info["location"]
    start = int(info.get("offset") or 0)
    length = int(info["length"]) if info.get("length") else source.stat().st_size - start
    return source, start, length


def _read_span(source: Path, start: int, length: int) -> bytes:
    with open(source, "rb") as src:
        src.seek(start)
        return src.read(length)


def _copy_span(source: Path, start: int, length: int, data: HashingWriter) -> None:
    try:
        data.copy_from(source, start, length, _BLOCK)
    except EOFError:
        raise PartitionError(f"external data file {source.name} ended early") from None


def _raw_bytes(tensor: onnx.TensorProto, source_dir: Path | None) -> bytes | None:
    """The tensor's little-endian bytes (read from the source's data file when external)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return _read_span(*_external_span(tensor, source_dir))
    if tensor.data_type == onnx.TensorProto.STRING or is_weightless(tensor):
        return None  # a weightless initializer stays as it is: name, dtype, shape
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    array = numpy_helper.to_array(tensor)
    return np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    _clear_data(tensor)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _set_inline(tensor: onnx.TensorProto, raw: bytes) -> None:
    _clear_data(tensor)
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = raw


def _clear_data(tensor: onnx.TensorProto) -> None:
    for name in ("float_data", "int32_data", "string_data", "int64_data", "double_data",
                 "uint64_data", "raw_data", "external_data"):
        tensor.ClearField(name)


# --------------------------------------------------------------------------- plan folder


def io_specs(graph: OpGraph) -> tuple[list[IOSpec], list[IOSpec]]:
    """Graph inputs and outputs with dtype and (symbolic) shape, for feeding a plan."""
    bounds = graph.index_bounds

    def spec(name: str, high: int | None = None) -> IOSpec:
        ttype = graph.types.get(name) or graph.concrete_types.get(name)
        if ttype is None:
            return IOSpec(name, "unknown", [], high)
        tt = ttype.tensor_type
        dtype = str(helper.tensor_dtype_to_np_dtype(tt.elem_type)) if tt.elem_type else "unknown"
        shape: list[int | str] = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim
        ]
        return IOSpec(name, dtype, shape, high)

    inputs = [spec(name, bounds.get(name)) for name in graph.inputs]
    return inputs, [spec(name) for name in graph.outputs]


def write_plan_folder(
    out: Path, write: Callable[[Path], None], *, force: bool = False
) -> None:
    """Run ``write(tmp)`` (which writes plan.json and its files) into a fresh temporary folder,
    then publish it as ``out`` with its manifest
    (see :func:`onnx_partition.plan.folder.publish`)."""

    def body(folder: Path) -> dict[str, Any]:
        write(folder)
        return read_body(folder)

    publish(out, body, force=force)


def emit(
    graph: OpGraph,
    cuts: Sequence[StageCut],
    plan: Plan,
    out: Path,
    *,
    force: bool = False,
    check: bool = True,
    reporter: Reporter = SILENT,
) -> Plan:
    """Write every stage file and plan.json into ``out`` atomically; return the final plan.
    Each stage file written is reported to ``reporter``."""
    source_dir = graph.path.parent.resolve() if graph.path else None

    def write(folder: Path) -> dict[str, Any]:
        for k, cut in enumerate(cuts):
            stage = plan.stages[k]
            stage.sha256 = save_stage(
                stage_proto(graph, cut, k), folder / stage.file, source_dir, check=check
            )
            reporter.step("writing stage files", k + 1, len(cuts))
        return plan.to_json()

    protect: list[Path] = []
    if graph.path is not None:
        plan.model = os.path.relpath(graph.path.resolve(), Path(os.path.abspath(out)).resolve())
        protect = [graph.path, *(graph.path.parent / f for f in external_files(graph.model))]
    plan.manifest = publish(out, write, force=force, protect=protect)
    return plan
