"""The exported program (``model.pt2``) without a second copy of the weights.

A model whose weights go to external data (``model.onnx.data``) keeps them there only: its
program is saved with each parameter, buffer and constant that an initializer of the ONNX file
holds (the very tensor the exporter serialized) replaced by a meta tensor of its dtype and shape,
and a manifest in the archive's extra files (:data:`MANIFEST_KEY`, JSON) naming the ONNX file
beside it and, per program tensor, the initializer holding its bytes. :func:`load_program` loads
the program and reads those bytes back as data (a plain file, byte ranges checked against the
ONNX file's own external-data entries), so the program is the one that was exported, bit for
bit; tensors that shared storage (tied weights) share it again. A program without a manifest
(an older export, a small model with inline weights, a trained plan's program) loads as
``torch.export.load`` gives it; a weightless one keeps its meta tensors.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import onnx
import torch

from onnx_partition.errors import PartitionError
from onnx_partition.graph.protos import check_external_data

__all__ = ["MANIFEST_KEY", "TORCH_DTYPES", "held_tensors", "load_program", "read_archive",
           "save_program", "tensor_key"]

#: Extra file of a ``.pt2`` archive naming where its weights lie.
MANIFEST_KEY = "onnx_partition.weights.json"
_FORMAT = "onnx-partition/program-weights@1"
#: ONNX tensor dtype -> the torch dtype a program tensor of its bytes has.
TORCH_DTYPES: dict[int, torch.dtype] = {
           onnx.TensorProto.FLOAT: torch.float32, onnx.TensorProto.DOUBLE: torch.float64,
           onnx.TensorProto.FLOAT16: torch.float16, onnx.TensorProto.BFLOAT16: torch.bfloat16,
           onnx.TensorProto.INT8: torch.int8, onnx.TensorProto.UINT8: torch.uint8,
           onnx.TensorProto.INT16: torch.int16, onnx.TensorProto.INT32: torch.int32,
           onnx.TensorProto.INT64: torch.int64, onnx.TensorProto.BOOL: torch.bool}


def _tables(program: Any) -> Iterator[dict[str, Any]]:
    yield program.state_dict
    yield program.constants


def tensor_key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Same key: the same bytes (one storage, offset, shape, stride, dtype)."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


def held_tensors(model: Any) -> dict[tuple[Any, ...], str]:
    """Key of each torch tensor an initializer of the ``onnx_ir`` model serializes -> its name
    (taken before the model is saved: saving may swap the values for the written file's)."""
    held: dict[tuple[Any, ...], str] = {}
    for value in model.graph.initializers.values():
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and not raw.is_meta and raw.is_contiguous():
            held.setdefault(tensor_key(raw), value.name or "")
    return held


def save_program(program: Any, path: Path, held: Mapping[tuple[Any, ...], str],
                 onnx_path: Path) -> None:
    """``torch.export.save`` of ``program`` to ``path``, each tensor that an initializer of the
    ONNX file ``onnx_path`` beside it holds (``held``: :func:`held_tensors` of its model) left
    out and named in the manifest (module docstring). The program is unchanged afterwards."""
    mapping: dict[str, str] = {}
    saved: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for table in _tables(program):
            for name, tensor in list(table.items()):
                if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
                    continue
                source = held.get(tensor_key(tensor))
                if source is None or tensor.dtype not in TORCH_DTYPES.values():
                    continue
                mapping[name] = source
                saved.append((table, name, tensor))
                empty = torch.empty_like(tensor, device="meta")
                table[name] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                               if isinstance(tensor, torch.nn.Parameter) else empty)
        order = [list(table) for table in _tables(program)]  # loading may reorder them
        extra = ({MANIFEST_KEY: json.dumps({"format": _FORMAT, "onnx": onnx_path.name,
                                            "tensors": mapping, "order": order},
                                           sort_keys=True)}
                 if mapping else None)
        torch.export.save(program, path, extra_files=extra)
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


def read_archive(path: str | os.PathLike[str], extra: dict[str, str] | None = None
                 ) -> torch.export.ExportedProgram:
    """``torch.export.load(path)``, without the traceback torch logs as a warning when a file
    is not its archive (the exception still raises: callers say it in one line)."""
    quiet = logging.getLogger("torch.export")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return torch.export.load(str(path), extra_files=extra)
    finally:
        quiet.setLevel(level)


