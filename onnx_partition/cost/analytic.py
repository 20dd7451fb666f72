"""Analytic per-operator cost: a roofline time estimate from FLOPs and bytes moved.

Time follows the roofline model (Williams, Waterman, Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009): an operator takes
``max(flops / peak, bytes / bandwidth)`` plus a fixed per-operator launch overhead.

The counts come from :mod:`.op_counts` (an ONNX operator's FLOPs, bytes and class) and
:mod:`.aten_backward` (an aten op's backward), both pure, re-exported here; this module holds
the device's roofline parameters (:class:`DeviceSpec`) and the times.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from onnx_partition.cost.aten_backward import AtenOp, aten_backward, aten_class, aten_kernels
from onnx_partition.cost.op_counts import DENSE, OpInfo, Shape, bytes_moved, flops, op_class
from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.simulate import backward_factor as _backward_factor

__all__ = ["DENSE", "AtenOp", "DeviceSpec", "OpInfo", "Shape", "aten_backward",
           "aten_backward_ms", "aten_class", "aten_kernels", "backward_factor", "backward_ms",
           "bytes_moved", "flops", "forward_ms", "op_class"]


@dataclass(frozen=True)
class DeviceSpec:
    """Roofline parameters of one device (GFLOP/s, GB/s with G = 1e9, and ms per operator).

    ``peak_gflops`` is the dense peak of matrix products on 4-byte floats (TF32 or fp32 on a
    GPU, see :mod:`onnx_partition.cost.devices`), ``half_gflops`` that on 2-byte floats,
    ``vector_gflops`` that of every other operator (CUDA cores); 0 means ``peak_gflops``.
    ``efficiency`` maps an operator class (:func:`op_class`) to the achievable fractions
    ``(of peak FLOP/s, of bandwidth)``; a class not listed gets ``(1, 1)``.
    """

    name: str
    peak_gflops: float
    mem_gbps: float
    launch_overhead_ms: float
    half_gflops: float = 0.0
    vector_gflops: float = 0.0
    efficiency: Mapping[str, tuple[float, float]] = field(default_factory=dict, hash=False)
    memory_gb: float = math.inf
    kind: str = "cpu"
    source: str = field(default="", compare=False)  # where the figures came from (summary)

    def __post_init__(self) -> None:
        if not (self.peak_gflops > 0 and self.mem_gbps > 0 and self.launch_overhead_ms >= 0):
            raise PartitionError(
                f"device {self.name!r}: need peak_gflops > 0, mem_gbps > 0 "
                f"and launch_overhead_ms >= 0, got {self}"
            )

    @classmethod
    def cpu(cls) -> DeviceSpec:
        """One modern x86 core running onnxruntime (assumed, not measured).

        Peak: AVX2 with 2 FMA ports at ~3 GHz is 2*8*2*3 = 96 GFLOP/s fp32; MLAS sgemm
        sustains roughly half, so 50. Bandwidth: single-core STREAM is typically 10-20 GB/s;
        10 is the conservative end. Overhead: onnxruntime's per-node dispatch is a few us.
        """
        return cls("cpu", peak_gflops=50.0, mem_gbps=10.0, launch_overhead_ms=0.005)

    @classmethod
    def gpu_h100(cls) -> DeviceSpec:
        """NVIDIA H100 SXM5 from the datasheet, derated to sustained values.

        Datasheet: 494.7 TFLOP/s dense TF32 tensor core (989 fp16/bf16), 3.35 TB/s HBM3.
        Assumed sustained: 60% of TF32 (fp32 models) = ~300 TFLOP/s; 90% of HBM = ~3000 GB/s.
        Overhead: ~5 us CUDA launch + onnxruntime CUDA EP dispatch, so 0.01 ms.
        """
        return cls("gpu_h100", peak_gflops=300_000.0, mem_gbps=3000.0, launch_overhead_ms=0.01)


def _peak_gflops(op: OpInfo, device: DeviceSpec, kind: str) -> float:
    if kind not in ("dense", "attention"):
        return device.vector_gflops or device.peak_gflops
    if device.half_gflops and any(s == 2 for s in op.input_itemsizes[:2]):
        return device.half_gflops
    return device.peak_gflops


def _roofline_ms(op: OpInfo, device: DeviceSpec) -> float:
    # GFLOP/s * 1e6 = FLOP/ms; GB/s * 1e6 = B/ms.
    kind = op_class(op.op_type)
    compute_eff, memory_eff = device.efficiency.get(kind, (1.0, 1.0))
    return max(flops(op) / (_peak_gflops(op, device, kind) * compute_eff * 1e6),
               bytes_moved(op) / (device.mem_gbps * memory_eff * 1e6))


def forward_ms(op: OpInfo, device: DeviceSpec) -> float:
    """``launch_overhead + max(flops / (peak x eff_c), bytes / (bandwidth x eff_m))`` (roofline,
    Williams 2009), with the efficiencies of the operator's class (:func:`op_class`)."""
    return device.launch_overhead_ms + _roofline_ms(op, device)


def backward_ms(op: OpInfo, device: DeviceSpec) -> float:
    """Training backward: one launch overhead plus k times the forward roofline term.

    k = 2 for MatMul/Gemm/Conv/ConvTranspose/Einsum/attention (gradients w.r.t. both the
    input and the weight, each as costly as the forward), k = 1 for everything else
    (element-wise, normalization, data movement: one gradient of the same size).
    """
    return device.launch_overhead_ms + backward_factor(op.op_type) * _roofline_ms(op, device)


def backward_factor(op_type: str | None = None) -> float:
    """Backward time over forward time: the pipeline model's one rule
    (:func:`onnx_partition.pipeline.simulate.backward_factor`) for this operator class: 2 for
    the :data:`DENSE` operators, 1 for other operators, 2 for ``None`` (class not known)."""
    return _backward_factor(None if op_type is None else op_type in DENSE)


def aten_backward_ms(op: AtenOp, device: DeviceSpec) -> float:
    """Roofline time of one op's backward (:func:`aten_backward`) on ``device``: a launch
    overhead per kernel (:func:`aten_kernels`) plus ``max(flops / (peak x eff_c), bytes /
    (bandwidth x eff_m))``; 0 when it has no backward work."""
    flops_, bytes_ = aten_backward(op)
    if flops_ <= 0 and bytes_ <= 0:
        return 0.0
    kind = aten_class(op.name)
    compute_eff, memory_eff = device.efficiency.get(kind, (1.0, 1.0))
    if kind in ("dense", "attention"):
        half = device.half_gflops and any(s == 2 for s in op.itemsizes[:3])
        peak = device.half_gflops if half else device.peak_gflops
    else:
        peak = device.vector_gflops or device.peak_gflops
    return aten_kernels(op) * device.launch_overhead_ms + max(
        flops_ / (peak * compute_eff * 1e6), bytes_ / (device.mem_gbps * memory_eff * 1e6))
