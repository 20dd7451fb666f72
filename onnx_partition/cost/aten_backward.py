"""FLOPs, bytes moved and kernels of one aten op's backward, by rule per op family.

Pure, as :mod:`.op_counts`: plain shapes and item sizes (:class:`AtenOp`), never a torch object;
odd input counts 0. :func:`~onnx_partition.cost.analytic.aten_backward_ms` prices the counts on a
device (the roofline).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from onnx_partition.cost.counting import TRANSCENDENTAL_FLOPS as _T
from onnx_partition.cost.counting import Shape
from onnx_partition.cost.counting import known_shape as _at
from onnx_partition.cost.counting import numel as _numel

__all__ = ["AtenOp", "aten_backward", "aten_class", "aten_kernels"]


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
