"""Operator signatures: nodes that cost the same share one digest, measured once.

A signature is the domain, op type, opset, attributes, input and output dtypes and concrete
shapes, and which inputs are initializers (``init``), outputs of constant-only nodes
(``const``) or computed values (``flow``); small initializers add their values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from onnx_partition.graph import OpGraph
from onnx_partition.graph.protos import shape_of

__all__ = ["model_digest", "signature_groups", "signatures"]

#: Integer and boolean initializers with at most this many elements (axes, shapes, indices), and
#: scalars (exponents, bounds), take part in signatures by value; other values change no cost.
_VALUE_ELEMENTS = 64
_EXACT_TYPES = frozenset({
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32,
    onnx.TensorProto.UINT64, onnx.TensorProto.BOOL})


def signatures(graph: OpGraph) -> dict[int, tuple[str, bool]]:
    """Node index -> (signature digest, cacheable) for every compute node.

    A node with an unknown input or output shape gets a signature of its own (its key) that is
    never cached: it cannot be shown identical to anything else.
    """
    protos = graph.protos()
    inits = {t.name: t for t in graph.model.graph.initializer}
    opsets = {(o.domain or "ai.onnx"): o.version for o in graph.model.opset_import}
    out: dict[int, tuple[str, bool]] = {}
    for node in graph.nodes:
        if node.free:
            continue
        proto = protos[node.key]
        domain = proto.domain or "ai.onnx"
        captured = [n for n in (*node.inputs, *node.initializers) if n not in proto.input]
        ins = [_describe(graph, n, inits) for n in (*proto.input, *captured)]
        outs = [_describe(graph, n, inits) for n in proto.output]
        known = all(k for _, k in ins + outs)
        body = {
            "op": [domain, proto.op_type, opsets.get(domain)],
            "attrs": sorted((a.name, hashlib.sha256(a.SerializeToString()).hexdigest())
                            for a in proto.attribute),
            "in": [d for d, _ in ins[: len(proto.input)]],
            "captured": [d for d, _ in ins[len(proto.input):]],
            "out": [d for d, _ in outs],
            "node": None if known else node.key,
        }
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        out[node.index] = (hashlib.sha256(text.encode()).hexdigest(), known)
    return out


def signature_groups(sigs: Mapping[int, tuple[str, bool]]) -> dict[str, list[int]]:
    """Signature digest -> the indices of its nodes, in node order (the first one is measured)."""
    groups: dict[str, list[int]] = {}
    for index, (digest, _) in sigs.items():
        groups.setdefault(digest, []).append(index)
    return groups


def _describe(graph: OpGraph, name: str,
              inits: Mapping[str, onnx.TensorProto]) -> tuple[object, bool]:
    """A tensor's part of a signature: kind, dtype, shape (and value, for small initializers),
    and whether its type is fully known."""
    if not name:
        return None, True
    if name in inits:
        t = inits[name]
        entry: list[object] = ["init", t.data_type, list(t.dims)]
        numel = int(np.prod(t.dims))
        exact = t.data_type in _EXACT_TYPES and numel <= _VALUE_ELEMENTS
        if t.data_location != onnx.TensorProto.EXTERNAL and (numel <= 1 or exact):
            entry.append(numpy_helper.to_array(t).tobytes().hex())
        return entry, True
    ttype = graph.concrete_types.get(name)
    shape = shape_of(graph.concrete_types, name)
    elem = ttype.tensor_type.elem_type if ttype and ttype.HasField("tensor_type") else 0
    kind = "const" if name in graph.free_outputs else "flow"
    return [kind, elem, list(shape) if shape is not None else None], bool(shape is not None
                                                                          and elem)


def model_digest(graph: OpGraph) -> str:
    """The whole model and its input shapes, as the cache key of its whole-model time."""
    digest = hashlib.sha256(graph.model.SerializeToString(deterministic=True))
    digest.update(json.dumps(sorted(graph.input_shapes.items())).encode())
    return digest.hexdigest()
