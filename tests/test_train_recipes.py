"""Every recipe trained over real gloo process groups: exported with its program, partitioned in
train mode into 2 stages, 2 optimizer steps, and every rank's parameters equal single-process
training (``train --check``). The Hugging Face models: ``test_train_hf.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from onnx_partition import models
from onnx_partition.partition import partition
from onnx_partition.runtime.train.trainer import train_plan


def train_checked(model: Path, plan: Path, stages: int, **options: str) -> None:
    """Partition ``model`` in train mode and train it 2 steps with ``--check``."""
    partition(model, stages, plan, batch_size=2, mode="train", **options)
    stats = train_plan(plan, steps=2, microbatches=2, batch_size=2, check=True)
    assert stats.mismatches == [], stats.mismatches


@pytest.mark.parametrize("name", models.RECIPES)
def test_every_recipe_trains_like_one_process(name: str, tmp_path: Path) -> None:
    model = models.export(name, tmp_path / f"{name}.onnx", size="tiny")
    assert model.with_suffix(".pt2").is_file()
    train_checked(model, tmp_path / "plan", 2)
