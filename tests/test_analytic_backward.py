"""The analytic backward per aten op: exact FLOP and byte counts on tiny programs, and the
train plan a GPU prices with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from onnx_partition import export
from onnx_partition.cost.analytic import (
    AtenOp,
    DeviceSpec,
    aten_backward,
    aten_backward_ms,
    aten_kernels,
)
from onnx_partition.cost.aten import ANALYTIC_BACKWARD, aten_ops, backward_per_node
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.report.lines import priced_by

F = 4  # fp32 bytes


def _ops(module: torch.nn.Module, example: torch.Tensor, shape: tuple[int, ...]
         ) -> dict[str, tuple[float, float]]:
    """aten op name -> (backward FLOPs, bytes) of ``module`` exported at ``example``, counted at
    input ``shape``."""
    program = torch.export.export(module, (example,))
    return {op.name: aten_backward(op) for op in aten_ops(program, [shape]).values()}


def test_linear_is_two_matmuls_and_a_bias_sum() -> None:
    # x [5, 8] needs no gradient (a model input): dW = x^T dY and db = sum(dY) only
    got = _ops(torch.nn.Linear(8, 6), torch.randn(2, 8), (5, 8))
    out, gout = 5 * 6, 5 * 6 * F
    assert got["linear"] == (2 * out * 8 + out, (gout + 5 * 8 * F + 6 * 8 * F) + (gout + 6 * F))


def test_hidden_linear_adds_the_input_gradient() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 6))
    program = torch.export.export(module, (torch.randn(2, 8),))
    ops = list(aten_ops(program, [(5, 8)]).values())
    second = ops[1]
    assert second.needs_grad[:3] == [True, True, True]
    dense, gout, x, w = 2 * 30 * 8, 30 * F, 40 * F, 48 * F
    assert aten_backward(second) == (2 * dense + 30,
                                     2 * (gout + x + w) + gout + 6 * F)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.ln = torch.nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ln(torch.nn.functional.gelu(self.emb(ids)))


def test_embedding_gelu_layer_norm_by_hand() -> None:
    got = _ops(_Block(), torch.randint(0, 10, (2, 3)), (4, 3))
    n, rows = 4 * 3 * 8, 4 * 3
    # embedding: a scatter-add of dY's rows into a zeroed [10, 8] table
    assert got["embedding"] == (n, 10 * 8 * F + rows * 8 + 3 * n * F)
    # gelu: reads its saved input and dY, writes dX
    assert got["gelu"] == (12 * n, 3 * n * F)
    # layer norm: dX (8/element: x, dY read, dX written, weight read), dW and dB (3/element:
    # x and dY read again, both written), the fp32 row mean and rstd
    assert got["layer_norm"] == (8 * n + 3 * n, (2 * n * F + n * F + 8 * F)
                                 + (2 * n * F + 8 * F + 8 * F) + 2 * rows * F)


def test_no_gradient_no_backward_and_views_are_free() -> None:
    no_grad = AtenOp("mm", [(4, 4), (4, 4)], [F, F], [False, False], [(4, 4)], [F])
    view = AtenOp("view", [(4, 4), None], [F, 0], [True, False], [(16,)], [F])
    assert aten_backward(no_grad) == (0.0, 0.0) == aten_backward(view)
    assert aten_backward_ms(view, DeviceSpec.gpu_h100()) == 0.0


def test_softmax_attention_and_matmul_rules() -> None:
    soft = AtenOp("_softmax", [(2, 10), None, None], [F, 0, 0], [True, False, False],
                  [(2, 10)], [F])
    assert aten_backward(soft) == (4 * 20, 3 * 20 * F)
    q = (1, 2, 6, 4)  # B, H, L, E; K and V the same shape
    sdpa = AtenOp("scaled_dot_product_attention", [q, q, q], [F] * 3, [True] * 3, [q], [F])
    scores = 2 * 6 * 6
    assert aten_backward(sdpa) == (2 * scores * (3 * 4 + 2 * 4) + 4 * scores,
                                   2 * 3 * 48 * F + 2 * 48 * F)
    mm = AtenOp("mm", [(3, 5), (5, 7)], [F, F], [True, False], [(3, 7)], [F])
    assert aten_backward(mm) == (2 * 21 * 5, 21 * F + 35 * F + 15 * F)


def test_roofline_time_of_a_backward() -> None:
    device = DeviceSpec("d", peak_gflops=1.0, mem_gbps=1.0, launch_overhead_ms=0.5)
    mm = AtenOp("mm", [(3, 5), (5, 7)], [F, F], [True, False], [(3, 7)], [F])
    flops, moved = aten_backward(mm)  # 210 FLOPs, 284 bytes: memory bound at 1 GB/s
    assert aten_backward_ms(mm, device) == pytest.approx(0.5 + max(flops, moved) / 1e6)
    linear = AtenOp("linear", [(3, 5), (7, 5), (7,)], [F] * 3, [True] * 3, [(3, 7)], [F])
    flops, moved = aten_backward(linear)  # dX, dW and db: three kernels
    assert aten_kernels(linear) == 3
    assert aten_backward_ms(linear, device) == pytest.approx(1.5 + max(flops, moved) / 1e6)


@pytest.fixture(scope="module")
def block_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("aten")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    return export(module, (torch.randn(2, 8),), folder / "block.onnx", input_names=["x"])


def test_each_op_lands_on_its_units_first_onnx_node(block_model: Path) -> None:
    graph = load(block_model, batch_size=4)
    program = torch.export.load(str(block_model.with_suffix(".pt2")))
    device = DeviceSpec.gpu_h100()
    per_node = backward_per_node(graph, program, device)
    ops = aten_ops(program, [(4, 8)])
    assert sum(per_node) == pytest.approx(sum(aten_backward_ms(op, device)
                                              for op in ops.values()))
    assert sum(1 for b in per_node if b > 0) == sum(
        1 for op in ops.values() if aten_backward(op) != (0.0, 0.0))


def test_a_gpu_train_plan_is_priced_per_aten_op(block_model: Path, tmp_path: Path) -> None:
    device = DeviceSpec("gpu", peak_gflops=1000.0, mem_gbps=100.0, launch_overhead_ms=0.01,
                        kind="cuda")
    plan = partition(block_model, 2, tmp_path / "plan", batch_size=4, mode="train",
                     device=device)
    assert plan.extra["costs"]["backward"] == ANALYTIC_BACKWARD
    assert "backward per aten op" in priced_by(read_plan(tmp_path / "plan"))
    graph = load(block_model, batch_size=4)
    per_node = backward_per_node(graph, block_model.with_suffix(".pt2"), device)
    index = {n.key: n.index for n in graph.nodes}
    stage_backward = [sum(per_node[index[k]] for k in s.nodes) for s in plan.stages]
    assert [s.predicted.backward_ms for s in plan.stages] == pytest.approx(stage_backward,
                                                                            abs=1e-6)
