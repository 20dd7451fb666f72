"""Analytic per-operator cost: FLOPs, bytes moved, and a roofline time estimate.

Time follows the roofline model (Williams, Waterman, Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009): an operator takes
``max(flops / peak, bytes / bandwidth)`` plus a fixed per-operator launch overhead.

The module is pure: it sees plain shapes, item sizes and decoded attributes (``OpInfo``),
never ONNX protos, and never raises on odd input; unknown shapes count as 0 elements.
Counting conventions: a multiply-add is 2 FLOPs; cheap element-wise math is 1 FLOP per
element; transcendentals (exp, log, tanh, erf, sqrt, pow, ...) are ``_T`` = 4 FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.simulate import backward_factor as _backward_factor

__all__ = ["DENSE", "AtenOp", "DeviceSpec", "OpInfo", "Shape", "aten_backward",
           "aten_backward_ms", "aten_class", "aten_kernels", "backward_factor", "backward_ms",
           "bytes_moved", "flops", "forward_ms", "op_class"]

Shape = tuple[int, ...]

_T = 4.0  # FLOPs charged per transcendental function evaluation


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


@dataclass(frozen=True)
class OpInfo:
    """One node as plain data. Unknown / missing-optional tensors have shape None, size 0."""

    op_type: str
    attrs: Mapping[str, object]
    input_shapes: Sequence[Shape | None]
    output_shapes: Sequence[Shape | None]
    input_itemsizes: Sequence[int]
    output_itemsizes: Sequence[int]


# --- op tables -------------------------------------------------------------------------------

# fmt: off
# Views and metadata: no math, no bytes (the output aliases the input or is tiny).
_VIEW = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size",
                   "Constant"})
# Pure data movement: no math, bytes = inputs + outputs.
_MOVE = frozenset({
    "Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "Expand",
    "Cast", "CastLike", "Tile", "Pad", "DepthToSpace", "SpaceToDepth", "ScatterND",
    "ScatterElements", "Scatter", "ConstantOfShape", "Range", "NonZero", "OneHot", "Trilu",
    "ReverseSequence", "Compress", "Dropout", "EyeLike"})
# Of those, ops that read from input 0 only what they output (not all of it).
_PARTIAL_READ = frozenset({"Gather", "GatherElements", "GatherND", "Slice"})
# Element-wise: FLOPs per output element.
_CHEAP = (
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Where", "Max", "Min", "Sum", "Mean",
    "Mod", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor",
    "Not", "Floor", "Ceil", "Round", "Sign", "Reciprocal", "BitShift", "BitwiseAnd",
    "BitwiseOr", "BitwiseXor", "BitwiseNot", "IsNaN", "IsInf")
_TRANSCENDENTAL = ("Exp", "Log", "Tanh", "Sqrt", "Pow", "Erf", "Sin", "Cos", "Tan", "Asin",
                   "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")
_PER_OUTPUT: dict[str, float] = {
    **dict.fromkeys(_CHEAP, 1.0), **dict.fromkeys(_TRANSCENDENTAL, _T),
    "LeakyRelu": 2.0, "PRelu": 2.0, "Clip": 2.0, "ThresholdedRelu": 2.0, "Shrink": 3.0,
    "HardSigmoid": 3.0, "HardSwish": 4.0, "Sigmoid": _T + 2, "Elu": _T + 2, "Selu": _T + 3,
    "Celu": _T + 3, "Softsign": 3.0, "Softplus": 2 * _T + 1, "Mish": 3 * _T + 2,
    "Gelu": _T + 4, "FastGelu": _T + 7, "BiasGelu": _T + 5, "QuickGelu": _T + 4,
    "Swish": _T + 3, "QuantizeLinear": 3.0, "DequantizeLinear": 2.0}
_VARIADIC = frozenset({"Sum", "Max", "Min", "Mean"})  # (n_inputs - 1) ops per element
# Per element of input 0: normalizations, softmax, reductions, global pooling.
_REDUCE = (
    "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "TopK", "CumSum",
    "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
_PER_INPUT: dict[str, float] = {
    **dict.fromkeys(_REDUCE, 1.0),
    "BatchNormalization": 4.0,  # (x - mean) * inv_std * scale + bias
    "LayerNormalization": 8.0,  # mean 1, variance 3, normalize 2, affine 2
    "InstanceNormalization": 8.0, "GroupNormalization": 8.0, "MeanVarianceNormalization": 7.0,
    "SkipLayerNormalization": 9.0, "SimplifiedLayerNormalization": 5.0,
    "RMSNormalization": 5.0, "LpNormalization": 3.0, "LRN": 6.0,
    "Softmax": _T + 4, "LogSoftmax": _T + 4, "Hardmax": 1.0}  # max, sub, exp, sum, div
# Backward computes gradients w.r.t. input and weight: 2x the forward work.
DENSE = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "Attention", "MultiHeadAttention",
    "GroupQueryAttention", "MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv"})
# fmt: on


# --- helpers ---------------------------------------------------------------------------------


def _at(shapes: Sequence[Shape | None], i: int) -> Shape | None:
    """Shape i as plain ints, or None if absent, unknown, or holding a negative/symbolic dim."""
    s = shapes[i] if 0 <= i < len(shapes) else None
    if s is None or not all(isinstance(d, Integral) and d >= 0 for d in s):
        return None
    return tuple(int(d) for d in s)


def _numel(shape: Shape | None) -> int:
    return math.prod(shape) if shape is not None else 0


def _ints(attrs: Mapping[str, object], key: str, default: list[int]) -> list[int]:
    v = attrs.get(key)
    if isinstance(v, list | tuple) and (not default or len(v) == len(default)):
        return [int(x) for x in v] if all(isinstance(x, Integral) for x in v) else default
    return default


def _int(attrs: Mapping[str, object], key: str, default: int) -> int:
    v = attrs.get(key)
    return int(v) if isinstance(v, Integral) else default


def _str(attrs: Mapping[str, object], key: str, default: str) -> str:
    v = attrs.get(key)
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return v if isinstance(v, str) else default


def _broadcast(x: Shape, y: Shape) -> Shape | None:
    n = max(len(x), len(y))
    x, y = (1,) * (n - len(x)) + x, (1,) * (n - len(y)) + y
    if any(p != q and 1 not in (p, q) for p, q in zip(x, y, strict=True)):
        return None
    return tuple(p if q == 1 else q for p, q in zip(x, y, strict=True))


def _window_out(spatial: Shape, kernel: Sequence[int], attrs: Mapping[str, object]) -> Shape:
    """Output spatial dims of a conv / pool window (ONNX Conv and MaxPool formulas)."""
    n = len(spatial)
    if len(kernel) != n:
        return ()
    strides, dil = _ints(attrs, "strides", [1] * n), _ints(attrs, "dilations", [1] * n)
    pads, auto = _ints(attrs, "pads", [0] * 2 * n), _str(attrs, "auto_pad", "NOTSET")
    rnd = math.ceil if _int(attrs, "ceil_mode", 0) else math.floor
    out = []
    for i in range(n):
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-spatial[i] // strides[i])
        else:
            pad = 0 if auto == "VALID" else pads[i] + pads[i + n]
            o = rnd((spatial[i] + pad - dil[i] * (kernel[i] - 1) - 1) / strides[i]) + 1
        out.append(max(o, 0))
    return tuple(out)


# --- FLOPs of the special ops ----------------------------------------------------------------


def _matmul(op: OpInfo) -> float:
    a = _at(op.input_shapes, 0)
    b = _at(op.input_shapes, 3 if op.op_type == "QLinearMatMul" else 1)
    if not a or not b:
        return 0.0
    m, k, n = (a[-2] if len(a) > 1 else 1), a[-1], (b[-1] if len(b) > 1 else 1)
    batch = _broadcast(a[:-2], b[:-2])
    if batch is None:  # not broadcastable: trust the output shape instead
        return 2.0 * _numel(_at(op.output_shapes, 0)) * k
    return 2.0 * math.prod(batch) * m * n * k


def _gemm(op: OpInfo) -> float:
    a, b = _at(op.input_shapes, 0), _at(op.input_shapes, 1)
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return 0.0
    m, k = (a[1], a[0]) if _int(op.attrs, "transA", 0) else a
    n = b[0] if _int(op.attrs, "transB", 0) else b[1]
    bias = m * n if _at(op.input_shapes, 2) is not None else 0  # beta * C
    return 2.0 * m * n * k + bias


def _conv(op: OpInfo) -> float:
    """2 * out_elems * (Cin / groups) * prod(kernel); bias adds are ignored."""
    q = op.op_type == "QLinearConv"
    x, w = _at(op.input_shapes, 0), _at(op.input_shapes, 3 if q else 1)
    if w is None or len(w) < 2:
        return 0.0
    out = _numel(_at(op.output_shapes, 0))
    if not out and x is not None and len(x) >= 2:
        out = x[0] * w[0] * math.prod(_window_out(x[2:], w[2:], op.attrs) or (0,))
    return 2.0 * out * w[1] * math.prod(w[2:])


def _conv_transpose(op: OpInfo) -> float:
    """Each input element scatters into (Cout / groups) * prod(kernel) outputs."""
    x, w = _at(op.input_shapes, 0), _at(op.input_shapes, 1)
    if x is None or w is None or len(w) < 2:
        return 0.0
    return 2.0 * _numel(x) * w[1] * math.prod(w[2:])


def _pool(op: OpInfo) -> float:
    kernel = _ints(op.attrs, "kernel_shape", [])
    out = _numel(_at(op.output_shapes, 0))
    x = _at(op.input_shapes, 0)
    if not out and x is not None and len(x) >= 2:
        out = x[0] * x[1] * math.prod(_window_out(x[2:], kernel, op.attrs) or (0,))
    return float(out * math.prod(kernel))


def _attention(op: OpInfo) -> float:
    """QK^T + softmax + PV; com.microsoft Attention (2-D weight) adds the QKV projection."""
    q, k = _at(op.input_shapes, 0), _at(op.input_shapes, 1)
    if not q or len(q) < 3:
        return 0.0
    heads = _int(op.attrs, "q_num_heads", _int(op.attrs, "num_heads", 1))
    if k is not None and len(k) == 2:  # fused com.microsoft Attention: x [B,S,H], w [H,3H]
        rows, seq = _numel(q) // max(q[-1], 1), q[1]
        qk_v = 2.0 * rows * seq * (2 * k[1] / 3)
        return 2.0 * _numel(q) * k[1] + qk_v + (_T + 4) * rows * heads * seq
    seq_q = q[2] if len(q) == 4 else q[1]
    seq_kv = k[2] if k is not None and len(k) == 4 else k[1] if k and len(k) == 3 else seq_q
    scores = _numel(q) // max(q[-1], 1) * (1 if len(q) == 4 else heads) * seq_kv
    out = _numel(_at(op.output_shapes, 0)) or _numel(q)
    return 2.0 * _numel(q) * seq_kv + 2.0 * out * seq_kv + (_T + 4) * scores


def _einsum(op: OpInfo) -> float:
    """2 * prod(all index extents) for contractions; no ellipsis support (gives 0)."""
    terms = _str(op.attrs, "equation", "").replace(" ", "").split("->")[0].split(",")
    dims: dict[str, int] = {}
    for i, term in enumerate(terms):
        s = _at(op.input_shapes, i)
        if s is None or "." in term or len(term) != len(s):
            return 0.0
        for c, d in zip(term, s, strict=True):
            dims[c] = max(dims.get(c, 1), d)
    return (2.0 if len(terms) > 1 else 1.0) * math.prod(dims.values())


# fmt: off
_SPECIAL: dict[str, Callable[[OpInfo], float]] = {
    "MatMul": _matmul, "MatMulInteger": _matmul, "QLinearMatMul": _matmul, "Gemm": _gemm,
    "Conv": _conv, "ConvInteger": _conv, "QLinearConv": _conv,
    "ConvTranspose": _conv_transpose, "MaxPool": _pool, "AveragePool": _pool, "LpPool": _pool,
    "Attention": _attention, "MultiHeadAttention": _attention,
    "GroupQueryAttention": _attention, "Einsum": _einsum}
# fmt: on


# --- public API ------------------------------------------------------------------------------


def _flops(op: OpInfo) -> float:
    t = op.op_type
    if t in _SPECIAL:
        return _SPECIAL[t](op)
    if t in _VIEW or t in _MOVE:
        return 0.0
    ins = [_numel(_at(op.input_shapes, i)) for i in range(len(op.input_shapes))]
    if t in _PER_OUTPUT:
        out = _numel(_at(op.output_shapes, 0)) or max(ins, default=0)
        present = sum(s is not None for s in op.input_shapes)
        return _PER_OUTPUT[t] * out * (max(present - 1, 1) if t in _VARIADIC else 1)
    if t in _PER_INPUT:
        return _PER_INPUT[t] * (ins[0] if ins and ins[0] else _numel(_at(op.output_shapes, 0)))
    return float(sum(_numel(_at(op.output_shapes, i)) for i in range(len(op.output_shapes))))


def flops(op: OpInfo) -> float:
    """Floating-point operations of one forward execution (unknown op: 1 per output element)."""
    try:
        return max(float(_flops(op)), 0.0)
    except (ArithmeticError, LookupError, TypeError, ValueError):
        return 0.0


def _tensor_bytes(shapes: Sequence[Shape | None], sizes: Sequence[int]) -> list[float]:
    sizes = list(sizes) + [0] * max(len(shapes) - len(sizes), 0)
    return [float(_numel(_at(shapes, i)) * sizes[i]) for i in range(len(shapes))]


def bytes_moved(op: OpInfo) -> float:
    """Bytes read plus written: all inputs (weights included) and outputs.

    Views/metadata (Reshape, Squeeze, Shape, ...) move 0. Gather-like ops and Slice read only
    what they output from input 0, so they count indices + 2 * output bytes.
    """
    if op.op_type in _VIEW:
        return 0.0
    try:
        ins = _tensor_bytes(op.input_shapes, op.input_itemsizes)
        out = sum(_tensor_bytes(op.output_shapes, op.output_itemsizes))
        if op.op_type in _PARTIAL_READ:
            return sum(ins[1:]) + 2.0 * out
        return sum(ins) + out
    except (ArithmeticError, LookupError, TypeError, ValueError):
        return 0.0


_ATTENTION = frozenset({"Attention", "MultiHeadAttention", "GroupQueryAttention"})


def op_class(op_type: str) -> str:
    """``dense`` (matrix products, convolutions), ``attention`` (fused attention ops), ``norm``
    (normalisations, softmax, reductions, pooling), ``elementwise``, ``move`` (data movement)
    or ``view`` (free: reshapes and metadata)."""
    if op_type in _ATTENTION:
        return "attention"
    if op_type in DENSE:
        return "dense"
    if op_type in _VIEW:
        return "view"
    if op_type in _MOVE:
        return "move"
    if op_type in _PER_INPUT or op_type in _SPECIAL:
        return "norm"
    return "elementwise"


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


# --- training backward per aten op -----------------------------------------------------------


@dataclass(frozen=True)
class AtenOp:
    """One op of an exported torch program as plain data, for its backward's cost.

    ``name`` is the aten overload packet (``mm``, ``linear``, ``native_layer_norm``...); the
    argument lists follow the op's schema by position: ``inputs[i]`` is argument i's shape
    (None where it is no tensor), ``itemsizes[i]`` its bytes per element, ``needs_grad[i]``
    whether autograd wants its gradient; ``outputs`` likewise (a gradient flows into output 0).
    """

    name: str
    inputs: Sequence[Shape | None]
    itemsizes: Sequence[int]
    needs_grad: Sequence[bool]
    outputs: Sequence[Shape | None]
    out_itemsizes: Sequence[int]


# fmt: off
_MATMULS = frozenset({"mm", "bmm", "matmul", "linear", "addmm", "baddbmm", "addbmm"})
_CONVS = frozenset({"convolution", "conv1d", "conv2d", "conv3d", "_convolution"})
_SDPA = frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                   "_scaled_dot_product_efficient_attention",
                   "_scaled_dot_product_flash_attention_for_cpu"})
_SOFTMAX = {"softmax": 4.0, "_softmax": 4.0, "log_softmax": _T + 3, "_log_softmax": _T + 3}
_LAYER_NORM = frozenset({"layer_norm", "native_layer_norm"})
_EMBEDDING = frozenset({"embedding"})
# backward is a view of the gradient (or nothing): free
_FREE_BACKWARD = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "t", "unsqueeze", "squeeze",
    "alias", "detach", "flatten", "unflatten", "split", "split_with_sizes", "chunk", "unbind",
    "clone", "contiguous", "_to_copy", "to", "lift_fresh_copy", "view_as", "expand_as"})
# backward writes zeros of the input and copies the gradient into its part
_SCATTER_BACKWARD = frozenset({"slice", "select", "narrow", "index", "index_select",
                               "gather"})
# per element of output 0: backward FLOPs for each input that needs a gradient
_ELEMENTWISE_BACKWARD: dict[str, float] = {
    "add": 0.0, "sub": 1.0, "rsub": 1.0, "mul": 1.0, "div": 3.0, "neg": 1.0, "relu": 1.0,
    "gelu": _T + 8, "tanh": 3.0, "sigmoid": 3.0, "silu": _T + 6, "exp": 1.0, "log": 1.0,
    "sqrt": 2.0, "rsqrt": 3.0, "pow": _T + 2, "dropout": 2.0, "native_dropout": 2.0,
    "where": 1.0, "masked_fill": 1.0, "abs": 1.0, "erf": _T + 2, "sin": _T + 1,
    "cos": _T + 1, "square": 2.0, "hardtanh": 1.0, "leaky_relu": 2.0, "mean": 1.0,
    "sum": 0.0, "expand": 1.0}
# which inputs' saved values the gradient reads (others: the gradient alone)
_READS_NOTHING_SAVED = frozenset({"add", "sub", "rsub", "neg", "sum", "mean", "expand"})
# fmt: on


def _nbytes(shape: Shape | None, itemsize: int) -> float:
    return float(_numel(_at([shape], 0)) * itemsize) if shape is not None else 0.0


def _arg(op: AtenOp, i: int) -> tuple[Shape | None, int, bool]:
    """(shape, itemsize, needs gradient) of argument i (None, 0, False if absent)."""
    if i >= len(op.inputs):
        return None, 0, False
    shape = _at(op.inputs, i)
    size = op.itemsizes[i] if i < len(op.itemsizes) else 0
    grad = bool(op.needs_grad[i]) if i < len(op.needs_grad) else False
    return shape, size, grad and shape is not None


def _matmul_backward(op: AtenOp, gout: float, out: int) -> tuple[float, float]:
    """dA = dY B^T and dB = A^T dY (each the forward's 2·out·K FLOPs; each reads dY and the
    other operand and writes its gradient), a bias's gradient the sum of dY over rows."""
    a, b, bias = (1, 2, 0) if op.name in ("addmm", "baddbmm", "addbmm") else (0, 1, 2)
    (sa, za, ga), (sb, zb, gb) = _arg(op, a), _arg(op, b)
    sc, zc, gc = _arg(op, bias) if op.name != "mm" and op.name != "bmm" else (None, 0, False)
    if sa is None or sb is None:
        return 0.0, 0.0
    k = sa[-1] if sa else 1
    dense = 2.0 * out * k
    return _operand_gradients(dense, gout, out, (_nbytes(sa, za), ga), (_nbytes(sb, zb), gb),
                              (_nbytes(sc, zc), gc))


