"""Weightless models: initializers that keep their name, dtype and shape and hold no data.

A model exported from a module on ``torch.device("meta")`` has no weight values. Each such
initializer is a ``TensorProto`` with ``dims`` and ``data_type`` and no data field at all (no
raw data, no typed data, no external data), marked by the tensor metadata entry
``onnx_partition.weights = none``; the model's own metadata says what its weights are
(``onnx_partition.weights``: ``none``, ``random`` or absent for real data) and where it came
from (``onnx_partition.origin``: JSON, e.g. ``{"hf": {"class": ..., "config": {...}}}``).
Loading, pricing and planning read only dims and dtypes, so a weightless model plans like any
other; the ONNX checker wants data in every initializer, so :func:`checkable` shows it the
weightless ones as graph inputs of the same type.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import onnx

__all__ = ["ORIGIN_KEY", "WEIGHTS_KEY", "checkable", "is_weightless", "mark_model",
           "model_origin", "model_weights", "weightless_tensor"]

#: Metadata key (model and tensor) saying what the weights are.
WEIGHTS_KEY = "onnx_partition.weights"
#: Model metadata key holding the model's origin as JSON.
ORIGIN_KEY = "onnx_partition.origin"
_DATA_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data",
                "uint64_data", "raw_data", "external_data")


def weightless_tensor(name: str, dims: Iterable[int], data_type: int) -> onnx.TensorProto:
    """An initializer of this name, shape and ONNX dtype without data, marked weightless."""
    tensor = onnx.TensorProto(name=name, data_type=data_type)
    tensor.dims.extend(int(d) for d in dims)
    entry = tensor.metadata_props.add()
    entry.key, entry.value = WEIGHTS_KEY, "none"
    return tensor


def is_weightless(tensor: onnx.TensorProto) -> bool:
    """A marked initializer that holds no data."""
    marked = any(e.key == WEIGHTS_KEY and e.value == "none" for e in tensor.metadata_props)
    return marked and not any(
        len(getattr(tensor, f)) if f != "raw_data" else tensor.HasField(f) for f in _DATA_FIELDS)


def _metadata(model: onnx.ModelProto) -> dict[str, str]:
    return {e.key: e.value for e in model.metadata_props}


def mark_model(model: onnx.ModelProto, weights: str, origin: Mapping[str, Any] | None) -> None:
    """Record what the model's weights are (``none``, ``random``) and its origin."""
    props = {WEIGHTS_KEY: weights}
    if origin is not None:
        props[ORIGIN_KEY] = json.dumps(origin, sort_keys=True, allow_nan=False)
    kept = [e for e in model.metadata_props if e.key not in props]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value


def model_weights(model: onnx.ModelProto) -> str:
    """``none`` (a weightless model), ``random`` (built from a config with random weights) or
    ``data`` (real weights: any model not marked otherwise, a trained weightless one too)."""
    if any(is_weightless(t) for t in model.graph.initializer):
        return "none"
    return "random" if _metadata(model).get(WEIGHTS_KEY) == "random" else "data"


def model_origin(model: onnx.ModelProto) -> dict[str, Any] | None:
    """The origin recorded at export (None when none was, or it is not a JSON object)."""
    text = _metadata(model).get(ORIGIN_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as the ONNX checker accepts it: each weightless initializer a graph input of
    its dtype and shape instead (the model itself when it has none)."""
    if not any(is_weightless(t) for t in model.graph.initializer):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept = [t for t in copy.graph.initializer if not is_weightless(t)]
    gone = [t for t in copy.graph.initializer if is_weightless(t)]
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(kept)
    for tensor in gone:
        copy.graph.input.append(onnx.helper.make_tensor_value_info(
            tensor.name, tensor.data_type, list(tensor.dims)))
    return copy
