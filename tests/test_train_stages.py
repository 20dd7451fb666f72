"""Stage modules cut from the exported program equal the whole program, forward and gradients.

Every recipe (and Hugging Face GPT-2, BERT and a Llama-style decoder, in test_train_hf.py) is
exported through onnx_partition.export, partitioned in train mode into 2 and 3 stages, and its
stage modules chained in one process (tensors relayed by name) must give the whole module's
outputs and, summed over the stages holding a copy, its parameter gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch

from onnx_partition import models
from onnx_partition.graph.fxtag import fx_node_name
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.modules import (
    StageModule,
    load_program,
    stage_modules,
    whole_module,
)
from onnx_partition.runtime.train.task import task_for


def chain(stages: list[StageModule], feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the stages one after another, each reading its inputs by name from all before it."""
    env = dict(feeds)
    for stage in stages:
        outputs = stage.module(*[env[name] for name in stage.inputs])
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.outputs)
        env.update(zip(stage.outputs, outputs, strict=True))
    return env


def assert_stages_equal_whole(plan_dir: Path, rows: int = 3, seed: int = 0) -> None:
    """Chained stages == whole module: outputs, loss, and every parameter's gradient (the sum
    over the stages holding a copy of a tied parameter)."""
    plan = read_plan(plan_dir)
    task = task_for(plan_dir)
    inputs, targets = task.make_batch(rows, torch.Generator().manual_seed(seed))
    whole = whole_module(plan_dir, deterministic=True)
    stages = stage_modules(plan_dir, deterministic=True)
    assert [s.inputs for s in stages] == [tuple(s.inputs) for s in plan.stages]
    assert [s.outputs for s in stages] == [tuple(s.outputs) for s in plan.stages]

    want = dict(zip([o.name for o in plan.outputs],
                    whole(*[inputs[s.name] for s in plan.inputs]), strict=True))
    env = chain(stages, inputs)
    for name, value in want.items():
        torch.testing.assert_close(env[name], value, rtol=1e-5, atol=1e-6)
    task.loss_fn(want, targets).backward()
    task.loss_fn({n: env[n] for n in want}, targets).backward()

    expected = {n: p.grad for n, p in whole.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for name, param in stage.module.named_parameters():
            assert name in expected, name
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            got[name] = got[name] + grad if name in got else grad
            holders.setdefault(name, []).append(stage.index)
        assert all(stage.index in ks for ks in stage.tied.values())
    for name, want_grad in expected.items():
        if want_grad is None:
            continue
        torch.testing.assert_close(got[name], want_grad, rtol=1e-4, atol=1e-6)
    tied = {n: tuple(ks) for n, ks in holders.items() if len(ks) > 1}
    assert {n: ks for s in stages for n, ks in s.tied.items()} == tied


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
