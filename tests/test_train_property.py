"""Property: for random small torch DAGs (MLP layers, skip connections, joins, several outputs)
exported through onnx_partition.export and cut at a random stage count, the stage modules
chained equal the whole program, forward and gradients."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.training import assert_stages_equal_whole
from torch import nn

from onnx_partition import export
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan

WIDTH = 6
OPS = ("linear", "add", "mul", "norm", "cat")


class RandomDag(nn.Module):
    """Layer i reads one or two earlier values (0 = the input) and applies ``ops[i]``."""

    def __init__(self, ops: list[str], reads: list[tuple[int, int]], outputs: list[int]) -> None:
        super().__init__()
        self.ops, self.reads, self.outs = ops, reads, outputs
        self.layers = nn.ModuleList(
            nn.Linear(2 * WIDTH if op == "cat" else WIDTH, WIDTH) if op in ("linear", "cat")
            else nn.LayerNorm(WIDTH) if op == "norm" else nn.Identity()
            for op in ops)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = [x]
        for op, (a, b), layer in zip(self.ops, self.reads, self.layers, strict=True):
            u, v = values[a], values[b]
            if op == "linear":
                y = torch.tanh(layer(u))
            elif op == "add":
                y = u + v
            elif op == "mul":
                y = u * torch.sigmoid(v)
            elif op == "norm":
                y = layer(u + v)
            else:
                y = layer(torch.cat([u, v], dim=-1))
            values.append(y)
        return tuple(values[i] for i in self.outs)


@st.composite
def dags(draw: st.DrawFn) -> tuple[RandomDag, int, int]:
    n = draw(st.integers(3, 6))
    ops = [draw(st.sampled_from(OPS)) for _ in range(n)]
    ops[0] = "linear"  # something with weights first
    reads = [(draw(st.integers(0, i)), draw(st.integers(0, i))) for i in range(n)]
    extra = draw(st.integers(1, n - 1))
    outputs = [n] if draw(st.booleans()) else [extra, n]
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    return RandomDag(ops, reads, outputs), draw(st.integers(2, 4)), seed


@settings(max_examples=3, deadline=None)
@given(dags())
def test_random_dag_stage_modules_equal_whole(case: tuple[RandomDag, int, int]) -> None:
    module, stages, seed = case
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        names = [f"y{i}" for i in range(len(module.outs))]
        path = export(module, (torch.randn(2, WIDTH),), root / "dag.onnx", input_names=["x"],
                      output_names=names)
        try:
            partition(path, stages, root / "plan", mode="train", batch_size=2, ordering="topo")
        except PartitionError as exc:  # fewer units than stages: the partitioner says so
            assert "is not possible" in str(exc)
            return
        assert len(read_plan(root / "plan").stages) == stages
        assert_stages_equal_whole(root / "plan", rows=3, seed=seed)
