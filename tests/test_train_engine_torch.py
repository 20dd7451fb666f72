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
import torch

import onnx_partition
from onnx_partition.cli import main
from onnx_partition.cost.devices import pinned_cpu
from onnx_partition.partition import partition
from onnx_partition.pipeline.layout import layout
from onnx_partition.runtime.train.modules import stage_modules
from onnx_partition.runtime.train.torch_engine import hop_metas
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
    """2 pipelines of 2 stages (4 ranks, a DP group per stage), GPipe, SGD, clipping on:
    gradients after step 1 and parameters after steps 1 and 3 (clipped) equal single-process
    training; the saved plan serves."""
    plan = _with_replicas(gpt_plan, tmp_path / "plan", [2, 2])
    trained = tmp_path / "trained"
    code = main(["train", str(plan), "--engine", "torch", "--schedule", "gpipe", "--steps", "3",
                 "--microbatches", "4", "--batch-size", "2", "--clip-grad-norm", "0.5",
                 "--optimizer", "sgd", "--check", "--save", str(trained)])
    out = capfd.readouterr().out
    assert code == 0, out
    assert "4 ranks (torch engine, gpipe, fp32 math), batch 8 = 4 micro-batches x 2 rows" in out
    assert "check against single-process training after step 1 and 3: OK" in out
    assert main(["run", str(trained), "--batch-size", "2", "--check"]) == 0
    assert "(OK)" in capfd.readouterr().out


def test_relayed_integers_and_tied_weights(hf_exported: Callable[..., Path],
                                           tmp_path: Path) -> None:
    """Hugging Face GPT-2 given labels at 3 stages, 1F1B, its own loss: the labels (int64) are
    relayed through the middle stage, hops carry booleans, indices and sizes, and the tied
    embedding lives on stages 0 and 2: --check OK (gradients of step 1 equal one process)."""
    plan_dir = tmp_path / "plan"
    partition(hf_exported("gpt2", labels=True), 3, plan_dir, mode="train", batch_size=2,
              force=True, schedule="1f1b")
    stats = train_plan(plan_dir, engine="torch", check=True, steps=2, microbatches=3,
                       batch_size=2, loss="output")
    assert stats.engine == "torch" and stats.checked_steps == (1,)
    assert stats.mismatches == []
    assert len(stats.loss) == 2 and all(v > 0 for v in stats.loss)


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
    assert main(["train", str(gpt_plan), "--schedule", "interleaved-zb"]) == 2
    assert "add --engine torch" in capfd.readouterr().err
    assert main(["train", str(gpt_plan), "--engine", "torch", "--schedule", "interleaved-zb",
                 "--nproc", "2"]) == 2
    assert "need 1 processes; got 2" in capfd.readouterr().err
    recomputing = _with_replicas(gpt_plan, tmp_path / "recompute", [1, 1])
    body = json.loads((recomputing / "plan.json").read_text())
    body["stages"][1]["recompute"] = True
    (recomputing / "plan.json").write_text(json.dumps(body))
    assert main(["train", str(recomputing), "--engine", "torch"]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and "stages [1] recompute" in err
    assert time.perf_counter() - began < 10  # no process was started


def test_interleaved_zero_bubble_two_stages_per_rank(exported: Callable[[str, str], Path],
                                                     tmp_path: Path) -> None:
    """ScheduleInterleavedZeroBubble: gpt tiny at 4 stages on 2 processes (stages 0 and 2 on
    rank 0, 1 and 3 on rank 1; the tied embedding's copies on both), the weights' backward
    deferred: gradients and parameters after steps 1 and 3 equal single-process training.
    The CPU is pinned so the cut is always one where a stage sends a view and a tensor its
    backward saved (pipelining detaches what it sends in place) and receives a gradient that
    autograd left strided (gloo sends only contiguous tensors): CI once drew such a cut."""
    plan_dir = tmp_path / "plan"
    partition(exported("gpt", "tiny"), 4, plan_dir, mode="train", batch_size=2,
              device=pinned_cpu(0.01, 5))
    stats = train_plan(plan_dir, engine="torch", schedule="interleaved-zb", steps=3,
                       microbatches=4, batch_size=2, check=True, optimizer="sgd")
    assert stats.schedule == "interleaved-zb" and stats.checked_steps == (1, 3)
    assert stats.mismatches == []
    assert sorted((r.rank, r.stage) for r in stats.ranks) == [(0, 0), (0, 2), (1, 1), (1, 3)]
    assert all(b > 0 for b in stats.backward_ms)


class _LateInput(torch.nn.Module):
    """Four layers on ``x``; ``y``, a floating model input, read only at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * y + (y > 0).float()


def test_both_ends_of_a_hop_agree_on_gradients(tmp_path: Path) -> None:
    """The cause of the earlier deadlock: a floating model input relayed to a later stage. Its
    hop metadata says no gradient on both ends, activations say one, sizes (integers) none."""
    model = tmp_path / "late.onnx"
    onnx_partition.export(_LateInput(), (torch.randn(2, 8), torch.randn(2, 8)), model)
    plan_dir = tmp_path / "plan"
    plan = partition(model, 2, plan_dir, mode="train", batch_size=2, force=True)
    lay = layout(plan)
    assert lay.recv_names[1][-1] == "y"  # relayed through the hop
    stages = stage_modules(plan_dir)
    feeds = {"x": torch.randn(2, 8), "y": torch.randn(2, 8)}
    metas = hop_metas(stages, lay, feeds, {"x", "y"}, [s.name for s in plan.outputs])
    sent, received = metas[0][1], metas[1][0]
    assert sent == received
    flags = dict(zip(lay.recv_names[1], (grad for _, _, grad in received), strict=True))
    assert flags["y"] is False and all(v for n, v in flags.items() if n != "y")
