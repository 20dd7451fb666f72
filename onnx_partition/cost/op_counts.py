"""FLOPs and bytes moved of one ONNX operator, and its class (for a device's efficiencies).

The module is pure: it sees plain shapes, item sizes and decoded attributes (``OpInfo``),
never ONNX protos, and never raises on odd input; unknown shapes count as 0 elements.
Counting conventions: a multiply-add is 2 FLOPs; cheap element-wise math is 1 FLOP per
element; transcendentals (exp, log, tanh, erf, sqrt, pow, ...) are ``_T`` = 4 FLOPs.
:mod:`.analytic` turns the counts into time (the roofline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

from onnx_partition.cost.counting import TRANSCENDENTAL_FLOPS as _T
from onnx_partition.cost.counting import Shape
from onnx_partition.cost.counting import known_shape as _at
from onnx_partition.cost.counting import numel as _numel

__all__ = ["DENSE", "OpInfo", "Shape", "bytes_moved", "flops", "op_class"]


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