def load_program(path: str | os.PathLike[str]) -> torch.export.ExportedProgram:
    """The exported program at ``path`` with its weights, read from the ONNX file its manifest
    names when it has one (module docstring). Raises :class:`PartitionError` when the manifest
    or the ONNX file beside it does not hold what the program needs."""
    path = Path(path)
    extra = {MANIFEST_KEY: ""}
    program = read_archive(path, extra)
    if extra[MANIFEST_KEY]:
        _fill(program, path, extra[MANIFEST_KEY])
    return program


def _manifest(path: Path, text: str) -> tuple[Path, dict[str, str], list[list[str]]]:
    try:
        body = json.loads(text)
        ok = (isinstance(body, dict) and body.get("format") == _FORMAT
              and isinstance(body.get("onnx"), str) and isinstance(body.get("tensors"), dict)
              and all(isinstance(v, str) for v in body["tensors"].values())
              and isinstance(body.get("order"), list) and len(body["order"]) == 2
              and all(isinstance(o, list) for o in body["order"]))
    except ValueError:
        ok = False
    if not ok:
        raise PartitionError(f"program {path}: its weights manifest is not a {_FORMAT} object")
    name = body["onnx"]
    if not name or Path(name).name != name:
        raise PartitionError(f"program {path}: its weights file {name!r} is not a file name "
                             "beside it")
    return path.parent / name, body["tensors"], body["order"]


def _fill(program: Any, path: Path, text: str) -> None:
    """Give each meta tensor the manifest names the bytes of its initializer, in place."""
    onnx_path, mapping, order = _manifest(path, text)
    if not onnx_path.is_file():
        raise PartitionError(f"program {path} keeps its weights in {onnx_path.name}, which is "
                             "missing beside it")
    model = onnx.load(str(onnx_path), load_external_data=False)
    check_external_data(model, onnx_path.parent.resolve())
    inits = {t.name: t for t in model.graph.initializer}
    made: dict[str, torch.Tensor] = {}
    for table in _tables(program):
        for name, old in list(table.items()):
            if name not in mapping:
                continue
            source = mapping[name]
            tensor = inits.get(source)
            if not isinstance(old, torch.Tensor) or tensor is None:
                raise PartitionError(f"program {path}: {name!r} should lie in initializer "
                                     f"{source!r} of {onnx_path.name}, which has none")
            if source not in made:
                made[source] = _read(tensor, onnx_path.parent, old, f"{onnx_path.name}: {source!r}")
            value = made[source]
            if value.dtype != old.dtype or value.shape != old.shape:
                raise PartitionError(f"program {path}: {name!r} is {old.dtype} "
                                     f"{list(old.shape)}, initializer {source!r} of "
                                     f"{onnx_path.name} {value.dtype} {list(value.shape)}")
            table[name] = (torch.nn.Parameter(value, requires_grad=old.requires_grad)
                           if isinstance(old, torch.nn.Parameter) else value)
    for table, names in zip(_tables(program), order, strict=True):
        if sorted(names) == sorted(table):  # as exported: the stage modules' parameter order
            items = {name: table[name] for name in names}
            table.clear()
            table.update(items)


def _read(tensor: onnx.TensorProto, folder: Path, like: torch.Tensor, what: str) -> torch.Tensor:
    """The initializer's value as a fresh CPU tensor: external bytes read straight into it."""
    dtype = TORCH_DTYPES.get(tensor.data_type)
    if dtype is None:
        raise PartitionError(f"{what} has ONNX dtype {tensor.data_type}, which no program "
                             "tensor has")
    out = torch.empty(tuple(tensor.dims), dtype=dtype)
    buffer = memoryview(out.view(-1).view(torch.uint8).numpy().data) if out.numel() else (
        memoryview(bytearray()))
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info: Mapping[str, str] = {e.key: e.value for e in tensor.external_data}
        length = int(info.get("length") or len(buffer))
        if length != len(buffer):
            raise PartitionError(f"{what} has {length} bytes of external data, its shape "
                                 f"needs {len(buffer)}")
        with open(folder / info["location"], "rb") as handle:
            handle.seek(int(info.get("offset") or 0))
            if handle.readinto(buffer) != len(buffer):
                raise PartitionError(f"{what}: its external data file ended early")
        return out
    if tensor.HasField("raw_data") and len(tensor.raw_data) == len(buffer):
        buffer[:] = tensor.raw_data
        return out
    from onnx import numpy_helper

    array = numpy_helper.to_array(tensor)
    if dtype == torch.bfloat16:
        raise PartitionError(f"{what}: a bfloat16 initializer must hold raw bytes")
    return torch.from_numpy(array.copy()).to(dtype).reshape(like.shape)
