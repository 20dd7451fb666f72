"""`onnx-partition train` end to end on the gpt tiny recipe (real gloo process groups):
--check at 2 stages, an unequal-replica plan, and the refusals that come before any process."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from onnx_partition.cli import main


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt tiny exported with its program, partitioned in train mode into 2 stages."""
    root = tmp_path_factory.mktemp("train-cli")
    assert main(["export", "gpt", "--size", "tiny", "-o", str(root / "gpt.onnx")]) == 0
    assert main(["partition", str(root / "gpt.onnx"), "--stages", "2", "--mode", "train",
                 "--batch-size", "2", "-o", str(root / "plan")]) == 0
    return root / "plan"


def test_two_stages_check_save_and_serve(gpt_plan: Path, tmp_path: Path,
                                        capfd: pytest.CaptureFixture[str]):
    trained = tmp_path / "trained"
    code = main(["train", str(gpt_plan), "--nproc", "2", "--steps", "2", "--microbatches", "4",
                 "--batch-size", "2", "--optimizer", "sgd", "--check", "--save", str(trained)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert len(out.split("loss per step: ")[1].split("\n")[0].split()) == 2
    assert "batch 8 = 4 micro-batches x 2 rows" in out
    assert "measured/simulated" in out
    assert "check against single-process training after step 1: OK" in out
    assert f"saved the trained plan to {trained}" in out
    assert main(["run", str(trained), "--batch-size", "2", "--check"]) == 0
    assert "(OK)" in capfd.readouterr().out


def test_unequal_replicas_check(gpt_plan: Path, tmp_path: Path,
                                capfd: pytest.CaptureFixture[str]):
    """Stage 0 on 2 replicas, stage 1 on 1: 3 ranks, SGD with momentum, the parameters
    checked after steps 1 and 3 (AdamW's are not compared, only its gradients)."""
    plan_dir = tmp_path / "plan"
    shutil.copytree(gpt_plan, plan_dir)
    body = json.loads((plan_dir / "plan.json").read_text())
    body["program"] = str((gpt_plan / body["program"]).resolve())
    body["model"] = str((gpt_plan / body["model"]).resolve())
    body["stages"][0].update(replicas=2, devices=["cpu", "cpu"])
    (plan_dir / "plan.json").write_text(json.dumps(body))
    record = tmp_path / "times.json"
    code = main(["train", str(plan_dir), "--nproc", "3", "--steps", "3", "--microbatches", "4",
                 "--batch-size", "1", "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.1",
                 "--check",
                 "--record", str(record)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "3 ranks" in out
    assert "training on synthetic batches (seed 0)" in out  # no --data: said so
    assert "after step 1 and 3: OK" in out
    times = json.loads(record.read_text())["simulator_costs"]
    assert len(times["forward_ms"]) == len(times["backward_ms"]) == 2
    assert all(t > 0 for t in times["forward_ms"] + times["backward_ms"])


def test_refusals_before_any_process(gpt_plan: Path, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]):
    began = time.perf_counter()
    assert main(["train", str(gpt_plan), "--nproc", "3"]) == 2
    assert "2 stage replicas (1 + 1); got 3 processes" in capfd.readouterr().err
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert main(["train", str(gpt_plan), "--save", str(tmp_path / "mine")]) == 2
    assert "not an earlier plan" in capfd.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    altered = tmp_path / "altered"
    shutil.copytree(gpt_plan.parent, altered)
    program = altered / "gpt.pt2"
    program.write_bytes(program.read_bytes() + b"\0")
    assert main(["train", str(altered / "plan"), "--steps", "1"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and "altered" in err and len(err.splitlines()) == 1
    assert time.perf_counter() - began < 10  # no process was started
