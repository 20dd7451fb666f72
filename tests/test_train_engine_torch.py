"""`train --engine torch`: uniform plans trained on torch.distributed.pipelining (real gloo
processes) equal single-process training (`--check`), and the plans and options it cannot run
are refused in one line, exit 2, before any process starts."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from onnx_partition.cli import main
from onnx_partition.partition import partition
from onnx_partition.runtime.train.trainer import train_plan


@pytest.fixture(scope="module")
def gpt_plan(exported: Callable[[str, str], Path],
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt tiny (the session's export, with its program) partitioned in train mode into 2
    stages (its hop carries an integer, a symbolic size, beside the activations)."""
    out = tmp_path_factory.mktemp("engine-torch") / "plan"
    partition(exported("gpt", "tiny"), 2, out, mode="train", batch_size=2)
    return out


def _with_replicas(plan: Path, out: Path, replicas: list[int]) -> Path:
    """A copy of ``plan`` whose stages run on ``replicas`` CPU processes each."""
    shutil.copytree(plan, out)
    body = json.loads((out / "plan.json").read_text())
    body["program"] = str((plan / body["program"]).resolve())
    body["model"] = str((plan / body["model"]).resolve())
    for stage, count in zip(body["stages"], replicas, strict=True):
        stage.update(replicas=count, devices=["cpu"] * count)
    (out / "plan.json").write_text(json.dumps(body))
    return out


def test_two_stages_two_replicas_equal_one_process(gpt_plan: Path, tmp_path: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """2 pipelines of 2 stages (4 ranks, a DP group per stage), GPipe, clipping on: gradients
    after step 1 and parameters after steps 1 and 3 equal single-process training; the saved
    plan serves."""
    plan = _with_replicas(gpt_plan, tmp_path / "plan", [2, 2])
    trained = tmp_path / "trained"
    code = main(["train", str(plan), "--engine", "torch", "--schedule", "gpipe", "--steps", "3",
                 "--microbatches", "4", "--batch-size", "2", "--clip-grad-norm", "0.5",
                 "--check", "--save", str(trained)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "4 ranks (torch engine, gpipe), batch 8 = 4 micro-batches x 2 rows" in out
    assert "check against single-process training after step 1 and 3: OK" in out
    assert main(["run", str(trained), "--batch-size", "2", "--check"]) == 0
    assert "(OK)" in capfd.readouterr().out


def test_relayed_integers_and_tied_weights(hf_exported: Callable[..., Path],
                                           tmp_path: Path) -> None:
    """Hugging Face GPT-2 given labels at 3 stages, 1F1B, its own loss: the labels (int64) are
    relayed through the middle stage, hops carry booleans, indices and sizes, and the tied
    embedding lives on stages 0 and 2; the same loss per step as our engine, and --check OK."""
    plan_dir = tmp_path / "plan"
    partition(hf_exported("gpt2", labels=True), 3, plan_dir, mode="train", batch_size=2,
              force=True)
    common = dict(steps=2, microbatches=3, batch_size=2, loss="output")
    torch_run = train_plan(plan_dir, engine="torch", check=True, **common)  # type: ignore[arg-type]
    assert torch_run.engine == "torch" and torch_run.checked_steps == (1,)
    assert torch_run.mismatches == []
    ours = train_plan(plan_dir, check=True, **common)  # type: ignore[arg-type]
    assert torch_run.loss == pytest.approx(ours.loss, rel=1e-5)


def test_refusals_before_any_process(gpt_plan: Path, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    began = time.perf_counter()
    unequal = _with_replicas(gpt_plan, tmp_path / "unequal", [2, 1])
    assert main(["train", str(unequal), "--engine", "torch"]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and "maps stage i to rank i % (its group's size)" in err
    assert "[2, 1]" in err
    assert main(["train", str(gpt_plan), "--engine", "torch", "--eval-every", "1"]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and "does not take --eval-every" in err
    equal = _with_replicas(gpt_plan, tmp_path / "equal", [2, 2])
    assert main(["train", str(equal), "--engine", "torch", "--microbatches", "1"]) == 2
    assert "each of the 2 replicas needs a micro-batch" in capfd.readouterr().err
    assert time.perf_counter() - began < 10  # no process was started