def _conv_backward(op: AtenOp, gout: float, out: int) -> tuple[float, float]:
    """Gradient of input and weight: each the forward's FLOPs (2·out·Cin/groups·prod(kernel)),
    reading dY and the other operand; the bias's the sum of dY."""
    (sx, zx, gx), (sw, zw, gw), (sb, zb, gb) = _arg(op, 0), _arg(op, 1), _arg(op, 2)
    if sx is None or sw is None or len(sw) < 2:
        return 0.0, 0.0
    dense = 2.0 * out * sw[1] * math.prod(sw[2:])
    return _operand_gradients(dense, gout, out, (_nbytes(sx, zx), gx), (_nbytes(sw, zw), gw),
                              (_nbytes(sb, zb), gb))


def _operand_gradients(dense: float, gout: float, out: int, a: tuple[float, bool],
                       b: tuple[float, bool], bias: tuple[float, bool]) -> tuple[float, float]:
    """A two-operand product's backward (matmul, convolution): each operand that needs a
    gradient costs the forward's ``dense`` FLOPs reading dY and both operands (``(bytes,
    needs_grad)``); the bias's is the sum of dY (``out`` FLOPs, dY and the bias read)."""
    flops = bytes_ = 0.0
    for _, needs in (a, b):
        if needs:
            flops, bytes_ = flops + dense, bytes_ + gout + a[0] + b[0]
    if bias[1]:
        flops, bytes_ = flops + out, bytes_ + gout + bias[0]
    return flops, bytes_


