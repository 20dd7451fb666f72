"""Every recipe trained over real gloo process groups: exported with its program, partitioned in
train mode into 2 stages, 2 optimizer steps, and every rank's parameters equal single-process
training (``train --check``). The Hugging Face models: ``test_train_hf.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.training import train_checked

from onnx_partition import models


@pytest.mark.parametrize("name", models.RECIPES)
def test_every_recipe_trains_like_one_process(name: str, tmp_path: Path) -> None:
    model = models.export(name, tmp_path / f"{name}.onnx", size="tiny")
    assert model.with_suffix(".pt2").is_file()
    train_checked(model, tmp_path / "plan", 2)
