"""Tests for the analytic (roofline) cost model: exact FLOP / byte counts on tiny inputs."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

from onnx_partition.cost.analytic import (
    DeviceSpec,
    OpInfo,
    Shape,
    backward_ms,
    bytes_moved,
    flops,
    forward_ms,
)
from onnx_partition.errors import PartitionError

Shapes = Sequence[Shape | None]


def op(
    op_type: str,
    ins: Shapes,
    outs: Shapes,
    attrs: Mapping[str, object] | None = None,
    itemsize: int = 4,
) -> OpInfo:
    return OpInfo(op_type, attrs or {}, ins, outs, [itemsize] * len(ins), [itemsize] * len(outs))


SLOW = DeviceSpec("slow", peak_gflops=1.0, mem_gbps=1.0, launch_overhead_ms=0.5)


# --- matmul family --------------------------------------------------------------------------


def test_matmul_batched() -> None:
    assert flops(op("MatMul", [(2, 3, 4), (4, 5)], [(2, 3, 5)])) == 2 * 2 * 3 * 4 * 5


def test_matmul_broadcasts_batch_dims() -> None:
    # batch (2,1) x (5,) -> (2,5); m=3, k=4, n=6
    assert flops(op("MatMul", [(2, 1, 3, 4), (5, 4, 6)], [(2, 5, 3, 6)])) == 2 * 10 * 3 * 4 * 6


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((4,), (4, 5), 2 * 4 * 5),
        ((3, 4), (4,), 2 * 3 * 4),
        ((4,), (4,), 2 * 4),
        ((2, 3, 4), (4,), 2 * 6 * 4),
    ],
)
def test_matmul_1d_operands(a: Shape, b: Shape, expected: int) -> None:
    assert flops(op("MatMul", [a, b], [None])) == expected


def test_matmul_bytes_count_weights() -> None:
    assert bytes_moved(op("MatMul", [(2, 3, 4), (4, 5)], [(2, 3, 5)])) == (24 + 20 + 30) * 4


def test_gemm_trans_and_bias() -> None:
    # A [3,4], B^T [5,4]: M=3 K=4 N=5
    assert flops(op("Gemm", [(3, 4), (5, 4)], [(3, 5)], {"transB": 1})) == 2 * 3 * 4 * 5
    assert flops(op("Gemm", [(3, 4), (5, 4), (5,)], [(3, 5)], {"transB": 1})) == 120 + 15
    assert flops(op("Gemm", [(4, 3), (4, 5)], [(3, 5)], {"transA": 1})) == 120
    assert flops(op("Gemm", [(4, 3), (5, 4), None], [(3, 5)], {"transA": 1, "transB": 1})) == 120


def test_einsum_matches_matmul() -> None:
    e = op("Einsum", [(2, 3, 4), (2, 4, 5)], [(2, 3, 5)], {"equation": "bij,bjk->bik"})
    assert flops(e) == flops(op("MatMul", [(2, 3, 4), (2, 4, 5)], [(2, 3, 5)])) == 240


# --- convolution and pooling ----------------------------------------------------------------


def test_conv_groups() -> None:
    # X [1,4,8,8], W [6, 4/2, 3, 3], pad 1 -> Y [1,6,8,8]
    attrs = {"group": 2, "pads": [1, 1, 1, 1]}
    expected = 2 * (6 * 8 * 8) * 2 * 9
    assert flops(op("Conv", [(1, 4, 8, 8), (6, 2, 3, 3)], [(1, 6, 8, 8)], attrs)) == expected
    # Output shape unknown: derived from the attributes.
    assert flops(op("Conv", [(1, 4, 8, 8), (6, 2, 3, 3)], [None], attrs)) == expected


def test_conv_depthwise_and_3d() -> None:
    dw = op("Conv", [(1, 8, 5, 5), (8, 1, 3, 3)], [(1, 8, 3, 3)], {"group": 8})
    assert flops(dw) == 2 * 72 * 1 * 9
    c3 = op("Conv", [(1, 2, 4, 4, 4), (3, 2, 2, 2, 2), (3,)], [(1, 3, 3, 3, 3)])
    assert flops(c3) == 2 * 81 * 2 * 8


def test_conv_transpose() -> None:
    # X [1,4,3,3], W [Cin=4, Cout/g=2, 3, 3]: each input scatters into 2*9 outputs
    assert flops(op("ConvTranspose", [(1, 4, 3, 3), (4, 2, 3, 3)], [(1, 2, 5, 5)])) == 2 * 36 * 18


def test_pooling() -> None:
    mp = op("MaxPool", [(1, 2, 4, 4)], [(1, 2, 2, 2)], {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert flops(mp) == 8 * 4
    ap = {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}
    assert flops(op("AveragePool", [(1, 1, 6, 6)], [None], ap)) == 9 * 9  # out 3x3
    assert flops(op("AveragePool", [(1, 1, 6, 6)], [None], {**ap, "ceil_mode": 0})) == 4 * 9
    assert flops(op("GlobalAveragePool", [(2, 3, 4, 4)], [(2, 3, 1, 1)])) == 96


def _onnx_out_shape(op_type: str, x: Shape, w: Shape | None, attrs: dict[str, Any]) -> Shape:
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x)]
    if w is not None:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, w))
    node = helper.make_node(op_type, [i.name for i in inputs], ["y"], **attrs)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    model = helper.make_model(helper.make_graph([node], "g", inputs, [y]))
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    return tuple(d.dim_value for d in dims)


@pytest.mark.parametrize(
    ("op_type", "x", "w", "attrs"),
    [
        ("Conv", (1, 3, 11, 9), (4, 3, 3, 2), {"strides": [2, 3], "dilations": [2, 1]}),
        ("Conv", (2, 4, 10), (6, 2, 4), {"group": 2, "pads": [2, 1], "strides": [3]}),
        ("Conv", (1, 2, 7, 8), (2, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
        ("Conv", (1, 2, 7, 8), (2, 2, 3, 3), {"auto_pad": "VALID", "strides": [2, 2]}),
        ("Conv", (1, 1, 5, 5, 5), (2, 1, 2, 3, 2), {"pads": [0, 1, 0, 1, 0, 1]}),
        (
            "MaxPool",
            (1, 2, 9, 9),
            None,
            {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "pads": [1, 0, 0, 1]},
        ),
        ("AveragePool", (1, 2, 12), None, {"kernel_shape": [5], "strides": [4]}),
    ],
)
def test_window_fallback_matches_onnx_shape_inference(
    op_type: str, x: Shape, w: Shape | None, attrs: dict[str, Any]
) -> None:
    y = _onnx_out_shape(op_type, x, w, attrs)
    ins = [x, w] if w is not None else [x]
    assert flops(op(op_type, ins, [None], attrs)) == flops(op(op_type, ins, [y], attrs)) > 0


# --- element-wise, normalization, reductions, attention -----------------------------------


def test_elementwise() -> None:
    assert flops(op("Add", [(2, 3), (3,)], [(2, 3)])) == 6
    assert flops(op("Add", [(2, 3), (3,)], [None])) == 6  # output unknown: largest input
    assert flops(op("Relu", [(2, 3)], [(2, 3)])) == 6
    assert flops(op("Where", [(4,), (4,), (1,)], [(4,)])) == 4
    assert flops(op("Exp", [(10,)], [(10,)])) == 40
    assert flops(op("Sigmoid", [(10,)], [(10,)])) == 60
    assert flops(op("Sum", [(4,), (4,), (4,)], [(4,)])) == 8
    assert bytes_moved(op("Add", [(2, 3), (3,)], [(2, 3)])) == (6 + 3 + 6) * 4


def test_normalization_softmax_reduction() -> None:
    bn_ins: Shapes = [(1, 2, 3, 3), (2,), (2,), (2,), (2,)]
    assert flops(op("BatchNormalization", bn_ins, [(1, 2, 3, 3)])) == 18 * 4
    assert flops(op("LayerNormalization", [(2, 5), (5,), (5,)], [(2, 5)])) == 10 * 8
    assert flops(op("Softmax", [(2, 5)], [(2, 5)])) == 10 * 8
    assert flops(op("ReduceMean", [(4, 5)], [(4, 1)])) == 20


def test_attention_4d_and_3d_agree() -> None:
    # B=1, H=2, S=3, L=5, D=4: QK 2*24*5 + PV 2*24*5 + softmax 8*(2*3*5)
    expected = 240 + 240 + 240
    four = op("Attention", [(1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4)], [(1, 2, 3, 4)])
    three = op("Attention", [(1, 3, 8), (1, 5, 8), (1, 5, 8)], [(1, 3, 8)], {"q_num_heads": 2})
    assert flops(four) == flops(three) == expected


# --- data movement --------------------------------------------------------------------------


@pytest.mark.parametrize("op_type", ["Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"])
def test_views_move_no_bytes(op_type: str) -> None:
    o = op(op_type, [(2, 3, 4), (2,)], [(6, 4)])
    assert flops(o) == 0 and bytes_moved(o) == 0
    assert forward_ms(o, SLOW) == SLOW.launch_overhead_ms


def test_copies_and_gathers() -> None:
    t = op("Transpose", [(2, 3, 4)], [(4, 3, 2)], {"perm": [2, 1, 0]})
    assert flops(t) == 0 and bytes_moved(t) == 2 * 24 * 4
    # Embedding lookup: reads 6 rows of 16 floats, not the 1000-row table.
    g = OpInfo("Gather", {}, [(1000, 16), (2, 3)], [(2, 3, 16)], [4, 8], [4])
    assert flops(g) == 0 and bytes_moved(g) == 6 * 8 + 2 * 96 * 4


def test_unknown_op() -> None:
    u = op("MyCustomOp", [(3,), None], [(2, 3), (4,)])
    assert flops(u) == 10 and bytes_moved(u) == (3 + 6 + 4) * 4


# --- roofline -------------------------------------------------------------------------------


def test_roofline_takes_max() -> None:
    mm = op("MatMul", [(2, 3, 4), (4, 5)], [(2, 3, 5)])  # 240 FLOP, 296 B
    assert forward_ms(mm, SLOW) == pytest.approx(0.5 + 296 / 1e6)  # memory bound
    fast_mem = DeviceSpec("c", peak_gflops=1.0, mem_gbps=1e6, launch_overhead_ms=0.0)
    assert forward_ms(mm, fast_mem) == pytest.approx(240 / 1e6)  # compute bound


def test_backward() -> None:
    for weighted in (
        op("MatMul", [(64, 64), (64, 64)], [(64, 64)]),
        op("Conv", [(1, 4, 8, 8), (6, 2, 3, 3)], [(1, 6, 6, 6)], {"group": 2}),
        op("Gemm", [(8, 4), (4, 5)], [(8, 5)]),
    ):
        for dev in (SLOW, DeviceSpec.cpu(), DeviceSpec.gpu_h100()):
            fwd, bwd = forward_ms(weighted, dev), backward_ms(weighted, dev)
            assert bwd - dev.launch_overhead_ms == pytest.approx(2 * (fwd - dev.launch_overhead_ms))
            assert bwd > fwd
    relu = op("Relu", [(1000,)], [(1000,)])
    assert backward_ms(relu, SLOW) == pytest.approx(forward_ms(relu, SLOW))


def test_device_specs() -> None:
    cpu, gpu = DeviceSpec.cpu(), DeviceSpec.gpu_h100()
    assert gpu.peak_gflops > cpu.peak_gflops and gpu.mem_gbps > cpu.mem_gbps
    big = op("MatMul", [(512, 512), (512, 512)], [(512, 512)])
    assert forward_ms(big, gpu) < forward_ms(big, cpu)
    with pytest.raises(PartitionError):
        DeviceSpec("bad", peak_gflops=0.0, mem_gbps=1.0, launch_overhead_ms=0.0)


# --- robustness -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "o",
    [
        op("MatMul", [None, (4, 5)], [None]),
        op("MatMul", [(), ()], [()]),
        op("Conv", [(1, -1, 8, 8), (6, 2, 3, 3)], [None], {"strides": [0, 0]}),
        op("Conv", [(1, 4, 8, 8), (6, 2, 3, 3)], [None], {"strides": [0, 0]}),
        op("Conv", [(1, 4, 8, 8), (6, 2, 3, 3)], [None], {"pads": "oops", "group": "x"}),
        op("Gemm", [(3,), (3, 4)], []),
        op("MaxPool", [(1, 2)], [None], {"kernel_shape": [3, 3]}),
        op("Einsum", [(2, 3)], [None], {"equation": "...ij->ij"}),
        op("Attention", [(1, 3)], [None]),
        op("Add", [], []),
        op("If", [(1,)], [None, None]),
        OpInfo("Add", {}, [(2, 3)], [(2, 3)], [], []),  # item sizes missing
    ],
)
def test_unknown_shapes_never_raise(o: OpInfo) -> None:
    assert flops(o) >= 0 and bytes_moved(o) >= 0
    assert forward_ms(o, SLOW) >= SLOW.launch_overhead_ms
    assert backward_ms(o, SLOW) >= SLOW.launch_overhead_ms


def test_all_unknown_costs_only_overhead() -> None:
    o = op("Conv", [None, None], [None])
    assert forward_ms(o, SLOW) == SLOW.launch_overhead_ms == backward_ms(o, SLOW)


def test_numpy_dims_and_bytes_attributes() -> None:
    dims = tuple(np.int64(d) for d in (1, 4, 8, 8))
    w = tuple(np.int64(d) for d in (6, 2, 3, 3))
    attrs = {"group": np.int64(2), "auto_pad": b"SAME_UPPER"}
    assert flops(op("Conv", [dims, w], [None], attrs)) == 2 * (6 * 8 * 8) * 2 * 9  # type: ignore[list-item]


_OP_TYPES = [
    "MatMul",
    "Gemm",
    "Conv",
    "ConvTranspose",
    "MaxPool",
    "Attention",
    "Einsum",
    "Add",
    "Sum",
    "Softmax",
    "ReduceMean",
    "Gather",
    "Reshape",
    "Loop",
    "Mystery",
]
_dims = st.one_of(st.none(), st.lists(st.integers(-2, 6), max_size=5).map(tuple))
_attr = st.one_of(
    st.integers(-3, 3),
    st.lists(st.integers(-2, 3), max_size=6),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.none(),
    st.floats(allow_nan=True),
)
_keys = [
    "group",
    "strides",
    "pads",
    "dilations",
    "kernel_shape",
    "auto_pad",
    "transA",
    "transB",
    "ceil_mode",
    "equation",
    "num_heads",
    "q_num_heads",
]


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(_OP_TYPES),
    st.lists(_dims, max_size=4),
    st.lists(_dims, max_size=3),
    st.dictionaries(st.sampled_from(_keys), _attr),
    st.lists(st.integers(0, 8), max_size=4),
)
def test_fuzz_never_raises(
    op_type: str,
    ins: list[Shape | None],
    outs: list[Shape | None],
    attrs: dict[str, object],
    sizes: list[int],
) -> None:
    o = OpInfo(op_type, attrs, ins, outs, sizes, sizes)
    for v in (flops(o), bytes_moved(o), forward_ms(o, SLOW), backward_ms(o, SLOW)):
        assert math.isfinite(v) and v >= 0


# --- hand-computed reference shapes ---------------------------------------------------------


@pytest.mark.parametrize(
    ("o", "expected"),
    [
        # ResNet-50 stem: 7x7/2 conv, 3->64 channels, 224 -> 112 (118M MACs)
        (
            op(
                "Conv",
                [(1, 3, 224, 224), (64, 3, 7, 7)],
                [(1, 64, 112, 112)],
                {"strides": [2, 2], "pads": [3, 3, 3, 3]},
            ),
            2 * 64 * 112 * 112 * 3 * 49,
        ),
        # BERT-base FFN up-projection, seq 128
        (op("MatMul", [(1, 128, 768), (768, 3072)], [(1, 128, 3072)]), 2 * 128 * 768 * 3072),
        # ResNet 3x3 max pool on the stem output
        (
            op("MaxPool", [(1, 64, 112, 112)], [(1, 64, 56, 56)], {"kernel_shape": [3, 3]}),
            64 * 56 * 56 * 9,
        ),
        # MobileNet depthwise 3x3 on 32 channels at 112x112
        (
            op("Conv", [(1, 32, 112, 112), (32, 1, 3, 3)], [(1, 32, 112, 112)], {"group": 32}),
            2 * 32 * 112 * 112 * 9,
        ),
        # classifier head: Gemm 2048 -> 1000 with bias, B stored transposed
        (
            op("Gemm", [(1, 2048), (1000, 2048), (1000,)], [(1, 1000)], {"transB": 1}),
            2 * 2048 * 1000 + 1000,
        ),
        # GELU over the FFN activation: erf (4) + 4 arithmetic per element
        (op("Gelu", [(1, 128, 3072)], [(1, 128, 3072)]), 8 * 128 * 3072),
    ],
)
def test_hand_computed(o: OpInfo, expected: int) -> None:
    assert flops(o) == expected