def _sdpa_backward(op: AtenOp, gout: float) -> tuple[float, float]:
    """FlashAttention-2's backward (Dao, 2023): S = QK^T recomputed, dV = P^T dO,
    dP = dO V^T, dQ = dS K, dK = dS^T Q (five products of 2·B·H·L·S·E) and softmax's gradient
    (4 per score); reads Q, K, V, O and dO, writes dQ, dK, dV."""
    (sq, zq, gq), (sk, zk, gk), (sv, zv, gv) = _arg(op, 0), _arg(op, 1), _arg(op, 2)
    if sq is None or sk is None or sv is None or len(sq) < 2 or not (gq or gk or gv):
        return 0.0, 0.0
    scores = _numel(sq) // max(sq[-1], 1) * sk[-2]
    flops = 2.0 * scores * (3 * sq[-1] + 2 * sv[-1]) + 4.0 * scores
    qkv = _nbytes(sq, zq) + _nbytes(sk, zk) + _nbytes(sv, zv)
    return flops, 2 * qkv + 2 * gout


def _layer_norm_backward(op: AtenOp, gout: float) -> tuple[float, float]:
    """dX = rstd (g w - mean(g w) - x̂ mean(g w x̂)) with x̂ recomputed from x, mean, rstd:
    8 FLOPs per element, reading x and dY and writing dX; dW = sum(dY x̂) and dB = sum(dY):
    3 per element, reading x and dY again and writing dW, dB; the row statistics (fp32 mean
    and rstd) read once."""
    (sx, zx, gx), (sw, zw, gw), (sb, zb, gb) = _arg(op, 0), _arg(op, 2), _arg(op, 3)
    if sx is None:
        return 0.0, 0.0
    n = _numel(sx)
    bx = _nbytes(sx, zx)
    width = _numel(sw) if sw is not None else (sx[-1] if sx else 1)
    rows = n // max(width, 1)
    flops = bytes_ = 0.0
    if gx:
        flops, bytes_ = flops + 8.0 * n, bytes_ + 2 * bx + gout + _nbytes(sw, zw)
    if gw or gb:
        flops += 3.0 * n
        bytes_ += bx + gout + (_nbytes(sw, zw) if gw else 0.0) + (_nbytes(sb, zb) if gb else 0.0)
    if flops:
        bytes_ += 2.0 * rows * 4
    return flops, bytes_


