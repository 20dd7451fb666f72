"""Activation memory as autograd keeps it (cost/saved.py): bytes saved for backward per FX unit,
by hand on a small block, equal under FakeTensorMode and on real tensors, and a 2-stage train
plan's per-stage ``activation_bytes`` summing to what the whole program and the trainer's loss
after it save in a real run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.blocks import HIDDEN, ROWS, WIDTH, Block, Logits, tiny_gpt2

from onnx_partition import export, models
from onnx_partition.cost.saved import saved_by_module, saved_bytes, saved_bytes_per_node
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.loss import upcast
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.task import task_for


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Block(), (torch.randn(ROWS, WIDTH),),
                  tmp_path_factory.mktemp("block") / "block.onnx")


# by hand: linear saves its input x (its weight is a parameter: not counted), GELU its input
# (linear's output), layer norm its input (GELU's output) and its mean and rstd (one per row)
HAND = {"linear": ROWS * WIDTH * 4, "gelu": ROWS * HIDDEN * 4,
        "layer_norm": ROWS * HIDDEN * 4 + 2 * ROWS * 4}


@pytest.mark.parametrize("fake", [True, False])
def test_saved_bytes_per_unit_equal_a_hand_count(block: Path, fake: bool) -> None:
    program = torch.export.load(str(block.with_suffix(".pt2")))
    counted = saved_bytes(program, [(ROWS, WIDTH)], fake=fake)
    assert counted.per_node == HAND
    assert counted.total == sum(HAND.values())
    assert counted.weights == (WIDTH * HIDDEN + 3 * HIDDEN) * 4
    # the eager module, counted the same way, saves the same bytes
    assert saved_by_module(Block(), torch.randn(ROWS, WIDTH)) == sum(HAND.values())


def test_each_unit_lands_on_its_first_onnx_node(block: Path) -> None:
    graph = load(block, batch_size=ROWS)
    per_node = saved_bytes_per_node(graph, block.with_suffix(".pt2"))
    assert {graph.nodes[i].key: b for i, b in enumerate(per_node) if b} == {
        f"node_{k}": float(v) for k, v in HAND.items()}


def test_fake_and_real_runs_count_the_same_bytes_on_gpt2() -> None:
    torch.manual_seed(0)
    model = tiny_gpt2()
    program = torch.export.export(Logits(model), (torch.zeros(2, 8, dtype=torch.long),),
                                  strict=False)
    fake = saved_bytes(program, [(2, 8)], fake=True)
    real = saved_bytes(program, [(2, 8)], fake=False)
    assert fake.per_node == real.per_node and fake.total > 0


class _WithLoss(torch.nn.Module):
    """A plan's whole module followed by the trainer's loss (``--loss auto``) on ``targets``."""

    def __init__(self, plan_dir: Path, targets: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.whole, self.targets = whole_module(plan_dir), targets
        self.names = [o.name for o in read_plan(plan_dir).outputs]
        self.loss = task_for(plan_dir).loss_fn

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        outs = self.whole(*inputs)
        outs = upcast(outs if isinstance(outs, tuple) else (outs,))
        return self.loss(dict(zip(self.names, outs, strict=True)), self.targets)


def _measured(plan_dir: Path, rows: int) -> int:
    """What the whole program and the trainer's loss after it save for backward in a real run
    of one micro-batch."""
    plan = read_plan(plan_dir)
    inputs, targets = task_for(plan_dir).make_batch(rows, torch.Generator().manual_seed(0))
    return saved_by_module(_WithLoss(plan_dir, targets), *[inputs[s.name] for s in plan.inputs])


def _two_stage_sum(model: Path, plan_dir: Path, rows: int) -> tuple[int, int]:
    plan = partition(model, 2, plan_dir, batch_size=rows, mode="train", check=False)
    assert plan.extra["activations"]["source"] == "saved-tensors"
    parts = [s.predicted.activation_bytes for s in plan.stages if s.predicted]
    assert len(parts) == 2 and all(p is not None for p in parts)
    return sum(p or 0 for p in parts), _measured(plan_dir, rows)


@pytest.mark.parametrize("name", models.RECIPES)
def test_two_stage_activation_bytes_sum_to_the_measured_whole(
        name: str, tmp_path: Path, exported: Callable[[str, str], Path]) -> None:
    model = exported(name, "tiny")  # the session's export (its program beside it)
    modelled, measured = _two_stage_sum(model, tmp_path / "plan", 2)
    assert measured > 0
    assert abs(modelled - measured) <= 0.05 * measured, (modelled, measured)


def test_two_stage_activation_bytes_of_hf_gpt2(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    model = export(Logits(tiny_gpt2()), (ids,), tmp_path / "gpt2.onnx")
    modelled, measured = _two_stage_sum(model, tmp_path / "plan", 2)
    assert abs(modelled - measured) <= 0.05 * measured, (modelled, measured)
