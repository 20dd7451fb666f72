"""`onnx-partition train` with ZB-H1 and recomputing stages, end to end on the gpt tiny recipe
(real gloo process groups): ``--check`` holds against single-process training."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from onnx_partition.cli import main


def test_zb_h1_and_recomputing_stages_check(exported: Callable[..., Path], tmp_path: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    """A 3-stage plan for ZB-H1 with every stage recomputing (``partition --recompute all``):
    train defaults to the plan's schedule and passes --check; so does a 2-stage plan that
    keeps its activations, trained with ``--schedule zb-h1``."""
    model = str(exported("gpt"))
    plan = tmp_path / "plan"
    assert main(["partition", model, "--stages", "3", "--mode", "train", "--batch-size", "2",
                 "--schedule", "zb-h1", "--recompute", "all", "-o", str(plan)]) == 0
    body = json.loads((plan / "plan.json").read_text())
    assert body["schedule"] == "zb-h1"
    assert [s.get("recompute") for s in body["stages"]] == [True] * 3
    capfd.readouterr()
    code = main(["train", str(plan), "--nproc", "3", "--steps", "2", "--microbatches", "4",
                 "--batch-size", "2", "--check"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "3 ranks (ours engine, zb-h1)" in out
    assert "check against single-process training after step 1: OK" in out

    two = tmp_path / "two"
    assert main(["partition", model, "--stages", "2", "--mode", "train", "--batch-size", "2",
                 "--schedule", "1f1b", "--recompute", "none", "-o", str(two)]) == 0
    capfd.readouterr()
    code = main(["train", str(two), "--nproc", "2", "--steps", "1", "--microbatches", "4",
                 "--batch-size", "2", "--schedule", "zb-h1", "--check"])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "2 ranks (ours engine, zb-h1)" in out and ": OK" in out