def _embedding_backward(op: AtenOp, gout: float, out: int) -> tuple[float, float]:
    """A scatter-add of dY's rows into a zeroed table gradient: writes the whole table once
    (zeros), reads the indices and dY, and reads and writes each row it adds to."""
    (sw, zw, gw), (si, zi, _) = _arg(op, 0), _arg(op, 1)
    if sw is None or not gw:
        return 0.0, 0.0
    return float(out), _nbytes(sw, zw) + _nbytes(si, zi) + 3 * gout


def _elementwise_backward(op: AtenOp, gout: float, out: int) -> tuple[float, float]:
    """Per input that needs a gradient: ``_ELEMENTWISE_BACKWARD`` FLOPs per output element,
    its gradient written; dY read once and, unless the gradient needs none, every saved tensor
    input read once (an op not listed: 1 FLOP per element, all its inputs read)."""
    args = [_arg(op, i) for i in range(len(op.inputs))]
    wanted = [(s, z) for s, z, g in args if g]
    if not wanted:
        return 0.0, 0.0
    per = _ELEMENTWISE_BACKWARD.get(op.name, 1.0)
    flops = per * out * len(wanted)
    saved = 0.0 if op.name in _READS_NOTHING_SAVED else sum(
        _nbytes(s, z) for s, z, _ in args if s is not None)
    return flops, gout + saved + sum(_nbytes(s, z) for s, z in wanted)


