"""A rank holds what its schedule promises (issue 33): under 1F1B and ZB-H1 at most ``p``
micro-batches are in flight on a stage, so a rank's measured peak (``train``'s
``memory_bytes``: the storage tracker's) must not grow with the step's micro-batch count. The
old engine held every sent tensor to the step's end, and ZB-H1's retained graphs of the first
step were never freed (the saved-tensor counter packed saved outputs as themselves: a cycle):
from 4 to 16 micro-batches gpt tiny's ranks grew by 0.8 (1F1B) and 4.9 (ZB-H1) micro-batches'
activations; now only by the step's batch (the data, ``M`` x rows), which the test allows."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan

ROWS = 4
FEW, MANY = 4, 16


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory: pytest.TempPathFactory,
              exported: Callable[[str, str], Path]) -> Path:
    out = tmp_path_factory.mktemp("memory") / "plan"
    partition(exported("gpt", "tiny"), 2, out, batch_size=ROWS, mode="train", check=False)
    return out


def _batch_bytes(plan: Path, microbatches: int) -> int:
    """The bytes of one step's whole batch (inputs and targets) at ``microbatches``."""
    inputs, targets = task_for(plan).make_batch(ROWS * microbatches,
                                                torch.Generator().manual_seed(0))
    return sum(t.untyped_storage().nbytes() for t in [*inputs.values(), *targets.values()])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_peak_does_not_grow_with_the_microbatch_count(tiny_plan: Path, schedule: str) -> None:
    peaks = {}
    for count in (FEW, MANY):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a schedule other than the plan's: warned
            stats = train_plan(tiny_plan, steps=2, microbatches=count, schedule=schedule)
        assert all(isinstance(b, int) for b in stats.memory_bytes), stats.memory_bytes
        peaks[count] = stats.memory_bytes
    data = _batch_bytes(tiny_plan, MANY) - _batch_bytes(tiny_plan, FEW)
    for k, stage in enumerate(read_plan(tiny_plan).stages):
        assert stage.predicted is not None and stage.predicted.activation_bytes
        growth = (peaks[MANY][k] or 0) - (peaks[FEW][k] or 0)
        assert growth - data < stage.predicted.activation_bytes / 2, (
            f"stage {k}: peak {peaks[FEW][k]} at M={FEW}, {peaks[MANY][k]} at M={MANY}; "
            f"a micro-batch's activations {stage.predicted.activation_bytes}")
