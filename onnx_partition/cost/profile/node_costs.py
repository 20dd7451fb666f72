"""The signature cost model: raw signature times -> calibrated per-node forward/backward ms.

A node's weight is its event time minus the profiler's time per event, plus what a tiny node
really costs unprofiled (see :mod:`.cpu`); a constant-folded node weighs 0, and a node with no
measurement gets its analytic (roofline) cost. The weights are then scaled to sum to the median
*unprofiled* whole-model time. Backward is forward times the op type's ratio (default
:func:`analytic.backward_factor`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from onnx_partition.cost.analytic import DeviceSpec, backward_factor
from onnx_partition.cost.analytic import forward_ms as analytic_forward_ms
from onnx_partition.cost.annotate import op_infos
from onnx_partition.cost.profile.cpu import FOLDED
from onnx_partition.graph import OpGraph

__all__ = ["Calibrated", "SignatureTimes", "calibrate"]


@dataclass(frozen=True)
class SignatureTimes:
    """What the measuring phase found: raw ms per signature digest, and the calibration terms."""

    raw_ms: dict[str, float]  # signature digest -> raw ms (FOLDED when constant-folded)
    measured_nodes: set[int]  # the node measured for each signature measured by this call
    event_overhead_ms: float  # the profiler's own time per event
    node_overhead_ms: float  # what a tiny node really costs unprofiled
    whole_ms: float  # median unprofiled whole-model time
    whole_cached: bool


@dataclass(frozen=True)
class Calibrated:
    """Per-node costs (node key -> ms) and the figures of their calibration."""

    forward_ms: dict[str, float]
    backward_ms: dict[str, float]
    raw_sum_ms: float  # sum of the raw per-node times before calibration
    weights_sum_ms: float
    scale: float
    analytic_nodes: int  # nodes weighed by the roofline model (no measurement)
    reused: int  # nodes served by another node's measurement or by the cache


def calibrate(graph: OpGraph, sigs: Mapping[int, tuple[str, bool]], times: SignatureTimes,
              spec: DeviceSpec, ratios: Mapping[str, float]) -> Calibrated:
    """Weigh every compute node of ``graph`` (its signature's time, else analytic under
    ``spec``), scale the weights to ``times.whole_ms``, and derive backward times."""
    infos = op_infos(graph)
    weight: dict[str, float] = {}
    raw_sum = 0.0
    analytic = reused = 0
    for index, (digest, _) in sigs.items():
        key = graph.nodes[index].key
        if digest in times.raw_ms:
            raw = times.raw_ms[digest]
            raw_sum += max(raw, 0.0)
            weight[key] = (0.0 if raw == FOLDED
                           else max(raw - times.event_overhead_ms, 0.0)
                           + times.node_overhead_ms)
            reused += index not in times.measured_nodes
        else:
            weight[key] = analytic_forward_ms(infos[index], spec)
            raw_sum += weight[key]
            analytic += 1
    total = sum(weight.values())
    scale = times.whole_ms / total if total > 0 else 1.0
    forward = {k: v * scale for k, v in weight.items()}
    op_type = {n.key: n.op_type for n in graph.nodes}
    backward = {k: v * ratios.get(op_type[k], backward_factor(op_type[k]))
                for k, v in forward.items()}
    return Calibrated(forward, backward, raw_sum, total, scale, analytic, reused)
