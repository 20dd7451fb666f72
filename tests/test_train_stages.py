"""Stage modules cut from the exported program equal the whole program, forward and gradients.

Every recipe (and Hugging Face GPT-2, BERT and a Llama-style decoder, in test_train_hf.py) is
exported through onnx_partition.export, partitioned in train mode into 2 and 3 stages, and its
stage modules chained in one process (tensors relayed by name) must give the whole module's
outputs and, summed over the stages holding a copy, its parameter gradients; moved to the
``meta`` device, the stage modules run there (the GPU's case: nothing pinned to the cpu).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from support.training import assert_stages_equal_whole, assert_stages_run_on_meta

from onnx_partition import models
from onnx_partition.graph.fxtag import fx_node_name
from onnx_partition.partition import partition
from onnx_partition.runtime.train.modules import (
    load_program,
)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", models.RECIPES)
def test_recipe_stage_modules_equal_whole(
    name: str, stages: int, exported: Callable[[str], Path], tmp_path: Path
) -> None:
    model = exported(name)  # conftest's session-wide export (onnx_partition.export underneath)
    assert model.with_suffix(".pt2").is_file()
    plan = partition(model, stages, tmp_path / "plan", mode="train", batch_size=2,
                     ordering="topo")
    assert plan.mode == "train" and plan.program.endswith(model.with_suffix(".pt2").name)
    if stages == 2:  # the FX map: every ONNX node's tag names a node of the train program
        program = load_program(tmp_path / "plan", plan)  # (cached for the checks below)
        names = {n.name for n in program.graph.nodes}
        tags = [fx_node_name(n) for n in onnx.load(str(model), load_external_data=False).graph.node]
        assert tags and all(t in names for t in tags)
    assert_stages_equal_whole(tmp_path / "plan")
    if stages == 3:  # on any device: nothing the stages make stays on the export's cpu
        assert_stages_run_on_meta(tmp_path / "plan")
