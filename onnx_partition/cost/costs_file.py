"""What a costs.json says about where it was measured, and whether it fits the graph planned.

``profile`` records (beside ``nodes``, the only required key of the contract):

* ``fingerprint``: ``sha256:<hex>`` of the graph's structure (:func:`fingerprint`): node keys,
  domains and op types, the tensor names each node reads and writes (the edges), the graph
  inputs with their dtypes and *declared* shapes (static dims as numbers, symbolic ones as
  ``"?"``) and the graph outputs. Not the weights (cheap on a multi-GB model, and a costs file
  measured on random weights prices the trained model too) and not the dims ``--batch-size`` /
  ``--input-shape`` fix, so the same model measured at another batch is the same graph.
* ``input_shapes`` (``{name: [dims]}``) and ``batch_size`` (rows per micro-batch: the leading
  dim of the inputs whose declared leading dim is symbolic; null when no input has one).
* ``device`` (``cpu`` / ``cuda:N``, unchanged), ``device_kind`` (``cpu`` / ``cuda``),
  ``device_name`` (the CPU model or GPU name) and ``onnxruntime`` (its version).

:func:`check_costs` turns that into a verdict for ``partition --costs``: another graph is an
error; fewer than :data:`MIN_COVERAGE` of the compute nodes covered, or another batch size,
are one-line warnings; at another batch the measured per-node times are scaled linearly in
batch (``planned / measured``); an old file without these fields is a one-line note that it
cannot be checked. Both take the file read once (:class:`~onnx_partition.cost.annotate.CostsFile`,
from :func:`~onnx_partition.cost.annotate.load_costs`) or its path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from onnx_partition.cost.annotate import CostsLike, NodeCosts, load_costs
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph

__all__ = ["MIN_COVERAGE", "CostsCheck", "batch_size_of", "check_costs", "compute_scale",
           "device_name", "fingerprint", "provenance", "recorded_shapes", "rescale"]

#: A costs file covering fewer of the compute nodes than this is warned about.
MIN_COVERAGE = 0.9


def fingerprint(graph: OpGraph) -> str:
    """``sha256:<hex>`` over the graph's structure (see the module docstring)."""
    protos = graph.protos()
    declared = {v.name: v for v in graph.model.graph.input}
    inputs = []
    for name in graph.inputs:
        ttype = declared[name].type.tensor_type
        dims = ([d.dim_value if d.HasField("dim_value") else "?" for d in ttype.shape.dim]
                if ttype.HasField("shape") else None)
        inputs.append([name, ttype.elem_type, dims])
    nodes = []
    for node in graph.nodes:
        proto = protos[node.key]
        nodes.append([node.key, proto.domain, proto.op_type, list(proto.input),
                      list(proto.output)])
    body = {"inputs": inputs, "outputs": list(graph.outputs), "nodes": nodes}
    text = json.dumps(body, separators=(",", ":"), sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def batch_size_of(graph: OpGraph) -> int | None:
    """Rows per (micro-)batch the graph was fixed at: the leading dim of the inputs whose
    declared leading dim is symbolic (None when none is, or they disagree)."""
    declared = {v.name: v for v in graph.model.graph.input}
    sizes = set()
    for name in graph.inputs:
        ttype = declared[name].type.tensor_type
        dims = ttype.shape.dim if ttype.HasField("shape") else []
        if dims and not dims[0].HasField("dim_value") and graph.input_shapes.get(name):
            sizes.add(int(graph.input_shapes[name][0]))
    return sizes.pop() if len(sizes) == 1 else None


def device_name(device: str) -> str:
    """A readable name of ``device`` (``cpu`` or ``cuda:N``): the CPU model or the GPU name."""
    if device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                return str(torch.cuda.get_device_name(int(device.partition(":")[2] or 0)))
        except (ImportError, RuntimeError, ValueError):
            pass
        return device
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return f"{line.partition(':')[2].strip()} ({os.cpu_count()} cpus)"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


def provenance(graph: OpGraph, device: str) -> dict[str, Any]:
    """The fields ``profile`` records beside the nodes (the module docstring lists them)."""
    return {
        "fingerprint": fingerprint(graph),
        "input_shapes": {k: list(v) for k, v in graph.input_shapes.items()},
        "batch_size": batch_size_of(graph),
        "device_kind": "cuda" if device.startswith("cuda") else "cpu",
        "device_name": device_name(device),
    }


def recorded_shapes(costs: CostsLike) -> dict[str, list[int]] | None:
    """The input shapes a costs file was measured at, or None if it does not say (old file)."""
    costs = load_costs(costs)
    shapes = costs.body.get("input_shapes")
    if not isinstance(shapes, dict):
        return None
    try:
        return {str(k): [int(d) for d in v] for k, v in shapes.items()}
    except (TypeError, ValueError):
        raise PartitionError(f"costs file {costs.path}: input_shapes must map names to "
                             "lists of integers") from None


@dataclass(frozen=True)
class CostsCheck:
    """The verdict on a costs file for one graph."""

    covered: int  # compute nodes the file names
    compute: int  # compute nodes of the graph
    scale: float = 1.0  # factor applied to the measured per-node times
    batch_size: int | None = None  # the batch the file was measured at, if it says
    notes: list[str] = field(default_factory=list)  # one-line warnings / notes

    def to_json(self) -> dict[str, Any]:
        return {"covered_nodes": self.covered, "compute_nodes": self.compute,
                "batch_size": self.batch_size, "scale": self.scale, "notes": list(self.notes)}


def check_costs(costs: CostsLike, graph: OpGraph) -> CostsCheck:
    """Check the costs file ``costs`` (read once, or its path) against ``graph`` (fixed at the
    planned shapes).

    Raises :class:`PartitionError` when its fingerprint names another graph.
    """
    costs = load_costs(costs)
    body, path = costs.body, costs.path
    keys = {graph.nodes[i].key for i in graph.compute_nodes}
    covered = sum(1 for k in costs.nodes if k in keys)
    notes: list[str] = []
    recorded = body.get("fingerprint")
    if isinstance(recorded, str):
        mine = fingerprint(graph)
        if recorded != mine:
            raise PartitionError(f"costs file {path} was measured on another graph (fingerprint "
                                 f"{recorded[:19]} != this model's {mine[:19]}); profile this "
                                 "model")
    else:
        notes.append(f"note: costs file {path} records no model fingerprint or batch size "
                     "(written by an older version); it cannot be checked against this model")
    if keys and covered < MIN_COVERAGE * len(keys):
        notes.append(f"warning: costs file {path} covers {covered} of {len(keys)} compute nodes "
                     f"({covered / len(keys):.0%} < {MIN_COVERAGE:.0%}); the rest are priced "
                     "by the analytic model")
    measured_at = body.get("batch_size")
    measured = measured_at if isinstance(measured_at, int) and measured_at > 0 else None
    planned = batch_size_of(graph)
    scale = 1.0
    if measured is not None and planned is not None and planned != measured:
        scale = planned / measured
        notes.append(f"warning: costs file {path} was measured at batch size {measured}, this "
                     f"plan is for {planned}: measured per-node times scaled by {scale:.4g} "
                     "(linear in batch)")
    shapes = body.get("input_shapes")
    if isinstance(shapes, dict) and _other_dims(shapes, graph.input_shapes):
        notes.append(f"warning: costs file {path} was measured at input shapes "
                     f"{_fmt(shapes)}, this plan is for {_fmt(graph.input_shapes)}; only the "
                     "batch dim is rescaled")
    return CostsCheck(covered, len(keys), scale, measured, notes)


def _other_dims(recorded: Mapping[str, Any], planned: Mapping[str, Sequence[int]]) -> bool:
    """Whether the shapes differ in anything but the leading (batch) dim."""
    for name, dims in planned.items():
        other = recorded.get(name)
        if isinstance(other, list) and [*other[1:]] != [*dims[1:]]:
            return True
    return False


def _fmt(shapes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items())


def rescale(node_costs: NodeCosts, graph: OpGraph, given: Sequence[str],
            scale: float, *, backward: float | None = None) -> NodeCosts:
    """``node_costs`` with the times of the nodes named in ``given`` (a costs file's keys)
    multiplied by ``scale`` (their backward by ``backward`` where given); analytic ones are
    already priced at the planned shapes."""
    backward = scale if backward is None else backward
    if scale == 1.0 and backward == 1.0:
        return node_costs
    names = set(given)
    fwd, bwd = list(node_costs.forward_ms), list(node_costs.backward_ms)
    for node in graph.nodes:
        if node.key in names and not node.free:
            fwd[node.index] *= scale
            bwd[node.index] *= backward
    return replace(node_costs, forward_ms=fwd, backward_ms=bwd)


def compute_scale(costs: CostsLike, processes: int) -> dict[str, Any] | None:
    """How much a train costs file's compute times grow when ``processes`` training processes
    share one CPU machine: the product of its settings' ``side_by_side`` factors (beside a
    second process: :mod:`onnx_partition.cost.profile.side_by_side`) and ``cold_cache`` factors
    (each action starting from caches the other processes replaced while it waited:
    :mod:`onnx_partition.cost.profile.cold_cache`), each where measured, as ``{"forward": x,
    "backward": y, "parts": {name: factors}, "why": ...}``; None (priced
    as measured, alone) for one process, a CUDA file, or a file that measured neither. A factor
    that is not a positive number is a PartitionError."""
    costs = load_costs(costs)
    settings = costs.body.get("settings")
    if processes < 2 or not isinstance(settings, dict) or str(costs.device or "cpu") != "cpu":
        return None
    parts: dict[str, dict[str, float]] = {}
    for name in ("side_by_side", "cold_cache"):
        part = settings.get(name)
        if not isinstance(part, dict) or "skipped" in part:
            continue
        parts[name] = {}
        for key in ("forward", "backward"):
            value = part.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
                    or value == float("inf"):
                raise PartitionError(f"costs file {costs.path}: settings.{name}.{key} must "
                                     f"be a positive number, got {value!r}")
            parts[name][key] = float(value)
    if not parts:
        return None
    factors = {key: math.prod(p[key] for p in parts.values()) for key in ("forward", "backward")}
    what = {"side_by_side": "beside a second process", "cold_cache": "from cold caches"}
    return {**factors, "parts": parts,
            "why": f"{processes} training processes share one CPU machine: the compute times "
                   "the profile measured alone, scaled by what they measured "
                   + " and ".join(what[n] for n in parts) + " (the costs file's "
                   + " and ".join(f"settings.{n}" for n in parts) + ")"}

