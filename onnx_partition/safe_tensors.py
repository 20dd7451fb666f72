"""Tensor files read as data, never as code: a safetensors file's header checked before any
tensor is read (:func:`check_safetensors`), and the few tensors a caller asks for read lazily
(:func:`read_tensors`, safetensors' ``safe_open``).

A safetensors file is 8 bytes of little-endian header length, a JSON header
``{"NAME": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`` and the
tensors' bytes. Nothing in it is executed; what a crafted file can still do is lie about sizes.
The header is checked here, in plain Python, so that a lie is a one-line
:class:`~onnx_partition.errors.PartitionError` naming the file, never a traceback from the
reader: a header length beyond the file or above 100 MB, a header that is not a JSON object, an
unknown dtype, a shape that is not a list of non-negative integers, offsets whose span is not
the shape's byte size, or offsets outside the data or overlapping another tensor's.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_partition.errors import PartitionError

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPE_BYTES", "TensorEntry", "check_safetensors", "read_tensors", "save_tensors"]

#: safetensors dtype name -> bytes per element (the format's whole list, 0.4)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100_000_000  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def check_safetensors(path: Path, where: str = "") -> dict[str, TensorEntry]:
    """The tensors of the safetensors file ``path`` (name -> entry), its header checked (the
    module docstring); a PartitionError ``{where or path}: not a valid safetensors file (...)``
    otherwise."""
    what = where or str(path)

    def bad(why: str) -> PartitionError:
        return PartitionError(f"{what}: not a valid safetensors file ({why})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER or 8 + length > size:
                raise bad(f"header length {length} beyond the file's {size} bytes or 100 MB")
            text = handle.read(length)
    except OSError as exc:
        raise PartitionError(f"{what}: cannot read it ({exc.strerror or exc})") from None
    try:
        header = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise bad("its header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    entries = {name: _entry(name, body, bad) for name, body in header.items()
               if name != "__metadata__"}
    _check_layout(entries, size - 8 - length, bad)
    return entries


def _entry(name: str, body: Any, bad: Any) -> TensorEntry:
    if not isinstance(body, dict):
        raise bad(f"tensor {name!r} is not an object")
    dtype, shape, offsets = body.get("dtype"), body.get("shape"), body.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise bad(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
    begin, end = offsets
    if end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise bad(f"tensor {name!r} spans {end - begin} bytes, its shape and dtype take "
                  f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_layout(entries: dict[str, TensorEntry], data: int, bad: Any) -> None:
    """Every tensor inside the data, none overlapping another."""
    last_end, last = 0, ""
    for name, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < 0 or e.end > data:
            raise bad(f"tensor {name!r} at bytes {e.begin}..{e.end}, outside the file's "
                      f"{data} bytes of data")
        if e.begin < last_end:
            raise bad(f"tensor {name!r} overlaps tensor {last!r}")
        last_end, last = e.end, name


def read_tensors(path: Path, names: Collection[str] | None = None,
                 where: str = "") -> dict[str, torch.Tensor]:
    """The tensors ``names`` (all when None) of the safetensors file ``path``, on the CPU,
    read lazily (only those named), its header checked first (:func:`check_safetensors`)."""
    from safetensors import SafetensorError, safe_open

    entries = check_safetensors(path, where)
    wanted = list(entries) if names is None else list(names)
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise PartitionError(f"{where or path}: holds no tensor {missing[0]!r}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return {n: handle.get_tensor(n) for n in wanted}
    except (SafetensorError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PartitionError(f"{where or path}: not a valid safetensors file ({first})") from None


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` as a safetensors file at ``path`` (each a contiguous CPU copy, so shared
    storage and views save as their own tensors)."""
    from safetensors.torch import save_file

    save_file({n: t.detach().to("cpu", copy=True).contiguous() for n, t in tensors.items()},
              str(path))
