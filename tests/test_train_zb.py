"""`onnx-partition train` with ZB-H1 and recomputing stages, end to end on the gpt tiny recipe
(real gloo process groups): ``--check`` holds against single-process training, and a stage
cut from the program that recomputes saves no activation in its forward."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.training import saved_bytes

from onnx_partition.cli import main
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.modules import stage_modules
from onnx_partition.runtime.train.passes import kept_forward, rebuild
from onnx_partition.runtime.train.task import task_for


@pytest.fixture(scope="module")
def zb_plan(exported: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt tiny in 3 stages for ZB-H1, every stage recomputing (``partition --recompute all``)."""
    plan = tmp_path_factory.mktemp("train-zb") / "plan"
    assert main(["partition", str(exported("gpt")), "--stages", "3", "--mode", "train",
                 "--batch-size", "2", "--schedule", "zb-h1", "--recompute", "all",
                 "-o", str(plan)]) == 0
    return plan


def test_zb_h1_and_recomputing_stages_check(exported: Callable[..., Path], zb_plan: Path,
                                           tmp_path: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    """train defaults to the plan's schedule (zb-h1) and its recomputing stages and passes
    --check; so does a 2-stage plan that keeps its activations, trained with
    ``--schedule zb-h1``."""
    body = json.loads((zb_plan / "plan.json").read_text())
    assert body["schedule"] == "zb-h1"
    assert [s.get("recompute") for s in body["stages"]] == [True] * 3
    capfd.readouterr()
    code = main(["train", str(zb_plan), "--nproc", "3", "--steps", "1", "--microbatches", "4",
                 "--batch-size", "2", "--check"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "3 ranks (ours engine, zb-h1, fp32 math)" in out
    assert "check against single-process training of the gradients of step 1" in out
    assert "its first step turns rounding in a tiny gradient into +-lr): OK" in out

    two = tmp_path / "two"
    assert main(["partition", str(exported("gpt")), "--stages", "2", "--mode", "train",
                 "--batch-size", "2", "--schedule", "1f1b", "--recompute", "none",
                 "-o", str(two)]) == 0
    capfd.readouterr()
    code = main(["train", str(two), "--nproc", "2", "--steps", "1", "--microbatches", "4",
                 "--batch-size", "2", "--schedule", "zb-h1", "--check"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "2 ranks (ours engine, zb-h1, fp32 math)" in out and ": OK" in out



def test_a_recomputing_stage_saves_only_its_inputs(zb_plan: Path) -> None:
    """Each of gpt tiny's stages, as the engine runs them: keeping its activations, autograd
    saves more than the stage's inputs for backward; recomputing, its forward saves nothing
    (it keeps the inputs alone) and the rebuild gives the same outputs."""
    plan = read_plan(zb_plan)
    inputs, _ = task_for(zb_plan).make_batch(2, torch.Generator().manual_seed(0))
    env: dict[str, torch.Tensor] = dict(inputs)
    model_inputs = {s.name for s in plan.inputs}
    for stage in stage_modules(zb_plan, deterministic=True):
        args = [env[n].detach().requires_grad_()
                if env[n].is_floating_point() and n not in model_inputs else env[n]
                for n in stage.inputs]

        def run(stage=stage, args=args) -> tuple[torch.Tensor, ...]:
            return tuple(stage.module(*args))

        kept, outs = saved_bytes(run)
        received = sum(a.numel() * a.element_size() for a in args)
        saved, (cheap, rng) = saved_bytes(lambda run=run: kept_forward(run, torch.device("cpu")))
        assert saved == 0 and kept > 2 * received, (stage.index, kept, received)
        again = rebuild(run, stage.module, rng)
        for a, b, c in zip(outs, cheap, again, strict=True):
            assert torch.equal(a, b) and torch.equal(a, c)
        env.update(zip(stage.outputs, (o.detach() for o in outs), strict=True))