def aten_backward(op: AtenOp) -> tuple[float, float]:
    """(FLOPs, bytes moved) of one op's backward: the rules of the helpers above (matrix
    products, convolutions, attention, softmax, layer norm, embedding, element-wise; views
    free; slices and gathers a zeroed input gradient and a copy). 0 when no input needs a
    gradient."""
    try:
        if op.name in _FREE_BACKWARD or not any(
                _arg(op, i)[2] for i in range(len(op.inputs))):
            return 0.0, 0.0
        out_shape = _at(op.outputs, 0)
        out = _numel(out_shape)
        gout = _nbytes(out_shape, op.out_itemsizes[0] if op.out_itemsizes else 0)
        if op.name in _MATMULS:
            return _matmul_backward(op, gout, out)
        if op.name in _CONVS:
            return _conv_backward(op, gout, out)
        if op.name in _SDPA:
            return _sdpa_backward(op, gout)
        if op.name in _SOFTMAX:
            return _SOFTMAX[op.name] * out, 3 * gout
        if op.name in _LAYER_NORM:
            return _layer_norm_backward(op, gout)
        if op.name in _EMBEDDING:
            return _embedding_backward(op, gout, out)
        if op.name in _SCATTER_BACKWARD:
            s, z, _ = _arg(op, 0)
            return 0.0, _nbytes(s, z) + 2 * gout
        return _elementwise_backward(op, gout, out)
    except (ArithmeticError, LookupError, TypeError, ValueError):
        return 0.0, 0.0


def aten_class(name: str) -> str:
    """The :func:`op_class` of an aten op's backward (for the device's efficiencies)."""
    if name in _MATMULS or name in _CONVS:
        return "dense"
    if name in _SDPA:
        return "attention"
    if name in _SOFTMAX or name in _LAYER_NORM:
        return "norm"
    if name in _FREE_BACKWARD:
        return "view"
    if name in _EMBEDDING or name in _SCATTER_BACKWARD:
        return "move"
    return "elementwise"


def aten_kernels(op: AtenOp) -> int:
    """Kernels one op's backward launches: a matrix product or convolution one per gradient it
    computes (input, weight, bias), layer norm two (dX; dW and dB together) when its weights
    need gradients, any other op one."""
    grads = sum(1 for i in range(len(op.inputs)) if _arg(op, i)[2])
    if op.name in _MATMULS or op.name in _CONVS:
        return max(grads, 1)
    if op.name in _LAYER_NORM:
        return 1 + (_arg(op, 0)[2] and (_arg(op, 2)[2] or _arg(op, 3)[2]))
    return 1


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
